"""Read-only tensor sources for the tools: checkpoint directories, torch.save files, safetensors.

Every source lists its tensors (:class:`TensorInfo`) and reads them block by block
(:func:`plan_blocks` cuts a tensor into boxes of at most a memory budget), so the
commands stream checkpoints larger than RAM.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import mmap
import os
import pickle
import struct
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..errors import (CheckpointingException, CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError,
                      UnsupportedCheckpointError)
from ..execution.preprocess import layout_problem
from ..mapping import object_key_of
from ..planning.boxes import Box, intersect, relative_slices
from ..storage import checkpoint_dir as ckdir
from ..storage.opened import OpenedCheckpoint, open_reader, read_metadata
from ..storage.filesystem import is_remote, name_problem
from ..storage.checksum import check_zip_crcs
from ..storage.fs import tensor_buffer
from ..storage.readers import open_regular
from ..storage.torch_dist import DCP_METADATA_FILE
from .common import SAFETENSORS_INDEX, dtype_size
from ..storage.safe_pickle import object_payload, safe_torch_load


def plan_blocks(shape: Sequence[int], dtype: torch.dtype, budget: int) -> List[Box]:
    """Cut a tensor into boxes of at most ``budget`` bytes that are contiguous in C order.

    Whole rows (axis 0) when a row fits, otherwise rows of the first axis whose
    sub-rows fit; a tensor within the budget is one box.
    """
    shape = tuple(int(s) for s in shape)
    ndim = len(shape)
    if ndim == 0 or math.prod(shape) == 0:
        return [Box((0,) * ndim, shape)]
    esize = dtype_size(dtype)
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


def box_slices(box: Box) -> Tuple[slice, ...]:
    """The index of ``box`` into a whole tensor: ``tensor[box_slices(box)]``."""
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


# --------------------------------------------------------------------------- sources
@dataclass
class TensorInfo:
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


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

    def __exit__(self, *exc: object) -> None:
        self.close()


class DistCheckpointSource(TensorSource):
    """A committed checkpoint directory: ``torch_dist`` (ours, Megatron-Core's, PyTorch DCP's) or ``zarr``."""

    kind = "torch_dist"
    checkpoint: Optional[OpenedCheckpoint] = None  # what it opened (closed with it) or was given
    given: Any = None

    def __init__(self, path: Union[str, os.PathLike], trusted: bool = False):
        # opened once (or the opened checkpoint given): every read below is of the commit it pinned
        self.given = path
        # (manifest formats 1-3 too: this is how they are converted to the current one)
        self.checkpoint = path if isinstance(path, OpenedCheckpoint) else OpenedCheckpoint(path, trusted, legacy=True)
        super().__init__(self.checkpoint.path)
        self.trusted = trusted
        self.config = self.checkpoint.config
        self.kind = self.config.sharded_backend
        try:
            self.metadata = read_metadata(self.checkpoint, trusted=trusted, backend=self.kind)
            # the reader checks every byte it reads against the pinned manifest (a deleted one is
            # damage), and every file name in the metadata before opening it
            self.reader = open_reader(self.checkpoint, self.metadata, self.kind, verify_checksums=True)
        except BaseException:
            self._close_checkpoint()
            raise
        self.manifest = getattr(self.reader, "manifest", None)
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
        """Unpickle a byte item (restricted unless the source is trusted): a ShardedObject's payload,
        stored as a one-element list (Megatron-Core's layout), or a plain DCP value, stored as is."""
        data = self.reader.read_bytes(unique_key)
        value = safe_torch_load(io.BytesIO(data), trusted=self.trusted, what=f"object {unique_key!r} in {self.path}")
        return object_payload(value) if object_key_of(unique_key) is not None else value

    def close(self) -> None:
        self.reader.close()
        self._close_checkpoint()

    def _close_checkpoint(self) -> None:
        if self.checkpoint is not None and self.checkpoint is not self.given:
            self.checkpoint.close()


class MappedFiles:
    """Private (copy-on-write) memory maps of files (pages come from the page cache, not the heap)."""

    def __init__(self) -> None:
        self.maps: Dict[str, Any] = {}

    def get(self, path: str) -> Any:
        mm = self.maps.get(path)
        if mm is None:
            with _open_file(path) as f:
                size = os.fstat(f.fileno()).st_size
                mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else b""
            self.maps[path] = mm
        return mm


def spill_tensors(src: "TensorSource", keys: Sequence[str], where: str, budget: int, progress: Any,
                  what: str) -> Dict[str, torch.Tensor]:
    """Stream the tensors ``keys`` of ``src`` into one temporary file in ``where`` and return
    memory-mapped views of it (``progress``: a :data:`~.common.ProgressFactory`). The file is unlinked
    as soon as it exists, so a process killed on the way leaves nothing behind; the mapping keeps the
    data until the views are dropped."""
    offsets, pos = {}, 0
    for k in keys:
        offsets[k] = pos
        pos += src.tensors[k].nbytes + (-src.tensors[k].nbytes % 64)
    fd, spill = tempfile.mkstemp(prefix=f".ckpt-{what}-spill-", dir=where)
    os.unlink(spill)
    with os.fdopen(fd, "w+b") as f:
        bar = progress(total=pos, unit="B", unit_scale=True, desc="read")
        for k in keys:
            f.seek(offsets[k])
            for _, block in src.iter_blocks(k, budget):
                if block.numel():
                    f.write(tensor_buffer(block.contiguous()))
                bar.update(block.numel() * block.element_size())
        bar.close()
        f.truncate(max(pos, 1))
        f.flush()
        mapped = mmap.mmap(f.fileno(), max(pos, 1), access=mmap.ACCESS_COPY)
    return {k: tensor_from_map(mapped, src.tensors[k].dtype, src.tensors[k].shape, offsets[k]) for k in keys}


def _open_file(path: str) -> Any:
    """``open(path, "rb")`` of a regular file only: a FIFO, device or directory raises
    CorruptCheckpointError instead of blocking (see ``readers.open_regular``)."""
    return os.fdopen(open_regular(path, "input file"), "rb")


def check_zip_records(path: str) -> None:
    """Raise :class:`CorruptCheckpointError` naming ``path`` and the damaged record when the zip
    archive of a ``torch.save`` file fails its CRC32 checks (``torch.load`` does not check them:
    a flipped bit in tensor data would be read as a value). Reads the whole file once; a file
    that is no zip archive (the legacy ``torch.save`` format) has no CRCs and passes."""
    with _open_file(path) as f:
        if f.read(4) != b"PK\x03\x04":
            return
    check_zip_crcs(path, path)


def tensor_from_map(mm: Union[mmap.mmap, bytes], dtype: torch.dtype, shape: Tuple[int, ...], offset: int) -> torch.Tensor:
    """A tensor viewing ``shape`` elements of ``dtype`` at byte ``offset`` of a :class:`MappedFiles` map (no copy)."""
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
#: torch dtype -> safetensors dtype name (``torch.float32`` -> ``"F32"``)
SAFETENSORS_DTYPE_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def read_safetensors_header(path: str) -> Tuple[Dict[str, Any], int]:
    """``(header, data_start)`` of a safetensors file (the JSON header and where tensor bytes begin)."""
    with _open_file(path) as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CorruptCheckpointError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        size = os.fstat(f.fileno()).st_size
        if n > size - 8 or n > 100 * 2**20:
            raise CorruptCheckpointError(f"{path} is not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise CorruptCheckpointError(f"{path} is not a safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path} is not a safetensors file: its header is not a JSON object")
    return header, 8 + n


def _is_int(x: Any) -> bool:
    return type(x) is int  # noqa: E721 - JSON true/false are bools, not sizes


def check_safetensors_entry(file: str, key: str, entry: Any, data_size: int) -> Tuple[torch.dtype, Tuple[int, ...], int, int]:
    """``(dtype, shape, start, end)`` of one header entry of a safetensors file, checked against
    itself and the ``data_size`` bytes after the header (a truncated file, or a header whose ranges
    disagree with dtype x shape, would otherwise be read as other tensors' bytes or fail in torch)."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{file} is damaged: tensor {key!r} {what}")

    if not isinstance(entry, dict):
        raise bad(f"has a header entry that is not an object: {entry!r:.80}")
    name = entry.get("dtype")
    if not isinstance(name, str):
        raise bad(f"has no valid dtype (got {name!r:.40})")
    dtype = _ST_DTYPES.get(name)
    if dtype is None:
        raise UnsupportedCheckpointError(f"{file}: tensor {key!r} has unsupported dtype {name}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"has no valid shape (a list of non-negative integers; got {shape!r:.80})")
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise bad(f"has no valid data_offsets ([start, end] integers; got {offsets!r:.80})")
    start, end = offsets
    nbytes = math.prod(shape) * dtype_size(dtype)
    if not 0 <= start <= end:
        raise bad(f"has data_offsets {offsets} (start after end)")
    if end - start != nbytes:
        raise bad(f"has data_offsets {offsets} ({end - start} bytes) but {name} x {shape} is {nbytes} bytes")
    if end > data_size:
        raise bad(f"has data_offsets {offsets} past the end of the data ({data_size} bytes after the header): "
                  "the file is truncated or its header is wrong")
    return dtype, tuple(shape), start, end


def check_no_overlap(file: str, ranges: Dict[str, Tuple[int, int]]) -> None:
    """Raise :class:`CorruptCheckpointError` when two tensors' byte ranges of ``file`` overlap."""
    last_key, last_end = None, 0
    for key, (start, end) in sorted(ranges.items(), key=lambda kv: kv[1]):
        if start == end:
            continue  # an empty tensor owns no bytes
        if last_key is not None and start < last_end:
            raise CorruptCheckpointError(f"{file} is damaged: the data of tensors {last_key!r} and {key!r} overlap "
                                         f"(bytes [{start}, {last_end}))")
        if end > last_end:
            last_key, last_end = key, end


class SafetensorsSource(TensorSource):
    """A ``.safetensors`` file, or a folder of them (with or without ``model.safetensors.index.json``)."""

    kind = "safetensors"

    def __init__(self, path: str):
        super().__init__(path)
        if os.path.isdir(path):
            index = os.path.join(path, SAFETENSORS_INDEX)
            if os.path.exists(index):
                with _open_file(index) as f:
                    weight_map = ckdir.load_json(f.read(), index)
                try:
                    files = sorted(set(weight_map["weight_map"].values()))
                except (TypeError, KeyError, AttributeError):
                    raise CorruptCheckpointError(f"{index} has no valid 'weight_map' (file names by tensor)") from None
                for name in files:  # names from the index stay inside the folder (links are followed: HF caches use them)
                    problem = name_problem(name)
                    if problem:
                        raise UnsafeCheckpointError(f"refusing {index}: it names the file {name!r}: {problem}; an index "
                                                    "may only name files inside its own folder")
            else:
                files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            if not files:
                raise CheckpointingException(f"{path} holds no .safetensors files")
            files = [os.path.join(path, n) for n in files]
        else:
            files = [path]
        self._maps = MappedFiles()
        self._where: Dict[str, Tuple[str, int]] = {}
        self.metadata: Dict[str, str] = {}
        for file in files:
            header, start = read_safetensors_header(file)
            data_size = os.path.getsize(file) - start
            ranges: Dict[str, Tuple[int, int]] = {}
            for key, entry in header.items():
                if key == "__metadata__":
                    if entry is not None and not isinstance(entry, dict):
                        raise CorruptCheckpointError(f"{file} is damaged: its __metadata__ is not an object")
                    self.metadata.update(entry or {})
                    continue
                dtype, shape, begin, end = check_safetensors_entry(file, key, entry, data_size)
                if key in self.tensors:
                    raise CorruptCheckpointError(f"tensor {key!r} appears in more than one file of {path}")
                ranges[key] = (begin, end)
                self.tensors[key] = TensorInfo(dtype, shape)
                self._where[key] = (file, start + begin)
            check_no_overlap(file, ranges)
        self.tensors = dict(sorted(self.tensors.items()))

    def tensor(self, key: str) -> torch.Tensor:
        """The whole tensor as a view of the memory-mapped file."""
        file, offset = self._where[key]
        info = self.tensors[key]
        return tensor_from_map(self._maps.get(file), info.dtype, info.shape, offset)

    def read_block(self, key: str, box: Box) -> torch.Tensor:
        return self.tensor(key)[box_slices(box)]


def flatten_tensors(obj: object, prefix: str, out: Dict[str, torch.Tensor]) -> Any:
    """Collect tensors of nested dicts/lists under dotted keys; return the structure with tensors replaced by keys."""
    if isinstance(obj, torch.Tensor):
        if prefix in out:  # {"a.b": t, "a": {"b": u}}: one of them would be lost without a word
            raise CheckpointingException(f"two tensors of the input are both named {prefix!r} once nested keys are "
                                         "joined with '.': rename one of them")
        out[prefix] = obj
        return _TensorSlot(prefix)
    if isinstance(obj, dict):
        return {k: flatten_tensors(v, f"{prefix}.{k}" if prefix else str(k), out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        items = [flatten_tensors(v, f"{prefix}.{i}" if prefix else str(i), out) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


@dataclass(frozen=True)
class _TensorSlot:
    key: str


def restore_structure(obj: object, tensors: Dict[str, Any]) -> Any:
    """The inverse of :func:`flatten_tensors`: the structure with each key slot replaced by ``tensors[key]``."""
    if isinstance(obj, _TensorSlot):
        return tensors[obj.key]
    if isinstance(obj, dict):
        return {k: restore_structure(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [restore_structure(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(restore_structure(v, tensors) for v in obj)
    return obj


class TorchFileSource(TensorSource):
    """A ``torch.save`` file holding a (flat or nested) dict of tensors; loaded memory-mapped, weights-only."""

    kind = "torch"

    def __init__(self, path: str, trusted: bool = False):
        super().__init__(path)
        check_zip_records(path)
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
        if not isinstance(obj, (dict, list, tuple)):
            what = "a single tensor" if isinstance(obj, torch.Tensor) else f"an object of type {type(obj).__name__}"
            raise CheckpointingException(f"{path} holds {what}, not a dict of tensors")
        self._values: Dict[str, torch.Tensor] = {}
        self.structure = flatten_tensors(obj, "", self._values)
        for k, t in sorted(self._values.items()):
            self.tensors[k] = TensorInfo(t.dtype, tuple(t.shape))

    def tensor(self, key: str) -> torch.Tensor:
        t = self._values[key]
        # (a sparse or quantized tensor's values are not its memory: sliced, it failed with a bare error, or was
        # written as raw integers without its quantizer; listed, as inspect lists it, it is fine)
        problem = "a meta tensor: it holds no values" if t.is_meta else layout_problem(t)
        if problem:
            raise UnsupportedCheckpointError(f"{self.path}: the values of tensor {key!r} cannot be read: it is {problem}")
        return t

    def read_block(self, key: str, box: Box) -> torch.Tensor:
        return self.tensor(key)[box_slices(box)]


_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def _sniff_file(path: str) -> Optional[str]:
    """``"torch"`` or ``"safetensors"`` from the first bytes of a file, ``None`` if neither.

    A torch.save file is a zip archive (``PK``) or, in the legacy format, a protocol-2 pickle
    of torch's magic number; a safetensors file starts with the length of the JSON header
    that follows, which must fit in the file.
    """
    with _open_file(path) as f:
        head = f.read(9)
        size = os.fstat(f.fileno()).st_size
    if head[:4] == b"PK\x03\x04" or head[:3] == b"\x80\x02\x8a":
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        (n,) = struct.unpack("<Q", head[:8])
        if n <= size - 8:
            return "safetensors"
    return None


def detect_kind(path: str) -> str:
    """``"torch_dist"``, ``"safetensors"`` or ``"torch"`` for a checkpoint dir, safetensors file/folder or torch.save file.

    Anything else (a README, an empty folder) raises :class:`CheckpointNotFoundError` saying
    that it is not a checkpoint. Files are told apart by their first bytes; a file with a
    checkpoint suffix whose content is not recognised goes to the reader of that suffix,
    which names the damage.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist")
    if os.path.isdir(path):
        names = os.listdir(path)
        if ckdir.CONFIG_FILE in names or DCP_METADATA_FILE in names or any(n.endswith(".distcp") for n in names):
            return "torch_dist"
        if SAFETENSORS_INDEX in names or any(n.endswith(".safetensors") for n in names):
            return "safetensors"
        raise CheckpointNotFoundError(
            f"{path} is not a checkpoint: the directory has no {ckdir.CONFIG_FILE} (checkpoint directory) "
            "and no .safetensors files"
        )
    kind = _sniff_file(path)
    if kind is None and path.endswith(_TORCH_SUFFIXES):
        kind = "torch"
    elif kind is None and path.endswith(".safetensors"):
        kind = "safetensors"
    if kind is None:
        raise CheckpointNotFoundError(
            f"{path} is not a checkpoint: not a checkpoint directory, torch.save file or safetensors file"
        )
    return kind


def open_source(path: str, trusted: bool = False) -> TensorSource:
    """Open a checkpoint directory (or an opened checkpoint), a torch.save file or safetensors
    file/folder for reading."""
    if isinstance(path, OpenedCheckpoint):
        return DistCheckpointSource(path, trusted=trusted)
    path = os.fspath(path)
    if is_remote(path):  # (on object stores: checkpoint directories, which the source reads through fsspec)
        return DistCheckpointSource(path, trusted=trusted)
    path = path[len("file://"):] if path.startswith("file://") else path  # (a file:// URL is its path)
    kind = detect_kind(path)
    if kind == "torch_dist":
        return DistCheckpointSource(path, trusted=trusted)
    if kind == "safetensors":
        return SafetensorsSource(path)
    return TorchFileSource(path, trusted=trusted)
