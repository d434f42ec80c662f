"""Load with resharding from the torch_dist backend.

Every rank reads only the parts of saved chunks that overlap its requested shards (see
:mod:`ckpt_integration.planning.reshard`; a per-key :class:`~ckpt_integration.planning.reshard.ChunkIndex`
makes each request O(log chunks)), with a thread pool.

Collectives, none of which carries O(world) bytes to a rank when nothing fails:

* one broadcast: the coordinator reads ``metadata.json``, ``.metadata`` and the
  manifest and shares them compactly (:mod:`.shared_metadata`);
* an all-reduce of a few integers that compares the options (and, with ``validate_access_integrity``,
  begins the request check: by counting when every rank requests whole saved chunks, one all-to-all
  of four integers per request to the keys' owners, :mod:`..planning.request_check`; otherwise the
  check of a save's exchange, :mod:`.exchange`: records to chunk owners, holdings to key owners);
* with a strict ``*_ALL`` mode: an OR all-reduce of one bit per checkpoint key
  ("requested by some rank");
* a final agreement so that a failure on any rank raises on every rank.
"""

from __future__ import annotations

import io
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ..dict_utils import dict_list_map_inplace, merge
from ..errors import KeyNotInCheckpointError, MismatchError, StateVerificationError
from ..mapping import ShardedObject, ShardedTensor, apply_factory_merges, is_main_replica
from ..planning.boxes import Box, clip_to_shape, relative_slices
from ..planning.delivery import check_delivered
from ..planning.request_check import object_place
from ..planning.reshard import plan_chunk_reads, uncovered_elements
from ..planning.strict import StrictHandling, mismatched_keys, parse_strict_flag
from ..storage import checkpoint_dir as ckdir
from ..storage.opened import (MANIFEST_FROM_DIRECTORY, backend_named, embedded_common_bytes, open_reader,
                              read_metadata, saved_chunk_reads)
from ..storage.safe_pickle import object_payload, safe_torch_load
from ..storage.chunk_index import CompactChunks, checkpoint_keys, compact_chunks_of
from ..storage.small_reads import read_order, read_tasks
from ..storage.torch_dist_reader import TorchDistReader
from . import dist
from .dist import Group
from . import exchange
from . import load_request
from .failure import Failure
from .gc_pause import with_gc_paused
from .preprocess import local_shards, restore_list_types, shards_identity, split_state_dict
from .read_once import load_read_once
from .shared_metadata import SharedMetadata, open_shared
from .state_check import LoadedPart, verify_loaded_state

logger = logging.getLogger(__name__)

# load strategies handled by execution/read_once.py ("auto" falls back to "local" when reading
# once would not read fewer bytes); READ_ONCE on backends that store plain arrays, PARALLEL on any
READ_ONCE = ("auto", "read_once")
PARALLEL = ("fully_parallel", "two_stage")
# what this process's last load did (strategy used, bytes read/sent/received, seconds per
# phase): read by benchmarks/bench.py
last_load_stats: Dict[str, Any] = {}


@dataclass
class ReadTask:
    """Fill ``out`` (this rank's view of ``overlap``, global coordinates) from one stored chunk.

    ``got``: the boxes (global coordinates) actually copied into ``out``, recorded where each copy
    happens (:mod:`..planning.delivery`); ``dest``: the whole destination whose tasks share it, or
    None when ``overlap`` is the destination itself (a request that is one saved chunk)."""

    key: str
    chunk: Any
    overlap: Box
    out: torch.Tensor
    dtype: torch.dtype
    dest: Optional[Box] = None
    got: List[Box] = field(default_factory=list)


