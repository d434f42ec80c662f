"""``chunk_index.bin``: what a load needs of ``.metadata``, as integers, written beside it at save.

DCP's ``.metadata`` is a pickle of one object per tensor, chunk and storage record;
unpickling it costs ~25 us per chunk (0.5 s for 20,000 small tensors) and a load
then re-encodes it for the broadcast. Every torch_dist commit therefore also writes
the same content in the compact message format of :mod:`..planning.records`
(zlib-compressed): per tensor its dtype, global shape and chunks (sorted along the
axis where they overlap least, so a request is answered by a binary search) with
where each chunk is stored; per object where it is stored. A load reads this file
instead of ``.metadata`` and broadcasts its bytes as they are.

The index is trusted only for the ``.metadata`` it was made from: its header records
that file's size and CRC32, and a load uses it only when the manifest records the
index (size + CRC32, checked on read) and the same ``.metadata`` size and CRC32.
Anything else (older checkpoints, checkpoints of other writers, a ``.metadata``
rewritten by a tool) is read from ``.metadata`` itself and encoded the same way, so
every load plans from one form. ``.metadata`` stays what PyTorch DCP and
Megatron-Core read; they ignore this file.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CheckpointingException, CorruptCheckpointError
from ..planning.boxes import Box, intersect, sweep_axis
from ..planning.dtypes import dtype_from_name, dtype_name
from ..planning.records import MessageWriter, decode, group_rows
from ..planning.reshard import ChunkRead, band
from ..planning.written import CommitLayout
from . import checkpoint_dir as ckdir
from .checkpoint_index import INDEX_FILE, CheckpointIndex, encode_index
from .checksum import write_recorded
from .filesystem import CheckpointLocation
from .torch_dist_reader import ChunkInfo

logger = logging.getLogger(__name__)

CHUNK_INDEX_FILE = ckdir.CHUNK_INDEX_FILE
_FORMAT = 1
_LEVEL = 1  # zlib: the records repeat their structure; level 1 is fast and takes most of it
_MISSING = (-1, 0, 0)  # a chunk .metadata lists without a storage record


def _dtype(name: str, where: str) -> torch.dtype:
    try:
        return dtype_from_name(name)
    except CheckpointingException:  # (read from a checkpoint: damage, named)
        raise CorruptCheckpointError(f"{where} names an unknown dtype {name!r}") from None


# --------------------------------------------------------------------------- encoding
def _tensor(ints: List[int], kid: int, did: int, size: Sequence[int],
            chunks: List[Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, int, int]]]) -> None:
    """One tensor record: its chunks (offsets, sizes, location) sorted along the axis where they
    overlap least, with the longest extent along it (see ``planning.reshard.ChunkIndex``)."""
    if len(chunks) == 1:  # many small tensors: nothing to sort or sweep (axis -1: no search)
        offsets, sizes, loc = chunks[0]
        ints += (0, kid, did, len(size), *size, 1, -1, 0, *offsets, *sizes, *loc)
        return
    axis = sweep_axis([c[0] for c in chunks], [c[1] for c in chunks]) if len(size) else -1
    if axis >= 0:
        chunks = sorted(chunks, key=lambda c: c[0][axis])
    longest = max((c[1][axis] for c in chunks), default=0) if axis >= 0 else 0
    ints += (0, kid, did, len(size), *size, len(chunks), axis, longest)
    for offsets, sizes, loc in chunks:
        ints += (*offsets, *sizes, *loc)


def _writer(metadata_entry: Optional[Dict[str, int]]) -> MessageWriter:
    w = MessageWriter()
    entry = metadata_entry or {}
    w.add(_FORMAT, int(entry.get("size", -1)), int(entry.get("crc32", -1)))
    return w


def encode_metadata(md: Metadata, w: MessageWriter) -> None:
    """Append the parts of a DCP ``Metadata`` that loading uses (keys, dtypes, shapes, chunks, locations)."""
    storage = md.storage_data or {}
    # locations by (key, offsets): one pass over the storage records instead of building and
    # hashing a MetadataIndex per chunk (a dataclass: tens of microseconds per small tensor)
    located: Dict[Tuple[str, Any], Tuple[int, int, int]] = {}
    for index, info in storage.items():
        located[(index.fqn, None if index.offset is None else tuple(index.offset))] = (
            w.sid(str(info.relative_path)), int(info.offset), int(info.length))
    ints = w.ints
    ints.append(len(md.state_dict_metadata))
    dtype_ids: Dict[Any, int] = {}
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            dt = meta.properties.dtype
            did = dtype_ids.get(dt)
            if did is None:
                did = dtype_ids[dt] = w.sid(dtype_name(dt))
            chunks = [(o := tuple(c.offsets), tuple(c.sizes), located.get((key, o), _MISSING)) for c in meta.chunks]
            _tensor(ints, w.sid(key), did, tuple(meta.size), chunks)
        else:
            ints += (1, w.sid(key), *located.get((key, None), _MISSING))


def index_of_layout(layout: CommitLayout, metadata_entry: Dict[str, int]) -> bytes:
    """The index of a commit (``planning.written.CommitLayout``), built from its arrays: the
    records :func:`encode_metadata` makes of the ``.metadata`` written from that layout, as whole
    arrays per (dimensions, chunks per key) group. Chunks of a multi-chunk key are sorted along
    the axis with the most distinct chunk starts (the lowest on ties): for the tilings a save
    writes (rows, columns, layers, grids) the axis ``sweep_axis`` picks, found without a Python
    loop per key (any axis gives the same answers; this one keeps the search short)."""
    return zlib.compress(_layout_message(layout, metadata_entry).tobytes(), _LEVEL)


def write_index(d: CheckpointLocation, layout: CommitLayout, h: Any, md_entry: Dict[str, int], version: int,
                durable: bool) -> Dict[str, Dict[str, int]]:
    """Write a commit's index (format 6: ``index.bin``, every item's row; formats 4 and 5: the chunk
    records in ``chunk_index.bin``) and return its ``files`` entry."""
    if version >= 6:
        name, data = INDEX_FILE, encode_index(layout, h, md_entry)
    else:
        name, data = CHUNK_INDEX_FILE, index_of_layout(layout, md_entry)
    return {name: write_recorded(d, name, data, durable)}


def compact_of_index(index: "CheckpointIndex") -> CompactMetadata:
    """The chunk index of a format-6 checkpoint, derived from its ``index.bin`` (the same records
    :func:`index_of_layout` stores in ``chunk_index.bin`` for formats 4 and 5) with the index's own
    string table, so no string is looked up again; ``raw`` is the index file's bytes (what a load's
    broadcast sends)."""
    w = _layout_message(index.layout, {"size": index.metadata_size, "crc32": index.metadata_crc32}, index)
    return CompactMetadata(index.raw, w.strings, w.int_values(), index.metadata_size, index.metadata_crc32, index.where)


def _layout_message(layout: CommitLayout, metadata_entry: Dict[str, int],
                    index: Optional["CheckpointIndex"] = None) -> MessageWriter:
    """The records of ``layout``; with ``index`` (the layout decoded from it) in the index's string ids."""
    w = _writer(metadata_entry)
    ws = layout.written
    keys = layout.tensor_keys
    counts = np.diff(layout.key_starts)
    w.add(len(keys) + len(layout.object_items))
    if index is not None:  # the index's strings and ids as they are
        w.strings = ws.strings
        key_ids, dtype_ids, shapes = index.tensor_key_ids, index.tensor_dtype_ids, index.tensor_shapes
        file_sid = np.arange(len(ws.strings), dtype=np.int64)
        object_ids = ws.key[layout.object_items]
    else:
        by_name = {d: w.sid(d) for d in dict.fromkeys(layout.tensor_dtypes)}
        dtype_ids = np.asarray([by_name[d] for d in layout.tensor_dtypes], dtype=np.int64)
        file_sid = np.full(len(ws.strings), -1, dtype=np.int64)
        used = np.unique(ws.file[np.concatenate([layout.chunk_items, layout.object_items])]) if len(ws) else []
        used = np.asarray(used, dtype=np.int64)
        file_sid[used] = w.sids([ws.strings[f] for f in used.tolist()])  # (one call: 131,072 files at 65,536 ranks)
        key_ids, shapes = w.sids(keys), None
        object_ids = w.sids([ws.strings[k] for k in ws.key[layout.object_items].tolist()])
    with_chunks = np.flatnonzero(counts > 0)
    nds = ws.nd[layout.chunk_items[layout.key_starts[with_chunks]]] if len(with_chunks) else np.zeros(0, dtype=np.int64)
    groups = np.stack([nds, counts[with_chunks]], axis=1) if len(with_chunks) else np.zeros((0, 2), dtype=np.int64)
    for (nd, c), members in group_rows(groups):
        w.add_array(_tensor_rows(layout, with_chunks[members], nd, c, key_ids, dtype_ids, file_sid, shapes))
    for k in np.flatnonzero(counts == 0).tolist():  # (a tensor with no chunk: nothing to search)
        _tensor(w.ints, int(key_ids[k]), int(dtype_ids[k]), layout.tensor_shapes[k], [])
    obj = layout.object_items
    if len(obj):
        n = len(obj)
        w.add_array(np.concatenate([
            np.ones((n, 1), dtype=np.int64), np.asarray(object_ids, dtype=np.int64).reshape(n, 1),
            file_sid[ws.file[obj]].reshape(n, 1), ws.start[obj].reshape(n, 1), ws.length[obj].reshape(n, 1),
        ], axis=1))
    return w


