"""Files shared by all backends: the commit marker, common state and manifest.

* ``metadata.json`` - ``{"sharded_backend", "sharded_backend_version",
  "common_backend", "common_backend_version"}`` exactly as Megatron-Core writes
  it (Megatron builds a dataclass from it, so no extra keys may go there). It
  is written **last**, atomically, after every rank's data is durable: a
  directory without it is an incomplete save and is never loaded.
* ``common.pt`` - the common (non-sharded) state, ``torch.save``'d by rank 0.
* ``manifest.json`` - our own record: format version, world size, per-item and
  per-file checksums. Optional on load (Megatron/DCP checkpoints lack it).
* ``ckpt_integration.json`` - written with the manifest, before the commit marker:
  says that this checkpoint has a ``manifest.json`` with checksums, so that
  ``verify`` can tell a deleted manifest (damage) from a foreign checkpoint that
  never had one. A separate file because ``metadata.json`` must stay Megatron's.
"""

from __future__ import annotations

import io
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsupportedCheckpointError,
)
from .checksum import crc32
from .filesystem import join, storage_for
from .safe_pickle import safe_torch_load

CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
MANIFEST_FILE = "manifest.json"
WRITER_FILE = "ckpt_integration.json"
FORMAT_NAME = "ckpt_integration"
MANIFEST_VERSION = 1

# backend -> supported versions of its on-disk layout
SUPPORTED_BACKENDS: Dict[str, Tuple[int, ...]] = {"torch_dist": (1,), "zarr": (1,)}
SUPPORTED_COMMON_BACKENDS: Dict[str, Tuple[int, ...]] = {"torch": (1,)}


@dataclass
class CheckpointingConfig:
    """Contents of ``metadata.json``: which backends wrote the checkpoint (Megatron-compatible)."""

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1


@dataclass
class Manifest:
    """Contents of ``manifest.json`` (our addition; absent in foreign checkpoints)."""

    format: str = FORMAT_NAME
    version: int = MANIFEST_VERSION
    created: float = field(default_factory=time.time)
    world_size: int = 1
    # "file@offset" -> crc32 of the item's stored bytes
    items: Dict[str, int] = field(default_factory=dict)
    # file name -> {"size": bytes}
    files: Dict[str, Dict[str, int]] = field(default_factory=dict)
    library_version: str = ""

    def checksums(self) -> Dict[Tuple[str, int], int]:
        out = {}
        for k, v in self.items.items():
            name, _, off = k.rpartition("@")
            out[(name, int(off))] = int(v)
        return out


ZARR_INDEX_FILE = "zarr_index.json"
_DATA_MARKERS = (".metadata", COMMON_FILE, MANIFEST_FILE, WRITER_FILE, ZARR_INDEX_FILE)


def looks_like_partial_save(directory: str) -> bool:
    """Whether the directory holds files of a save that never committed."""
    storage, directory = storage_for(directory)
    try:
        names = storage.listdir(directory)
    except OSError:
        return False
    return any(n.endswith(".distcp") or n in _DATA_MARKERS or n.endswith(".zarr") for n in names)


def interrupted_overwrite_hint(directory: str) -> str:
    """Where an ``overwrite=True`` save that crashed mid-swap left the checkpoints, if it did.

    Only the two-rename fallback (filesystems without an atomic exchange) can leave
    ``<dir>`` missing, with the old checkpoint at ``<dir>.old-*`` and the new committed
    one at ``<dir>.tmp-*``; nothing is lost, and this says where to find it.
    """
    storage, directory = storage_for(directory)
    if storage.remote:
        return ""
    parent, base = os.path.split(directory.rstrip(os.sep))
    try:
        names = storage.listdir(parent or ".")
    except OSError:
        return ""
    found = [
        join(parent, n) for n in names
        if n.startswith(base + ".old-") or n.startswith(base + ".tmp-")
        if storage.exists(join(parent, n, CONFIG_FILE))
    ]
    if not found:
        return ""
    return (
        "; a save with overwrite=True was interrupted while replacing it, and these complete "
        f"checkpoints remain: {', '.join(found)} (.tmp-* is the newer one); rename one back to {directory}"
    )