def _tensor_tasks(
    sh: ShardedTensor, md: Metadata, reader: TorchDistReader, checkpoint_dir: str, strict_dtype: bool = False
) -> Tuple[torch.Tensor, List[ReadTask], Optional[Tuple[Box, torch.Tensor, torch.dtype]]]:
    """The host tensor a request is read into, its read tasks, and the region of it that the
    checkpoint fills (global box, its elements, the saved dtype: what the state check checks)."""
    # (once per tensor, tens of thousands per rank for some models: torch.Size and tuples are
    # compared as they are, no copies; a device test by ``is_cpu``)
    tmeta = md.state_dict_metadata.get(sh.key)
    saved_dtype = load_request.check_against_saved(sh, tmeta, checkpoint_dir, strict_dtype)
    saved_shape = tmeta.size
    out = sh.data
    out = torch.empty(sh.local_shape, dtype=sh.dtype) if out is None else out
    if out.shape != sh.local_shape:
        raise MismatchError(f"{sh.key!r}: data shape {tuple(out.shape)} != local_shape {sh.local_shape}")
    if not out.is_cpu:
        # Read into host memory, copy to the device afterwards (see load_sharded).
        host = torch.empty(sh.local_shape, dtype=sh.dtype)
    else:
        # a Parameter (requires_grad) as destination: write through a detached alias of its
        # memory, since in-place copies into a leaf that requires grad are refused by autograd
        host = out.detach() if out.requires_grad else out
    shape = sh.saved_shape()
    view = host if host.shape == shape else host.view(shape)
    request = Box(sh.global_offset, shape)
    reads = saved_chunk_reads(reader, sh.key, request)
    dest: Optional[Box] = request
    if sh.allow_shape_mismatch:
        host.zero_()
        dest = clip_to_shape(request, tuple(saved_shape))  # the part of it the checkpoint holds
    elif len(reads) == 1 and (reads[0].overlap is request or reads[0].overlap == request) and _inside(request, saved_shape):
        # the request is one saved chunk (or inside it): covered, and the destination is the
        # whole view (the common case of a same-layout load: no slicing per tensor)
        return host, [ReadTask(sh.key, reads[0].source, request, view, saved_dtype)], (request, view, saved_dtype)
    if uncovered_elements(request, tuple(saved_shape), reads) != 0:
        raise MismatchError(
            f"{checkpoint_dir}: the saved chunks of {sh.key!r} do not cover the requested region {request}"
        )
    # read as stored, cast on copy into the requested dtype (like Megatron-Core: bf16 saved, fp32 requested)
    if dest is None:
        return host, [], None
    tasks = [
        ReadTask(sh.key, r.source, r.overlap, view[relative_slices(r.overlap, request)], saved_dtype, dest)
        for r in reads
    ]
    return host, tasks, (dest, view if dest == request else view[relative_slices(dest, request)], saved_dtype)


def _whole_chunk_task(sh: ShardedTensor, sdm: Dict[str, Any], compact: CompactChunks,
                      directory: str) -> Optional[Tuple[ReadTask, Tuple[int, int, int]]]:
    """The read of a request that is exactly one saved chunk, in the saved dtype, into a CPU tensor
    of its shape (a same-layout load: every tensor of it, tens of thousands per rank for some
    models), checked and planned in one step, with the chunk's place in the index (key position,
    chunks of the key, chunk number: what the request check counts, ``planning.request_check``);
    None for anything else, which :func:`_tensor_tasks` plans (and refuses, naming the problem)."""
    if sh.prepend_axis_num or sh.allow_shape_mismatch:
        return None
    tmeta = sdm.get(sh.key)
    if not isinstance(tmeta, TensorStorageMetadata) or tmeta.properties.dtype is not sh.dtype \
            or tmeta.size != sh.global_shape:
        return None
    out = sh.data
    shape = sh.local_shape
    if out is not None and (not out.is_cpu or out.shape != shape or out.layout is not torch.strided or out.is_quantized
                            or not out.is_contiguous() or out.is_conj() or out.is_neg()):
        return None  # (_tensor_tasks plans it, or refuses a destination whose memory is not its values)
    request = Box(sh.global_offset, shape)
    if not _inside(request, tmeta.size):
        return None
    found = compact.whole_chunk_at(sh.key, request, directory)
    if found is None:
        return None
    info, position, chunks, number = found
    if out is None:
        out = torch.empty(shape, dtype=sh.dtype)
    elif out.requires_grad:
        out = out.detach()  # (as _tensor_tasks: write through an alias of a Parameter's memory)
    return ReadTask(sh.key, info, request, out, sh.dtype), (position, chunks, number)