def _tensor_rows(layout: CommitLayout, ks: np.ndarray, nd: int, c: int, key_ids: np.ndarray, dtype_ids: np.ndarray,
                 file_sid: np.ndarray, shapes: Optional[Tuple[np.ndarray, np.ndarray]] = None) -> np.ndarray:
    """The records of the tensors ``ks`` (each of ``nd`` dimensions and ``c`` chunks), one row each."""
    ws, m = layout.written, len(ks)
    items = layout.chunk_items[layout.key_starts[ks][:, None] + np.arange(c)[None, :]]  # (m, c)
    offs = ws.grid(items.reshape(-1), nd).reshape(m, c, nd)
    sizes = ws.grid(items.reshape(-1), nd, sizes=True).reshape(m, c, nd)
    if c == 1 or nd == 0:  # nothing to search (many small tensors): axis -1
        axis, longest = np.full(m, -1, dtype=np.int64), np.zeros(m, dtype=np.int64)
    else:
        distinct = 1 + (np.diff(np.sort(offs, axis=1), axis=1) != 0).sum(axis=1)  # (m, nd)
        axis = distinct.argmax(axis=1)
        order = np.argsort(np.take_along_axis(offs, axis[:, None, None], axis=2)[:, :, 0], axis=1, kind="stable")
        items = np.take_along_axis(items, order, axis=1)
        offs = np.take_along_axis(offs, order[:, :, None], axis=1)
        sizes = np.take_along_axis(sizes, order[:, :, None], axis=1)
        longest = np.take_along_axis(sizes, axis[:, None, None], axis=2)[:, :, 0].max(axis=1)
    chunks = np.concatenate([offs, sizes, file_sid[ws.file[items]][:, :, None], ws.start[items][:, :, None],
                             ws.length[items][:, :, None]], axis=2).reshape(m, c * (2 * nd + 3))
    if shapes is None:
        shapes = np.asarray([layout.tensor_shapes[k] for k in ks.tolist()], dtype=np.int64)
    else:  # (the index's shapes, one after another: ``(flat, start of each key's)``)
        flat, starts = shapes
        shapes = flat[starts[ks][:, None] + np.arange(nd)[None, :]]
    return np.concatenate([
        np.zeros((m, 1), dtype=np.int64), key_ids[ks].reshape(m, 1), dtype_ids[ks].reshape(m, 1),
        np.full((m, 1), nd, dtype=np.int64), shapes.reshape(m, nd),
        np.full((m, 1), c, dtype=np.int64), axis.reshape(m, 1), longest.reshape(m, 1),
        chunks,
    ], axis=1)


