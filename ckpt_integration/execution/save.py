"""Synchronous save on the torch_dist backend, in three phases.

1. **prepare** (collective): split the state dict, exchange shard metadata so that each chunk's
   copies meet on one rank and each key's chunks on another (compact records over ``all_to_all``;
   see :mod:`.exchange` for the protocol), validate sharding integrity there, and learn which
   chunks this rank writes (balanced within each chunk's replica set). When every rank's shards
   have the same structure as at the last save, one small all-reduce agrees on that and the plan
   is reused without exchanging metadata.
2. **write** (local, no collectives; may run in the background): write this rank's chunks with
   several threads and fsync them.
3. **finalize** (collective): gather compact write records (one per written chunk) and the key
   owners' summaries on the coordinator, which checks that every chunk was written once and writes
   ``.metadata``, ``common.pt``, ``manifest.json`` and finally the ``metadata.json`` commit marker -
   work and input O(unique chunks), not O(ranks x shards); the outcome is broadcast so that a
   failure on any rank raises on every rank with all causes.

The coordinator claims the target directory first (``storage/claim.py``): it writes the save's
marker before anything else, refuses directories holding files this library did not write, and
holds the marker's lock until the save is committed or cleaned up, so two saves into one
directory never mix their files and the second committer fails. A local error in any phase is
carried through the next collective instead of being raised at once (no rank left waiting: no hang).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import uuid

import torch
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

from ..version import __version__
from ..errors import CheckpointingException, DistributedCheckpointingError, SaveConflictError
from ..mapping import ShardedBase, ShardedObject, ShardedTensor
from ..planning.exchange import KeySummary, Routed, SummaryTable
from ..planning.written import (
    CommitLayout, FingerprintRow, WrittenColumns, WrittenTable, commit_layout, encode_finalize, gather_finalize,
)
from ..planning.shards import ShardMeta
from ..storage import checkpoint_dir as ckdir
from ..storage import claim as claims
from ..storage.chunk_index import write_index
from ..storage.dcp_pickle import dumps_commit_layout
from ..storage.item_table import file_sizes, table_of_written
from ..storage.checksum import save_block_hash, write_recorded
from ..storage.opened import EMBEDDED_COMMON_KEY, next_commit_seq
from ..storage.filesystem import CheckpointLocation, canonical, locate, write_error
from ..storage.fingerprint import encode_groups, fingerprints
from ..storage.incremental import BaseFiles
from ..storage.safe_pickle import torch_dumps
from ..storage.zarr_backend import INDEX_FILE as ZARR_INDEX_FILE, commit_file_records, write_zarr_requests
from ..storage.torch_dist import DCP_METADATA_FILE, WriteRequest, write_data_files
from ..strategies import save_strategy_options
from . import dist
from . import exchange
from . import zarr_save
from .dist import Group, describe_error as _describe
from .failure import Failure
from .common_check import check_common_consistency
from .gc_pause import with_gc_paused
from .preprocess import local_shards, savable, shards_identity, split_state_dict
from .save_base import frozen, open_base, resolve_base

logger = logging.getLogger(__name__)

CONTENT_METADATA_KEY = "content_metadata"


@dataclass
class SavePlan:
    """Everything the write and finalize phases need (one per save)."""

    rank: int
    world_size: int
    group: Group
    checkpoint_dir: str  # the final location
    write_dir: str  # where files go now (a staging dir when overwriting)
    staging: bool
    common: Any
    requests: List[WriteRequest]
    summaries: Union[SummaryTable, List[KeySummary]]  # of the keys this rank validated (rank 0's commit checks against them)
    thread_count: int
    durable: bool
    backend: str = "torch_dist"
    step: Optional[int] = None  # the training step, recorded in the manifest (commit order)
    separation_hint: Optional[str] = None  # keys starting with it go to data files of their own
    started: float = field(default_factory=time.time)
    written: Any = field(default_factory=WrittenTable)  # WrittenTable (torch_dist) or [WrittenItem] (zarr)
    failure: Failure = field(default_factory=Failure)  # this rank's, reported by finalize_save on every rank
    stop: Optional[Callable[[], None]] = None  # raises to abandon the write (async saves, preemption)
    # the layout-independent fingerprint of every tensor chunk this rank writes, computed over the
    # bytes written (an async save's staged copies): torch_dist's per request before writing, and
    # recorded with the items; zarr's as rows (key, offsets, sizes, value) before its requests are
    # cut into zarr chunks
    item_fingerprints: Optional[List[Optional[int]]] = None
    fingerprints: Optional[List[FingerprintRow]] = None
    base: Optional[BaseFiles] = None  # an earlier checkpoint's files this rank may link (incremental save)
    # a save in waves (staging_budget): what the caller's waves wrote or linked, and their file names
    written_before: Optional[WrittenTable] = None
    common_state_in_data: bool = False  # the common state went into the data (no common.pt)
    taken_names: Set[str] = field(default_factory=set)
    committed: bool = False  # the coordinator committed it (metadata.json is in place)
    commit_started: bool = False  # every rank's outcome reached the coordinator (it may commit)
    target: Optional[CheckpointLocation] = None  # ``write_dir`` as the handle the writers take (made once)
    final_path: Optional[str] = None  # ``checkpoint_dir`` on its storage (a ``file://`` URL's path): the swap's target

    def __post_init__(self) -> None:
        if self.target is None:
            self.target = locate(self.write_dir)


_claims: Dict[str, claims.SaveClaim] = {}  # coordinator: the claim (marker lock) of each save in progress, by directory


def _prepare_directory(where: CheckpointLocation, overwrite: bool, durable: bool = True) -> Tuple[str, bool]:
    """Coordinator only: claim the target and return (write_dir, staging). Never touches a
    committed checkpoint, never mixes into or deletes files this library did not write."""
    storage, checkpoint_dir = where.storage, where.path
    if storage.exists(checkpoint_dir) and not storage.isdir(checkpoint_dir):
        raise CheckpointingException(f"cannot save to {checkpoint_dir}: it is a file")
    token = uuid.uuid4().hex
    committed = where.exists(ckdir.CONFIG_FILE)
    if committed:
        if not overwrite:
            raise CheckpointingException(
                f"{checkpoint_dir} already holds a committed checkpoint; save to a new directory "
                "or pass overwrite=True (the old one is replaced only after the new one is complete)"
            )
        if storage.remote:
            raise CheckpointingException(
                f"overwrite=True is not supported for {checkpoint_dir}: object stores cannot swap "
                "directories atomically; save to a new location and delete the old one afterwards"
            )
        _, foreign = claims.classify_entries(where)
        if foreign:
            raise SaveConflictError(
                f"refusing to replace {checkpoint_dir} (overwrite=True): besides the checkpoint it holds files this "
                f"library did not write ({claims.describe_names(sorted(foreign))}), which replacing the directory "
                "would delete; move them elsewhere first"
            )
        if os.path.basename(checkpoint_dir.rstrip(os.sep)) in (".", "..") or os.path.ismount(checkpoint_dir):
            raise CheckpointingException(f"overwrite=True cannot replace {checkpoint_dir}: a checkpoint is replaced by renaming a "
                                         "sibling directory over it, which a mount point or a path ending in '.' cannot take; "
                                         "save into a directory below it")
        if os.path.islink(checkpoint_dir.rstrip(os.sep)):  # (rename semantics: the name is replaced, not the target)
            target = os.path.realpath(checkpoint_dir)
            logger.warning("%s is a symbolic link to %s: the overwrite puts the new checkpoint in place of the link, "
                           "and %s keeps the old one", checkpoint_dir, target, target)
        claim = claims.claim_staging(where, claims.staging_name(checkpoint_dir, token), token, durable)
        try:  # (after the claim: a save still creating its staging directory holds the lock this one now holds)
            claims.remove_dead_staging(where)
        except BaseException:
            claim.release()
            raise
    else:
        claim = claims.claim_new(where, token, durable)
    _claims[claim.write_dir] = claim
    return claim.write_dir, claim.staging


def _agreed(where: CheckpointLocation, backend: str, validate_access_integrity: bool, balance: bool,
            common_state_in_data: bool, asynchronous: bool) -> str:
    """The options of a save that every rank must pass alike: those that decide which collectives follow,
    and the directory (every rank writes where the coordinator claimed)."""
    return (f"checkpoint_dir={canonical(where)!r}, backend={backend!r}, "
            f"validate_access_integrity={validate_access_integrity}, balance={balance}, "
            f"common_state_in_data={common_state_in_data}, async_sharded_save={asynchronous}")


def _release_claim(write_dir: str) -> None:
    claim = _claims.pop(write_dir, None)
    if claim is not None:
        claim.release()


def _requests_for(shards: List[ShardedBase], to_write: List[int]) -> List[WriteRequest]:
    """The write requests of the chunks ``to_write`` (indices into ``shards``), named and placed as their records
    (:func:`shard_meta`) name and place them (from the shards: a save that reuses its plan builds no records)."""
    out = []
    for i in to_write:
        sh = shards[i]
        if isinstance(sh, ShardedTensor):
            if sh.data is None:
                raise CheckpointingException(f"ShardedTensor {sh.key!r} has no data to save")
            data, sizes, stable = sh.data, sh.saved_shape(), frozen(sh.data)
            if isinstance(data, torch.nn.Parameter):
                data = data.detach()  # (a plain tensor: the writers' fast paths take only those)
            out.append(WriteRequest(sh.key, sh.global_offset, data if data.shape == sizes else data.reshape(sizes),
                                    stable=stable))
        else:
            out.append(WriteRequest(sh.unique_key, None, torch_dumps([sh.data])))
    return out


def save_options(kwargs: Dict[str, Any], what: str) -> Dict[str, Any]:
    """A save's options given to another entry point (a memory tier's persist), checked at its call, not in
    the background: ``sharded_strategy`` as ``save`` takes it; a name :func:`prepare_save` does not take refused."""
    out = dict(kwargs)
    spec = out.pop("sharded_strategy", None)
    if spec is not None:
        out.update(save_strategy_options(spec))
    own = {"sharded_state_dict", "checkpoint_dir", "process_group", "asynchronous"}  # (the entry point's)
    unknown = sorted(set(out) - (set(inspect.signature(prepare_save).parameters) - own))
    if unknown:
        raise CheckpointingException(f"{what}: {', '.join(unknown)} is not an option of the save")
    return out


@with_gc_paused  # its per-item records (see gc_pause); also the blocking part of an async save
def prepare_save(
    sharded_state_dict: Dict[str, Any],
    checkpoint_dir: str,
    *,
    validate_access_integrity: bool = True,
    content_metadata: Optional[dict] = None,
    thread_count: int = 2,
    balance: bool = True,
    overwrite: bool = False,
    durable: bool = True,
    process_group: Group = None,
    backend: str = "torch_dist",
    preprocess_common: Optional[Callable[[Any], Any]] = None,
    step: Optional[int] = None,
    separation_hint: Optional[str] = None,
    base: Union[None, str, os.PathLike, Callable[[], Optional[str]]] = None,
    common_state_in_data: bool = False,
    asynchronous: bool = False,
) -> SavePlan:
    """Phase 1 (collective). Raises the same error on every rank when anything is wrong.
    ``asynchronous``: the plan is for an async save (every rank must say the same)."""
    be = SAVE_BACKENDS.get(backend)
    if be is None:
        raise CheckpointingException(f"unknown backend {backend!r}; supported: {sorted(SAVE_BACKENDS)}")
    checkpoint_dir = os.fspath(checkpoint_dir)
    where = locate(checkpoint_dir)  # (the write directory is it or a sibling: the same storage)
    group = process_group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    coord = rank == 0
    failure = Failure()
    metas: List[ShardMeta] = []
    shards: List[ShardedBase] = []
    common: Any = None
    dir_info = None
    routed: Optional[Routed] = None
    identity: Any = None
    options = ""
    with failure.capture():
        if content_metadata is not None:
            sharded_state_dict = {**sharded_state_dict, CONTENT_METADATA_KEY: content_metadata}
        sharded, common, _nonpersistent, _factories, _template = split_state_dict(sharded_state_dict)
        shards = local_shards(sharded)
        if common_state_in_data:  # Megatron-Core 0.19's layout: no common.pt, rank 0's common state as an object
            if any(isinstance(s, ShardedObject) and s.key == EMBEDDED_COMMON_KEY for s in shards):
                raise CheckpointingException(f"a ShardedObject named {EMBEDDED_COMMON_KEY!r} cannot be saved with "
                                             "common_state_in_data=True, which stores the common state under that name")
            shards.append(ShardedObject(EMBEDDED_COMMON_KEY, common, (1,), (0,), replica_id=rank))
        shards = savable(shards)
        options = f"{balance}/{validate_access_integrity}/{backend}"
        # the structure of the last save planned (every save of a training run): its plan's digest
        # is known, and the shard records are built only if some rank's structure changed (below)
        identity = shards_identity(shards, rank, world, options)
        metas, routed = exchange.routes_for("save", identity, shards, rank, world, options)
        if coord:
            dir_info = _prepare_directory(where, overwrite, durable)
    base_path = resolve_base(base, checkpoint_dir) if coord and base is not None else None
    context = f"save to {checkpoint_dir} failed before writing"
    try:
        agreed = _agreed(where, backend, validate_access_integrity, balance, common_state_in_data, asynchronous)
        planned = exchange.start(routed, failure, group, context, arguments=agreed)
        (write_dir, staging), base_path = dist.broadcast_object(
            (dir_info, base_path), src=dist.coordinator_rank(group), group=group)
        target = where.at(write_dir)
        if validate_access_integrity:
            check_common_consistency(common, group, preprocess_common)
        if planned is None:
            assert routed is not None  # start() raised on every rank otherwise
            metas, routed, late = exchange.routes_after_change(metas, routed, shards, rank, world, options)
            planned = exchange.run(
                metas, routed, group, balance=balance, validate=validate_access_integrity, want_layout=be.wants_layout,
                context=context, problems_header=f"invalid sharding, nothing was saved to {checkpoint_dir}",
                identity=identity, failure=late,
            )
    except BaseException:
        if coord and dir_info is not None:  # any rank failed: remove this save's marker, release the directory
            cleanup_failed(where.at(dir_info[0]), dir_info[1])
        raise
    if be.prepare_storage is not None:
        # e.g. zarr's arrays must exist before any rank writes chunks: the coordinator creates
        # them, and the broadcast of its outcome doubles as the barrier
        err = None
        if coord:
            try:
                be.prepare_storage(target, planned.layout, durable)
            except Exception as e:
                err = f"rank 0 (preparing the {backend} storage): {_describe(e)}"
                cleanup_failed(target, staging)
        err = dist.broadcast_object(err, src=dist.coordinator_rank(group), group=group)
        if err:
            raise DistributedCheckpointingError(f"save to {checkpoint_dir} failed before writing:\n  " + err)
    requests: List[WriteRequest] = []
    with failure.capture():
        requests = _requests_for(shards, planned.to_write)
    found = open_base(base_path, backend, rank, group, checkpoint_dir, {r.storage_key for r in requests})
    fprints: Optional[List[FingerprintRow]] = None
    if be.shape_requests is not None:
        with failure.capture():  # of the chunks as validated, before they are cut into the backend's units
            fprints = fingerprint_rows(requests, request_fingerprints(requests))
        # may exchange pieces of chunks on shard borders: every rank takes part, even after an error
        chosen = {m.chunk_id: m for m in planned.layout}
        requests = be.shape_requests(requests, planned.layout, chosen, rank, group, failure)
    return SavePlan(
        rank=rank,
        world_size=world,
        group=group,
        checkpoint_dir=checkpoint_dir,
        final_path=where.path,
        write_dir=write_dir,
        target=target,
        staging=staging,
        common=common if coord else None,
        requests=requests,
        summaries=planned.summaries,
        thread_count=thread_count,
        durable=durable,
        backend=backend,
        step=_recorded_step(step, common) if coord else None,
        separation_hint=separation_hint,
        fingerprints=fprints,
        failure=failure,
        base=found,
        common_state_in_data=common_state_in_data,
    )


def _recorded_step(step: Optional[int], common: object) -> Optional[int]:
    """The step a checkpoint holds: ``step`` if given, else the common state's top-level
    ``global_step`` (Lightning) or ``iteration`` (Megatron-LM), if it is an integer."""
    if step is not None:
        return step  # checked by serialization.save
    if isinstance(common, dict):
        for key in ("global_step", "iteration"):
            v = common.get(key)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def request_fingerprints(requests: List[WriteRequest]) -> List[Optional[int]]:
    """The fingerprint of every tensor chunk among ``requests`` (storage.fingerprint; None for objects)."""
    at = [i for i, r in enumerate(requests) if isinstance(r.data, torch.Tensor) and r.offsets is not None]
    out: List[Optional[int]] = [None] * len(requests)
    for i, v in zip(at, fingerprints([(requests[i].data, requests[i].offsets) for i in at])):
        out[i] = v
    return out


def fingerprint_rows(requests: List[WriteRequest], values: List[Optional[int]]) -> List[FingerprintRow]:
    """``(key, offsets, sizes, fingerprint)`` of every tensor chunk among ``requests``."""
    return [(r.storage_key, tuple(r.offsets), tuple(r.data.shape), v) for r, v in zip(requests, values) if v is not None]


def write_local(plan: SavePlan) -> None:
    """Phase 2 (no collectives). Records an error instead of raising."""
    if plan.failure.failed:
        return
    try:
        if plan.stop is not None:
            plan.stop()
        if plan.fingerprints is None and plan.item_fingerprints is None and plan.backend == "torch_dist":
            # (zarr's: before its chunks were cut; a save in waves: computed with its waves)
            plan.item_fingerprints = request_fingerprints(plan.requests)
        plan.written = SAVE_BACKENDS[plan.backend].write(plan)
    except Exception as e:
        plan.failure.record(write_error(e, plan.write_dir))  # an OSError (disk full...) becomes CheckpointWriteError
    finally:
        plan.requests = []  # drop references to the state (and staged copies) early


def cleanup_failed(target: CheckpointLocation, staging: bool) -> None:
    """Coordinator: remove what the failed save wrote, if the directory is still its own; release it."""
    storage, write_dir = target.storage, target.path
    claim = _claims.get(write_dir)
    try:
        if claim is not None and not claim.owned():
            logger.warning("not cleaning up %s: another save has taken the directory over", write_dir)
        elif staging:
            storage.rmtree(write_dir)
        else:
            for n in sorted(claims.library_entries(target), key=lambda n: n != ckdir.CONFIG_FILE):  # (marker first)
                storage.remove_any(target.file(n))
            if claim is not None and claim.created and not storage.listdir(write_dir):
                storage.rmtree(write_dir)  # (an empty directory named like a checkpoint misleads: Lightning's -v1)
    except OSError:
        logger.exception("could not clean up the failed save in %s", write_dir)
    finally:
        _release_claim(write_dir)


def _write_torch_dist(plan: SavePlan) -> Any:
    out = write_data_files(plan.target, plan.rank, plan.requests, plan.thread_count, plan.durable,
                           separation_hint=plan.separation_hint, stop=plan.stop, fingerprints=plan.item_fingerprints,
                           base=plan.base, taken_names=plan.taken_names)
    if plan.written_before is not None:
        out.extend(plan.written_before)
    return out


def _write_zarr(plan: SavePlan) -> Any:
    return write_zarr_requests(plan.target, plan.requests, plan.thread_count, plan.durable)


def _commit_torch_dist(plan: SavePlan, layout: CommitLayout) -> None:
    """Coordinator: write metadata files, then the commit marker, then swap if staging."""
    d = plan.target
    claim = _check_claim(plan)
    metadata = dumps_commit_layout(layout)  # .metadata from the arrays (DCP's pickle, no objects built)
    md_entry = write_recorded(d, DCP_METADATA_FILE, metadata, plan.durable)
    digest = save_block_hash()  # what write_data_files recorded
    fmt = ckdir.manifest_format(digest)
    files: Dict[str, Dict[str, int]] = {DCP_METADATA_FILE: md_entry}
    files.update(write_index(d, layout, digest, md_entry, fmt["version"], plan.durable))
    if not plan.common_state_in_data:
        files[ckdir.COMMON_FILE] = ckdir.save_common(d, plan.common, plan.durable)
    files.update(file_sizes(layout.written))
    manifest = ckdir.Manifest(
        **fmt,
        world_size=plan.world_size,
        files=files,
        library_version=__version__,
        save=claim.token if claim else "",
        step=plan.step,
        commit_seq=next_commit_seq(d.at(plan.checkpoint_dir)),
        commit_id=uuid.uuid4().hex,
    )
    rendered = None
    if fmt["version"] < 6:  # (formats 4 and 5: the items in the manifest, as their writers wrote them)
        manifest.fingerprints = _fingerprint_text(layout)
        rendered = {"tables": table_of_written(layout.written, digest)}
    ckdir.write_manifest(d, manifest, plan.durable, rendered=rendered)
    _write_commit_marker(plan, plan.backend)
    _swap_if_staging(plan)


def _fingerprint_text(layout: CommitLayout) -> str:
    return fingerprint_text(layout.written)


def fingerprint_text(w: WrittenColumns) -> str:
    """The manifest's ``fingerprints`` (format 5) of the written items ``w`` (``WrittenColumns``): one row
    per tensor chunk written."""
    groups = list(w.fingerprints)  # zarr's rows
    for nd, keys, fp, offs, sizes in w.fingerprint_groups():  # torch_dist's, with the items
        groups.append((nd, [w.strings[k] for k in keys.tolist()], fp, offs, sizes))
    if not any(len(g[1]) for g in groups):
        return ""
    return encode_groups(groups)


def _check_claim(plan: SavePlan) -> Optional[claims.SaveClaim]:
    """Before the commit files: the write directory must still be this save's."""
    claim = _claims.get(plan.target.path)
    if claim is not None:
        claim.check_owned()
    return claim