def _whole_chunk_place(sh: ShardedTensor, ts: List[ReadTask], sdm: Dict[str, Any], compact: Optional[CompactChunks],
                       directory: str) -> Optional[Tuple[int, int, int]]:
    """The place in the index (see :func:`_whole_chunk_task`) of a request that
    :func:`_tensor_tasks` planned, if it is one whole saved chunk in the saved dtype (a destination
    that is not a plain CPU tensor: a GPU tensor is read into host memory first); None otherwise
    (a cast, for one: ranks may request a key in different dtypes, which the general check refuses)."""
    if compact is None or type(sh) is not ShardedTensor or sh.prepend_axis_num or sh.allow_shape_mismatch \
            or len(ts) != 1 or sh.flattened_range is not None:
        return None
    t = ts[0]
    tmeta = sdm.get(sh.key)
    if tmeta is None or tmeta.properties.dtype is not sh.dtype or (t.overlap is not t.chunk.box and t.overlap != t.chunk.box):
        return None
    found = compact.whole_chunk_at(sh.key, t.overlap, directory)
    return None if found is None else found[1:]


def _whole_chunks(tasks: List[ReadTask]) -> bool:
    for t in tasks:  # (a loop with an identity test first: once per small tensor)
        if t.overlap is not t.chunk.box and t.overlap != t.chunk.box:
            return False
    return True


def _inside(box: Box, shape: Tuple[int, ...]) -> bool:
    for o, n, g in zip(box.offsets, box.sizes, shape):  # (a loop, not all(...): once per small tensor)
        if o < 0 or o + n > g:
            return False
    return True