# --------------------------------------------------------------------------- decoding
def decode_metadata(
    strings: List[str], ints: Sequence[int], p: int, keys: Optional[Set[str]] = None, lazy_chunks: bool = False
) -> Tuple[Metadata, int, Dict[str, Tuple[int, ...]]]:
    """Inverse of :func:`encode_metadata` from position ``p``.

    Returns the metadata, the next position and, per tensor key, ``(position of its
    first chunk, chunks, dims, index axis, longest extent along it)``. Tensors outside ``keys`` (or all with
    ``lazy_chunks``) keep their dtype and shape but get no chunk records (skipped in
    O(1) each); objects outside ``keys`` get no storage record. With ``lazy_chunks`` and
    ``keys`` (a load's plan) the keys outside ``keys`` are only stepped over: the metadata lists
    the requested keys, and every key of the checkpoint is in :func:`checkpoint_keys` (a rank
    decoded every key of the job at each load: ~1.5 us each, 20,000 for 2 ranks of 10,000
    small tensors, growing with the number of ranks).
    """
    positions: Dict[str, Tuple[int, ...]] = {}
    skip = lazy_chunks and keys is not None
    others: List[str] = []  # keys stepped over (skip)
    other_objects: List[str] = []  # (those of them that are objects)
    sd_meta: dict = {}
    storage: dict = {}
    dtypes: Dict[int, torch.dtype] = {}
    # with lazy chunks (a load's plan, never handed out) the keys of one dtype share one
    # TensorProperties: nothing modifies them, and one per key cost ~0.7 us of ~2 per key
    shared_props: Dict[int, TensorProperties] = {}
    count = ints[p]
    p += 1
    for _ in range(count):
        kind, key = ints[p], strings[ints[p + 1]]
        if skip and key not in keys:  # type: ignore[operator]  (a set whenever skip is set)
            others.append(key)
            if kind == 0:
                nd = ints[p + 3]
                p += 7 + nd + ints[p + 4 + nd] * (2 * nd + 3)
            else:
                other_objects.append(key)
                p += 5
            continue
        if kind == 0:
            ds, nd = ints[p + 2], ints[p + 3]
            dt = dtypes.get(ds)
            if dt is None:
                dt = dtypes[ds] = _dtype(strings[ds], "the tensor metadata")
            size = torch.Size(ints[p + 4 : p + 4 + nd])
            nchunks, axis, longest = ints[p + 4 + nd : p + 7 + nd]
            p += 7 + nd
            chunks = []
            positions[key] = (p, nchunks, nd, axis, longest)
            if lazy_chunks or (keys is not None and key not in keys):
                props = shared_props.get(ds) if lazy_chunks else None
                if props is None:
                    props = TensorProperties(dtype=dt)
                    if lazy_chunks:
                        shared_props[ds] = props
                sd_meta[key] = TensorStorageMetadata(props, size, chunks)
                p += nchunks * (2 * nd + 3)
                continue
            for _ in range(nchunks):
                offsets = torch.Size(ints[p : p + nd])
                chunks.append(ChunkStorageMetadata(offsets, torch.Size(ints[p + nd : p + 2 * nd])))
                f, off, length = ints[p + 2 * nd : p + 2 * nd + 3]
                if f >= 0:
                    storage[MetadataIndex(key, offsets)] = _StorageInfo(strings[f], off, length)
                p += 2 * nd + 3
            sd_meta[key] = TensorStorageMetadata(TensorProperties(dtype=dt), size, chunks)
        else:
            f, off, length = ints[p + 2 : p + 5]
            if f >= 0 and (keys is None or key in keys):
                storage[MetadataIndex(key)] = _StorageInfo(strings[f], off, length)
            sd_meta[key] = BytesStorageMetadata()
            p += 5
    fields = dict(state_dict_metadata=sd_meta, planner_data={k: (k,) for k in sd_meta}, storage_data=storage,
                  storage_meta=StorageMeta(), version="1.0.0")
    if not lazy_chunks:  # whole chunk lists: DCP's own class, as ``.metadata`` holds it
        return Metadata(**fields), p, positions
    # (other keys sorted with the listed ones when asked: most loads never ask)
    return IndexedMetadata(**fields, other_keys=others if skip else None, other_objects=other_objects), p, positions