def _write_commit_marker(plan: SavePlan, backend: str) -> None:
    """``metadata.json``, created exclusively in place: of two saves committing into one
    directory at once exactly one succeeds (a staging directory is this save's alone)."""
    try:
        ckdir.write_config(plan.target, ckdir.CheckpointingConfig(backend, 1), plan.durable, exclusive=not plan.staging)
    except FileExistsError:
        claim = _claims.get(plan.write_dir)  # (an object store's create whose answer was lost, retried by the
        if plan.target.storage.remote and claim is not None and claim.owned():  # client: ours if nobody took over)
            return
        raise SaveConflictError(
            f"cannot commit the save to {plan.write_dir}: another save committed a checkpoint there meanwhile "
            "(two jobs saved to the same path at once); this save is abandoned"
        ) from None


def _written_records(plan: SavePlan) -> WrittenTable:
    """This rank's written items (torch_dist: with the chunk sizes, so rank 0 needs no other layout record)."""
    if isinstance(plan.written, WrittenTable):
        return plan.written
    return WrittenTable.from_items(plan.written)


def _swap_if_staging(plan: SavePlan) -> None:
    """Put the committed staging directory in place of the old checkpoint (``overwrite=True``),
    by the library's one atomic-replace rule (:func:`..storage.claim.replace`; the data is fsync'ed already).

    A crash in the two-rename fallback leaves the old checkpoint at ``<dir>.old-*`` and the new,
    committed one at ``<dir>.tmp-*``, which ``load`` names in its error
    (see ``claim.interrupted_overwrite_hint``).
    """
    if not plan.staging:
        return
    # (the checkpoint's path on its storage: ``checkpoint_dir`` may be a ``file://`` URL)
    claims.replace(plan.target.storage, plan.write_dir, plan.final_path or plan.checkpoint_dir, durable=plan.durable,
                   data_synced=True)


