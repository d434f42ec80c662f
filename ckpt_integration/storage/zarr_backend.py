"""The ``zarr`` backend: one zarr array per tensor key (zarr-python, format 3).

Layout of a checkpoint directory::

    <key>/zarr.json, <key>/c/...     one array per ShardedTensor key (global shape)
    <object key>/shard_<o>_<s>.pt    ShardedObjects, torch.save([obj]) (Megatron's layout)
    zarr_index.json                  keys -> dtype, shape, chunking; object keys
    common.pt, manifest.json         as for torch_dist
    metadata.json                    commit marker: {"sharded_backend": "zarr", ...}

Why this shape: every array is chunked on the grid of all shard boundaries
(the gcd of offsets and sizes per axis), so each zarr chunk lies inside exactly
one saved shard and ranks write disjoint chunk files without coordination.
Resharded reads are plain slices of the array. zarr has no bfloat16 (and no
float8): such tensors are stored as same-width integers and the real dtype is
kept in the index.

The load side exposes the same interface as :class:`TorchDistReader` (a DCP
``Metadata`` view, ``chunks``, ``read_region``, ``read_bytes``), so every load
strategy works on both backends.
"""

from __future__ import annotations

import json
import math
import threading
from functools import reduce
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CorruptCheckpointError, MismatchError
from ..planning.boxes import Box
from .filesystem import is_remote, join, storage_for
from .torch_dist import ChunkInfo, WriteRequest, WrittenItem, run_parallel

INDEX_FILE = "zarr_index.json"


def _zarr() -> Any:
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


def _storage_dtype(dtype: torch.dtype) -> torch.dtype:
    try:
        torch.empty(0, dtype=dtype).numpy()
        return dtype
    except TypeError:
        return _INT_OF_SIZE[torch.empty((), dtype=dtype).element_size()]


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def chunk_shape_for(global_shape: Sequence[int], boxes: Iterable[Box]) -> Tuple[int, ...]:
    """Per axis, the gcd of all shard offsets and sizes: chunk borders are shard borders."""
    boxes = list(boxes)
    out = []
    for a, n in enumerate(global_shape):
        values = [b.offsets[a] for b in boxes] + [b.sizes[a] for b in boxes] + [n]
        g = reduce(math.gcd, [v for v in values if v > 0], 0)
        out.append(max(1, g or 1))
    return tuple(out)


def _array_path(directory: str, key: str) -> str:
    return join(directory, key)


def _store(directory: str, key: str, read_only: bool = False) -> Any:
    """What zarr should open: a local path, or an fsspec store for URLs.

    (A bare ``memory://`` string would give zarr's own in-process store, not
    fsspec's memory filesystem where the rest of the checkpoint lives.)
    """
    path = _array_path(directory, key)
    if not is_remote(path):
        return path
    zarr = _zarr()

    return zarr.storage.FsspecStore.from_url(path, read_only=read_only)


def object_path(directory: str, unique_key: str) -> str:
    return join(directory, f"{unique_key}.pt")


def create_arrays(
    directory: str,
    tensors: Dict[str, Tuple[torch.dtype, Tuple[int, ...], List[Box]]],
    object_keys: Iterable[str],
) -> Dict[str, Any]:
    """Coordinator: create every array (metadata only) and return the index to commit."""
    zarr = _zarr()

    index: Dict[str, Any] = {"format": 1, "tensors": {}, "objects": sorted(object_keys)}
    for key, (dtype, shape, boxes) in tensors.items():
        stored = _storage_dtype(dtype)
        chunks = chunk_shape_for(shape, boxes) if shape else ()
        zarr.create_array(
            store=_store(directory, key),
            shape=shape,
            chunks=chunks if shape else None,
            dtype=_numpy_dtype(stored),
            compressors=None,
            fill_value=0,
            overwrite=True,
        )
        index["tensors"][key] = {
            "dtype": str(dtype).replace("torch.", ""),
            "stored_dtype": str(stored).replace("torch.", ""),
            "shape": list(shape),
            "chunks": list(chunks),
        }
    return index


def write_index(directory: str, index: Dict[str, Any], durable: bool = True) -> None:
    storage, directory = storage_for(directory)
    storage.write_atomic(join(directory, INDEX_FILE), json.dumps(index).encode(), durable)


def read_index(directory: str) -> Dict[str, Any]:
    storage, directory = storage_for(directory)
    path = join(directory, INDEX_FILE)
    try:
        return json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: the zarr checkpoint has no index") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is damaged: {e}") from None