@dataclass
class IndexedMetadata(Metadata):
    """DCP ``Metadata`` decoded from a chunk index, with what the index adds as declared fields.

    ``chunks``: the index's chunk lists of the requested keys, where the DCP lists are left empty
    (:meth:`CompactMetadata.metadata_for`); ``other_keys``: the checkpoint's keys this metadata
    leaves out (decoded for some keys only), which :func:`checkpoint_keys` adds back, and
    ``other_objects``: those of them that are objects. DCP code takes it as the ``Metadata`` it is."""

    chunks: Optional["CompactChunks"] = None
    other_keys: Optional[List[str]] = None
    other_objects: Optional[List[str]] = None


def checkpoint_keys(md: Metadata) -> List[str]:
    """Every key of the checkpoint ``md`` describes, sorted: also those a load's metadata (for
    the requested keys only, :meth:`CompactMetadata.metadata_for`) leaves out."""
    others = md.other_keys if isinstance(md, IndexedMetadata) else None
    return sorted([*md.state_dict_metadata, *others]) if others is not None else sorted(md.state_dict_metadata)


@dataclass
class CompactMetadata:
    """A checkpoint's chunk index: ``raw`` (the compressed bytes, as stored and as broadcast) and
    their decoded strings and integers; ``metadata_size``/``metadata_crc32``: the ``.metadata`` it
    describes (-1 when unknown)."""

    raw: bytes
    strings: List[str]
    ints: Sequence[int]  # (a list, or a memoryview of int64s: compact_of_index)
    metadata_size: int = -1
    metadata_crc32: int = -1
    where: str = CHUNK_INDEX_FILE  # names it in errors
    start: int = 3  # where the encode_metadata section starts

    def metadata_for(self, keys: Optional[Iterable[str]] = None) -> "IndexedMetadata":
        """DCP ``Metadata`` with the dtype and shape of the requested keys (of every key when
        ``keys`` is None; :func:`checkpoint_keys` names them all), storage records of the
        requested objects and **no tensor chunk lists**: those stay integers in a
        :class:`CompactChunks` in its ``chunks`` field (:class:`IndexedMetadata`), materialised per chunk
        only when read."""
        md, _, positions = self._decode(None if keys is None else set(keys), True)
        md.chunks = CompactChunks(self.strings, self.ints, positions, self.identity)
        return md

    @property
    def identity(self) -> int:
        """A number that differs between indexes (the CRC32 and length of the raw bytes): ranks
        compare it before comparing chunk numbers (:meth:`CompactChunks.whole_chunk_at`)."""
        got = self.__dict__.get("_identity")
        if got is None:
            got = self.__dict__["_identity"] = zlib.crc32(self.raw) << 30 | len(self.raw) & 0x3FFFFFFF  # (< 2**62)
        return got

    def full(self) -> Metadata:
        """The whole DCP ``Metadata``, chunk lists included."""
        return self._decode(None, False)[0]

    def metadata_of(self, keys: Iterable[str]) -> Metadata:
        """DCP ``Metadata`` of ``keys`` only, chunk lists and storage records included (what an incremental
        save compares: the items of the keys it saves, not the whole checkpoint's)."""
        return self._decode(set(keys), False)[0]

    def _decode(self, keys: Optional[Set[str]], lazy: bool) -> Tuple[Metadata, int, Dict[str, Tuple[int, ...]]]:
        # the records are walked here, not when the index is read (each load walks them once):
        # an index whose checksum passes but whose records do not add up is damage, named
        try:
            md, end, positions = decode_metadata(self.strings, self.ints, self.start, keys, lazy_chunks=lazy)
            if end != len(self.ints):
                raise ValueError(f"{len(self.ints) - end} integers after the last record")
            return md, end, positions
        except CorruptCheckpointError:
            raise
        except (ValueError, IndexError, TypeError) as e:
            raise CorruptCheckpointError(f"{self.where} is damaged and cannot be decoded: {e!r}") from None