@with_gc_paused  # (issue 19: the per-item objects of a load, see gc_pause)
def load_sharded(
    sharded_state_dict: Dict[str, Any],
    checkpoint_dir: str,
    *,
    strict: Union[str, bool, StrictHandling, None] = StrictHandling.ASSUME_OK_UNEXPECTED,
    validate_access_integrity: bool = True,
    trusted: bool = False,
    allowed_globals: Optional[Iterable[Any]] = None,
    thread_count: int = 4,
    verify_checksums: bool = True,
    process_group: Group = None,
    load_strategy: str = "auto",
    memory_budget: int = 1 << 30,
    strict_dtype: bool = False,
    shared: Optional[SharedMetadata] = None,
    verify_state: bool = False,
) -> Any:
    """A load of a checkpoint of any backend (the one its ``metadata.json`` names). Collective.

    ``checkpoint_dir``: a path, or the :class:`~..storage.opened.OpenedCheckpoint` every helper
    below is given (its storage and small files are not read again). ``shared``: what it read, as
    a load uses it (every rank passes one, or none: then the coordinator opens the path and
    broadcasts it)."""
    group = process_group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    strict = parse_strict_flag(strict)
    global_strict = StrictHandling.requires_global_app_metadata(strict)
    # Steps: open -> plan -> check (collective) -> read (collective) -> finish. A step that fails
    # on one rank is held (failure.Failure) and raised on every rank at the next agreement, so no
    # rank waits in a collective for one that left. The reads are planned before the request
    # check, which uses them; a failure to plan is raised after the check, as when planning
    # followed it.
    opened, planned = Failure(), Failure()
    req: Optional[_Request] = None
    (memory_budget, thread_count), bad = load_request.counts(rank, memory_budget=(memory_budget, 1 << 30),
                                                            thread_count=(thread_count, 4))
    with opened.capture():
        if bad is not None:  # (raised on every rank at the agreement below, not by one rank in a transfer)
            raise bad
        req = _open_request(sharded_state_dict, checkpoint_dir, shared, group, trusted, allowed_globals,
                            validate_access_integrity, rank, world)
        checkpoint_dir = req.checkpoint_dir
    job: Optional[_LoadJob] = None
    if req is not None:  # (opened)
        with planned.capture():
            job = _prepare_reads(
                checkpoint_dir, req.md, req.common, req.sharded, req.nonpersistent, req.factories, req.template,
                strict, req.requested, trusted, allowed_globals, verify_checksums, rank, req.backend,
                strict_dtype=strict_dtype, manifest=req.shared.manifest, shards=req.shards,
            )
    requested_global: Set[str] = set()  # (*_all modes: keys some rank requests, known after the check)
    try:
        agreed = (f"validate_access_integrity={validate_access_integrity}, load_strategy={load_strategy}, "
                  f"verify_state={verify_state}, strict *_all mode={global_strict}")
        if not validate_access_integrity:  # (the same first collective as the check's, with these options)
            load_request.agree_arguments(opened, group, checkpoint_dir, agreed)
        else:
            load_request.check_request(job, req and req.routed, req.shards if req else [], req and req.identity,
                                       opened, group, checkpoint_dir, agreed)
        if global_strict:
            requested_global = load_request.requested_by_any_rank(checkpoint_keys(req.md), req.requested, group)
    except BaseException:
        if job is not None:
            job.reader.close()
        raise
    failure = planned if planned.failed else opened
    if global_strict and job is not None and not failure.failed:
        with failure.capture():  # (a *_all mode that raises: before anything is read)
            load_request.strict_after_check(job, strict, req, requested_global, checkpoint_dir, rank)
    last_load_stats.clear()
    last_load_stats["strategy"] = "local"
    result: Any = None
    missing, unexpected = set(), set()  # (the keys a *_all strict mode reports, from job.finish())
    try:
        outcome = _read(job, failure, load_strategy, req.backend if req else "torch_dist", group, thread_count,
                        memory_budget, disjoint=validate_access_integrity and job is not None and job.whole_chunks)
        if job is not None and not failure.failed and outcome != "failed":  # (failed: another rank raises)
            with failure.capture():
                job.check_delivered(rank)
                result, missing, unexpected = job.finish()
    finally:
        if job is not None:
            if hasattr(job.reader, "stats"):  # reads of the reader itself ("local", and chunks read-once left to it)
                for k, v in job.reader.stats.as_dict().items():
                    last_load_stats[k] = last_load_stats.get(k, 0) + v
            job.reader.close()
    failure.agree(group, f"load of {checkpoint_dir} failed")
    if outcome == "failed":  # a strategy stopped because of a failure that no rank reported: never return
        raise StateVerificationError(f"load of {checkpoint_dir} on rank {rank}: the {load_strategy} load stopped "
                                     "after a failure no rank reported; nothing was returned")
    if verify_state and job is not None:
        verify_loaded_state(job.parts, req.shared.manifest, rank, group, str(checkpoint_dir), last_load_stats)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return result, missing, unexpected
    return result


@dataclass
class _Request:
    """What a rank asks of an opened checkpoint (the load's first step)."""

    checkpoint_dir: Any  # the OpenedCheckpoint every later step is given
    shared: SharedMetadata
    backend: str
    common: Any
    sharded: Any
    nonpersistent: Any
    factories: Any
    template: Any
    shards: List[Any]
    requested: List[str]  # the checkpoint keys this rank requests, sorted
    md: Any  # the chunk records of the requested keys
    identity: Any = None  # (validate_access_integrity) the request, compared with the last one checked
    routed: Any = None


def _open_request(sharded_state_dict: Dict[str, Any], checkpoint_dir: Union[str, os.PathLike],
                  shared: Optional[SharedMetadata], group: Group, trusted: bool,
                  allowed_globals: Optional[Iterable[Any]], validate: bool, rank: int, world: int) -> _Request:
    """Open the checkpoint (collective when ``shared`` is None: one reader, one broadcast) and
    split this rank's request into what the later steps read."""
    if shared is None:
        checkpoint_dir, shared = open_shared(checkpoint_dir, group, trusted)
    load_request.check_directory(checkpoint_dir, shared.path)  # (before this rank reads any file of its own)
    backend = shared.backend
    # the manifest the coordinator read and checked (one JSON parse per load, not per rank)
    common = ckdir.load_common(checkpoint_dir, trusted=trusted, allowed_globals=allowed_globals,
                               manifest=shared.manifest if backend_named(backend).dcp_metadata else None,
                               embedded=lambda: embedded_common_bytes(checkpoint_dir))
    sharded, _req_common, nonpersistent, factories, template = split_state_dict(sharded_state_dict)
    shards = local_shards(sharded)
    requested = sorted({load_request.request_key(s) for s in shards})
    md = shared.metadata_for(requested)  # chunk records of the requested keys only
    if md is None:  # zarr: the rank's reader reads the zarr index
        md = read_metadata(checkpoint_dir, trusted=trusted, backend=backend)
    req = _Request(checkpoint_dir, shared, backend, common, sharded, nonpersistent, factories, template, shards,
                   requested, md)
    if validate:
        # a request like the last one checked: its digest is known, no records built unless one changed
        req.identity = shards_identity(shards, rank, world, "load")
        req.routed = exchange.known_routes("load", req.identity)
    return req