def _commit_zarr(plan: SavePlan, layout: CommitLayout) -> None:
    d = plan.target
    claim = _check_claim(plan)
    # chunk/object sizes + CRC32s into zarr_index.json, itself recorded in the manifest like every small file
    files = {ZARR_INDEX_FILE: commit_file_records(d, layout.written.items(), plan.durable),
             ckdir.COMMON_FILE: ckdir.save_common(d, plan.common, plan.durable)}
    manifest = ckdir.Manifest(version=ckdir.ZARR_MANIFEST_VERSION, world_size=plan.world_size, files=files,
                              library_version=__version__,
                              save=claim.token if claim else "", step=plan.step,
                              commit_seq=next_commit_seq(d.at(plan.checkpoint_dir)), commit_id=uuid.uuid4().hex,
                              fingerprints=_fingerprint_text(layout))
    ckdir.write_manifest(d, manifest, plan.durable)
    _write_commit_marker(plan, plan.backend)
    _swap_if_staging(plan)


def finalize_save(plan: SavePlan) -> None:
    """Phase 3 (collective). Raises DistributedCheckpointingError on every rank if any rank failed."""
    try:
        message = encode_finalize(plan.failure.message, _written_records(plan), plan.summaries, plan.fingerprints or ())
    except Exception as e:
        plan.failure.record(e)
        message = encode_finalize(plan.failure.message, [], [])
    results = dist.gather_bytes(message, dst=dist.coordinator_rank(plan.group), group=plan.group)
    plan.commit_started = True
    status: Optional[str] = None
    if plan.rank == 0:
        try:
            failures, written, summaries = gather_finalize(results)
            errors = dist.rank_errors(failures, plan.group)
            if errors:
                status = "\n  ".join(errors)
            else:
                be = SAVE_BACKENDS[plan.backend]
                layout = commit_layout(written, summaries, check_layout=be.check_layout)
                be.commit(plan, layout)
                plan.committed = True
        except Exception as e:
            e = write_error(e, plan.write_dir)  # an OSError (disk full...) becomes CheckpointWriteError
            status = f"rank 0 (commit): {_describe(e)}"
            plan.failure.exc = e
        if status:
            cleanup_failed(plan.target, plan.staging)
        _release_claim(plan.target.path)
    status = dist.broadcast_object(status, src=dist.coordinator_rank(plan.group), group=plan.group)
    if status:
        dist.raise_if_any_failed(
            plan.failure.exc,
            status.split("\n  "),
            f"save to {plan.checkpoint_dir} failed; no checkpoint was committed there and earlier "
            "checkpoints are untouched",
        )
    logger.debug("saved %s in %.3fs", plan.checkpoint_dir, time.time() - plan.started)


