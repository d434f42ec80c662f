"""A load reads the checkpoint's metadata once and shares it: one reader, one broadcast.

The coordinator reads ``metadata.json``, ``.metadata`` and ``manifest.json`` (with
their checks: commit marker, checksums, safe unpickling) and broadcasts them as one
compact message (a string table and integers, see :mod:`..planning.records`): no
pickle crosses ranks, and the filesystem sees one reader instead of one per rank.
Every rank rebuilds the same :class:`SharedMetadata`. A failure on the coordinator
arrives on every rank as the same exception type and message, as if each had read
the files itself.

For zarr checkpoints only ``metadata.json`` and the manifest travel this way; each
rank's reader still opens the zarr index itself (storage layer).

:class:`SharedMetadata` is what the load path passes down; a future checkpoint
object opened once by the storage layer can carry the same three fields.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .. import errors as errors_mod
from ..planning.records import MessageWriter, decode
from ..storage import checkpoint_dir as ckdir
from ..storage.backends import read_metadata
from . import dist
from .preprocess import dtype_from_name, dtype_name


@dataclass
class SharedMetadata:
    backend: str
    metadata: Optional[Metadata]  # None for zarr: each rank's reader reads the zarr index
    manifest: Optional[ckdir.Manifest]


def encode_metadata(md: Metadata, w: MessageWriter) -> None:
    """Append the parts of a DCP ``Metadata`` that loading uses (keys, dtypes, shapes, chunks, locations)."""
    storage = md.storage_data or {}

    def where(index: MetadataIndex) -> Tuple[int, int, int]:
        info = storage.get(index)
        if info is None:
            return (-1, 0, 0)
        return (w.sid(str(info.relative_path)), int(info.offset), int(info.length))

    w.add(len(md.state_dict_metadata))
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            size = tuple(meta.size)
            w.add(0, w.sid(key), w.sid(dtype_name(meta.properties.dtype)), len(size), *size, len(meta.chunks))
            for c in meta.chunks:
                offsets = tuple(c.offsets)
                w.add(*offsets, *c.sizes, *where(MetadataIndex(key, torch.Size(offsets))))
        else:
            w.add(1, w.sid(key), *where(MetadataIndex(key)))


def decode_metadata(strings: List[str], ints: List[int], p: int) -> Tuple[Metadata, int]:
    """Inverse of :func:`encode_metadata` from position ``p``; returns the metadata and the next position."""
    sd_meta: dict = {}
    storage: dict = {}
    count = ints[p]
    p += 1
    for _ in range(count):
        kind, key = ints[p], strings[ints[p + 1]]
        if kind == 0:
            ds, nd = ints[p + 2], ints[p + 3]
            size = torch.Size(ints[p + 4 : p + 4 + nd])
            nchunks = ints[p + 4 + nd]
            p += 5 + nd
            chunks = []
            for _ in range(nchunks):
                offsets = torch.Size(ints[p : p + nd])
                chunks.append(ChunkStorageMetadata(offsets, torch.Size(ints[p + nd : p + 2 * nd])))
                f, off, length = ints[p + 2 * nd : p + 2 * nd + 3]
                if f >= 0:
                    storage[MetadataIndex(key, offsets)] = _StorageInfo(strings[f], off, length)
                p += 2 * nd + 3
            sd_meta[key] = TensorStorageMetadata(TensorProperties(dtype=dtype_from_name(strings[ds])), size, chunks)
        else:
            f, off, length = ints[p + 2 : p + 5]
            if f >= 0:
                storage[MetadataIndex(key)] = _StorageInfo(strings[f], off, length)
            sd_meta[key] = BytesStorageMetadata()
            p += 5
    md = Metadata(
        state_dict_metadata=sd_meta, planner_data={k: (k,) for k in sd_meta}, storage_data=storage,
        storage_meta=StorageMeta(), version="1.0.0",
    )
    return md, p


def encode_shared(shared: SharedMetadata) -> bytes:
    w = MessageWriter()
    w.sid("")  # index 0: no error
    w.add(0, w.sid(shared.backend), w.sid(json.dumps(asdict(shared.manifest)) if shared.manifest else ""))
    if shared.metadata is None:
        w.add(0)
    else:
        w.add(1)
        encode_metadata(shared.metadata, w)
    return w.tobytes()


def encode_failure(e: BaseException) -> bytes:
    w = MessageWriter()
    w.add(1, w.sid(type(e).__name__), w.sid(str(e)))
    return w.tobytes()


def decode_shared(buf: bytes) -> SharedMetadata:
    strings, ints = decode(buf)
    if ints[0]:
        raise _rebuild_failure(strings[ints[1]], strings[ints[2]])
    backend, manifest_json = strings[ints[1]], strings[ints[2]]
    manifest = ckdir.Manifest(**json.loads(manifest_json)) if manifest_json else None
    md = decode_metadata(strings, ints, 4)[0] if ints[3] else None
    return SharedMetadata(backend, md, manifest)


def _rebuild_failure(name: str, message: str) -> BaseException:
    """The coordinator's exception as the same type here (checkpointing errors), or a wrapper naming it."""
    cls = getattr(errors_mod, name, None)
    if isinstance(cls, type) and issubclass(cls, errors_mod.CheckpointingException):
        return cls(message)
    return errors_mod.DistributedCheckpointingError(f"rank 0 could not read the checkpoint metadata: {name}: {message}")


def read_local(checkpoint_dir: str, trusted: bool = False) -> SharedMetadata:
    """What the coordinator reads (also the whole job's metadata in a single process)."""
    backend = ckdir.read_config(checkpoint_dir).sharded_backend
    md = read_metadata(checkpoint_dir, trusted=trusted, backend=backend) if backend == "torch_dist" else None
    return SharedMetadata(backend, md, ckdir.read_manifest(checkpoint_dir))


def read_shared(checkpoint_dir: str, group: Any = None, trusted: bool = False) -> SharedMetadata:
    """Collective: the coordinator reads, every rank gets the result (or raises the coordinator's error)."""
    if not dist.is_distributed() or dist.get_world_size(group) == 1:
        return read_local(checkpoint_dir, trusted)
    coord = dist.coordinator_rank(group)
    payload: Optional[bytes] = None
    local: Optional[BaseException] = None
    if dist.get_rank(group) == 0:
        try:
            payload = encode_shared(read_local(checkpoint_dir, trusted))
        except Exception as e:  # every rank raises it, below
            payload, local = encode_failure(e), e
    payload = dist.broadcast_bytes(payload, src=coord, group=group)
    if local is not None:
        raise local
    return decode_shared(payload)
