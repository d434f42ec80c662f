"""Checkpoint tools behind the ``ckpt-integration`` command line (also usable as a library).

* :func:`inspect_checkpoint` - backend, tensors (shape, dtype, bytes, shard layout),
  ShardedObjects and common-state keys of a checkpoint directory.
* :func:`verify_checkpoint` - completeness and per-item CRC32 checksums.
* :func:`convert_checkpoint` - streaming conversion between a distributed checkpoint,
  ``torch.save`` files and (HF-style, sharded) safetensors, in both directions.
* :func:`diff_checkpoints` - keys, shapes, dtypes and max abs difference of two sources.

Nothing here needs a GPU or ``torch.distributed``. Tensor data is streamed: at
most one *block* of ``memory_budget`` bytes (rows of one tensor, read with
:meth:`TorchDistReader.read_region`) is held at a time, so checkpoints larger
than RAM can be converted, verified and diffed. Inputs given as ``torch.save``
or safetensors files are memory-mapped (their pages stay in the page cache).
"""

from __future__ import annotations

import collections
import io
import itertools
import json
import math
import mmap
import os
import pickle
import re
import shutil
import struct
import tempfile
import uuid
import zipfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from .errors import CheckpointingException, CorruptCheckpointError, UnsafeCheckpointError
from .planning.boxes import Box, intersect, relative_slices
from .storage import checkpoint_dir as ckdir
from .storage.checksum import crc32
from .storage.fs import tensor_buffer
from .storage.backends import open_reader, read_metadata
from .storage.torch_dist import DCP_METADATA_FILE, read_dcp_metadata

DEFAULT_MEMORY_BUDGET = 256 * 2**20
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
SAFETENSORS_INDEX = "model.safetensors.index.json"
_READ_PIECE = 8 * 2**20

ProgressFactory = Callable[..., Any]


# --------------------------------------------------------------------------- helpers
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: Any) -> int:
    """Parse ``"5GB"``, ``"500MB"``, ``"1.5GiB"``, ``"4096"`` into bytes (GB = 10^9, GiB = 2^30)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 5GB, 500MB, 64MiB, 4096)")
    number, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    power = "kmgtp".find(unit) + 1 if unit else 0
    return int(number * ((1024 if binary else 1000) ** power))


def format_size(n: int) -> str:
    """Human-readable binary size: ``1.5 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def _no_progress(iterable: Any = None, **_: Any) -> Any:
    return _NullBar(iterable)


