"""The layout of a zarr checkpoint and its index ``zarr_index.json``: what writer and reader agree on.

Names (keys are paths inside the checkpoint, checked both ways: :func:`check_layout_paths`
before a save, :func:`check_index_paths` before a read), chunk shapes (:func:`chunk_shape_for`),
the stored dtype of tensors zarr cannot hold, the file records (size + CRC32 of every chunk,
object and ``zarr.json`` file) and the index file itself.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import posixpath
from dataclasses import dataclass
from functools import reduce
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ...errors import CheckpointingException, CorruptCheckpointError, UnsafeCheckpointError
from ...planning.boxes import Box
from ..checkpoint_dir import (COMMON_FILE, CONFIG_FILE, MANIFEST_FILE, WRITER_FILE, Manifest, load_json, read_manifest,
                              read_verified_file)
from ..checksum import write_recorded
from ..filesystem import CheckpointLocation, is_remote, join, symlinks_allowed

INDEX_FILE = "zarr_index.json"
# format 2 adds "files": per chunk/object file its key, size and CRC32;
# format 3 adds the records of every array's zarr.json (and may coarsen chunks, see chunk_shape_for)
INDEX_FORMAT = 3
ARRAY_METADATA_FILE = "zarr.json"
# Chunks below this size are coarsened (unless the tensor is small): zarr-python
# spends about half a millisecond per chunk file, which dominates below it.
MIN_CHUNK_BYTES = 1 << 20
# ... and a tensor below 64 MiB gets about this many chunks at most.
MAX_SMALL_TENSOR_CHUNKS = 64
# files of the checkpoint directory itself: a key must not start with one of them
_RESERVED_NAMES = frozenset({CONFIG_FILE, COMMON_FILE, MANIFEST_FILE, WRITER_FILE, INDEX_FILE, ".metadata"})


def zarr_module() -> Any:
    """zarr-python, or an error that says how to install it (it is an optional dependency)."""
    try:
        import zarr
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the zarr backend needs zarr-python >= 3: pip install 'ckpt_integration[zarr]' "
            "(or save with the default backend, sharded_strategy='torch_dist')"
        ) from e
    return zarr


# torch dtypes numpy cannot represent -> same-width integer storage
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is stored as (``dtype`` itself, or the same-width integer numpy lacks it for)."""
    try:
        torch.empty(0, dtype=dtype).numpy()
        return dtype
    except TypeError:
        return _INT_OF_SIZE[torch.empty((), dtype=dtype).element_size()]


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of a torch dtype numpy can hold (see :func:`storage_dtype`)."""
    return torch.empty(0, dtype=dtype).numpy().dtype


# --------------------------------------------------------------------------- chunk shapes
def aligned_chunk_shape(global_shape: Sequence[int], boxes: Iterable[Box]) -> Tuple[int, ...]:
    """Per axis, the gcd of all shard offsets and sizes: chunk borders are shard borders."""
    boxes = list(boxes)
    out = []
    for a, n in enumerate(global_shape):
        values = [b.offsets[a] for b in boxes] + [b.sizes[a] for b in boxes] + [n]
        g = reduce(math.gcd, [v for v in values if v > 0], 0)
        out.append(max(1, g or 1))
    return tuple(out)


def chunk_shape_for(global_shape: Sequence[int], boxes: Iterable[Box], itemsize: int = 1) -> Tuple[int, ...]:
    """The chunk shape of an array saved from shards ``boxes``.

    The shard-aligned grid (:func:`aligned_chunk_shape`) when its chunks hold at least
    ``min(MIN_CHUNK_BYTES, tensor / MAX_SMALL_TENSOR_CHUNKS)`` bytes: then no chunk is
    shared by two shards. Otherwise (uneven shards make the gcd tiny, down to one row)
    a coarser grid of about that size, so the number of chunk files stays bounded by
    ``max(64, tensor / 1 MiB)``; chunks on shard borders then need one owner each
    (:func:`plan_chunk_writes`).
    """
    shape = tuple(int(n) for n in global_shape)
    aligned = aligned_chunk_shape(shape, boxes)
    total = math.prod(shape) * itemsize
    target = min(MIN_CHUNK_BYTES, total / MAX_SMALL_TENSOR_CHUNKS)
    if not shape or math.prod(aligned) * itemsize >= target:
        return aligned
    return _coarsened(shape, aligned, math.ceil(target / itemsize))


def _coarsened(shape: Tuple[int, ...], aligned: Tuple[int, ...], min_elements: int) -> Tuple[int, ...]:
    """Grow ``aligned`` to about ``min_elements`` per chunk.

    Axes without shard borders are already whole. The others grow about equally
    (smallest extent first, as it may be capped at its extent): square-ish chunks
    cross the fewest shard borders on a 2-D grid of shards, so few chunks need
    pieces from another rank.
    """
    chunks = list(aligned)
    growing = sorted((a for a, n in enumerate(shape) if chunks[a] < n), key=lambda a: shape[a])
    while growing:
        fixed = math.prod(chunks[a] for a in range(len(shape)) if a not in growing)
        per_axis = math.ceil((min_elements / max(1, fixed)) ** (1 / len(growing)))
        a = growing.pop(0)
        chunks[a] = min(shape[a], max(chunks[a], per_axis))
    return tuple(chunks)


def array_chunks(dtype: torch.dtype, shape: Sequence[int], boxes: Iterable[Box]) -> Tuple[int, ...]:
    """The chunk shape :func:`create_arrays` gives a tensor (every rank computes the same)."""
    if not shape:
        return ()  # 0-d tensors: one chunk file "c"
    return chunk_shape_for(shape, boxes, torch.empty((), dtype=dtype).element_size())


def chunk_box(coords: Sequence[int], shape: Sequence[int], chunks: Sequence[int]) -> Box:
    """The region of chunk ``coords``, clipped to the array (edge chunks are partial)."""
    offsets = tuple(i * c for i, c in zip(coords, chunks))
    return Box(offsets, tuple(min(c, n - o) for o, c, n in zip(offsets, chunks, shape)))


# --------------------------------------------------------------------------- keys as paths
def key_path_problem(key: object) -> Optional[str]:
    """Why ``key`` cannot be a path inside the checkpoint directory, or None.

    Keys become directories as they are ("decoder.layers.0.weight", "model/w"), so
    only what could leave the checkpoint, hit its own files or differ between
    operating systems is refused.
    """
    if not isinstance(key, str) or not key:
        return "the key is empty"
    if "\\" in key:
        return "it contains a backslash (a path separator on Windows)"
    if any(ord(ch) < 32 for ch in key):
        return "it contains a control character"
    if key.startswith("/"):
        return "it is an absolute path"
    segments = key.split("/")
    if "" in segments:
        return "it has an empty path segment ('//' or a trailing '/')"
    if any(seg in (".", "..") for seg in segments):
        return "it has a '.' or '..' path segment (it would leave its own directory)"
    if segments[0] in _RESERVED_NAMES:
        return f"{segments[0]!r} is a file of the checkpoint directory itself"
    long = next((seg for seg in segments if len(seg.encode()) > 255), None)  # (NAME_MAX of common filesystems)
    if long is not None:
        return f"its path segment {long[:40]!r}... is {len(long.encode())} bytes long (file names hold 255 at most)"
    return None


def check_layout_paths(tensor_keys: Iterable[str], object_keys: Iterable[str]) -> None:
    """Before anything is written: every key must be a safe path, and no two may collide.

    Each array owns its directory (zarr keeps ``zarr.json`` and ``c/...`` there, and
    overwriting or removing an array deletes it whole), so nothing else may lie
    inside it; an object's ``.pt`` file must not be an array's or object's path.
    """
    owners: Dict[str, str] = {}
    for what, keys, path_of in (("tensor", tensor_keys, lambda k: k), ("object", object_keys, object_file_name)):
        for key in keys:
            problem = key_path_problem(key)
            if problem:
                raise CheckpointingException(
                    f"{what} key {key!r} cannot be saved by the zarr backend, whose files are named after "
                    f"their keys: {problem}; rename it (or save with sharded_strategy='torch_dist')"
                )
            path = path_of(key)
            if path in owners:
                raise CheckpointingException(f"zarr backend: {what} {key!r} and {owners[path]} would both be stored at {path}")
            owners[path] = f"{what} {key!r}"
    for path, owner in sorted(owners.items()):
        parts = path.split("/")
        for i in range(1, len(parts)):
            outer = owners.get("/".join(parts[:i]))
            if outer is not None:
                raise CheckpointingException(
                    f"zarr backend: {owner} would be stored inside the directory of {outer} "
                    f"({'/'.join(parts[:i])}/), which belongs to that array alone; rename one of the keys"
                )


def check_index_paths(directory: str, index: Dict[str, Any]) -> None:
    """Reader: every path the index names must stay inside the checkpoint directory.

    Lexically for every backend (a crafted index could name ``../../x`` or ``/etc``),
    and for local checkpoints also after resolving symbolic links.
    """
    where = join(directory, INDEX_FILE)
    keys = [("tensor", k) for k in index.get("tensors", {})] + [("object", k) for k in index.get("objects", [])]
    root = None if is_remote(directory) or symlinks_allowed() else os.path.realpath(directory)
    for what, key in keys:
        if not isinstance(key, str) or not key:
            raise CorruptCheckpointError(f"{where} is damaged: it names an empty or non-string {what} key {key!r}")
        norm = posixpath.normpath(key.replace("\\", "/"))
        if key.startswith(("/", "\\")) or os.path.isabs(key) or norm in (".", "..") or norm.startswith("../") or "\x00" in key:
            raise UnsafeCheckpointError(f"refusing {where}: {what} key {key!r} points outside the checkpoint directory")
        if root is not None:
            # the path actually read: the array's directory, or the object's .pt file
            real = os.path.realpath(os.path.join(root, key if what == "tensor" else object_file_name(key)))
            if not real.startswith(root.rstrip(os.sep) + os.sep):
                raise UnsafeCheckpointError(
                    f"refusing {where}: {what} key {key!r} resolves to {real}, outside the checkpoint directory {root}"
                )


# --------------------------------------------------------------------------- files
def array_path(ck: CheckpointLocation, key: str) -> str:
    """The directory of array ``key``."""
    return ck.file(key)


def array_store(ck: CheckpointLocation, key: str, read_only: bool = False) -> Any:
    """What zarr should open: a local path, or an fsspec store for URLs.

    (A bare ``memory://`` string would give zarr's own in-process store, not
    fsspec's memory filesystem where the rest of the checkpoint lives.)
    """
    path = array_path(ck, key)
    if not is_remote(path):
        return path
    zarr = zarr_module()

    return zarr.storage.FsspecStore.from_url(path, read_only=read_only)


def base_store(ck: CheckpointLocation, key: str, read_only: bool = False) -> Any:
    """Like :func:`array_store`, but always a zarr ``Store`` object (the integrity wrappers need one)."""
    store = array_store(ck, key, read_only)
    if isinstance(store, str):
        store = zarr_module().storage.LocalStore(store, read_only=read_only)
    return store


def object_path(ck: CheckpointLocation, unique_key: str) -> str:
    """The file of ShardedObject ``unique_key``."""
    return ck.file(object_file_name(unique_key))


def object_file_name(unique_key: str) -> str:
    """:func:`object_path` relative to the checkpoint."""
    return f"{unique_key}.pt"


def chunk_file_names(shape: Sequence[int], chunks: Sequence[int]) -> Iterator[str]:
    """Every chunk file of an array, relative to it (zarr v3 default key encoding, "/")."""
    grid = [math.ceil(n / c) for n, c in zip(shape, chunks)]
    for coords in itertools.product(*map(range, grid)):
        yield "/".join(["c", *map(str, coords)])


def is_chunk_name(name: str) -> bool:
    """Whether ``name`` (relative to an array) is a chunk file (``c`` or ``c/i/j/...``)."""
    return name == "c" or name.startswith("c/")


def chunk_coords(name: str) -> Tuple[int, ...]:
    """Grid coordinates of the chunk file ``c/i/j/...`` (see :func:`chunk_file_names`)."""
    return tuple(int(i) for i in name.split("/")[1:])


def chunk_offsets(name: str, chunks: Sequence[int]) -> Tuple[int, ...]:
    """Global offsets of the chunk file ``c/i/j/...``."""
    return tuple(i * c for i, c in zip(chunk_coords(name), chunks))


def metadata_file_name(key: str) -> str:
    """The ``zarr.json`` of array ``key``, relative to the checkpoint."""
    return f"{key}/{ARRAY_METADATA_FILE}"


def expected_files(index: Dict[str, Any]) -> List[Tuple[str, str]]:
    """(key, file relative to the checkpoint) for every chunk of every array and every object."""
    out = [
        (key, f"{key}/{name}")
        for key, info in sorted(index["tensors"].items())
        for name in chunk_file_names(info["shape"], info["chunks"])
    ]
    return out + [(key, object_file_name(key)) for key in sorted(index.get("objects", []))]


# --------------------------------------------------------------------------- the index and its integrity records
@dataclass(frozen=True)
class FileRecord:
    """One file a rank wrote (a zarr chunk or an object), as committed in ``zarr_index.json``."""

    key: str  # the tensor or object key the file belongs to (named in every error)
    size: int  # bytes
    crc32: int  # crc32 of the bytes, the checksum torch_dist uses too


def read_file_records(index: Dict[str, Any], where: str) -> Optional[Dict[str, FileRecord]]:
    """The records of a format-2 index; None for older indexes (integrity unknown, not corrupt)."""
    if "files" not in index:
        return None
    try:
        return {path: FileRecord(r["key"], int(r["size"]), int(r["crc32"])) for path, r in index["files"].items()}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: the file records are damaged: {e!r}") from None


def write_index(ck: CheckpointLocation, index: Dict[str, Any], durable: bool = True) -> Dict[str, int]:
    """Write ``zarr_index.json`` atomically; returns its manifest entry (size and CRC32), which every
    read of it checks (:func:`read_index`)."""
    return write_recorded(ck, INDEX_FILE, json.dumps(index).encode(), durable)


def read_index(ck: CheckpointLocation, manifest: Optional[Manifest] = None, *, unrecorded: bool = False) -> Dict[str, Any]:
    """``zarr_index.json`` of a checkpoint, checked against its entry in the manifest (``manifest``,
    else the one ``ck`` holds or reads): a changed size or CRC32 is :class:`CorruptCheckpointError`
    naming it, as for every small file. Zarr checkpoints saved before the manifest recorded it are
    read unchecked. Missing or not a JSON object: ``CorruptCheckpointError``. An opened checkpoint
    reads and checks it once (each caller gets its own copy of the parsed index). ``unrecorded``: a
    save's own index before its commit, which no manifest records yet (one in the directory is an
    earlier save's)."""
    path = ck.file(INDEX_FILE)
    if unrecorded:
        manifest = None
    elif manifest is None:
        manifest = ck.manifest if ck.manifest_read else read_manifest(ck)
    try:
        index = load_json(read_verified_file(ck, INDEX_FILE, manifest, "zarr index"), path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: the zarr checkpoint has no index") from None
    if not isinstance(index, dict):
        raise CorruptCheckpointError(f"{path} is damaged: it is not a JSON object")
    return index


def check_index_entries(directory: str, index: Dict[str, Any]) -> None:
    """Reader: the index's own tensor entries must be well formed and consistent.

    They are the checkpoint metadata every load plans with (dtype, shape), so a
    damaged entry would otherwise surface as a raw error deep in a load.
    """
    where = join(directory, INDEX_FILE)
    tensors = index.get("tensors", {})
    if not isinstance(tensors, dict) or not isinstance(index.get("objects", []), list):
        raise CorruptCheckpointError(f"{where} is damaged: 'tensors' must be an object and 'objects' a list")
    for key, info in tensors.items():
        try:
            dtype, stored = getattr(torch, info["dtype"]), getattr(torch, info["stored_dtype"])
            shape, chunks = info["shape"], info["chunks"]
            ok = (
                isinstance(dtype, torch.dtype)
                and isinstance(stored, torch.dtype)
                and stored == storage_dtype(dtype)
                and all(isinstance(n, int) and n >= 0 for n in shape)
                and all(isinstance(c, int) and c >= 1 for c in chunks)
                and len(shape) == len(chunks)
            )
        except (AttributeError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{where} is damaged: the entry of tensor {key!r} is unreadable: {e!r}") from None
        if not ok:
            raise CorruptCheckpointError(f"{where} is damaged: the entry of tensor {key!r} is inconsistent: {info!r}")