def _read(job: Optional["_LoadJob"], failure: Failure, load_strategy: str, backend: str, group: Group,
          thread_count: int, memory_budget: int, disjoint: bool) -> str:
    """The read step: ``"local"`` (each rank read its own ranges), ``"done"`` (read once: the
    strategies that share reads, collective, every rank takes part even after a failure) or
    ``"failed"`` (some rank failed: the final agreement raises). A failure is recorded, not raised."""
    world = dist.get_world_size(group)
    reader, tasks = (job.reader, job.tasks) if job is not None else (None, [])
    parallel = load_strategy in PARALLEL
    if world > 1 and (parallel or load_strategy in READ_ONCE and backend_named(backend).mapped_chunks):
        outcome = "failed"
        with failure.capture():
            outcome, stats = load_read_once(reader, tasks, failure.failed, group, mode=str(load_strategy),
                                            thread_count=thread_count, memory_budget=memory_budget, disjoint=disjoint)
            done = str(load_strategy) if parallel else "read_once"
            last_load_stats.update(stats, strategy=done if outcome == "done" else "local")
        if outcome != "local":
            return outcome
    if job is not None and not failure.failed:
        with failure.capture():
            job.read_all(thread_count)
    return "local"


@dataclass
class _LoadJob:
    """The local part of a load: read tasks prepared, results assembled after reading."""

    reader: TorchDistReader
    tasks: List[ReadTask]
    device_copies: List[Tuple[torch.Tensor, torch.Tensor]]
    loaded: Any
    common: Any
    nonpersistent: Any
    factories: Any
    template: Any
    missing: Set[str]
    unexpected: Set[str]
    # every request a plain main replica (no flattened range) and every task a whole stored
    # chunk: once the request check has proven the main replicas of all ranks disjoint, no
    # stored block is touched by two ranks, so reading once cannot save anything
    whole_chunks: bool = False
    # every request one whole saved chunk or an object cell: their rows for the request check
    # (planning.request_check), and the index that numbers them; None otherwise
    request_rows: Optional[List[Tuple[int, int, int, int]]] = None
    index_identity: int = 0
    # every requested tensor region as loaded, for the state check (execution.state_check)
    parts: List[LoadedPart] = field(default_factory=list)

    def read_all(self, thread_count: int) -> None:
        read_tasks(self.reader, self.tasks, thread_count)

    def check_delivered(self, rank: int) -> None:
        """Every requested element was delivered exactly once (the ledger of each destination,
        :mod:`..planning.delivery`), or raise naming the key, the region and the rank."""
        check_delivered(self.tasks, rank, getattr(self.reader, "directory", ""))

    def finish(self) -> Tuple[Any, Set[str], Set[str]]:
        with torch.no_grad():  # destinations may be Parameters
            for host, dev in self.device_copies:
                dev.copy_(host)
        result = self.common if isinstance(self.common, dict) else {"__common__": self.common}
        merge(result, self.nonpersistent)
        merge(result, self.loaded)
        result = restore_list_types(result, self.template)
        if self.factories:  # (unexpected keys, skipped by the strict mode: the factories they belong to too)
            load_request.skip_incomplete_factories(result, self.factories, self.template, self.unexpected)
            result = apply_factory_merges(result, self.factories) if self.factories else result
        return result, self.missing, self.unexpected