def write_zarr_requests(directory: str, requests: Sequence[WriteRequest], thread_count: int = 2, durable: bool = True) -> List[WrittenItem]:
    """Write tensor chunks into their arrays and objects into ``.pt`` files."""
    zarr = _zarr()

    storage, directory = storage_for(directory)
    arrays: Dict[str, Any] = {}
    lock = threading.Lock()

    def array(key: str) -> Any:
        with lock:
            if key not in arrays:
                arrays[key] = zarr.open_array(_store(directory, key), mode="r+")
            return arrays[key]

    def write(req: WriteRequest) -> WrittenItem:
        if req.offsets is None:
            path = object_path(directory, req.storage_key)
            parent = path.rsplit("/", 1)[0]
            storage.makedirs(parent)
            storage.write_atomic(path, req.data, durable)
            return WrittenItem(req.storage_key, None, f"{req.storage_key}.pt", 0, len(req.data), 0)
        t = req.data.detach().cpu().contiguous()
        stored = _storage_dtype(t.dtype)
        values = (t.view(stored) if stored != t.dtype else t).numpy()
        region = tuple(slice(o, o + s) for o, s in zip(req.offsets, t.shape))
        arr = array(req.storage_key)
        if region:
            arr[region] = values
        else:
            arr[...] = values
        return WrittenItem(req.storage_key, tuple(req.offsets), req.storage_key, 0, t.numel() * t.element_size(), 0)

    results: List[Optional[WrittenItem]] = [None] * len(requests)

    def task(i: int) -> None:
        results[i] = write(requests[i])

    run_parallel(list(range(len(requests))), task, thread_count)
    return [r for r in results if r is not None]


class ZarrReader:
    """Reads regions of zarr arrays; same interface as ``TorchDistReader``."""

    def __init__(self, directory: str, checksums: Any = None, verify_checksums: bool = True):
        self.storage, self.directory = storage_for(directory)
        self.index = read_index(self.directory)
        self._arrays: Dict[str, Any] = {}
        self._lock = threading.Lock()
        sd_meta: Dict[str, Any] = {}
        self.chunks: Dict[str, List[ChunkInfo]] = {}
        for key, info in self.index.get("tensors", {}).items():
            dtype = getattr(torch, info["dtype"])
            shape = tuple(info["shape"])
            whole = Box((0,) * len(shape), shape)
            sd_meta[key] = TensorStorageMetadata(
                TensorProperties(dtype=dtype), torch.Size(shape), [ChunkStorageMetadata(torch.Size(whole.offsets), torch.Size(shape))]
            )
            # the whole array is one logical chunk: zarr slices any region directly
            self.chunks[key] = [ChunkInfo(whole, _StorageInfo(key, 0, 0))]
        for key in self.index.get("objects", []):
            sd_meta[key] = BytesStorageMetadata()
        self.metadata = Metadata(state_dict_metadata=sd_meta, planner_data={k: (k,) for k in sd_meta}, storage_data={})

    def _array(self, key: str) -> Any:
        zarr = _zarr()

        with self._lock:
            if key not in self._arrays:
                path = _array_path(self.directory, key)
                try:
                    self._arrays[key] = zarr.open_array(_store(self.directory, key, read_only=True), mode="r")
                except Exception as e:  # zarr raises several types for missing/damaged metadata
                    raise CorruptCheckpointError(f"zarr array {path} for {key!r} cannot be opened: {e}") from None
            return self._arrays[key]

    def read_region(self, key: str, chunk: ChunkInfo, overlap: Box, out: torch.Tensor, dtype: torch.dtype) -> None:
        arr = self._array(key)
        info = self.index["tensors"][key]
        region = tuple(slice(o, o + s) for o, s in zip(overlap.offsets, overlap.sizes))
        try:
            values = arr[region] if region else arr[...]
        except Exception as e:
            raise CorruptCheckpointError(f"reading {overlap} of zarr array {key!r} in {self.directory} failed: {e}") from None
        t = torch.from_numpy(np.ascontiguousarray(values))
        if info["stored_dtype"] != info["dtype"]:
            t = t.view(dtype)
        out.copy_(t.reshape(out.shape))

    def read_bytes(self, storage_key: str) -> bytes:
        if storage_key not in self.index.get("objects", []):
            raise MismatchError(f"object {storage_key!r} is not in the checkpoint")
        path = object_path(self.directory, storage_key)
        try:
            return self.storage.read_bytes(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path} is missing (listed in {INDEX_FILE})") from None

    def close(self) -> None:
        self._arrays.clear()

    def __enter__(self) -> "ZarrReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
