"""PyTorch DCP's front door: a ``StorageWriter`` and a ``StorageReader`` that write and read this library's format.

Code that checkpoints with ``torch.distributed.checkpoint`` (torchtitan, TorchTune-style loops,
FSDP2 / DTensor state dicts from ``get_state_dict``) switches by passing these to DCP's own calls;
DCP's planners, its resharding and its async save stay as they are::

    import torch.distributed.checkpoint as dcp
    import ckpt_integration as ci

    dcp.save(state_dict, storage_writer=ci.dcp.Writer("ckpt/step_100"))
    dcp.async_save(state_dict, storage_writer=ci.dcp.Writer("ckpt/step_200"))
    dcp.load(state_dict, storage_reader=ci.dcp.Reader("ckpt/step_200"))

What a checkpoint written through :class:`Writer` has that a plain ``FileSystemWriter`` one lacks:
the commit rule (``metadata.json`` is written last, by the coordinator, once every rank's data is
durable; a save that fails or is killed is never taken for a checkpoint, and a directory holding a
committed checkpoint or files of another writer is refused), block digests of every item
(XXH3-64 per 1 MiB) and the layout-independent fingerprints of verified resume in ``manifest.json``,
retried object-store requests through fsspec. It is a directory of this library's ``torch_dist``
format: ``ci.load``, ``ckpt-integration verify / inspect``, Megatron-Core and plain ``dcp.load`` read it.

:class:`Reader` reads it, and plain DCP checkpoints, with every byte it returns checked against
the recorded digests (a flipped byte raises :class:`~ckpt_integration.CorruptCheckpointError`
naming the file and the byte range, where DCP's ``FileSystemReader`` returns the damaged values),
``.metadata`` unpickled restrictedly, and every data file name checked to lie inside the
checkpoint. A plain DCP checkpoint has no digests: that is said once, and its bytes are returned
as read.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import uuid
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as tdist
from torch.futures import Future
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed._shard._utils import narrow_tensor_by_index

from .errors import CheckpointingException, CorruptCheckpointError
from .execution.save import fingerprint_text, request_fingerprints
from .planning.written import encode_finalize, gather_finalize
from .storage import checkpoint_dir as ckdir
from .storage import claim as claims
from .storage.checkpoint_index import layout_of_metadata
from .storage.checksum import save_block_hash
from .storage.chunk_index import write_index
from .storage.opened import next_commit_seq
from .storage.filesystem import locate, storage_for
from .storage.item_table import file_sizes, table_of_written
from .storage.torch_dist import WriteRequest, read_dcp_metadata, write_data_files, write_dcp_metadata
from .storage.torch_dist_reader import TorchDistReader
from .version import __version__

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]


def _rank() -> int:
    return tdist.get_rank() if tdist.is_available() and tdist.is_initialized() else 0


_CACHED_OVERWRITE = ("ci.dcp.Writer(overwrite=True): {path} holds a committed checkpoint, and DCP's plan caching "
                     "(DefaultSavePlanner(enable_plan_caching=True)) reuses an earlier save's plans, which cannot carry "
                     "this save's staging directory to every rank: save to a new directory, or without plan caching")


class Writer(StorageWriter):
    """A ``torch.distributed.checkpoint`` ``StorageWriter`` writing this library's format to ``path``
    (a directory, or an fsspec URL such as ``s3://bucket/run/step_100``).

    Args:
        path: the checkpoint directory (the ``checkpoint_id`` given to ``dcp.save`` replaces it).
        thread_count: writer threads (and data files) per rank.
        durable: fsync every file before the commit (off only for throwaway checkpoints).
        overwrite: ``False`` (default) refuses a directory that holds a committed checkpoint; ``True``
            writes the new one beside it and puts it in place only once committed (as
            ``ci.save(overwrite=True)``: the old one stays whole until then; not on object stores).

    Example::

        dcp.save({"model": model.state_dict()}, storage_writer=ci.dcp.Writer("ckpt/step_100"))
    """

    def __init__(self, path: PathLike = "", thread_count: int = 2, durable: bool = True, overwrite: bool = False):
        super().__init__()
        self.path = _resolved(path)  # (absolute: torch's async_save writes in a thread, maybe after a chdir)
        self.thread_count = max(1, int(thread_count))
        self.durable = durable
        self.overwrite = overwrite
        self.is_coordinator = False
        self._claim: Optional[claims.SaveClaim] = None
        self._held_at = ""  # the path this writer's claim is held under in _held
        self._world = 1  # ranks saving (set by the global plan)
        self.write_dir = ""  # where this save's files go: the path, or a staging sibling when overwriting

    # -- DCP's sequence: reset, set_up, local plan, global plan (coordinator), write, finish (coordinator)
    def reset(self, checkpoint_id: Optional[PathLike] = None) -> None:
        if checkpoint_id:
            self.path = _resolved(checkpoint_id)
        self._release()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def set_up_storage_writer(self, is_coordinator: bool, *args: object, **kwargs: object) -> None:
        if not self.path:
            raise CheckpointingException("ci.dcp.Writer: no path (pass one, or checkpoint_id= to dcp.save)")
        if kwargs.get("use_collectives") is False and tdist.is_initialized() and tdist.get_world_size() > 1 \
                and kwargs.get("rank") == tdist.get_rank():
            # every rank would claim and commit the directory with its own part only: the first commit
            # would hold one rank's state and the others would fail against it
            raise CheckpointingException(
                f"ci.dcp.Writer({self.path!r}): dcp.save(use_collectives=False) saves each rank's part without "
                "coordination, but a checkpoint of this library is committed once for the whole job after every "
                "rank's data is durable. Save with use_collectives=True (the default); for one checkpoint per "
                "rank, give each rank its own path and no_dist=True")
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path, save_id=uuid.uuid4().hex)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        """Coordinator, before any rank writes: claim the directory (refusing a committed checkpoint
        and files of other writers, as ``ci.save`` does)."""
        ck = locate(self.path)
        storage, path = ck.storage, ck.path
        token = uuid.uuid4().hex
        self._world = len(plans)  # (one plan per rank of the save's process group, not of the world)
        stale = _held.pop(path, None)
        if stale is not None:  # an earlier save to this path from this process failed (DCP does not tell its writer)
            stale.release()
        if ck.exists(ckdir.CONFIG_FILE):
            if not self.overwrite or storage.remote:
                raise CheckpointingException(
                    f"{path} already holds a committed checkpoint; save to a new directory (ci.dcp.Writer(overwrite=True) "
                    "replaces it once the new one is committed; not on object stores)")
            self._claim = claims.claim_staging(ck, claims.staging_name(path, token), token, self.durable)
            try:  # (what such a failed save left beside it; after the claim, as ci.save does)
                claims.remove_dead_staging(ck)
            except BaseException:
                self._claim.release()
                raise
        else:
            self._claim = claims.claim_new(ck, token, self.durable)
        _held[path], self._held_at = self._claim, path
        if self._claim.write_dir != self.path and any(not p.usable for p in plans):
            self._release()  # (nothing written yet)
            raise CheckpointingException(_CACHED_OVERWRITE.format(path=path))
        # every rank writes where the coordinator claimed (the plans carry it to them, with the path they are for)
        return [dataclasses.replace(p, storage_data=(self.path, self._claim.write_dir)) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[List[WriteResult]]":
        """This rank's items into ``__<rank>_<i>.distcp`` files, with block digests and fingerprints."""
        self.write_dir = self._write_dir(plan)
        requests: List[WriteRequest] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                requests.append(WriteRequest(item.index.fqn, None, bytes(data.getbuffer())))
                continue
            t = data.detach()
            if not t.is_cpu:
                t = t.to("cpu")
            if t.is_conj() or t.is_neg():  # (the files take a tensor's memory, which holds the values before the flip)
                t = t.resolve_conj().resolve_neg()
            requests.append(WriteRequest(item.index.fqn, tuple(int(o) for o in item.tensor_data.chunk.offsets), t))
        fps = request_fingerprints(requests)
        written = write_data_files(locate(self.write_dir), _rank(), requests, self.thread_count, self.durable,
                                   fingerprints=fps)
        rows = {(w.storage_key, w.offsets): w for w in written.items()}
        results = []
        for item, req in zip(plan.items, requests):
            w = rows[(req.storage_key, req.offsets)]
            # (DCP keeps storage_data as given: the coordinator's finish() takes our row back out of it)
            results.append(WriteResult(index=item.index, size_in_bytes=w.length,
                                       storage_data=(_StorageInfo(w.relative_path, w.offset, w.length),
                                                     encode_finalize(None, [w], []))))
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_dir(self, plan: SavePlan) -> str:
        """Where this rank writes: the coordinator's claim (its own), or what the plans carried. A plan DCP's
        plan caching kept from an earlier save (``DefaultSavePlanner(enable_plan_caching=True)``) carries that
        save's directory: a new checkpoint is written in place at this save's path; an overwrite's staging
        directory is known to the coordinator only (refused there, and here)."""
        if self._claim is not None:
            return self._claim.write_dir
        got = plan.storage_data
        if isinstance(got, tuple) and len(got) == 2 and got[0] == self.path:
            return got[1]
        if locate(self.path).exists(ckdir.CONFIG_FILE):
            raise CheckpointingException(_CACHED_OVERWRITE.format(path=self.path))
        return self.path

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """Coordinator: ``.metadata`` (DCP's), ``common.pt``, ``manifest.json`` (digests of every item),
        then ``metadata.json``: the commit."""
        final = locate(self.path)
        target = self._claim.where if self._claim is not None else final
        path = target.path
        metadata.storage_data = {wr.index: wr.storage_data[0] for rs in results for wr in rs}
        written = _columns([wr.storage_data[1] for rs in results for wr in rs])
        if self._claim is not None:
            self._claim.check_owned()
        md_entry = write_dcp_metadata(target, metadata, self.durable)
        files: Dict[str, Dict[str, int]] = {".metadata": md_entry,
                                            ckdir.COMMON_FILE: ckdir.save_common(target, {}, self.durable)}
        files.update(file_sizes(written))
        digest = save_block_hash()
        fmt = ckdir.manifest_format(digest)
        manifest = ckdir.Manifest(
            **fmt, world_size=self._world,
            files=files, library_version=__version__, save=self._claim.token if self._claim else "", step=None,
            commit_seq=next_commit_seq(final), commit_id=uuid.uuid4().hex)
        rendered = None
        if fmt["version"] >= 6:  # every item's row in index.bin
            files.update(write_index(target, layout_of_metadata(metadata, written), digest, md_entry, fmt["version"],
                                     self.durable))
        else:
            manifest.fingerprints = fingerprint_text(written)
            rendered = {"tables": table_of_written(written, digest)}
        ckdir.write_manifest(target, manifest, self.durable, rendered=rendered)
        staging = self._claim is not None and self._claim.staging
        ckdir.write_config(target, ckdir.CheckpointingConfig("torch_dist", 1), self.durable, exclusive=not staging)
        if staging:  # the old checkpoint is replaced only now, whole (storage/claim.py's atomic-replace rule)
            claims.replace(final.storage, path, final.path, durable=self.durable, data_synced=True)
        self._release()
        logger.debug("ci.dcp.Writer committed %s", path)

    def _release(self) -> None:
        if self._claim is not None:
            self._claim.release()
            _held.pop(self._held_at, None)
            self._claim = None


# coordinator: the claim of each door save in progress, by target (released by the next save there if
# the save failed: DCP raises without telling the writer)
_held: Dict[str, claims.SaveClaim] = {}


def _columns(messages: Sequence[bytes]) -> Any:
    """Every rank's rows as the commit's columns (one ``encode_finalize`` message per item)."""
    return gather_finalize(list(messages))[1]


class Reader(StorageReader):
    """A ``torch.distributed.checkpoint`` ``StorageReader`` that reads this library's checkpoints, and plain
    DCP ones, verifying every byte it returns against the recorded digests.

    Args:
        path: the checkpoint directory or fsspec URL (the ``checkpoint_id`` given to ``dcp.load`` replaces it).
        trusted: unpickle ``.metadata`` without restrictions (only for checkpoints you trust).

    Example::

        dcp.load(state_dict, storage_reader=ci.dcp.Reader("ckpt/step_100"))
    """

    def __init__(self, path: PathLike = "", trusted: bool = False):
        super().__init__()
        self.path = _resolved(path)
        self.trusted = trusted
        self.manifest: Any = None
        self.storage_data: Dict[MetadataIndex, Any] = {}
        self._reader: Optional[TorchDistReader] = None

    def reset(self, checkpoint_id: Optional[PathLike] = None) -> None:
        if checkpoint_id:
            self.path = _resolved(checkpoint_id)
        self.manifest, self.storage_data, self._reader = None, {}, None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def read_metadata(self) -> Metadata:
        """``.metadata``, checked against the manifest where there is one, unpickled restrictedly.

        No ``**kwargs`` on purpose: DCP probes for them and, when this read fails, reads again with
        ``rank=`` ("rank-local metadata", which these checkpoints do not have); a rank whose second
        read worked (a passing object-store failure) would then load without collectives while the
        others wait in theirs, and the job would hang. Without them the failed read fails the load
        on every rank."""
        ck = locate(self.path)
        if ck.exists(ckdir.CONFIG_FILE):
            ckdir.read_config(ck)  # (a specific error for every way it is not a checkpoint)
        elif not ckdir.is_plain_dcp(ck):
            raise CorruptCheckpointError(f"{ck} holds no committed checkpoint: its save did not finish "
                                         "(metadata.json is missing)")
        # (a checkpoint without a manifest - plain DCP - is said once to be read unverified)
        self.manifest = ckdir.read_manifest_checked(ck)
        return read_dcp_metadata(ck, trusted=self.trusted, manifest=self.manifest)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: object, **kwargs: object) -> None:
        self.storage_data = dict(metadata.storage_data or {})
        ck = locate(self.path)
        if self.manifest is None and not is_coordinator and self.path:
            # (DCP reads the metadata on the coordinator only: the others learn the manifest here)
            self.manifest = ckdir.read_manifest_checked(ck)
        # every item read through the library's reader: names inside the checkpoint, extents, digests
        self._reader = TorchDistReader(ck, metadata, manifest=self.manifest)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        """Each requested item read whole once, checked, then handed to DCP's planner as its reader would."""
        assert self._reader is not None  # (set up by DCP before any read)
        per_item: Dict[Any, List[Any]] = {}
        for req in plan.items:
            per_item.setdefault(req.storage_index, []).append(req)
        try:
            for index, reqs in per_item.items():
                info = self.storage_data[index]
                data = self._reader.read_item(info, index.fqn)
                for req in reqs:
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(data))
                        continue
                    tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise CorruptCheckpointError(
                            f"{self._reader.ck.file(info.relative_path)}: {index.fqn} holds "
                            f"{tuple(tensor.size())} where .metadata records {tuple(target.size())}")
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        finally:
            self._reader.close()  # (its open files; the next read_data opens them again)
        fut: Future = Future()
        fut.set_result(None)
        return fut


__all__ = ["Reader", "Writer"]


def _resolved(path: Optional[PathLike]) -> str:
    """``path`` as the storage helpers resolve it (a local one absolute), or ``""`` for none."""
    return storage_for(path)[1] if path else ""