def _prepare_reads(
    checkpoint_dir, md, common, sharded, nonpersistent, factories, template, strict,
    requested, trusted, allowed_globals, verify_checksums, rank, backend="torch_dist",
    strict_dtype=False, manifest: Union[ckdir.Manifest, None, object] = MANIFEST_FROM_DIRECTORY, shards: Iterable[Any] = (),
) -> _LoadJob:
    """The local part of a load, planned before the ranks' requests are combined: unexpected keys
    are left out (and raised or logged here, except in a ``*_all`` strict mode, whose missing keys
    need every rank's request: :func:`.load_request.strict_after_check` reports both)."""
    missing: Set[str] = set()
    unexpected: Set[str] = set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        # (every key of the checkpoint: md lists the requested ones only)
        _, unexpected = mismatched_keys(requested, requested, checkpoint_keys(md), load_request.object_storage_keys(shards, md))
        if not StrictHandling.requires_global_app_metadata(strict):
            load_request.handle_strict(strict, missing, unexpected, checkpoint_dir, rank)
        if unexpected:
            sharded = load_request.drop_keys(sharded, unexpected)
    # the manifest read once by the coordinator and broadcast (shared_metadata), or read here
    reader = open_reader(checkpoint_dir, md, backend, None, verify_checksums, manifest=manifest)
    plan = _Planner(reader, md, checkpoint_dir, strict_dtype, trusted, allowed_globals, counted=not unexpected)
    try:
        # (a bound method: closures calling each other made a reference cycle that kept the load's
        # objects alive until the cycle collector ran, and then cost ~5 us a tensor)
        loaded = dict_list_map_inplace(plan.request, sharded)
    except BaseException:
        reader.close()
        raise
    plan.tasks.sort(key=read_order)
    return _LoadJob(reader, plan.tasks, plan.device_copies, loaded, common, nonpersistent, factories, template, missing,
                    unexpected, whole_chunks=plan.whole, request_rows=plan.rows,
                    index_identity=plan.fast.identity if plan.fast is not None else 0, parts=plan.parts)


