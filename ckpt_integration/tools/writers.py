"""Streaming writers for the tools' outputs: safetensors files (and HF-style folders of them) and
``torch.load``-able archives."""

from __future__ import annotations

import collections
import io
import json
import math
import os
import pickle
import struct
import zipfile
from typing import Any, Dict, Hashable, List, Optional, Tuple

import torch

from ..errors import CheckpointingException
from ..storage.fs import tensor_buffer
from .common import SAFETENSORS_INDEX, ProgressBar, dtype_size
from .sources import SAFETENSORS_DTYPE_NAMES, TensorInfo, TensorSource, flatten_tensors, restore_structure


class SafetensorsWriter:
    """Writes tensors into one safetensors file whose header is known up front; data streamed in blocks."""

    def __init__(self, path: str, entries: List[Tuple[str, TensorInfo]], metadata: Optional[Dict[str, str]] = None):
        header: Dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        pos = 0
        self.offsets: Dict[str, Tuple[int, int]] = {}
        for key, info in entries:
            name = SAFETENSORS_DTYPE_NAMES.get(info.dtype)
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


def shard_plan(entries: List[Tuple[str, TensorInfo]], max_size: int) -> List[List[Tuple[str, TensorInfo]]]:
    """``entries`` cut, in order, into shards of at most ``max_size`` bytes (a larger tensor is a shard alone)."""
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


def write_safetensors_folder(src: TensorSource, entries: List[Tuple[str, TensorInfo]], out_dir: str,
                             max_shard_size: int, budget: int, bar: ProgressBar) -> List[str]:
    """HF-style folder ``out_dir``: size-bounded ``.safetensors`` files and ``model.safetensors.index.json``,
    tensors streamed from ``src`` in blocks of at most ``budget`` bytes. Returns the names written."""
    if any(key == "__metadata__" for key, _ in entries):  # (before any file: safetensors reserves the name)
        raise CheckpointingException("a tensor named '__metadata__' cannot be stored in safetensors: the format keeps "
                                     "its header's metadata under that name (no reader would open the file); rename it")
    plan = shard_plan(entries, max_shard_size)
    n = len(plan)
    names: List[str] = []
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
        names.append(name)
    index = {"metadata": {"total_size": sum(i.nbytes for _, i in entries)}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, SAFETENSORS_INDEX), "w") as f:
        json.dump(index, f, indent=2)
    names.append(SAFETENSORS_INDEX)
    return names


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

    def add_value(self, key: Hashable, value: object) -> None:
        """Store ``value`` (plain data, may hold tensors) at top-level ``key`` of the saved dict.

        Its tensors become data records like the others: pickled in place they would need
        ``torch.load(weights_only=False)``.
        """
        found: Dict[str, torch.Tensor] = {}
        structure = flatten_tensors(value, "", found)
        refs = {}
        for name, t in found.items():
            slot = f"\0value\0{self._records}"  # never a tensor key; removed from refs below
            self.begin_tensor(slot, TensorInfo(t.dtype, tuple(t.shape)))
            self.write(t.detach().cpu())
            self.end_tensor()
            refs[name] = self.refs.pop(slot)
        self.values[key] = restore_structure(structure, refs)

    def abort(self) -> None:
        """Close the partial archive after a failure (the caller removes the ``.partial`` file)."""
        try:
            if self._open_member is not None:
                self._open_member.close()
        except Exception:  # noqa: S110 - best effort: the original error is the one to report
            pass
        finally:
            self._open_member = None
            try:
                self.zf.close()
            except Exception:  # noqa: S110
                pass

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
    def persistent_id(self, obj: object) -> Any:
        if isinstance(obj, _StorageRef):
            legacy = _legacy_storage_types().get(obj.dtype)
            if legacy is not None:
                return ("storage", legacy, obj.key, "cpu", obj.numel)
            return ("storage", torch.UntypedStorage, obj.key, "cpu", obj.numel * dtype_size(obj.dtype))
        return None

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, torch.Size):
            return torch.Size, (tuple(obj),)
        return NotImplemented