def parse_index(raw: bytes, where: str) -> CompactMetadata:
    """Decode an index (``where`` names it in errors); its records are checked as they are used
    (:meth:`CompactMetadata.metadata_for`)."""
    try:
        strings, ints = decode(zlib.decompress(raw))
        if len(ints) < 4 or ints[0] != _FORMAT:
            raise ValueError(f"unknown index format {ints[0] if ints else None}")
        return CompactMetadata(raw, strings, ints, ints[1], ints[2], where)
    except CorruptCheckpointError:
        raise
    except (zlib.error, ValueError, IndexError, TypeError) as e:
        raise CorruptCheckpointError(f"{where} is damaged and cannot be decoded: {e}") from None


def compact_of_metadata(md: Metadata, metadata_entry: Optional[Dict[str, int]] = None) -> CompactMetadata:
    """The same form built from a ``.metadata`` that has no usable index."""
    w = _writer(metadata_entry)
    encode_metadata(md, w)
    raw = zlib.compress(w.tobytes(), _LEVEL)
    return CompactMetadata(raw, w.strings, w.ints, w.ints[1], w.ints[2], ckdir.DCP_METADATA_FILE)


def usable(manifest: Optional[ckdir.Manifest]) -> bool:
    """Whether the manifest records an index and the ``.metadata`` it must describe (both with CRC32)."""
    files = getattr(manifest, "files", None) or {}
    return "crc32" in files.get(CHUNK_INDEX_FILE, {}) and "crc32" in files.get(ckdir.DCP_METADATA_FILE, {})


