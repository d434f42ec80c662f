"""Backend dispatch: metadata and readers for whichever backend wrote a checkpoint.

Both backends describe their content as a DCP ``Metadata`` (tensor keys with
dtype, global shape and chunks; object keys) and provide a reader with the
same interface, so everything above the storage layer is backend-agnostic.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from torch.distributed.checkpoint.metadata import Metadata

from . import checkpoint_dir as ckdir
from .torch_dist import MANIFEST_FROM_DIRECTORY, TorchDistReader, read_dcp_metadata
from .zarr_backend import ZarrReader


def backend_of(directory: str) -> str:
    return ckdir.read_config(directory).sharded_backend


def read_metadata(directory: str, trusted: bool = False, backend: Optional[str] = None) -> Metadata:
    backend = backend or backend_of(directory)
    if backend == "zarr":
        return ZarrReader(directory).metadata
    return read_dcp_metadata(directory, trusted=trusted)


def open_reader(
    directory: str,
    metadata: Metadata,
    backend: Optional[str] = None,
    checksums: Optional[Dict[Tuple[str, int], int]] = None,
    verify_checksums: bool = True,
    manifest: Any = MANIFEST_FROM_DIRECTORY,
) -> Any:
    """A reader of ``directory`` (``TorchDistReader`` or ``ZarrReader``) for ``read_region`` /
    ``read_bytes``. Each reader reads its integrity records itself (manifest / zarr index), so
    every caller gets verified reads and the containment checks, unless ``manifest`` hands it
    the checkpoint's manifest already read and checked (a load's coordinator reads it once and
    broadcasts it; ``None``: the checkpoint has none). ``checksums`` is accepted for
    compatibility and ignored where the checkpoint has a manifest."""
    backend = backend or backend_of(directory)
    if backend == "zarr":
        return ZarrReader(directory, verify_checksums=verify_checksums)
    return TorchDistReader(directory, metadata, checksums, verify_checksums, manifest=manifest)