def read_config(directory: str) -> CheckpointingConfig:
    """Parse ``metadata.json`` with a specific error for every way a path can fail to be a checkpoint."""
    storage, directory = storage_for(directory)
    if not storage.exists(directory):
        raise CheckpointNotFoundError(
            f"{directory} is not a distributed checkpoint: checkpoint directory {directory} does not exist"
            + interrupted_overwrite_hint(directory)
        )
    if not storage.isdir(directory):
        raise CheckpointNotFoundError(
            f"{directory} is a file, not a checkpoint directory (for a torch.save file use torch.load)"
        )
    path = join(directory, CONFIG_FILE)
    if not storage.exists(path):
        if looks_like_partial_save(directory):
            raise IncompleteCheckpointError(
                f"{directory} is not a distributed checkpoint: it holds an incomplete checkpoint, with data files but no {CONFIG_FILE} "
                "commit marker, so the save that wrote it did not finish; use an earlier checkpoint"
            )
        raise CheckpointNotFoundError(f"{directory} is not a distributed checkpoint: it has no {CONFIG_FILE}")
    try:
        raw = json.loads(storage.read_bytes(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or "sharded_backend" not in raw:
        raise CorruptCheckpointError(f"{path} does not describe a checkpoint (no 'sharded_backend')")
    known = {"sharded_backend", "sharded_backend_version", "common_backend", "common_backend_version"}
    unknown = set(raw) - known
    if unknown:
        raise UnsupportedCheckpointError(f"{path} has unknown fields {sorted(unknown)}; written by a newer version?")
    # Field types are checked before use: e.g. a list as backend name would otherwise
    # escape as "TypeError: unhashable type" from the lookups below.
    for name, typ in (("sharded_backend", str), ("common_backend", str), ("sharded_backend_version", int), ("common_backend_version", int)):
        if name in raw and (not isinstance(raw[name], typ) or isinstance(raw[name], bool)):
            raise CorruptCheckpointError(
                f"{path}: field {name!r} must be a {typ.__name__}, got {type(raw[name]).__name__} {raw[name]!r}"
            )
    config = CheckpointingConfig(**raw)
    versions = SUPPORTED_BACKENDS.get(config.sharded_backend)
    if versions is None:
        raise UnsupportedCheckpointError(
            f"{directory}: unknown sharded backend {config.sharded_backend!r}; "
            f"supported: {sorted(SUPPORTED_BACKENDS)}"
        )
    if config.sharded_backend_version not in versions:
        raise UnsupportedCheckpointError(
            f"{directory}: {config.sharded_backend} format version {config.sharded_backend_version} "
            f"is not supported (supported: {list(versions)})"
        )
    cversions = SUPPORTED_COMMON_BACKENDS.get(config.common_backend)
    if cversions is None or config.common_backend_version not in cversions:
        raise UnsupportedCheckpointError(
            f"{directory}: unsupported common backend {config.common_backend!r} "
            f"version {config.common_backend_version}"
        )
    return config


def write_config(directory: str, config: CheckpointingConfig, durable: bool = True) -> None:
    """Write the commit marker (atomically). Call only when everything else is durable."""
    storage, directory = storage_for(directory)
    storage.write_atomic(join(directory, CONFIG_FILE), json.dumps(asdict(config)).encode(), durable)


def save_common(directory: str, common_state_dict: Any, durable: bool = True) -> Dict[str, int]:
    """Write ``common.pt``; returns ``{"size", "crc32"}`` for the manifest."""
    buf = io.BytesIO()
    torch.save(common_state_dict, buf)
    data = buf.getvalue()
    storage, directory = storage_for(directory)
    storage.write_atomic(join(directory, COMMON_FILE), data, durable)
    return {"size": len(data), "crc32": crc32(data)}


def verify_file_checksum(directory: str, name: str, manifest: Optional["Manifest"]) -> None:
    """Compare a whole small file (``common.pt``, ``.metadata``) with its manifest entry."""
    entry = (manifest.files.get(name) if manifest else None) or {}
    if "crc32" not in entry:
        return
    storage, directory = storage_for(directory)
    path = join(directory, name)
    data = storage.read_bytes(path)
    if len(data) != entry.get("size", len(data)) or crc32(data) != entry["crc32"]:
        raise CorruptCheckpointError(
            f"{path} is damaged: its size/checksum differs from the one recorded at save time"
        )


def load_common(directory: str, trusted: bool = False, allowed_globals: Optional[Iterable[Any]] = None) -> Any:
    storage, directory = storage_for(directory)
    path = join(directory, COMMON_FILE)
    if not storage.exists(path):
        raise CorruptCheckpointError(f"{path} is missing: the checkpoint has no common state")
    verify_file_checksum(directory, COMMON_FILE, read_manifest(directory))
    try:
        source = path if not storage.remote else io.BytesIO(storage.read_bytes(path))
        return safe_torch_load(source, trusted=trusted, allowed_globals=allowed_globals, what=path)
    except (RuntimeError, EOFError) as e:
        raise CorruptCheckpointError(f"{path} is damaged and cannot be read: {e}") from None


def write_manifest(directory: str, manifest: Manifest, durable: bool = True) -> None:
    """Write ``manifest.json``, then :data:`WRITER_FILE` recording that it exists (both before the commit marker)."""
    storage, directory = storage_for(directory)
    storage.write_atomic(join(directory, MANIFEST_FILE), json.dumps(asdict(manifest)).encode(), durable)
    writer = {"format": manifest.format, "library_version": manifest.library_version, "manifest": MANIFEST_FILE}
    storage.write_atomic(join(directory, WRITER_FILE), json.dumps(writer).encode(), durable)


def manifest_deleted(directory: str) -> bool:
    """Whether ``manifest.json`` is gone from a checkpoint that was saved with one (damage)."""
    storage, path = storage_for(directory)
    return manifest_expected(directory) and not storage.exists(join(path, MANIFEST_FILE))


def manifest_expected(directory: str) -> bool:
    """Whether the checkpoint was saved with a ``manifest.json`` (so its absence is damage).

    False for checkpoints of other writers (Megatron-Core, PyTorch DCP), which have no
    :data:`WRITER_FILE`, and for ours saved before the marker existed.
    """
    storage, directory = storage_for(directory)
    return storage.exists(join(directory, WRITER_FILE))


def read_manifest(directory: str) -> Optional[Manifest]:
    """Our manifest, or ``None`` for checkpoints written by other tools."""
    storage, directory = storage_for(directory)
    path = join(directory, MANIFEST_FILE)
    if not storage.exists(path):
        return None
    try:
        raw = json.loads(storage.read_bytes(path))
        manifest = Manifest(**raw)
        # Parse the checksum table now, so that wrong shapes/values (valid JSON, not a
        # manifest) fail here as CorruptCheckpointError rather than later as
        # ValueError/AttributeError in the middle of a load.
        if not isinstance(manifest.items, dict) or not isinstance(manifest.files, dict):
            raise TypeError("'items' and 'files' must be objects")
        manifest.checksums()
        return manifest
    except (json.JSONDecodeError, TypeError, ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is damaged: {e}") from None


def stale_save_files(directory: str) -> List[str]:
    """Files of an uncommitted earlier save that a new save into the same directory replaces."""
    storage, directory = storage_for(directory)
    names = storage.listdir(directory)
    out = [n for n in names if n.endswith(".distcp") or n in _DATA_MARKERS or ".tmp-" in n]
    if ZARR_INDEX_FILE in names:
        # a zarr save: its arrays and object files are the top-level entries its keys name
        try:
            index = json.loads(storage.read_bytes(join(directory, ZARR_INDEX_FILE)))
            keys = list(index.get("tensors", {})) + list(index.get("objects", []))
        except (ValueError, AttributeError, TypeError):
            keys = []
        tops = {k.split("/", 1)[0] for k in keys} | {f"{k}.pt" for k in keys if "/" not in k}
        out += sorted(n for n in tops if n in names and n not in out)
    return out