def matches(index: Any, metadata_entry: Dict[str, Any]) -> bool:
    """Whether ``index`` was made from the ``.metadata`` the manifest records."""
    return (index.metadata_size, index.metadata_crc32) == (int(metadata_entry.get("size", -2)),
                                                           int(metadata_entry.get("crc32", -2)))


def read_chunk_index(location: CheckpointLocation, manifest: Optional[ckdir.Manifest], metadata: Callable[[], Metadata]) -> CompactMetadata:
    """The chunk index of the checkpoint at ``location``:
    ``chunk_index.bin`` checked against ``manifest`` and matched to the ``.metadata`` it
    records, else built from ``metadata()`` (``.metadata``, read and checked by the caller).

    A recorded index that is missing, damaged or made from another ``.metadata`` is not used
    (with a warning naming the file): ``.metadata`` holds the same and is checked on its own.
    """
    index = manifest.index() if manifest is not None else None
    if index is not None:  # format 6: derived from index.bin, which holds every item's row
        return compact_of_index(index)
    md_entry = (manifest.files.get(ckdir.DCP_METADATA_FILE) if manifest is not None else None) or {}
    if usable(manifest):
        where = location.file(CHUNK_INDEX_FILE)
        problem = ""
        try:
            index = parse_index(ckdir.read_verified_file(location, CHUNK_INDEX_FILE, manifest, "chunk index"), where)
            if matches(index, md_entry):
                return index
            problem = f"it describes another {ckdir.DCP_METADATA_FILE} (rewritten after the save?)"
        except FileNotFoundError:
            problem = "it is missing"
        except CorruptCheckpointError as e:
            problem = str(e)
        logger.warning("%s is not used (%s): reading %s instead", where, problem, ckdir.DCP_METADATA_FILE)
        try:
            md = metadata()
        except CheckpointingException as e:  # neither: say so about both, as the same error type
            try:
                both = type(e)(f"{e} (and {where} could not be used either: {problem})")
            except TypeError:  # (a type that takes other arguments: its own message stands)
                raise e from None
            raise both from None
        return compact_of_metadata(md, md_entry)
    return compact_of_metadata(metadata(), md_entry)