class _NullBar:
    def __init__(self, iterable: Any = None):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_blocks(shape: Sequence[int], dtype: torch.dtype, budget: int) -> List[Box]:
    """Cut a tensor into boxes of at most ``budget`` bytes that are contiguous in C order.

    Whole rows (axis 0) when a row fits, otherwise rows of the first axis whose
    sub-rows fit; a tensor within the budget is one box.
    """
    shape = tuple(int(s) for s in shape)
    ndim = len(shape)
    if ndim == 0 or math.prod(shape) == 0:
        return [Box((0,) * ndim, shape)]
    esize = _esize(dtype)
    budget = max(budget, esize)
    axis = 0
    while axis < ndim - 1 and math.prod(shape[axis + 1 :]) * esize > budget:
        axis += 1
    inner = math.prod(shape[axis + 1 :]) * esize
    step = max(1, min(shape[axis], budget // inner))
    boxes = []
    outer_shape = shape[:axis]
    for idx in itertools.product(*map(range, outer_shape)):
        for start in range(0, shape[axis], step):
            size = min(step, shape[axis] - start)
            boxes.append(Box(tuple(idx) + (start,) + (0,) * (ndim - axis - 1), (1,) * axis + (size,) + shape[axis + 1 :]))
    return boxes


def _box_slices(box: Box) -> Tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


# --------------------------------------------------------------------------- sources
@dataclass
class TensorInfo:
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _esize(self.dtype)


class TensorSource:
    """Read-only view of named tensors, read block by block. Subclasses fill ``tensors``."""

    kind = "?"

    def __init__(self, path: str):
        self.path = path
        self.tensors: Dict[str, TensorInfo] = {}
        self.extra_values: Any = None  # nested non-tensor state (torch files) or common state

    def read_block(self, key: str, box: Box) -> torch.Tensor:
        raise NotImplementedError

    def iter_blocks(self, key: str, budget: int) -> Iterator[Tuple[Box, torch.Tensor]]:
        info = self.tensors[key]
        for box in plan_blocks(info.shape, info.dtype, budget):
            yield box, self.read_block(key, box)

    def close(self) -> None:
        pass

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class DistCheckpointSource(TensorSource):
    """A committed checkpoint directory: ``torch_dist`` (ours, Megatron-Core's, PyTorch DCP's) or ``zarr``."""

    kind = "torch_dist"

    def __init__(self, path: str, trusted: bool = False):
        super().__init__(path)
        self.trusted = trusted
        self.config = ckdir.read_config(path)
        self.kind = self.config.sharded_backend
        self.metadata = read_metadata(path, trusted=trusted, backend=self.kind)
        self.manifest = ckdir.read_manifest(path)
        checksums = self.manifest.checksums() if self.manifest is not None else None
        self.reader = open_reader(path, self.metadata, self.kind, checksums, verify_checksums=True)
        self.objects: List[str] = []
        for key, md in sorted(self.metadata.state_dict_metadata.items()):
            if isinstance(md, TensorStorageMetadata):
                self.tensors[key] = TensorInfo(md.properties.dtype, tuple(int(s) for s in md.size))
            elif isinstance(md, BytesStorageMetadata):
                self.objects.append(key)

    def read_block(self, key: str, box: Box) -> torch.Tensor:
        info = self.tensors[key]
        out = torch.empty(box.sizes, dtype=info.dtype)
        covered = 0
        for chunk in self.reader.chunks[key]:
            ov = intersect(chunk.box, box) if box.sizes else Box((), ())
            if ov is None:
                continue
            self.reader.read_region(key, chunk, ov, out[relative_slices(ov, box)], info.dtype)
            covered += ov.numel
            if not box.sizes:
                break
        if covered != box.numel:
            raise CorruptCheckpointError(
                f"{self.path}: the saved chunks of {key!r} cover {covered} of the {box.numel} elements of "
                f"region {box} (the checkpoint is missing shards)"
            )
        return out

    def read_object(self, unique_key: str) -> Any:
        """Unpickle a ShardedObject payload (restricted unless the source is trusted)."""
        from .storage.safe_pickle import safe_torch_load

        data = self.reader.read_bytes(unique_key)
        value = safe_torch_load(io.BytesIO(data), trusted=self.trusted, what=f"object {unique_key!r} in {self.path}")
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    def close(self) -> None:
        self.reader.close()


class _MappedFiles:
    """Private read-only memory maps of files (pages come from the page cache, not the heap)."""

    def __init__(self) -> None:
        self.maps: Dict[str, Any] = {}

    def get(self, path: str) -> Any:
        mm = self.maps.get(path)
        if mm is None:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else b""
            self.maps[path] = mm
        return mm


def _tensor_from_map(mm: Any, dtype: torch.dtype, shape: Tuple[int, ...], offset: int) -> torch.Tensor:
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(mm, dtype=dtype, count=count, offset=offset).reshape(shape)


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        _ST_DTYPES[_name] = getattr(torch, _attr)
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def read_safetensors_header(path: str) -> Tuple[Dict[str, Any], int]:
    """``(header, data_start)`` of a safetensors file (the JSON header and where tensor bytes begin)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CorruptCheckpointError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        size = os.fstat(f.fileno()).st_size
        if n > size - 8 or n > 100 * 2**20:
            raise CorruptCheckpointError(f"{path} is not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{path} is not a safetensors file: {e}") from None
    return header, 8 + n


class SafetensorsSource(TensorSource):
    """A ``.safetensors`` file, or a folder of them (with or without ``model.safetensors.index.json``)."""

    kind = "safetensors"

    def __init__(self, path: str):
        super().__init__(path)
        if os.path.isdir(path):
            index = os.path.join(path, SAFETENSORS_INDEX)
            if os.path.exists(index):
                with open(index) as f:
                    files = sorted(set(json.load(f)["weight_map"].values()))
            else:
                files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            if not files:
                raise CheckpointingException(f"{path} holds no .safetensors files")
            files = [os.path.join(path, n) for n in files]
        else:
            files = [path]
        self._maps = _MappedFiles()
        self._where: Dict[str, Tuple[str, int]] = {}
        self.metadata: Dict[str, str] = {}
        for file in files:
            header, start = read_safetensors_header(file)
            for key, entry in header.items():
                if key == "__metadata__":
                    self.metadata.update(entry or {})
                    continue
                dtype = _ST_DTYPES.get(entry["dtype"])
                if dtype is None:
                    raise CheckpointingException(f"{file}: tensor {key!r} has unsupported dtype {entry['dtype']}")
                if key in self.tensors:
                    raise CorruptCheckpointError(f"tensor {key!r} appears in more than one file of {path}")
                self.tensors[key] = TensorInfo(dtype, tuple(entry["shape"]))
                self._where[key] = (file, start + int(entry["data_offsets"][0]))
        self.tensors = dict(sorted(self.tensors.items()))

    def tensor(self, key: str) -> torch.Tensor:
        """The whole tensor as a view of the memory-mapped file."""
        file, offset = self._where[key]
        info = self.tensors[key]
        return _tensor_from_map(self._maps.get(file), info.dtype, info.shape, offset)

    def read_block(self, key: str, box: Box) -> torch.Tensor:
        return self.tensor(key)[_box_slices(box)]


def _flatten_tensors(obj: Any, prefix: str, out: Dict[str, torch.Tensor]) -> Any:
    """Collect tensors of nested dicts/lists under dotted keys; return the structure with tensors replaced by keys."""
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
        return _TensorSlot(prefix)
    if isinstance(obj, dict):
        return {k: _flatten_tensors(v, f"{prefix}.{k}" if prefix else str(k), out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        items = [_flatten_tensors(v, f"{prefix}.{i}" if prefix else str(i), out) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


@dataclass(frozen=True)
class _TensorSlot:
    key: str


class TorchFileSource(TensorSource):
    """A ``torch.save`` file holding a (flat or nested) dict of tensors; loaded memory-mapped, weights-only."""

    kind = "torch"

    def __init__(self, path: str, trusted: bool = False):
        super().__init__(path)
        try:
            try:
                obj = torch.load(path, map_location="cpu", mmap=True, weights_only=not trusted)
            except pickle.UnpicklingError:
                raise
            except Exception:  # legacy (non-zip) format cannot be memory-mapped
                obj = torch.load(path, map_location="cpu", weights_only=not trusted)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"refusing to load {path} with weights_only=True ({str(e).splitlines()[0]}); "
                "pass --trusted only if you trust the file"
            ) from None
        except Exception as e:
            raise CorruptCheckpointError(f"{path} cannot be read by torch.load: {e}") from None
        if isinstance(obj, torch.Tensor):
            raise CheckpointingException(f"{path} holds a single tensor, not a dict of tensors")
        self._values: Dict[str, torch.Tensor] = {}
        self.structure = _flatten_tensors(obj, "", self._values)
        for k, t in sorted(self._values.items()):
            self.tensors[k] = TensorInfo(t.dtype, tuple(t.shape))

    def tensor(self, key: str) -> torch.Tensor:
        return self._values[key]

    def read_block(self, key: str, box: Box) -> torch.Tensor:
        return self._values[key][_box_slices(box)]


def detect_kind(path: str) -> str:
    """``"torch_dist"``, ``"safetensors"`` or ``"torch"`` for a checkpoint dir, safetensors file/folder or torch.save file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointingException(f"{path} does not exist")
    if os.path.isdir(path):
        names = os.listdir(path)
        if ckdir.CONFIG_FILE in names or DCP_METADATA_FILE in names or any(n.endswith(".distcp") for n in names):
            return "torch_dist"
        if SAFETENSORS_INDEX in names or any(n.endswith(".safetensors") for n in names):
            return "safetensors"
        raise CheckpointingException(
            f"{path} is neither a checkpoint directory (no {ckdir.CONFIG_FILE}) nor a folder of .safetensors files"
        )
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] == b"PK\x03\x04" or path.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return "torch"
    if path.endswith(".safetensors") or len(head) == 8:
        return "safetensors"
    raise CheckpointingException(f"cannot tell what kind of file {path} is")


def open_source(path: str, trusted: bool = False) -> TensorSource:
    """Open a checkpoint directory, a torch.save file or safetensors file/folder for reading."""
    path = os.fspath(path)
    kind = detect_kind(path)
    if kind == "torch_dist":
        return DistCheckpointSource(path, trusted=trusted)
    if kind == "safetensors":
        return SafetensorsSource(path)
    return TorchFileSource(path, trusted=trusted)


# --------------------------------------------------------------------------- inspect
def _layout_summary(global_shape: Tuple[int, ...], chunks: List[Tuple[Tuple[int, ...], Tuple[int, ...]]],
                    unit: str = "shard") -> str:
    n = len(chunks)
    if n == 1:
        return f"1 {unit} (whole tensor)"
    split_axes = [a for a in range(len(global_shape)) if any(s[a] != global_shape[a] for _, s in chunks)]
    grid = [len({o[a] for o, _ in chunks}) for a in split_axes]
    sizes = sorted({s for _, s in chunks})
    if len(split_axes) == 1:
        where = f"split along axis {split_axes[0]}"
    else:
        where = "grid " + "x".join(map(str, grid)) + " over axes " + ",".join(map(str, split_axes))
    if len(sizes) == 1:
        sz = f"each {list(sizes[0])}"
    else:
        shown = ", ".join(str(list(s)) for s in sizes[:4]) + (", ..." if len(sizes) > 4 else "")
        sz = f"uneven: {shown}"
    return f"{n} {unit}s, {where}, {sz}"


def _describe_value(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor {list(v.shape)} {_dtype_name(v.dtype)}"
    if isinstance(v, (int, float, bool)) or v is None:
        return f"{type(v).__name__} = {v!r}"
    if isinstance(v, str):
        return f"str = {v[:60]!r}" + ("..." if len(v) > 60 else "")
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__} of {len(v)}"
    return type(v).__name__


def _common_keys(obj: Any, prefix: str = "") -> Dict[str, str]:
    out: Dict[str, str] = {}
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            p = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out.update(_common_keys(v, p))
            else:
                out[p] = _describe_value(v)
    elif prefix or not isinstance(obj, dict):
        out[prefix or "(root)"] = _describe_value(obj)
    return out


def _zarr_layout(path: str) -> Tuple[Dict[str, List[Dict[str, Any]]], Dict[str, Dict[str, Any]], Dict[str, int]]:
    """``(shards, objects, files)`` of a zarr checkpoint, from the records in ``zarr_index.json``.

    zarr checkpoints have no DCP storage records: a tensor's "shards" are its chunk files
    (each a file of its own, so ``file_offset`` is 0) and the sizes come from the chunk
    and object records the save committed. Indexes written before records existed give
    ``length`` None and no files.
    """
    from .storage.zarr_backend import ZarrReader, chunk_box, chunk_coords, chunk_file_names, object_file_name

    with ZarrReader(path) as reader:
        records = reader.files or {}
        shards: Dict[str, List[Dict[str, Any]]] = {}
        for key, info in reader.index.get("tensors", {}).items():
            shape, chunks = [int(n) for n in info["shape"]], [int(c) for c in info["chunks"]]
            shards[key] = []
            for name in chunk_file_names(shape, chunks):
                box = chunk_box(chunk_coords(name), shape, chunks)
                record = records.get(f"{key}/{name}")
                shards[key].append({
                    "offsets": list(box.offsets),
                    "sizes": list(box.sizes),
                    "file": f"{key}/{name}", "file_offset": 0, "length": record.size if record else None,
                })
        objects = {}
        for key in reader.index.get("objects", []):
            record = records.get(object_file_name(key))
            objects[key] = {"key": key, "file": object_file_name(key), "length": record.size if record else None}
        files = {name: record.size for name, record in records.items()}
    return shards, objects, files


def _dcp_shards(md: Any, key: str, meta: TensorStorageMetadata) -> List[Dict[str, Any]]:
    """The saved chunks of a torch_dist tensor with the file and byte range of each."""
    storage = md.storage_data or {}
    shards = []
    for c in meta.chunks:
        info = storage.get(MetadataIndex(key, torch.Size(c.offsets)))
        shards.append({
            "offsets": [int(o) for o in c.offsets],
            "sizes": [int(s) for s in c.sizes],
            "file": getattr(info, "relative_path", None),
            "file_offset": getattr(info, "offset", None),
            "length": getattr(info, "length", None),
        })
    return shards


def inspect_checkpoint(path: str, trusted: bool = False) -> Dict[str, Any]:
    """Describe a checkpoint directory as a JSON-serializable dict (nothing but metadata is read).

    Keys: ``path, kind`` (= ``backend``: ``torch_dist`` or ``zarr``), ``backend, backend_version,
    common_backend, manifest, manifest_expected, files`` (data file -> bytes), ``tensors`` (key ->
    shape, dtype, nbytes, shards, layout), ``objects``, ``common_state`` (``{"keys": {...}}`` or
    ``{"error": "..."}`` when loading it was refused as unsafe) and ``total_bytes``. For zarr the
    shards are the chunk files, sized from the records in ``zarr_index.json``.
    Safetensors and torch.save inputs are described too (without shard details).
    """
    path = os.fspath(path)
    kind = detect_kind(path)
    if kind != "torch_dist":
        with open_source(path, trusted=trusted) as src:
            tensors = {
                k: {"shape": list(i.shape), "dtype": _dtype_name(i.dtype), "nbytes": i.nbytes, "shards": [], "layout": kind}
                for k, i in src.tensors.items()
            }
            return {"path": path, "kind": kind, "tensors": tensors, "objects": [], "common_state": None,
                    "total_bytes": sum(t["nbytes"] for t in tensors.values())}
    config = ckdir.read_config(path)
    backend = config.sharded_backend
    md = read_metadata(path, trusted=trusted, backend=backend)
    manifest = ckdir.read_manifest(path)
    storage = md.storage_data or {}
    if backend == "zarr":
        zarr_shards, zarr_objects, files = _zarr_layout(path)
        checksummed = len(files)  # every chunk/object record carries a CRC32
    else:
        files = {}
        for info in storage.values():
            files[info.relative_path] = files.get(info.relative_path, 0) + info.length
        checksummed = len(manifest.items) if manifest is not None else 0
    tensors: Dict[str, Any] = {}
    objects = []
    for key, meta in sorted(md.state_dict_metadata.items()):
        if isinstance(meta, TensorStorageMetadata):
            shape = tuple(int(s) for s in meta.size)
            shards = zarr_shards.get(key, []) if backend == "zarr" else _dcp_shards(md, key, meta)
            shards.sort(key=lambda s: s["offsets"])
            unit = "chunk" if backend == "zarr" else "shard"
            tensors[key] = {
                "shape": list(shape),
                "dtype": _dtype_name(meta.properties.dtype),
                "nbytes": math.prod(shape) * _esize(meta.properties.dtype),
                "shards": shards,
                "layout": _layout_summary(shape, [(tuple(s["offsets"]), tuple(s["sizes"])) for s in shards], unit),
            }
        elif isinstance(meta, BytesStorageMetadata):
            if backend == "zarr":
                objects.append(zarr_objects.get(key, {"key": key, "file": None, "length": None}))
                continue
            info = storage.get(MetadataIndex(key))
            objects.append({"key": key, "file": getattr(info, "relative_path", None), "length": getattr(info, "length", None)})
    try:
        from .serialization import load_common_state_dict

        common: Dict[str, Any] = {"keys": _common_keys(load_common_state_dict(path, trusted=trusted))}
    except UnsafeCheckpointError as e:
        common = {"error": str(e), "unsafe": True}
    except CheckpointingException as e:
        common = {"error": str(e)}
    return {
        "path": path,
        "kind": backend,
        "backend": backend,
        "backend_version": config.sharded_backend_version,
        "common_backend": config.common_backend,
        "common_backend_version": config.common_backend_version,
        "manifest": None if manifest is None else {
            "format": manifest.format, "version": manifest.version, "world_size": manifest.world_size,
            "library_version": manifest.library_version, "created": manifest.created,
            "checksummed_items": checksummed,
        },
        "manifest_expected": ckdir.manifest_expected(path),
        "files": dict(sorted(files.items())),
        "tensors": tensors,
        "objects": objects,
        "common_state": common,
        "total_bytes": sum(t["nbytes"] for t in tensors.values()),
    }


def format_inspect(info: Dict[str, Any], show_shards: bool = False) -> str:
    """Render :func:`inspect_checkpoint` output as text: a tree of keys split on ``'.'``."""
    lines = [f"checkpoint: {info['path']}"]
    is_dir = "backend" in info  # a checkpoint directory (torch_dist or zarr), not a file
    if is_dir:
        lines.append(f"  backend: {info['backend']} (version {info['backend_version']}), common state: "
                     f"{info['common_backend']} (version {info['common_backend_version']})")
        m = info["manifest"]
        if m:
            lines.append(f"  written by: {m['format']} {m['library_version']} on {m['world_size']} rank(s); "
                         f"{m['checksummed_items']} checksummed items")
        elif info.get("manifest_expected"):
            lines.append("  manifest.json is missing although it was saved with one: run verify")
        else:
            lines.append("  no manifest.json: written by another tool (Megatron-Core / PyTorch DCP); no checksums")
        lines.append(f"  data files: {len(info['files'])} ({format_size(sum(info['files'].values()))})")
    else:
        lines.append(f"  kind: {info['kind']}")
    lines.append(f"  tensors: {len(info['tensors'])} ({format_size(info['total_bytes'])})")
    lines.append("")
    lines.append("tensors:")
    tree: Dict[str, Any] = {}
    for key in info["tensors"]:
        node = tree
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):  # a key is both a leaf and a prefix
                break
        node.setdefault(parts[-1], {})["\0leaf"] = key

    def render(node: Dict[str, Any], depth: int) -> None:
        for name, child in node.items():
            if name == "\0leaf":
                continue
            pad = "  " * depth
            if "\0leaf" in child:
                t = info["tensors"][child["\0leaf"]]
                lines.append(f"{pad}{name}: {t['shape']} {t['dtype']} {format_size(t['nbytes'])}"
                             + (f"  [{t['layout']}]" if t["shards"] else ""))
                if show_shards:
                    for s in t["shards"]:
                        box = ", ".join(f"{o}:{o + z}" for o, z in zip(s["offsets"], s["sizes"]))
                        lines.append(f"{pad}    [{box}] in {s['file']} @ {s['file_offset']} (+{s['length']})")
            if any(k != "\0leaf" for k in child):
                if "\0leaf" not in child:
                    lines.append(f"{pad}{name}")
                render(child, depth + 1)

    render(tree, 1)
    if is_dir:
        lines.append("")
        lines.append(f"sharded objects: {len(info['objects'])}")
        for o in info["objects"]:
            lines.append(f"  {o['key']} ({format_size(o['length'] or 0)} in {o['file']})")
        lines.append("")
        common = info["common_state"]
        if "error" in common:
            lines.append("common state: not shown - " + common["error"])
            if common.get("unsafe"):
                lines.append("  (rerun with --trusted to load it anyway, only if you trust this checkpoint)")
        else:
            lines.append(f"common state: {len(common['keys'])} key(s)")
            for k, v in common["keys"].items():
                lines.append(f"  {k}: {v}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- verify
@dataclass
class VerifyReport:
    """Result of :func:`verify_checkpoint`; ``ok`` is False when anything is damaged or missing."""

    path: str
    ok: bool = True
    checksums_available: bool = False
    items_checked: int = 0
    bytes_checked: int = 0
    problems: List[Dict[str, Any]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def add(self, message: str, file: Optional[str] = None, keys: Sequence[str] = ()) -> None:
        self.ok = False
        self.problems.append({"file": file, "message": message, "keys": sorted(set(keys))})

    def to_dict(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in ("path", "ok", "checksums_available", "items_checked",
                                               "bytes_checked", "problems", "notes")}

    def format(self) -> str:
        lines = [f"checkpoint: {self.path}"]
        lines += [f"  note: {n}" for n in self.notes]
        if self.ok:
            what = "checksums of" if self.checksums_available else "structure of"
            lines.append(f"OK: {what} {self.items_checked} items ({format_size(self.bytes_checked)}) verified")
        else:
            lines.append(f"DAMAGED: {len(self.problems)} problem(s)")
            for p in self.problems:
                lines.append(f"  - {p['message']}")
                if p["keys"]:
                    shown = ", ".join(p["keys"][:20]) + (f", ... ({len(p['keys'])} in all)" if len(p["keys"]) > 20 else "")
                    lines.append(f"    affected: {shown}")
        return "\n".join(lines)


def _item_name(index: MetadataIndex) -> str:
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}[{', '.join(str(o) for o in index.offset)}]"


def _manifest_deleted(path: str, report: VerifyReport) -> bool:
    """Report a missing ``manifest.json`` of a checkpoint that was saved with one; True if so.

    Foreign checkpoints (Megatron-Core, DCP) never have one: their missing manifest is
    no damage. Ours record at save time that they have one (``checkpoint_dir.WRITER_FILE``).
    """
    if not ckdir.manifest_deleted(path):  # storage-aware: path may be a URL
        return False
    report.add(f"{os.path.join(path, ckdir.MANIFEST_FILE)} is missing, but {ckdir.WRITER_FILE} says the checkpoint "
               "was saved with it: the recorded checksums are lost", ckdir.MANIFEST_FILE)
    return True


def _verify_zarr(path: str, report: VerifyReport) -> VerifyReport:
    """zarr checkpoints: every array opens, every chunk and object file matches its recorded
    size and CRC32 (each bad file reported with its key), common.pt checksum. Checkpoints
    written before chunk records existed: every array is read in full instead."""
    from .storage.zarr_backend import ZarrReader

    _manifest_deleted(path, report)
    try:
        ckdir.load_common(path, trusted=False)
    except UnsafeCheckpointError:
        pass  # readable, only not allow-listed: not damage
    except CheckpointingException as e:
        report.add(str(e), ckdir.COMMON_FILE)
    try:
        reader = ZarrReader(path)
    except CheckpointingException as e:
        report.add(str(e), "zarr_index.json")
        return report
    with reader:
        if reader.files is None:
            _verify_zarr_unrecorded(reader, report)
            return report
        report.checksums_available = True
        for key in sorted(reader.chunks):
            try:
                reader.array(key)  # zarr.json of the array: the chunk checks below do not read it
            except CheckpointingException as e:
                report.add(str(e), key, [key])
        for key, name, size, problem in reader.check_files():
            if problem:
                report.add(problem, name, [key])
            else:
                report.items_checked += 1
                report.bytes_checked += size
    return report


def _verify_zarr_unrecorded(reader: Any, report: VerifyReport) -> None:
    """An index without file records: read every array in full (missing chunks read as zeros)."""
    report.notes.append("zarr checkpoint written before chunk checksums were recorded: "
                        "arrays were read in full, missing chunk files cannot be detected")
    for key, chunks in sorted(reader.chunks.items()):
        box = chunks[0].box
        dtype = reader.metadata.state_dict_metadata[key].properties.dtype
        try:
            reader.read_region(key, chunks[0], box, torch.empty(box.sizes, dtype=dtype), dtype)
            report.items_checked += 1
            report.bytes_checked += box.numel * _esize(dtype)
        except CheckpointingException as e:
            report.add(str(e), key, [key])
    for key in reader.index.get("objects", []):
        try:
            reader.read_bytes(key)
            report.items_checked += 1
        except CheckpointingException as e:
            report.add(str(e), key, [key])


def verify_checkpoint(path: str, progress: ProgressFactory = _no_progress, trusted: bool = False) -> VerifyReport:
    """Check that a checkpoint is complete and undamaged; stream every item's bytes through CRC32.

    Completeness: ``metadata.json`` (commit marker), ``.metadata`` and ``common.pt`` readable,
    every data file named in ``.metadata`` exists and is long enough, the chunks of every tensor
    cover it. Checksums: per item from ``manifest.json``; for checkpoints without a manifest
    (written by Megatron-Core or DCP) only the structure is checked and a note says so.
    Problems name the file and the tensors/objects stored in it.
    """
    path = os.fspath(path)
    report = VerifyReport(path)
    try:
        if ckdir.read_config(path).sharded_backend == "zarr":
            return _verify_zarr(path, report)
    except CheckpointingException as e:
        report.add(str(e))
        if not os.path.isdir(path) or not os.path.exists(os.path.join(path, DCP_METADATA_FILE)):
            return report
    try:
        md = read_dcp_metadata(path, trusted=trusted)
    except CheckpointingException as e:
        report.add(str(e), DCP_METADATA_FILE)
        return report
    try:
        manifest = ckdir.read_manifest(path)
    except CheckpointingException as e:
        report.add(str(e), ckdir.MANIFEST_FILE)
        manifest = None
    common = os.path.join(path, ckdir.COMMON_FILE)
    if not os.path.exists(common):
        report.add(f"{common} is missing (common state)", ckdir.COMMON_FILE)
    elif not zipfile.is_zipfile(common):
        report.add(f"{common} is damaged: not a torch.save archive", ckdir.COMMON_FILE)

    storage = md.storage_data or {}
    by_file: Dict[str, List[Tuple[MetadataIndex, Any]]] = collections.defaultdict(list)
    for index, info in storage.items():
        by_file[info.relative_path].append((index, info))
    # coverage of every tensor
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            total = math.prod(int(s) for s in meta.size)
            have = sum(math.prod(int(s) for s in c.sizes) for c in meta.chunks)
            if have != total:
                report.add(f"tensor {key!r}: saved chunks hold {have} of its {total} elements", None, [key])
            for c in meta.chunks:
                if MetadataIndex(key, torch.Size(c.offsets)) not in storage:
                    report.add(f"tensor {key!r}: chunk at {tuple(c.offsets)} has no storage location", None, [key])
    checksums = manifest.checksums() if manifest is not None else {}
    report.checksums_available = manifest is not None
    manifest_damaged = any(p["file"] == ckdir.MANIFEST_FILE for p in report.problems)
    if manifest is None and not manifest_damaged and not _manifest_deleted(path, report):
        report.notes.append("no manifest.json (checkpoint written by another tool): checksums are unavailable, "
                            "only the structure was verified")
    total_bytes = sum(info.length for info in storage.values())
    bar = progress(total=total_bytes, unit="B", unit_scale=True, desc="verify")
    try:
        for name in sorted(by_file):
            items = sorted(by_file[name], key=lambda x: x[1].offset)
            file = os.path.join(path, name)
            keys_in_file = [_item_name(i) for i, _ in items]
            try:
                size = os.path.getsize(file)
            except OSError:
                report.add(f"{file} is missing (listed in .metadata)", name, keys_in_file)
                bar.update(sum(i.length for _, i in items))
                continue
            expected = max(i.offset + i.length for _, i in items)
            if manifest is not None and name in manifest.files:
                expected = max(expected, int(manifest.files[name].get("size", 0)))
            if size < expected:
                cut = [_item_name(i) for i, info in items if info.offset + info.length > size]
                report.add(f"{file} is truncated: {size} bytes, expected {expected}", name, cut)
            elif manifest is not None and name in manifest.files and size != int(manifest.files[name]["size"]):
                report.add(f"{file} has {size} bytes, manifest.json says {manifest.files[name]['size']}", name, keys_in_file)
            damaged = []
            with open(file, "rb") as f:
                fd = f.fileno()
                for index, info in items:
                    if info.offset + info.length > size:
                        bar.update(info.length)
                        continue
                    expected_crc = checksums.get((name, info.offset))
                    report.items_checked += 1
                    report.bytes_checked += info.length
                    if expected_crc is None:
                        bar.update(info.length)
                        continue
                    crc, pos, end = 0, info.offset, info.offset + info.length
                    while pos < end:
                        piece = os.pread(fd, min(_READ_PIECE, end - pos), pos)
                        if not piece:
                            break
                        crc = crc32(piece, crc)
                        pos += len(piece)
                        bar.update(len(piece))
                    if crc != expected_crc:
                        damaged.append((index, info))
            if damaged:
                ranges = ", ".join(f"[{i.offset}, {i.offset + i.length})" for _, i in damaged[:5])
                report.add(f"{file}: checksum mismatch in {len(damaged)} item(s) at bytes {ranges}: the file is damaged",
                           name, [_item_name(i) for i, _ in damaged])
            if manifest is not None:
                missing = [_item_name(i) for i, info in items if (name, info.offset) not in checksums]
                if missing:
                    report.notes.append(f"{name}: {len(missing)} item(s) have no checksum in manifest.json")
    finally:
        bar.close()
    return report


# --------------------------------------------------------------------------- writers
class SafetensorsWriter:
    """Writes tensors into one safetensors file whose header is known up front; data streamed in blocks."""

    def __init__(self, path: str, entries: List[Tuple[str, TensorInfo]], metadata: Optional[Dict[str, str]] = None):
        header: Dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        pos = 0
        self.offsets: Dict[str, Tuple[int, int]] = {}
        for key, info in entries:
            name = _ST_NAMES.get(info.dtype)
            if name is None:
                raise CheckpointingException(f"tensor {key!r}: dtype {info.dtype} cannot be stored in safetensors")
            header[key] = {"dtype": name, "shape": list(info.shape), "data_offsets": [pos, pos + info.nbytes]}
            self.offsets[key] = (pos, pos + info.nbytes)
            pos += info.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = path
        self.tmp = path + ".partial"
        self.f = open(self.tmp, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self.data_start = 8 + len(raw)
        self.size = pos

    def write(self, block: torch.Tensor) -> None:
        """Append the next block (in header order, C-contiguous bytes)."""
        block = block.contiguous()
        if block.numel():
            self.f.write(tensor_buffer(block))

    def close(self) -> None:
        written = self.f.tell() - self.data_start
        self.f.close()
        if written != self.size:
            raise CheckpointingException(f"internal error: wrote {written} of {self.size} bytes to {self.path}")
        os.replace(self.tmp, self.path)


class TorchSaveWriter:
    """Writes a ``torch.load``-able zip archive tensor by tensor, without holding the tensors.

    Produces the same records as ``torch.save`` (``data.pkl``, ``data/<i>``, ``version``,
    ``byteorder``), tensor data 64-byte aligned so ``torch.load(mmap=True)`` works too.
    """

    def __init__(self, path: str):
        self.path = path
        self.tmp = path + ".partial"
        self.zf = zipfile.ZipFile(self.tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self.prefix = "archive/"
        self.refs: Dict[str, Any] = {}
        self.values: Dict[Any, Any] = {}  # non-tensor top-level entries (add_value)
        self._records = 0  # data/<i> records written; also names the next one
        self._open_member: Any = None

    def _member(self, name: str, size: int) -> Any:
        zi = zipfile.ZipInfo(self.prefix + name, date_time=(1980, 1, 1, 0, 0, 0))
        zi.compress_type = zipfile.ZIP_STORED
        zi.file_size = size
        zip64 = size * 1.05 > zipfile.ZIP64_LIMIT
        start = self.zf.fp.tell()
        base = start + 30 + len(zi.filename.encode()) + 4 + (20 if zip64 else 0)
        pad = -base % 64
        zi.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        return self.zf.open(zi, "w", force_zip64=zip64)

    def begin_tensor(self, key: str, info: TensorInfo) -> None:
        index = str(self._records)
        self._records += 1
        self.refs[key] = _TensorRef(_StorageRef(index, info.dtype, math.prod(info.shape)), info.shape)
        self._open_member = self._member(f"data/{index}", info.nbytes)

    def write(self, block: torch.Tensor) -> None:
        block = block.contiguous()
        if block.numel():
            self._open_member.write(tensor_buffer(block))

    def end_tensor(self) -> None:
        self._open_member.close()
        self._open_member = None

    def add_value(self, key: Any, value: Any) -> None:
        """Store ``value`` (plain data, may hold tensors) at top-level ``key`` of the saved dict.

        Its tensors become data records like the others: pickled in place they would need
        ``torch.load(weights_only=False)``.
        """
        found: Dict[str, torch.Tensor] = {}
        structure = _flatten_tensors(value, "", found)
        refs = {}
        for name, t in found.items():
            slot = f"\0value\0{self._records}"  # never a tensor key; removed from refs below
            self.begin_tensor(slot, TensorInfo(t.dtype, tuple(t.shape)))
            self.write(t.detach().cpu())
            self.end_tensor()
            refs[name] = self.refs.pop(slot)
        self.values[key] = _restore_structure(structure, refs)

    def close(self, nested: bool = False) -> None:
        obj: Dict[str, Any] = {}
        for key, ref in self.refs.items():
            if nested:
                node = obj
                parts = key.split(".")
                for p in parts[:-1]:
                    node = node.setdefault(p, {})
                node[parts[-1]] = ref
            else:
                obj[key] = ref
        obj.update(self.values)  # keys checked against the tensors' by the caller
        buf = io.BytesIO()
        _RefPickler(buf, protocol=2).dump(obj)
        for name, data in (("data.pkl", buf.getvalue()), ("byteorder", b"little"), ("version", b"3\n"),
                           (".format_version", b"1"), (".storage_alignment", b"64")):
            with self._member(name, len(data)) as m:
                m.write(data)
        self.zf.close()
        os.replace(self.tmp, self.path)


class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    def __init__(self, storage: _StorageRef, shape: Tuple[int, ...]):
        self.storage, self.shape = storage, tuple(shape)

    def __reduce__(self) -> Any:
        stride, acc = [], 1
        for s in reversed(self.shape):
            stride.append(acc)
            acc *= s
        args = (self.storage, 0, torch.Size(self.shape), tuple(reversed(stride)), False, collections.OrderedDict())
        if self.storage.dtype in _legacy_storage_types():
            return torch._utils._rebuild_tensor_v2, args
        return torch._utils._rebuild_tensor_v3, args + (self.storage.dtype,)


def _legacy_storage_types() -> Dict[torch.dtype, Any]:
    return {d: getattr(torch, n) for d, n in torch.storage._dtype_to_storage_type_map().items() if hasattr(torch, n)}


class _RefPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            legacy = _legacy_storage_types().get(obj.dtype)
            if legacy is not None:
                return ("storage", legacy, obj.key, "cpu", obj.numel)
            return ("storage", torch.UntypedStorage, obj.key, "cpu", obj.numel * _esize(obj.dtype))
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Size):
            return torch.Size, (tuple(obj),)
        return NotImplemented


# --------------------------------------------------------------------------- convert
@dataclass
class ConvertResult:
    """What :func:`convert_checkpoint` wrote.

    ``skipped``: ShardedObject keys not written (torch / safetensors outputs hold tensors);
    ``skipped_common``: common-state entries not written, each with the reason.
    """

    output: str
    to: str
    tensors: int = 0
    bytes: int = 0
    files: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)
    skipped_common: List[str] = field(default_factory=list)


def _shard_plan(entries: List[Tuple[str, TensorInfo]], max_size: int) -> List[List[Tuple[str, TensorInfo]]]:
    shards: List[List[Tuple[str, TensorInfo]]] = []
    current: List[Tuple[str, TensorInfo]] = []
    size = 0
    for key, info in entries:
        if current and size + info.nbytes > max_size:
            shards.append(current)
            current, size = [], 0
        current.append((key, info))
        size += info.nbytes
    if current or not shards:
        shards.append(current)
    return shards


# --------------------------------------------------------------------------- convert: output handling
def _contains(parent: str, child: str) -> bool:
    """Whether resolved path ``child`` is ``parent`` or lies below it."""
    return os.path.commonpath([parent, child]) == parent


def _check_not_source(src: str, out: str) -> None:
    """Refuse an OUT that is SRC, holds SRC or lies inside SRC (resolved, symlinks followed).

    Replacing such an OUT would delete or change the source before (or while) it is read.
    """
    s, o = os.path.realpath(src), os.path.realpath(out)
    if s == o:
        raise CheckpointingException(
            f"output {out} is the source {src} itself: converting in place would destroy the source; choose another OUT")
    if _contains(o, s):
        raise CheckpointingException(
            f"output {out} contains the source {src}: replacing it would delete the source; choose another OUT")
    if _contains(s, o):
        raise CheckpointingException(
            f"output {out} lies inside the source {src}: writing there would change the source; choose another OUT")


def _check_output(out: str, overwrite: bool, is_dir: bool) -> None:
    """OUT must not exist (or be an empty directory, for directory outputs) unless ``overwrite``."""
    if os.path.lexists(out) and not overwrite and (not is_dir or not os.path.isdir(out) or os.listdir(out)):
        raise CheckpointingException(f"{out} already exists; pass --overwrite to replace it")


def _staging_path(out: str, is_dir: bool) -> str:
    """A fresh hidden sibling of OUT to write into; :func:`_commit_output` moves it to OUT.

    A sibling (same filesystem) so that the final move is a rename, and so that the old
    OUT stays intact until the new output is complete.
    """
    parent, base = os.path.split(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{base}.convert-tmp-{uuid.uuid4().hex[:8]}")
    if is_dir:
        os.mkdir(tmp)
    return tmp


def _remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _commit_output(tmp: str, out: str) -> None:
    """Put the finished output ``tmp`` in place of OUT; only now is an old OUT removed."""
    if not os.path.lexists(out) or (not os.path.isdir(tmp) and not os.path.isdir(out)) or os.path.islink(out):
        os.replace(tmp, out)  # atomic: OUT is the old or the new output at every instant
        return
    # a directory on either side cannot be replaced atomically: move the old one aside first
    old = f"{tmp}.old"
    os.rename(out, old)
    os.rename(tmp, out)
    _remove_path(old)


def _discard_output(tmp: str) -> None:
    """Remove a failed conversion's partial output (and a writer's ``.partial`` file)."""
    for path in (tmp, tmp + ".partial"):
        try:
            _remove_path(path)
        except OSError:
            pass  # best effort: the original error is the one to report


# --------------------------------------------------------------------------- convert: common state
def _load_common_for_output(src: TensorSource, result: ConvertResult) -> Dict[Any, Any]:
    """The common state of a checkpoint source as a dict (empty for other sources).

    A common state that cannot be loaded (unsafe without ``--trusted``, damaged) is
    recorded in ``result.skipped_common`` instead of failing the tensor conversion.
    """
    if not isinstance(src, DistCheckpointSource):
        return {}
    from .serialization import load_common_state_dict

    try:
        common = load_common_state_dict(src.path, trusted=src.trusted)
    except CheckpointingException as e:
        result.skipped_common.append(f"the common state ({str(e).splitlines()[0]})")
        return {}
    return common if isinstance(common, dict) else {"common": common}


def _weights_only_loadable(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` can load ``value`` (plain data, tensors, allow-listed types)."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
        return True
    except Exception:  # pickling and the weights-only unpickler fail in many ways
        return False


def _common_values_for_torch(src: TensorSource, tensor_names: set, result: ConvertResult) -> Dict[Any, Any]:
    """Common-state entries to store next to the tensors of a torch output, at their own top-level keys.

    Skipped (and listed in ``result.skipped_common``): entries whose key is already taken by
    a tensor, and entries ``torch.load(weights_only=True)`` could not load, so that the
    output stays loadable without ``weights_only=False``.
    """
    values = {}
    for key, value in _load_common_for_output(src, result).items():
        if key in tensor_names:
            result.skipped_common.append(f"{key!r} (same key as a tensor)")
        elif not _weights_only_loadable(value):
            result.skipped_common.append(f"{key!r} (not loadable with torch.load(weights_only=True))")
        else:
            values[key] = value
    return values


# --------------------------------------------------------------------------- convert
def _write_safetensors(src: TensorSource, entries: List[Tuple[str, TensorInfo]], out_dir: str, max_shard_size: int,
                       budget: int, bar: Any, result: ConvertResult) -> None:
    """HF-style folder: size-bounded ``.safetensors`` files and ``model.safetensors.index.json``."""
    plan = _shard_plan(entries, max_shard_size)
    n = len(plan)
    weight_map: Dict[str, str] = {}
    for i, shard in enumerate(plan):
        name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        writer = SafetensorsWriter(os.path.join(out_dir, name), shard)
        try:
            for key, _ in shard:
                for _, block in src.iter_blocks(key, budget):
                    writer.write(block)
                    bar.update(block.numel() * block.element_size())
                    del block
                weight_map[key] = name
        except BaseException:
            writer.f.close()
            raise
        writer.close()
        result.files.append(name)
    index = {"metadata": {"total_size": sum(i.nbytes for _, i in entries)}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, SAFETENSORS_INDEX), "w") as f:
        json.dump(index, f, indent=2)
    result.files.append(SAFETENSORS_INDEX)


def _write_torch(src: TensorSource, entries: List[Tuple[str, TensorInfo]], out_file: str, nested: bool,
                 budget: int, bar: Any, result: ConvertResult) -> None:
    """One ``torch.load``-able file: the tensors, and the common state of a checkpoint source."""
    tensor_names = {k.split(".")[0] for k, _ in entries} if nested else {k for k, _ in entries}
    common = _common_values_for_torch(src, tensor_names, result)
    writer = TorchSaveWriter(out_file)
    for key, info in entries:
        writer.begin_tensor(key, info)
        for _, block in src.iter_blocks(key, budget):
            writer.write(block)
            bar.update(block.numel() * block.element_size())
            del block
        writer.end_tensor()
    for key, value in common.items():
        writer.add_value(key, value)
    writer.close(nested=nested)


def convert_checkpoint(
    src_path: str,
    to: str,
    out: str,
    *,
    max_shard_size: Any = DEFAULT_MAX_SHARD_SIZE,
    memory_budget: Any = DEFAULT_MEMORY_BUDGET,
    overwrite: bool = False,
    trusted: bool = False,
    nested: bool = False,
    progress: ProgressFactory = _no_progress,
) -> ConvertResult:
    """Convert a checkpoint dir / torch.save file / safetensors file or folder into ``to`` at ``out``.

    ``to``: ``"safetensors"`` (folder ``out`` with size-bounded files and
    ``model.safetensors.index.json``), ``"torch"`` (one ``torch.load``-able file ``out``, a flat
    dict ``{key: tensor}``, nested on ``'.'`` with ``nested=True``, plus the common state of a
    checkpoint input at its own top-level keys) or ``"torch_dist"`` / ``"zarr"`` (checkpoint
    directory ``out``, written with :func:`ckpt_integration.save`; non-tensor values of a torch.save
    input, and common state / ShardedObjects of a checkpoint input, are kept).

    ``out`` may not be the source, contain it or lie inside it. The output is written into a
    hidden sibling of ``out`` and moved to ``out`` when complete, so with ``overwrite`` the old
    ``out`` is replaced only by a finished conversion (a failed one leaves it untouched).

    Tensors are streamed in blocks of at most ``memory_budget`` bytes for the safetensors and
    torch outputs. The torch_dist output of a checkpoint input spills tensors to a temporary file
    next to ``out`` and saves them memory-mapped.
    """
    to = to.lower().replace("-", "_")
    if to not in ("safetensors", "torch", "torch_dist", "zarr"):
        raise ValueError(f"unknown output format {to!r}: choose torch, safetensors, torch_dist or zarr")
    max_shard_size = parse_size(max_shard_size)
    budget = parse_size(memory_budget)
    out = os.fspath(out)
    _check_not_source(os.fspath(src_path), out)
    is_dir = to != "torch"
    _check_output(out, overwrite, is_dir)
    src = open_source(src_path, trusted=trusted)
    result = ConvertResult(out, to)
    try:
        tmp = _staging_path(out, is_dir)
        try:
            _convert_into(src, to, tmp, max_shard_size, budget, nested, progress, result)
            _commit_output(tmp, out)
        except BaseException:
            _discard_output(tmp)
            raise
        if to == "torch":
            result.files = [os.path.basename(os.path.abspath(out))]
        return result
    finally:
        src.close()


def _convert_into(src: TensorSource, to: str, target: str, max_shard_size: int, budget: int, nested: bool,
                  progress: ProgressFactory, result: ConvertResult) -> None:
    """Write the conversion of ``src`` to ``target`` (the staging path of OUT)."""
    entries = list(src.tensors.items())
    if to in ("torch_dist", "zarr"):
        _convert_to_torch_dist(src, target, budget, progress, result, backend=to)
        return
    if isinstance(src, DistCheckpointSource):
        result.skipped = list(src.objects)
    total = sum(i.nbytes for _, i in entries)
    bar = progress(total=total, unit="B", unit_scale=True, desc=f"convert to {to}")
    try:
        if to == "safetensors":
            common = _load_common_for_output(src, result)
            result.skipped_common += [f"{k!r} (safetensors holds tensors only)" for k in common]
            _write_safetensors(src, entries, target, max_shard_size, budget, bar, result)
        else:
            _write_torch(src, entries, target, nested, budget, bar, result)
    finally:
        bar.close()
    result.tensors, result.bytes = len(entries), total


def _restore_structure(obj: Any, tensors: Dict[str, Any]) -> Any:
    if isinstance(obj, _TensorSlot):
        return tensors[obj.key]
    if isinstance(obj, dict):
        return {k: _restore_structure(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restore_structure(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_restore_structure(v, tensors) for v in obj)
    return obj


def _convert_to_torch_dist(
    src: TensorSource, out: str, budget: int, progress: ProgressFactory, result: ConvertResult, backend: str = "torch_dist"
) -> None:
    from .mapping import ShardedObject, ShardedTensor
    from .serialization import load_common_state_dict, save

    spill_map = None
    if isinstance(src, DistCheckpointSource):
        # Stream every tensor into one spill file, then hand save() memory-mapped views of it.
        entries = list(src.tensors.items())
        offsets: Dict[str, int] = {}
        pos = 0
        for key, info in entries:
            offsets[key] = pos
            pos += info.nbytes + (-info.nbytes % 64)
        fd, spill = tempfile.mkstemp(prefix=".ckpt-convert-spill-", dir=os.path.dirname(os.path.abspath(out)))
        try:
            with os.fdopen(fd, "wb") as f:
                bar = progress(total=sum(i.nbytes for _, i in entries), unit="B", unit_scale=True, desc="read")
                for key, info in entries:
                    f.seek(offsets[key])
                    for _, block in src.iter_blocks(key, budget):
                        if block.numel():
                            f.write(tensor_buffer(block.contiguous()))
                        bar.update(block.numel() * block.element_size())
                bar.close()
                f.truncate(max(pos, 1))
            spill_map = _MappedFiles().get(spill)
        finally:
            os.remove(spill)  # the mapping keeps the data reachable until it is dropped
        tensors = {k: _tensor_from_map(spill_map, i.dtype, i.shape, offsets[k]) for k, i in entries}
        sd: Dict[str, Any] = {}
        try:
            common = load_common_state_dict(src.path, trusted=src.trusted)
        except CheckpointingException as e:
            raise CheckpointingException(f"cannot copy the common state: {e}") from None
        if isinstance(common, dict):
            sd.update(common)
        else:
            sd["common"] = common
        for key, t in tensors.items():
            sd[key] = ShardedTensor.from_rank_offsets(key, t)
        for unique_key in src.objects:
            obj = ShardedObject.empty_from_unique_key(unique_key)
            obj.data = src.read_object(unique_key)
            sd[unique_key] = obj
    elif isinstance(src, TorchFileSource):
        sharded = {k: ShardedTensor.from_rank_offsets(k, src.tensor(k)) for k in src.tensors}
        sd = _restore_structure(src.structure, sharded)
        if not isinstance(sd, dict):
            raise CheckpointingException(f"{src.path} does not hold a dict")
    else:
        assert isinstance(src, SafetensorsSource)
        sd = {k: ShardedTensor.from_rank_offsets(k, src.tensor(k)) for k in src.tensors}
        if src.metadata:
            sd["safetensors_metadata"] = dict(src.metadata)
    bar = progress(total=1, desc="save", unit="ckpt")
    save(sd, out, validate_access_integrity=True, overwrite=True, sharded_strategy=backend)
    bar.update(1)
    bar.close()
    result.tensors = len(src.tensors)
    result.bytes = sum(i.nbytes for i in src.tensors.values())
    result.files = sorted(os.listdir(out))
    del sd


# --------------------------------------------------------------------------- diff
@dataclass
class DiffReport:
    """Result of :func:`diff_checkpoints`; ``identical`` when keys, shapes, dtypes and values all match."""

    a: str
    b: str
    only_in_a: List[str] = field(default_factory=list)
    only_in_b: List[str] = field(default_factory=list)
    shape_mismatch: Dict[str, Tuple[List[int], List[int]]] = field(default_factory=dict)
    dtype_mismatch: Dict[str, Tuple[str, str]] = field(default_factory=dict)
    max_abs_diff: Dict[str, float] = field(default_factory=dict)
    objects_only_in_a: List[str] = field(default_factory=list)
    objects_only_in_b: List[str] = field(default_factory=list)

    @property
    def differing(self) -> Dict[str, float]:
        return {k: v for k, v in self.max_abs_diff.items() if v != 0}

    @property
    def identical(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.shape_mismatch or self.dtype_mismatch
                    or self.differing or self.objects_only_in_a or self.objects_only_in_b)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "a": self.a, "b": self.b, "identical": self.identical,
            "only_in_a": self.only_in_a, "only_in_b": self.only_in_b,
            "shape_mismatch": self.shape_mismatch, "dtype_mismatch": self.dtype_mismatch,
            "max_abs_diff": {k: (v if math.isfinite(v) else str(v)) for k, v in self.max_abs_diff.items()},
            "objects_only_in_a": self.objects_only_in_a, "objects_only_in_b": self.objects_only_in_b,
        }

    def format(self) -> str:
        lines = [f"A: {self.a}", f"B: {self.b}"]
        for title, items in (("only in A", self.only_in_a), ("only in B", self.only_in_b),
                             ("objects only in A", self.objects_only_in_a), ("objects only in B", self.objects_only_in_b)):
            if items:
                lines.append(f"{title} ({len(items)}):")
                lines += [f"  {k}" for k in items]
        if self.shape_mismatch:
            lines.append(f"shape differs ({len(self.shape_mismatch)}):")
            lines += [f"  {k}: {a} vs {b}" for k, (a, b) in self.shape_mismatch.items()]
        if self.dtype_mismatch:
            lines.append(f"dtype differs ({len(self.dtype_mismatch)}):")
            lines += [f"  {k}: {a} vs {b}" for k, (a, b) in self.dtype_mismatch.items()]
        diff = self.differing
        if diff:
            lines.append(f"values differ ({len(diff)} of {len(self.max_abs_diff)} common tensors):")
            lines += [f"  {k}: max abs diff {v:.6g}" for k, v in diff.items()]
        lines.append("identical" if self.identical else "different")
        return "\n".join(lines)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.dtype == b.dtype and torch.equal(a, b):
        return 0.0
    if a.is_complex() or b.is_complex():
        a, b = a.to(torch.complex128), b.to(torch.complex128)
    else:
        a, b = a.to(torch.float64), b.to(torch.float64)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if bool(same.all()):
        return 0.0
    d = (a - b).abs()[~same]
    if bool(torch.isnan(d).any()):
        return math.inf
    return float(d.max())


def diff_checkpoints(a: str, b: str, *, memory_budget: Any = DEFAULT_MEMORY_BUDGET, trusted: bool = False,
                     progress: ProgressFactory = _no_progress) -> DiffReport:
    """Compare the tensors of two sources (checkpoint dirs, torch.save or safetensors) block by block."""
    budget = parse_size(memory_budget)
    report = DiffReport(os.fspath(a), os.fspath(b))
    with open_source(a, trusted=trusted) as sa, open_source(b, trusted=trusted) as sb:
        ka, kb = set(sa.tensors), set(sb.tensors)
        report.only_in_a = sorted(ka - kb)
        report.only_in_b = sorted(kb - ka)
        if isinstance(sa, DistCheckpointSource) and isinstance(sb, DistCheckpointSource):
            # ShardedObjects exist only in checkpoint directories; compare their keys there
            oa, ob = set(sa.objects), set(sb.objects)
            report.objects_only_in_a, report.objects_only_in_b = sorted(oa - ob), sorted(ob - oa)
        common = sorted(ka & kb)
        bar = progress(total=sum(sa.tensors[k].nbytes for k in common), unit="B", unit_scale=True, desc="diff")
        try:
            for key in common:
                ia, ib = sa.tensors[key], sb.tensors[key]
                if ia.shape != ib.shape:
                    report.shape_mismatch[key] = (list(ia.shape), list(ib.shape))
                    bar.update(ia.nbytes)
                    continue
                if ia.dtype != ib.dtype:
                    report.dtype_mismatch[key] = (_dtype_name(ia.dtype), _dtype_name(ib.dtype))
                worst = 0.0
                big = ia if ia.nbytes >= ib.nbytes else ib
                for box in plan_blocks(ia.shape, big.dtype, max(budget // 2, 1)):
                    ta, tb = sa.read_block(key, box), sb.read_block(key, box)
                    worst = max(worst, _max_abs_diff(ta, tb))
                    bar.update(ta.numel() * ta.element_size())
                    del ta, tb
                report.max_abs_diff[key] = worst
        finally:
            bar.close()
    return report