class _Planner:
    """The reads of one rank's request, item by item (:meth:`request` on every leaf): the tasks, what the
    state check compares (``parts``), and for the request check ``whole`` (every request a main replica
    read as whole stored chunks) and ``rows`` (one per request while each is one whole saved chunk or an
    object cell, numbered in the index; None once one is not: the general check, ``exchange.run``)."""

    def __init__(self, reader: TorchDistReader, md: Metadata, checkpoint_dir: Any, strict_dtype: bool, trusted: bool,
                 allowed_globals: Optional[Iterable[Any]], counted: bool) -> None:
        self.reader, self.md, self.sdm, self.checkpoint_dir = reader, md, md.state_dict_metadata, checkpoint_dir
        self.strict_dtype, self.trusted, self.allowed_globals = strict_dtype, trusted, allowed_globals
        # requests that are one saved chunk each (a same-layout load) are planned in one step
        self.fast: Optional[CompactChunks] = compact_chunks_of(getattr(reader, "metadata", None))
        self.directory = getattr(reader, "directory", "")
        self.tasks: List[ReadTask] = []
        self.parts: List[LoadedPart] = []
        self.device_copies: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.whole = True
        # (keys left out as unexpected are not counted: the general check sees every request)
        self.rows: Optional[List[Tuple[int, int, int, int]]] = [] if self.fast is not None and counted else None

    def request(self, sh: object) -> Any:
        """A leaf: a flattened piece is read into the boxes it covers (views into the flat result)."""
        if isinstance(sh, ShardedTensor) and sh.flattened_range is not None:
            self.whole = False
            self.rows = None
            flat = sh.data
            if flat is None:
                flat = (torch.zeros if sh.allow_shape_mismatch else torch.empty)(sh.flat_numel(), dtype=sh.dtype)
            for box in replace(sh, data=flat).unflattened():
                self.item(box)
            return flat
        return self.item(sh)

    def count(self, place: Optional[Tuple[int, int, int]], main: bool) -> None:
        """The request's row for the request check; a request that is no saved chunk (None) ends them."""
        if self.rows is not None:
            if place is None:
                self.rows = None
            else:
                self.rows.append((*place, 1 if main else 0))

    def item(self, sh: object) -> Any:
        if type(sh) is ShardedTensor and 0 in sh.local_shape:  # (an empty piece: nothing to read or to count)
            return sh.data if sh.data is not None else torch.empty(sh.local_shape, dtype=sh.dtype)
        if self.fast is not None and type(sh) is ShardedTensor:
            found = _whole_chunk_task(sh, self.sdm, self.fast, self.directory)
            if found is not None:
                task, place = found
                main = is_main_replica(sh.replica_id)
                self.count(place, main)
                if not main:
                    self.whole = False
                self.tasks.append(task)
                self.parts.append(LoadedPart(sh.key, task.overlap, task.out, main, sh.dtype))
                return task.out if sh.data is None else sh.data
        if isinstance(sh, ShardedTensor):
            return self.tensor(sh)
        if isinstance(sh, ShardedObject):
            return self.object(sh)
        self.rows = None
        return sh

    def tensor(self, sh: ShardedTensor) -> Any:
        host, ts, part = _tensor_tasks(sh, self.md, self.reader, self.checkpoint_dir, self.strict_dtype)
        main = is_main_replica(sh.replica_id)
        if part is not None:
            self.parts.append(LoadedPart(sh.key, part[0], part[1], main, part[2]))
        # (e.g. a destination on a GPU: read into host memory, still one saved chunk)
        self.count(_whole_chunk_place(sh, ts, self.sdm, self.fast, self.directory) if self.rows is not None else None, main)
        if self.whole and not (main and _whole_chunks(ts)):
            self.whole = False
        self.tasks.extend(ts)
        data = sh.data
        if data is not None:
            if data is not host and not data.is_cpu:
                self.device_copies.append((host, data))
            return data  # loaded in place: the caller's tensor (or Parameter) itself
        return host

    def object(self, sh: ShardedObject) -> Any:
        meta = self.sdm.get(sh.unique_key)
        if not isinstance(meta, BytesStorageMetadata):
            raise KeyNotInCheckpointError(f"{self.checkpoint_dir}: object {sh.unique_key!r} is not in the checkpoint")
        raw = self.reader.read_bytes(sh.unique_key)
        obj = safe_torch_load(io.BytesIO(raw), trusted=self.trusted, allowed_globals=self.allowed_globals,
                              what=f"ShardedObject {sh.unique_key!r} in {self.checkpoint_dir}")
        if self.rows is not None:  # (an object cell: one chunk, numbered by its storage key)
            self.count(object_place(sh.unique_key), is_main_replica(sh.replica_id))
        return object_payload(obj)


def read_whole_tensors(checkpoint_dir: str, md: Metadata, thread_count: int = 2) -> Dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole (no common state, no collectives)."""
    out: Dict[str, torch.Tensor] = {}
    with open_reader(checkpoint_dir, md, None) as reader:
        tasks = []
        for key, tmeta in md.state_dict_metadata.items():
            if not isinstance(tmeta, TensorStorageMetadata):
                continue
            shape = tuple(tmeta.size)
            whole = Box((0,) * len(shape), shape)
            reads = plan_chunk_reads(whole, [c.box for c in reader.chunks[key]])
            if uncovered_elements(whole, shape, reads):
                raise MismatchError(f"{checkpoint_dir}: the saved chunks of {key!r} do not cover the whole tensor")
            reader.validate_tensor(key)  # declared shape vs what the chunks hold, before allocating
            out[key] = torch.empty(shape, dtype=tmeta.properties.dtype)
            chunk_of = {c.box: c for c in reader.chunks[key]}
            tasks += [ReadTask(key, chunk_of[r.chunk], r.overlap, out[key][relative_slices(r.overlap, whole)], out[key].dtype, whole)
                      for r in reads]
        tasks.sort(key=read_order)
        read_tasks(reader, tasks, thread_count)
        check_delivered(tasks, 0, checkpoint_dir)
    return out