# --------------------------------------------------------------------------- lookups
class CompactChunks:
    """The chunk records of an index, kept as integers.

    Each key's chunks are sorted along its index axis (see :func:`_tensor`), so a request
    is answered by a binary search in the integer list: O(log n + k), with nothing built
    per key or per chunk beforehand; the storage layer's chunk record is created only for a
    chunk that is read.
    """

    def __init__(self, strings: List[str], ints: Sequence[int], positions: Dict[str, Tuple[int, ...]], identity: int = 0):
        self._strings, self._ints, self._positions = strings, ints, positions
        self.identity = identity  # of the index (CompactMetadata.identity)
        self._infos: Dict[Tuple[str, int], Any] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._positions

    def chunk_reads(self, key: str, request: Box, directory: str) -> List[ChunkRead]:
        """The reads filling ``request`` from the saved chunks of ``key`` (as
        ``planning.reshard.ChunkIndex.reads``), ``source`` = the storage layer's chunk record. A
        request that is one whole saved chunk (a same-layout load) gets ``request`` itself as
        chunk and overlap, found by comparing integers: no box is built for it. Keys of a few
        chunks are scanned rather than searched."""
        p, n, nd, axis, longest = self._positions[key]
        ints, step = self._ints, 2 * nd + 3
        ro, rsz = request.offsets, request.sizes
        cands = range(n) if n <= 8 else band(lambda i: ints[p + i * step + axis], n, axis, longest, request)
        out = []
        for i in cands:
            base = p + i * step
            offsets, sizes = tuple(ints[base : base + nd]), tuple(ints[base + nd : base + 2 * nd])
            if offsets == ro and sizes == rsz:  # saved chunks are disjoint: this one is the whole answer
                return [ChunkRead(request, request, self.chunk_info(key, i, request, directory))]
            for o, s, a, b in zip(offsets, sizes, ro, rsz):
                if not (o < a + b and a < o + s):
                    break
            else:
                box = Box(offsets, sizes)
                common = intersect(request, box)
                if common is not None:  # (an empty request inside a chunk passes the test above: nothing to read)
                    out.append(ChunkRead(box, common, self.chunk_info(key, i, box, directory)))
        return out

    def whole_chunk(self, key: str, request: Box, directory: str) -> Any:
        """The record of the saved chunk of ``key`` that is exactly ``request`` (a same-layout
        load's request), or None (no such chunk, or not a key of this index): what
        :meth:`chunk_reads` answers for it, without its list and read record."""
        found = self.whole_chunk_at(key, request, directory)
        return None if found is None else found[0]

    def whole_chunk_at(self, key: str, request: Box, directory: str) -> Optional[Tuple[Any, int, int, int]]:
        """:meth:`whole_chunk` with the chunk's place in the index: ``(record, key position,
        chunks of the key, chunk number)``, numbers every rank given the same index agrees on
        (a load's request check counts requests by them: ``planning.request_check``)."""
        pos = self._positions.get(key)
        if pos is None:
            return None
        p, n, nd, axis, longest = pos
        ro, rsz = request.offsets, request.sizes
        if len(ro) != nd:
            return None
        ints, step = self._ints, 2 * nd + 3
        cands = range(n) if n <= 8 else band(lambda i: ints[p + i * step + axis], n, axis, longest, request)
        for i in cands:
            base = p + i * step
            if tuple(ints[base : base + nd]) == ro and tuple(ints[base + nd : base + 2 * nd]) == rsz:
                return self.chunk_info(key, i, request, directory), p, n, i
        return None

    def chunk_info(self, key: str, i: int, box: Box, directory: str) -> Any:
        """The storage layer's record of chunk ``i`` of ``key`` (built once)."""
        info = self._infos.get((key, i))
        if info is None:
            p, _, nd = self._positions[key][:3]
            base = p + i * (2 * nd + 3) + 2 * nd
            f, off, length = self._ints[base : base + 3]
            if f < 0:
                raise CorruptCheckpointError(
                    f"{directory}/.metadata lists chunk {box.offsets} of {key!r} but not where it is stored"
                )
            info = self._infos[(key, i)] = ChunkInfo(box, _StorageInfo(self._strings[f], off, length))
        return info


def compact_chunks_of(md: Metadata) -> Optional[CompactChunks]:
    """The :class:`CompactChunks` of a metadata built by :meth:`CompactMetadata.metadata_for`, if any."""
    return md.chunks if isinstance(md, IndexedMetadata) else None


