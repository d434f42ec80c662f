"""Saving with the zarr backend: arrays created, shards cut into whole-chunk writes, chunks written
and recorded, the records committed into the index before the commit marker.

Chunks wholly inside a shard are written by that shard's writer; a chunk shared by shards of
several writers (uneven sharding with coarsened chunks) has one owner, who assembles it from
the pieces the others send (:func:`plan_chunk_writes`, :func:`split_for_chunks`,
:func:`assemble_border_chunks`): concurrent writers never race on one file.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from ...errors import CheckpointingException, ShardingIntegrityError
from ...planning.boxes import Box, intersect, relative_slices
from ..checksum import crc32
from ..filesystem import CheckpointLocation, writing
from ..fs import fsync_dir, fsync_file
from ..torch_dist import WriteRequest, WrittenItem, run_parallel
from .checks import store_wrappers
from .index import (INDEX_FORMAT, FileRecord, array_chunks, base_store,
                    check_layout_paths, chunk_box, chunk_offsets, expected_files, metadata_file_name, numpy_dtype,
                    object_file_name, object_path, read_index, storage_dtype, write_index, zarr_module)


# --------------------------------------------------------------------------- chunks shared by several writers
def _chunk_ranges(box: Box, shape: Sequence[int], chunks: Sequence[int]) -> Tuple[List[range], List[range]]:
    """Per axis, the chunk indices ``box`` overlaps and those it contains whole
    (a chunk clipped at the array's end counts as whole when ``box`` reaches that end)."""
    overlapped, inside = [], []
    for o, s, n, c in zip(box.offsets, box.sizes, shape, chunks):
        end = o + s
        overlapped.append(range(o // c, -(-end // c)))
        inside.append(range(-(-o // c), -(-end // c) if end == n else end // c))
    return overlapped, inside


def interior_box(box: Box, shape: Sequence[int], chunks: Sequence[int]) -> Optional[Box]:
    """The union of the chunks lying wholly inside ``box`` (a box itself), or None."""
    _, inside = _chunk_ranges(box, shape, chunks)
    if any(len(r) == 0 for r in inside):
        return None
    offsets = tuple(r.start * c for r, c in zip(inside, chunks))
    ends = tuple(min(r.stop * c, n) for r, c, n in zip(inside, chunks, shape))
    return Box(offsets, tuple(e - o for o, e in zip(offsets, ends)))


def border_chunks(box: Box, shape: Sequence[int], chunks: Sequence[int]) -> Iterator[Tuple[int, ...]]:
    """Coordinates of the chunks ``box`` overlaps without containing them.

    Enumerated slab by slab (for the first axis on which a chunk is not inside,
    only the first and last overlapped index can be partial), so a shard of many
    chunks costs only its border.
    """
    overlapped, inside = _chunk_ranges(box, shape, chunks)
    for d in range(len(shape)):
        edges = sorted({i for i in (overlapped[d].start, overlapped[d].stop - 1) if i in overlapped[d] and i not in inside[d]})
        for e in edges:
            axes = [inside[k] for k in range(d)] + [[e]] + [overlapped[k] for k in range(d + 1, len(shape))]
            yield from itertools.product(*axes)


@dataclass
class BorderChunk:
    """A chunk shared by shards of more than one writer, or not wholly inside its writer's shard."""

    box: Box  # clipped to the array
    owner: int  # the rank that writes it: the writer of the shard holding the chunk's first element
    pieces: List[Tuple[Box, int]]  # (part of the chunk, writer rank of the shard it comes from)


def plan_chunk_writes(
    shape: Sequence[int], chunks: Sequence[int], writers: Sequence[Tuple[Box, int]]
) -> Dict[Tuple[int, ...], BorderChunk]:
    """Every border chunk of one array, with its owner and pieces; deterministic on every rank.

    ``writers``: (shard box, writing rank) per saved shard. Chunks wholly inside a shard
    are written by its writer and are not listed. Empty for shard-aligned chunking.
    """
    if not shape or math.prod(shape) == 0:
        return {}
    out: Dict[Tuple[int, ...], BorderChunk] = {}
    for box, rank in sorted(writers, key=lambda w: (w[0].offsets, w[1])):
        for coords in border_chunks(box, shape, chunks):
            cbox = chunk_box(coords, shape, chunks)
            part = intersect(box, cbox)
            if part is None:
                continue
            entry = out.setdefault(coords, BorderChunk(cbox, -1, []))
            entry.pieces.append((part, rank))
            if part.offsets == cbox.offsets:
                entry.owner = rank
    for coords, entry in out.items():
        if entry.owner < 0:  # no shard holds the chunk's first element: invalid sharding
            entry.owner = entry.pieces[0][1]
    return out


# --------------------------------------------------------------------------- chunk-aligned writes
ArrayPlan = Tuple[Tuple[int, ...], Tuple[int, ...], Dict[Tuple[int, ...], BorderChunk]]  # shape, chunks, border chunks


# (key, chunk coordinates, part of the chunk, its values): what a rank contributes to a border chunk
Piece = Tuple[str, Tuple[int, ...], Box, torch.Tensor]


def plan_array_writes(
    tensors: Dict[str, Tuple[torch.dtype, Tuple[int, ...], List[Box]]], writers: Dict[str, List[Tuple[Box, int]]]
) -> Dict[str, ArrayPlan]:
    """Per array: shape, chunk shape (as :func:`create_arrays` chooses it) and border chunks.

    ``tensors`` as for :func:`create_arrays`; ``writers``: per key (shard box, writing rank).
    The same on every rank (metadata only), so the save needs no extra exchange to agree on it.
    """
    plans: Dict[str, ArrayPlan] = {}
    for key, (dtype, shape, boxes) in tensors.items():
        shape = tuple(shape)
        chunks = array_chunks(dtype, shape, boxes)
        plans[key] = (shape, chunks, plan_chunk_writes(shape, chunks, writers.get(key, [])))
    return plans


def split_for_chunks(requests: Sequence[WriteRequest], plans: Dict[str, ArrayPlan]) -> Tuple[List[WriteRequest], List[Piece]]:
    """This rank's shard requests as writes of whole chunks, plus its pieces of border chunks.

    Per shard: one request for the chunks wholly inside it (zarr writes whole chunks
    without reading them back, so concurrent writers never race on one file), and one
    piece per border chunk it overlaps, for that chunk's owner to assemble.
    """
    out: List[WriteRequest] = []
    pieces: List[Piece] = []
    for req in requests:
        plan = plans.get(req.storage_key) if req.offsets is not None else None
        if plan is None or not plan[2]:
            out.append(req)  # shard-aligned chunks (or an object): written as it is
            continue
        shape, chunks, _ = plan
        box = Box(tuple(req.offsets), tuple(req.data.shape))
        inner = interior_box(box, shape, chunks)
        if inner == box:
            out.append(req)
            continue
        if inner is not None:
            out.append(WriteRequest(req.storage_key, inner.offsets, req.data[relative_slices(inner, box)]))
        for coords in border_chunks(box, shape, chunks):
            part = intersect(box, chunk_box(coords, shape, chunks))
            if part is not None:
                pieces.append((req.storage_key, coords, part, req.data[relative_slices(part, box)]))
    return out, pieces


def assemble_border_chunks(plans: Dict[str, ArrayPlan], dtypes: Dict[str, torch.dtype], rank: int, pieces: Iterable[Piece]) -> List[WriteRequest]:
    """Owner side: one whole-chunk request per border chunk ``rank`` owns, from all its pieces.

    A chunk the pieces do not cover would be saved with zeros in the gap, so it is an error.
    """
    got: Dict[Tuple[str, Tuple[int, ...]], List[Tuple[Box, torch.Tensor]]] = {}
    for key, coords, part, values in pieces:
        got.setdefault((key, tuple(coords)), []).append((part, values))
    out = []
    for key in sorted(plans):
        for coords, chunk in sorted(plans[key][2].items()):
            if chunk.owner != rank:
                continue
            buffer = torch.empty(chunk.box.sizes, dtype=dtypes[key])
            covered = 0
            for part, values in got.pop((key, coords), []):
                buffer[relative_slices(part, chunk.box)] = values
                covered += part.numel
            if covered < chunk.box.numel:
                raise CheckpointingException(
                    f"zarr chunk {'/'.join(map(str, coords))} {chunk.box} of {key!r}: the saved shards cover "
                    f"only {covered} of its {chunk.box.numel} elements (missing shards, or a rank failed)"
                )
            out.append(WriteRequest(key, chunk.box.offsets, buffer))
    if got:
        (key, coords), _ = next(iter(got.items()))
        raise CheckpointingException(f"internal error: rank {rank} received pieces of chunk {coords} of {key!r}, which it does not own")
    return out


# --------------------------------------------------------------------------- save: arrays, chunk files, records
def create_arrays(
    target: CheckpointLocation,
    tensors: Dict[str, Tuple[torch.dtype, Tuple[int, ...], List[Box]]],
    object_keys: Iterable[str],
    durable: bool = True,
) -> Dict[str, Any]:
    """Coordinator: write the index of the arrays, then create every array (metadata only); return the
    index to commit.

    Refuses unsafe or colliding keys (:func:`check_layout_paths`) before anything is written. The index
    comes first: it names the arrays' folders as this save's, so a save killed while it creates them
    leaves folders the next save knows for its own and cleans up (they were foreign to it before).
    """
    zarr = zarr_module()

    object_keys = sorted(object_keys)
    check_layout_paths(list(tensors), object_keys)
    index: Dict[str, Any] = {"format": 1, "tensors": {}, "objects": object_keys}
    for key, (dtype, shape, boxes) in tensors.items():
        stored = storage_dtype(dtype)
        index["tensors"][key] = {"dtype": str(dtype).replace("torch.", ""), "stored_dtype": str(stored).replace("torch.", ""),
                                 "shape": list(shape), "chunks": list(array_chunks(dtype, shape, boxes))}
    write_index(target, index, durable)  # (also marks the directory as a partial save of ours)
    for key, entry in index["tensors"].items():
        with writing(target.file(key)):  # (no inodes left: a CheckpointWriteError naming the array)
            zarr.create_array(  # (through the recording store: its zarr.json write gets the remote retries)
                store=store_wrappers()[0](base_store(target, key)),
                shape=tuple(entry["shape"]),
                chunks=tuple(entry["chunks"]),
                dtype=numpy_dtype(storage_dtype(tensors[key][0])),
                compressors=None,
                fill_value=0,
                # pinned: chunk_file_names() enumerates chunk files in this encoding
                chunk_key_encoding={"name": "default", "separator": "/"},
                # (no overwrite: the save's directory is new, and zarr's overwrite deletes through fsspec's
                # rm, which reads "[", "*", "?" in a key as a pattern: another array's files went with it)
            )
    return index


def write_zarr_requests(target: CheckpointLocation, requests: Sequence[WriteRequest], thread_count: int = 2, durable: bool = True) -> List[WrittenItem]:
    """Write tensor chunks into their arrays and objects into ``.pt`` files.

    Returns one item per file written (each chunk file, each object file) with its
    size and CRC32, for :func:`commit_file_records`.
    """
    zarr = zarr_module()
    RecordingStore, _ = store_wrappers()

    storage = target.storage
    arrays: Dict[str, Any] = {}
    stores: Dict[str, Any] = {}
    lock = threading.Lock()

    def array(key: str) -> Any:
        with lock:
            if key not in arrays:
                stores[key] = RecordingStore(base_store(target, key))
                # all-zero chunks are written too: a missing chunk file then always means damage
                arrays[key] = zarr.open_array(stores[key], mode="r+").with_config({"write_empty_chunks": True})
            return arrays[key]

    def write(req: WriteRequest) -> Optional[WrittenItem]:
        if req.offsets is None:
            path = object_path(target, req.storage_key)
            parent = path.rsplit("/", 1)[0]
            storage.makedirs(parent)
            storage.write_atomic(path, req.data, durable)
            return WrittenItem(req.storage_key, None, object_file_name(req.storage_key), 0, len(req.data), crc32(req.data))
        t = req.data.detach().cpu().contiguous()
        stored = storage_dtype(t.dtype)
        values = (t.view(stored) if stored != t.dtype else t).numpy()
        region = tuple(slice(o, o + s) for o, s in zip(req.offsets, t.shape))
        arr = array(req.storage_key)
        if region:
            arr[region] = values
        else:
            arr[...] = values
        return None  # its chunk files are reported from the recording store below

    results: List[Optional[WrittenItem]] = [None] * len(requests)

    def task(i: int) -> None:
        results[i] = write(requests[i])

    run_parallel(list(range(len(requests))), task, thread_count)
    if durable and not storage.remote:
        _sync_chunk_files(target, {key: list(store.records) for key, store in stores.items()}, thread_count)
    items = [r for r in results if r is not None]
    for key, store in stores.items():
        chunks = arrays[key].chunks
        for name, (size, crc) in sorted(store.records.items()):
            items.append(WrittenItem(key, chunk_offsets(name, chunks), f"{key}/{name}", 0, size, crc))
    return items


def _sync_chunk_files(target: CheckpointLocation, names: Dict[str, List[str]], thread_count: int) -> None:
    """fsync the chunk files this rank wrote (``names``: per array key), then every directory holding
    them, deepest first: zarr's local store writes without fsync, and the commit marker may only
    follow durable data (docs/format.md)."""
    files = [target.file(f"{key}/{name}") for key, chunk_names in names.items() for name in chunk_names]
    run_parallel(files, fsync_file, thread_count)
    _sync_dirs(target.path, files)


def _sync_dirs(directory: str, files: Iterable[str]) -> None:
    """fsync the directories between ``directory`` and each of ``files``, deepest first."""
    dirs = set()
    root = directory.rstrip(os.sep)
    for f in files:
        d = os.path.dirname(f)
        while len(d) > len(root) and d not in dirs:
            dirs.add(d)
            d = os.path.dirname(d)
    for d in sorted(dirs, key=lambda p: p.count(os.sep), reverse=True):
        fsync_dir(d)


def commit_file_records(target: CheckpointLocation, written: Iterable[WrittenItem], durable: bool = True) -> Dict[str, int]:
    """Coordinator, before the commit marker: put every rank's file records into the index,
    and those of every array's ``zarr.json`` (read back here: a few hundred bytes each).

    Also checks that every chunk of every array and every object has a record: a
    chunk no rank wrote would otherwise read as zeros. Returns the index's manifest entry (size
    and CRC32). The index read back is this save's own, written by ``create_arrays``: not yet
    recorded anywhere, so read unchecked.
    """
    index = read_index(target, unrecorded=True)
    files = {w.relative_path: FileRecord(w.storage_key, w.length, w.checksum) for w in written}  # (zarr items: CRC32s)
    missing = [(key, path) for key, path in expected_files(index) if path not in files]
    if missing:
        key, path = missing[0]
        keys = sorted({k for k, _ in missing})
        raise ShardingIntegrityError(
            f"nothing was saved: part of {key!r} was saved by no rank (its zarr chunk {path}; {len(missing)} such "
            f"chunk(s), of {', '.join(repr(k) for k in keys[:5])}{' ...' if len(keys) > 5 else ''}). A zarr array holds every "
            "element: save shards that cover the whole tensor (validate_access_integrity=True checks that before "
            "writing), or use the torch_dist backend, which stores the saved parts only")
    storage = target.storage
    metadata_files = [target.file(metadata_file_name(key)) for key in sorted(index["tensors"])]
    for key, path in zip(sorted(index["tensors"]), metadata_files):
        data = storage.read_bytes(path)
        files[metadata_file_name(key)] = FileRecord(key, len(data), crc32(data))
    if durable and not storage.remote:  # zarr wrote them (create_arrays) without fsync
        for path in metadata_files:
            fsync_file(path)
        _sync_dirs(target.path, metadata_files)
    index["format"] = INDEX_FORMAT
    index["files"] = {path: asdict(r) for path, r in sorted(files.items())}
    return write_index(target, index, durable)
