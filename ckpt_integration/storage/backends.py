"""The storage backends as typed objects: what each can do, how to read its metadata, its reader.

Both backends describe their content as a DCP ``Metadata`` (tensor keys with dtype, global shape
and chunks; object keys) and provide a :class:`CheckpointReader`, so the load path and the tools
are backend-agnostic: they ask the :class:`Backend` of a checkpoint (``backend_named`` /
``backend_of``) for a capability instead of comparing backend names.

Example::

    ck = locate("ckpt")                # the handle every helper below takes
    be = backend_of(ck)                # TORCH_DIST or ZARR, from the checkpoint's metadata.json
    md = be.read_metadata(ck, False)
    with be.open_reader(ck, md) as reader:
        reader.read_region(key, reader.chunks[key][0], box, out, dtype)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ..errors import CheckpointingException
from ..planning.boxes import Box
from . import checkpoint_dir as ckdir
from .located import CheckpointLocation
from .torch_dist import read_dcp_metadata
from .torch_dist_reader import MANIFEST_FROM_DIRECTORY, ChunkInfo, TorchDistReader
from .zarr_backend import ZarrReader


class CheckpointReader(Protocol):
    """What every backend's reader gives the load path and the tools (``TorchDistReader``,
    ``ZarrReader``). Every byte it returns was verified against the checkpoint's records
    (unless opened with ``verify_checksums=False``), and it reads only files inside the
    checkpoint."""

    metadata: Metadata
    chunks: Dict[str, List[ChunkInfo]]  # per tensor key: the stored chunks and where they are

    def validate_tensor(self, key: str) -> None:
        """Raise ``CorruptCheckpointError`` unless ``key``'s chunks tile its global shape."""

    def read_region(self, key: str, chunk: ChunkInfo, overlap: Box, out: torch.Tensor, dtype: torch.dtype) -> None:
        """Copy ``overlap`` (global coordinates, inside ``chunk``) of ``key`` into ``out``."""

    def read_bytes(self, storage_key: str) -> bytes:
        """The verified bytes of a stored object."""

    def close(self) -> None:
        """Release open files (the reader is unusable afterwards)."""

    def __enter__(self) -> "CheckpointReader": ...

    def __exit__(self, *exc: object) -> None: ...


@dataclass(frozen=True)
class Backend:
    """One storage format (``metadata.json``'s ``sharded_backend``) and what it supports.

    * ``dcp_metadata``: a PyTorch DCP ``.metadata`` describes the checkpoint (read once by a
      load's coordinator and broadcast; pinned by an opened checkpoint); otherwise each reader
      reads the backend's own index;
    * ``mapped_chunks``: chunks are plain row-major arrays at recorded offsets of local files,
      so the read-once and parallel planners can map and split them;
    * ``block_hash``: the digest algorithm of the backend's own records, or None when the
      manifest names it (``manifest.json``'s ``block_hash``).
    """

    name: str
    dcp_metadata: bool
    mapped_chunks: bool
    block_hash: Optional[str]
    read_metadata: Callable[[CheckpointLocation, bool], Metadata]
    open_reader: Callable[..., CheckpointReader]


def _open_torch_dist(
    ck: CheckpointLocation, metadata: Metadata, checksums: Optional[Dict[Tuple[str, int], int]] = None,
    verify_checksums: bool = True, manifest: Union[ckdir.Manifest, None, object] = MANIFEST_FROM_DIRECTORY,
) -> CheckpointReader:
    return TorchDistReader(ck, metadata, checksums, verify_checksums, manifest=manifest)


def _open_zarr(
    ck: CheckpointLocation, metadata: Metadata, checksums: Optional[Dict[Tuple[str, int], int]] = None,
    verify_checksums: bool = True, manifest: Union[ckdir.Manifest, None, object] = None,
) -> CheckpointReader:
    # the zarr index carries the chunk records and CRC32s; the DCP-shaped metadata is the reader's own
    return ZarrReader(ck, verify_checksums=verify_checksums, manifest=manifest if isinstance(manifest, ckdir.Manifest) else None)


TORCH_DIST = Backend(
    "torch_dist", dcp_metadata=True, mapped_chunks=True, block_hash=None,
    read_metadata=lambda ck, trusted: read_dcp_metadata(ck, trusted=trusted),
    open_reader=_open_torch_dist,
)
ZARR = Backend(
    "zarr", dcp_metadata=False, mapped_chunks=False, block_hash="crc32",
    read_metadata=lambda ck, trusted: ZarrReader(ck).metadata,
    open_reader=_open_zarr,
)
BACKENDS: Dict[str, Backend] = {b.name: b for b in (TORCH_DIST, ZARR)}


def backend_named(name: str) -> Backend:
    """The :class:`Backend` called ``name`` (``"torch_dist"``, ``"zarr"``)."""
    be = BACKENDS.get(name)
    if be is None:
        raise CheckpointingException(f"unknown checkpoint backend {name!r}; this library reads {sorted(BACKENDS)}")
    return be


def backend_of(ck: CheckpointLocation) -> Backend:
    """The backend that wrote the checkpoint (from its ``metadata.json``)."""
    return backend_named(ckdir.read_config(ck).sharded_backend)


def read_metadata(ck: CheckpointLocation, trusted: bool = False, backend: Optional[str] = None) -> Metadata:
    """The DCP-shaped ``Metadata`` of the checkpoint through its backend."""
    be = backend_named(backend) if backend else backend_of(ck)
    return be.read_metadata(ck, trusted)


#: Megatron-Core 0.19's layout: the common state as this ShardedObject inside the DCP data (no common.pt)
EMBEDDED_COMMON_KEY = "common_state"


def embedded_common_key(metadata: Optional[Metadata]) -> Optional[str]:
    """The storage key of a common state stored as the ``common_state`` ShardedObject (Megatron-Core 0.19
    layout: ``common_state/shard_0_1``), or None."""
    found = [k for k, v in ((metadata.state_dict_metadata or {}).items() if metadata is not None else ())
             if isinstance(v, BytesStorageMetadata)
             and (k == EMBEDDED_COMMON_KEY or k.startswith(EMBEDDED_COMMON_KEY + "/shard_"))]
    return sorted(found)[0] if found else None


def embedded_common_bytes(opened: CheckpointLocation) -> Optional[bytes]:
    """The bytes of the common state stored inside the DCP data of the opened checkpoint ``opened``
    (verified where its manifest records them), or None when it has none."""
    md = getattr(opened, "metadata", None)
    key = embedded_common_key(md)
    if key is None:
        return None
    reader = open_reader(opened, md, "torch_dist", manifest=getattr(opened, "manifest", None))
    try:
        return reader.read_bytes(key)
    finally:
        reader.close()


def open_reader(
    ck: CheckpointLocation,
    metadata: Metadata,
    backend: Optional[str] = None,
    checksums: Optional[Dict[Tuple[str, int], int]] = None,
    verify_checksums: bool = True,
    manifest: Union[ckdir.Manifest, None, object] = MANIFEST_FROM_DIRECTORY,
) -> CheckpointReader:
    """A :class:`CheckpointReader` of the checkpoint ``ck``. Each reader reads its integrity records
    itself (manifest / zarr index), so every caller gets verified reads and the containment
    checks, unless ``manifest`` hands it the checkpoint's manifest already read and checked (a
    load's coordinator reads it once and broadcasts it; ``None``: the checkpoint has none).
    ``checksums`` is accepted for compatibility and ignored where the checkpoint has a manifest."""
    be = backend_named(backend) if backend else backend_of(ck)
    return be.open_reader(ck, metadata, checksums, verify_checksums, manifest)