def differences(index: CompactMetadata, md: Metadata, limit: int = 5) -> List[str]:
    """Where ``index`` and ``md`` (the ``.metadata`` it was made from) disagree: keys, kinds,
    dtypes, shapes, chunk sets and storage records (empty when they describe the same; at most
    ``limit`` entries). ``verify`` reports them: a load plans from the index, DCP and
    Megatron-Core from ``.metadata``."""
    got = index.full()
    out: List[str] = []
    mine, theirs = got.state_dict_metadata, md.state_dict_metadata
    for key in sorted(mine.keys() ^ theirs.keys())[:limit]:
        out.append(f"{key!r} is only in {'the index' if key in mine else ckdir.DCP_METADATA_FILE}")
    for key in sorted(mine.keys() & theirs.keys()):
        a, b = mine[key], theirs[key]
        if len(out) >= limit:
            break
        if type(a) is not type(b):
            out.append(f"{key!r}: a {type(a).__name__} in the index, a {type(b).__name__} in {ckdir.DCP_METADATA_FILE}")
        elif isinstance(a, TensorStorageMetadata) and (
                a.properties.dtype != b.properties.dtype or tuple(a.size) != tuple(b.size)
                or sorted((tuple(c.offsets), tuple(c.sizes)) for c in a.chunks)
                != sorted((tuple(c.offsets), tuple(c.sizes)) for c in b.chunks)):
            out.append(f"{key!r}: dtype, shape or chunks differ")
    if len(out) < limit:
        stored = md.storage_data or {}
        for index_key in sorted(got.storage_data.keys() ^ stored.keys(), key=str)[: limit - len(out)]:
            out.append(f"the storage record of {index_key.fqn!r} {tuple(index_key.offset or ())} is only in "
                       f"{'the index' if index_key in got.storage_data else ckdir.DCP_METADATA_FILE}")
        for index_key, info in got.storage_data.items():
            if len(out) >= limit:
                break
            other = stored.get(index_key)
            if other is not None and (other.relative_path, other.offset, other.length) != (
                    info.relative_path, info.offset, info.length):
                out.append(f"{index_key.fqn!r} {tuple(index_key.offset or ())} is stored elsewhere per the index")
    return out


def index_problems(location: CheckpointLocation, manifest: Optional[ckdir.Manifest], md: Metadata, data: Optional[bytes] = None) -> List[str]:
    """What ``verify`` reports about a recorded index next to its (readable) ``.metadata``: made
    from another ``.metadata``, or describing other chunks. A damaged or missing file is reported
    with every other recorded file, not here. ``data``: the index's bytes, checked already."""
    index = manifest.index() if manifest is not None else None  # (format 6: read and checked already)
    if index is not None:
        if not matches(index, manifest.files[ckdir.DCP_METADATA_FILE]):
            return [f"{index.where} was not made with {ckdir.DCP_METADATA_FILE} as it is now (rewritten after the "
                    f"save?): PyTorch DCP and Megatron-Core read {ckdir.DCP_METADATA_FILE}, loads read the index"]
        try:
            found = differences(compact_of_index(index), md)
        except CorruptCheckpointError as e:
            return [str(e)]
        return [f"{index.where} does not describe {ckdir.DCP_METADATA_FILE} as saved: {d}" for d in found]
    if not usable(manifest):
        return []
    where = location.file(CHUNK_INDEX_FILE)
    try:
        if data is None:
            data = ckdir.read_verified_file(location, CHUNK_INDEX_FILE, manifest, "chunk index")
        index = parse_index(data, where)
    except (OSError, CheckpointingException):  # reported with every other recorded file
        return []
    if not matches(index, manifest.files[ckdir.DCP_METADATA_FILE]):
        return [f"{where} describes another {ckdir.DCP_METADATA_FILE} (loads read {ckdir.DCP_METADATA_FILE} instead)"]
    try:
        found = differences(index, md)
    except CorruptCheckpointError as e:
        return [str(e)]
    return [f"{where} does not describe {ckdir.DCP_METADATA_FILE} as saved: {d}" for d in found]
