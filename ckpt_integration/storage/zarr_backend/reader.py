"""Loading from the zarr backend: :class:`ZarrReader`, with the interface of ``TorchDistReader``.

Every file it reads is checked by the ``CheckingStore`` of :mod:`.checks`; ``check_files`` is
``verify``'s pass over every recorded file.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

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

from ...errors import CheckpointingException, CorruptCheckpointError, MismatchError
from ...planning.boxes import Box
from ..checksum import crc32
from ..filesystem import CheckpointLocation, join
from ..torch_dist_reader import ChunkInfo
from .checks import array_mismatch, file_problem, store_wrappers
from .index import (ARRAY_METADATA_FILE, INDEX_FILE, FileRecord, array_path, base_store, check_index_entries,
                    check_index_paths, expected_files, is_chunk_name, object_file_name, object_path, read_file_records,
                    read_index, zarr_module)

# verify reads files in blocks of this size (bounded memory for large chunks)
_VERIFY_BLOCK = 64 << 20


class ZarrReader:
    """Reads regions of zarr arrays; same interface as ``TorchDistReader``.

    Every chunk file read is checked against its record (present, size, and CRC32
    when ``verify_checksums``); ``checksums`` is unused (the records are in the index).
    """

    def __init__(self, ck: CheckpointLocation, checksums: Optional[Dict[Tuple[str, int], int]] = None, verify_checksums: bool = True,
                 manifest: Any = None):
        self.ck, self.directory = ck, ck.path  # (the handle; its path for the planners and messages)
        self.index = read_index(ck, manifest)  # checked against the manifest; an opened checkpoint: read once
        check_index_entries(self.directory, self.index)
        check_index_paths(self.directory, self.index)
        # None: an index written before records existed; such files are read unchecked
        self.files = read_file_records(self.index, self.ck.file(INDEX_FILE))
        self.verify_checksums = verify_checksums
        self._chunk_records: Optional[Dict[str, List[int]]] = None
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

    def array(self, key: str) -> Any:
        """The opened zarr array of ``key``.

        Its ``zarr.json`` is checked against its record (format 3 indexes) and the
        opened array against the index (shape, dtype, chunking): a ``zarr.json``
        edited after the save raises instead of decoding chunks as garbage.
        """
        zarr = zarr_module()

        with self._lock:
            if key not in self._arrays:
                path = array_path(self.ck, key)
                try:
                    # format pinned: zarr would otherwise also probe for zarr v2 metadata files
                    arr = zarr.open_array(self._open_store(key), mode="r", zarr_format=3)
                except CheckpointingException:
                    raise  # from the checking store: names the damaged zarr.json (or a refused path)
                except Exception as e:  # zarr raises several types for missing/damaged metadata
                    raise CorruptCheckpointError(f"zarr array {path} for {key!r} cannot be opened: {e}") from None
                problem = array_mismatch(arr, self.index["tensors"][key])
                if problem:
                    raise CorruptCheckpointError(
                        f"zarr metadata file {join(path, ARRAY_METADATA_FILE)} of {key!r} does not match "
                        f"{INDEX_FILE} (written at save time): {problem}"
                    )
                self._arrays[key] = arr
            return self._arrays[key]

    def _open_store(self, key: str) -> Any:
        files = self.files
        _, CheckingStore = store_wrappers()
        return CheckingStore(
            base_store(self.ck, key, read_only=True),
            array_path(self.ck, key),
            None if files is None else (lambda name: files.get(f"{key}/{name}")),
            self.verify_checksums,
            self.directory,
            key,
        )

    def validate_tensor(self, key: str) -> None:
        """Before allocating a whole ``key``: with file records, its declared shape must match
        the recorded chunk files (their number and sizes), so a damaged index cannot make a
        load allocate a tensor the files cannot hold. (Indexes without records: unchecked.)"""
        if self.files is None:
            return
        info = self.index["tensors"][key]
        shape, chunks = info["shape"], info["chunks"]
        esize = torch.empty((), dtype=getattr(torch, info["stored_dtype"])).element_size()
        grid = math.prod(math.ceil(n / c) for n, c in zip(shape, chunks)) if math.prod(shape) else 0
        per_chunk = math.prod(chunks) * esize
        if self._chunk_records is None:  # key -> sizes of its recorded chunk files (one pass over the records)
            self._chunk_records = {}
            for name, r in self.files.items():
                head, sep, rest = name.rpartition("/c/") if "/c/" in name else name.rpartition("/c")
                if sep and is_chunk_name(sep[1:] + rest):
                    self._chunk_records.setdefault(head, []).append(r.size)
        recorded = self._chunk_records.get(key, [])
        if len(recorded) != grid or any(size != per_chunk for size in recorded):
            raise CorruptCheckpointError(
                f"{self.ck.file(INDEX_FILE)} is damaged: tensor {key!r} is declared with shape {shape} "
                f"in chunks of {chunks} ({grid} chunk files of {per_chunk} bytes), but {len(recorded)} chunk "
                "files are recorded; nothing was allocated for it"
            )

    def row_grain(self, key: str) -> int:
        """Rows (along the first axis) of one band of ``key``'s stored chunks: regions whose rows
        start and end at multiples of it decode every stored chunk they touch once (shared reads
        plan zarr arrays in such bands)."""
        chunks = self.index["tensors"][key].get("chunks") or [1]
        return max(1, int(chunks[0]))

    def read_region(self, key: str, chunk: ChunkInfo, overlap: Box, out: torch.Tensor, dtype: torch.dtype) -> None:
        arr = self.array(key)
        info = self.index["tensors"][key]
        region = tuple(slice(o, o + s) for o, s in zip(overlap.offsets, overlap.sizes))
        try:
            values = arr[region] if region else arr[...]
        except CheckpointingException:
            raise  # from the checking store: already names key and chunk file
        except Exception as e:
            raise CorruptCheckpointError(f"reading {overlap} of zarr array {key!r} in {self.directory} failed: {e}") from None
        t = torch.from_numpy(np.ascontiguousarray(values))
        if info["stored_dtype"] != info["dtype"]:
            t = t.view(dtype)
        out.copy_(t.reshape(out.shape))

    def read_bytes(self, storage_key: str) -> bytes:
        if storage_key not in self.index.get("objects", []):
            raise MismatchError(f"object {storage_key!r} is not in the checkpoint")
        path = object_path(self.ck, storage_key)
        try:
            data = self.ck.read(object_file_name(storage_key), "object file", nested=True, source=INDEX_FILE)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"object file {path} of {storage_key!r} is missing (listed in {INDEX_FILE})") from None
        record = self.files.get(object_file_name(storage_key)) if self.files is not None else None
        if record is not None:
            crc = crc32(data) if self.verify_checksums else None
            problem = file_problem("object file", path, record, len(data), crc)
            if problem:
                raise CorruptCheckpointError(problem)
        return data

    def check_files(self) -> Iterator[Tuple[str, str, int, Optional[str]]]:
        """For ``verify``: (key, file, size, problem or None) for every chunk file of every
        array and every object file, read in blocks; nothing for indexes without records."""
        if self.files is None:
            return
        for key, name in expected_files(self.index):
            record = self.files.get(name)
            if record is None:
                yield key, name, 0, f"{self.ck.file(name)} of {key!r} has no record in {INDEX_FILE}: the index is damaged"
            else:
                yield key, name, record.size, self._file_problem(name, record)

    def _file_problem(self, name: str, record: FileRecord) -> Optional[str]:
        path = self.ck.file(name)
        what = "object file" if name == object_file_name(record.key) else "zarr chunk file"
        try:
            reader = self.ck.open(name, what, nested=True, source=INDEX_FILE)
        except FileNotFoundError:
            return file_problem(what, path, record, None)
        except CheckpointingException as e:  # refused (leads outside the checkpoint) or not a regular file
            return str(e)
        try:
            if reader.size != record.size:
                return file_problem(what, path, record, reader.size)
            crc = 0
            for start in range(0, reader.size, _VERIFY_BLOCK):
                crc = crc32(reader.read(start, min(_VERIFY_BLOCK, reader.size - start)), crc)
            return file_problem(what, path, record, reader.size, crc)
        finally:
            reader.close()

    def close(self) -> None:
        self._arrays.clear()

    def __enter__(self) -> "ZarrReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