@with_gc_paused  # 20,000 small tensors: 1.2-1.34 s with the cycle collector running, 0.88-0.99 s without
def save_sharded(sharded_state_dict: Dict[str, Any], checkpoint_dir: str, **kwargs: object) -> None:
    """A synchronous save with any backend (``backend="torch_dist"`` or ``"zarr"``): prepare,
    write this rank's items, finalize and commit. Collective."""
    plan = prepare_save(sharded_state_dict, checkpoint_dir, **kwargs)
    write_local(plan)
    finalize_save(plan)


@dataclass(frozen=True)
class SaveBackend:
    """What a save does differently per storage backend (the read side: ``storage.opened``).

    * ``wants_layout``: the metadata exchange also returns every chunk's layout (zarr creates its
      arrays from it and writes whole chunks);
    * ``prepare_storage(target, layout, durable)``: run by the coordinator before any rank
      writes (zarr: create the arrays), or None;
    * ``shape_requests(...)``: turn this rank's write requests into the backend's units,
      collective (zarr: whole chunks, border pieces sent to their owners), or None;
    * ``write(plan)``: phase 2, this rank's files; ``commit(plan, layout)``: the coordinator's
      commit; ``check_layout``: the commit checks that the written chunks tile each tensor.
    """

    name: str
    wants_layout: bool
    check_layout: bool
    prepare_storage: Optional[Callable[[CheckpointLocation, List[ShardMeta], bool], None]]
    shape_requests: Optional[Callable[..., List[WriteRequest]]]
    write: Callable[[SavePlan], Any]
    commit: Callable[[SavePlan, CommitLayout], None]


SAVE_BACKENDS: Dict[str, SaveBackend] = {
    "torch_dist": SaveBackend("torch_dist", wants_layout=False, check_layout=True, prepare_storage=None,
                              shape_requests=None, write=_write_torch_dist, commit=_commit_torch_dist),
    "zarr": SaveBackend("zarr", wants_layout=True, check_layout=False, prepare_storage=zarr_save.create_zarr_arrays,
                        shape_requests=zarr_save.zarr_chunk_requests, write=_write_zarr, commit=_commit_zarr),
}
