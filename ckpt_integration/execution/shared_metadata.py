"""A load reads the checkpoint's metadata once and shares it: one reader, one broadcast.

The coordinator reads ``metadata.json``, ``.metadata`` and ``manifest.json`` (with
their checks: commit marker, checksums, safe unpickling) and broadcasts them as one
compact message (a string table and integers, see :mod:`..planning.records`): no
pickle crosses ranks, and the filesystem sees one reader instead of one per rank.
Every rank rebuilds the same :class:`SharedMetadata`. A failure on the coordinator
arrives on every rank as the same exception type and message, as if each had read
the files itself.

For zarr checkpoints only ``metadata.json`` and the manifest travel this way; each
rank's reader still opens the zarr index itself (storage layer).

:func:`open_shared` gives every rank an :class:`~..storage.opened.OpenedCheckpoint` of the
commit the coordinator read, which the load passes down with the :class:`SharedMetadata`.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

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

from .. import errors as errors_mod
from ..errors import CorruptCheckpointError
from ..planning.boxes import Box, intersect, sweep_axis
from ..planning.records import MessageWriter, decode
from ..planning.reshard import ChunkRead, band, overlapping_reads
from ..storage import checkpoint_dir as ckdir
from ..storage.block_records import BlockRecordTable
from ..storage.opened import OpenedCheckpoint
from ..storage.torch_dist_reader import ChunkInfo
from . import dist
from .preprocess import dtype_from_name, dtype_name


@dataclass
class SharedMetadata:
    """A checkpoint's metadata as a load uses it.

    ``metadata`` is the whole DCP ``Metadata`` (None for zarr: each rank's reader
    reads the zarr index). After a broadcast it is decoded on demand by
    :meth:`metadata_for`, which builds chunk records only for the keys a rank
    requests (every key is listed, with its dtype and shape), so a rank's work is
    O(keys + its chunks) rather than O(all chunks).
    """

    backend: str
    metadata: Optional[Metadata]
    manifest: Optional[ckdir.Manifest]
    _encoded: Optional[Tuple[List[str], List[int], int]] = None
    config: Optional[ckdir.CheckpointingConfig] = None  # metadata.json

    def metadata_for(self, keys: Optional[Iterable[str]] = None) -> Optional[Metadata]:
        """The DCP ``Metadata`` to load ``keys`` (all keys when None).

        After a broadcast: every key with its dtype and shape, storage records of the
        requested objects, and **no tensor chunk lists**: those stay integers in a
        :class:`CompactChunks` attached to the returned metadata (see
        :func:`compact_chunks_of`), from which each requested region's chunks are
        found through a per-key index and materialised only when read.
        """
        if self._encoded is None:
            return self.metadata
        strings, ints, p = self._encoded
        md, _, positions = decode_metadata(strings, ints, p, None if keys is None else set(keys), lazy_chunks=True)
        setattr(md, _ATTR, CompactChunks(strings, ints, positions))
        return md


    def full_metadata(self) -> Optional[Metadata]:
        """The whole DCP ``Metadata``, chunk lists included (decoded once from the broadcast)."""
        if self.metadata is None and self._encoded is not None:
            strings, ints, p = self._encoded
            self.metadata = decode_metadata(strings, ints, p, None, lazy_chunks=False)[0]
        return self.metadata


class CompactChunks:
    """The chunk records of a broadcast ``.metadata``, kept as the integers that arrived.

    The coordinator sorted each key's chunks along its index axis (see
    :func:`encode_metadata`), so a request is answered by a binary search in the
    integer list: O(log n + k), with nothing built per key or per chunk beforehand;
    the storage layer's chunk record is created only for a chunk that is read.
    """

    def __init__(self, strings: List[str], ints: List[int], positions: Dict[str, Tuple[int, ...]]):
        self._strings, self._ints, self._positions = strings, ints, positions
        self._infos: Dict[Tuple[str, int], Any] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._positions

    def reads(self, key: str, request: Box) -> List[ChunkRead]:
        """:meth:`ChunkIndex.reads` over the integers (``source`` = the chunk's position)."""
        p, n, nd, axis, longest = self._positions[key]
        ints, step = self._ints, 2 * nd + 3
        if n == 1:  # one chunk (many small tensors): no search
            offsets, sizes = ints[p : p + nd], ints[p + nd : p + 2 * nd]
            ro, rsz = request.offsets, request.sizes
            if not all(o < a + b and a < o + s for o, s, a, b in zip(offsets, sizes, ro, rsz)):
                return []
            box = Box(tuple(offsets), tuple(sizes))
            return [ChunkRead(box, request if box == request else intersect(request, box), 0)]

        def chunk(i: int) -> Tuple[List[int], List[int], int]:
            base = p + i * step
            return ints[base : base + nd], ints[base + nd : base + 2 * nd], i

        return overlapping_reads(request, band(lambda i: ints[p + i * step + axis], n, axis, longest, request), chunk)

    def chunk_info(self, key: str, i: int, box: Box, checksums: Any, directory: str) -> Any:
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
            where = _StorageInfo(self._strings[f], off, length)
            crc = checksums.get((where.relative_path, where.offset)) if checksums else None
            info = self._infos[(key, i)] = ChunkInfo(box, where, crc)
        return info


_ATTR = "_ckpt_compact_chunks"  # set on the Metadata objects built by SharedMetadata.metadata_for


def compact_chunks_of(md: Any) -> Optional[CompactChunks]:
    """The :class:`CompactChunks` of a metadata built by :meth:`SharedMetadata.metadata_for`, if any."""
    return getattr(md, _ATTR, None)


def encode_metadata(md: Metadata, w: MessageWriter) -> None:
    """Append the parts of a DCP ``Metadata`` that loading uses (keys, dtypes, shapes, chunks, locations)."""
    storage = md.storage_data or {}
    # locations by (key, offsets): one pass over the storage records instead of building and
    # hashing a MetadataIndex per chunk (a dataclass: tens of microseconds per small tensor)
    located: Dict[Tuple[str, Any], Tuple[int, int, int]] = {}
    for index, info in storage.items():
        located[(index.fqn, None if index.offset is None else tuple(index.offset))] = (
            w.sid(str(info.relative_path)), int(info.offset), int(info.length))
    missing = (-1, 0, 0)
    ints = w.ints
    ints.append(len(md.state_dict_metadata))
    dtype_ids: Dict[Any, int] = {}
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            size = tuple(meta.size)
            dt = meta.properties.dtype
            did = dtype_ids.get(dt)
            if did is None:
                did = dtype_ids[dt] = w.sid(dtype_name(dt))
            kid = w.sid(key)
            if len(meta.chunks) == 1:  # many small tensors: nothing to sort or sweep (axis -1: no search)
                c = meta.chunks[0]
                offsets = tuple(c.offsets)
                ints += (0, kid, did, len(size), *size, 1, -1, 0, *offsets, *c.sizes)
                ints += located.get((key, offsets), missing)
                continue
            # the per-key index, built once here: chunks sorted by their start along the axis
            # where they overlap least, and the longest extent along it (see ChunkIndex)
            chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]
            axis = sweep_axis([o for o, _ in chunks], [s for _, s in chunks]) if size else -1
            if axis >= 0:
                chunks.sort(key=lambda c: c[0][axis])
            longest = max((s[axis] for _, s in chunks), default=0) if axis >= 0 else 0
            ints += (0, kid, did, len(size), *size, len(chunks), axis, longest)
            for offsets, sizes in chunks:
                ints += (*offsets, *sizes)
                ints += located.get((key, offsets), missing)
        else:
            ints += (1, w.sid(key))
            ints += located.get((key, None), missing)


def decode_metadata(
    strings: List[str], ints: List[int], p: int, keys: Optional[Set[str]] = None, lazy_chunks: bool = False
) -> Tuple[Metadata, int, Dict[str, Tuple[int, ...]]]:
    """Inverse of :func:`encode_metadata` from position ``p``.

    Returns the metadata, the next position and, per tensor key, ``(position of its
    first chunk, chunks, dims, index axis, longest extent along it)``. Tensors outside ``keys`` (or all with
    ``lazy_chunks``) keep their dtype and shape but get no chunk records (skipped in
    O(1) each); objects outside ``keys`` get no storage record.
    """
    positions: Dict[str, Tuple[int, ...]] = {}
    sd_meta: dict = {}
    storage: dict = {}
    count = ints[p]
    p += 1
    for _ in range(count):
        kind, key = ints[p], strings[ints[p + 1]]
        if kind == 0:
            ds, nd = ints[p + 2], ints[p + 3]
            size = torch.Size(ints[p + 4 : p + 4 + nd])
            nchunks, axis, longest = ints[p + 4 + nd : p + 7 + nd]
            p += 7 + nd
            chunks = []
            positions[key] = (p, nchunks, nd, axis, longest)
            if lazy_chunks or (keys is not None and key not in keys):
                sd_meta[key] = TensorStorageMetadata(TensorProperties(dtype=dtype_from_name(strings[ds])), size, chunks)
                p += nchunks * (2 * nd + 3)
                continue
            for _ in range(nchunks):
                offsets = torch.Size(ints[p : p + nd])
                chunks.append(ChunkStorageMetadata(offsets, torch.Size(ints[p + nd : p + 2 * nd])))
                f, off, length = ints[p + 2 * nd : p + 2 * nd + 3]
                if f >= 0:
                    storage[MetadataIndex(key, offsets)] = _StorageInfo(strings[f], off, length)
                p += 2 * nd + 3
            sd_meta[key] = TensorStorageMetadata(TensorProperties(dtype=dtype_from_name(strings[ds])), size, chunks)
        else:
            f, off, length = ints[p + 2 : p + 5]
            if f >= 0 and (keys is None or key in keys):
                storage[MetadataIndex(key)] = _StorageInfo(strings[f], off, length)
            sd_meta[key] = BytesStorageMetadata()
            p += 5
    md = Metadata(
        state_dict_metadata=sd_meta, planner_data={k: (k,) for k in sd_meta}, storage_data=storage,
        storage_meta=StorageMeta(), version="1.0.0",
    )
    return md, p, positions


# The broadcast is compressed (zlib level 1): the manifest travels as its JSON text, mostly the
# item digests as decimal numbers and the block digests in base64, and the chunk records repeat
# their structure; at 16,384 simulated ZeRO-1 ranks (CRC32 digests, manifest format 2) this took
# the message from 11.6 to 2.75 MiB for ~0.1 s on the
# coordinator and a few tens of ms per rank (docs/benchmarks.md#scale).
_LEVEL = 1


def encode_shared(shared: SharedMetadata) -> bytes:
    return zlib.compress(_encode_shared(shared), _LEVEL)


def _encode_shared(shared: SharedMetadata) -> bytes:
    w = MessageWriter()
    w.sid("")  # index 0: no error
    config = json.dumps(asdict(shared.config)) if shared.config is not None else ""
    w.add(0, w.sid(shared.backend), w.sid(ckdir.manifest_text(shared.manifest) if shared.manifest else ""), w.sid(config))
    if shared.metadata is None:
        w.add(0)
    else:
        w.add(1)
        encode_metadata(shared.metadata, w)
    return w.tobytes()


def encode_failure(e: BaseException) -> bytes:
    w = MessageWriter()
    w.add(1, w.sid(type(e).__name__), w.sid(str(e)))
    return zlib.compress(w.tobytes(), _LEVEL)


def decode_shared(buf: bytes) -> SharedMetadata:
    strings, ints = decode(zlib.decompress(buf))
    if ints[0]:
        raise _rebuild_failure(strings[ints[1]], strings[ints[2]])
    backend, manifest_json, config_json = strings[ints[1]], strings[ints[2]], strings[ints[3]]
    manifest = ckdir.Manifest(**json.loads(manifest_json)) if manifest_json else None
    config = ckdir.CheckpointingConfig(**json.loads(config_json)) if config_json else None
    if manifest is not None and manifest.blocks:
        # the coordinator read this text and checked every block record's form (read_manifest):
        # the table here decodes and indexes entries only as they are used (Manifest.block_records
        # returns the table cached for its current ``blocks``)
        manifest.__dict__["_block_records"] = (manifest.blocks, BlockRecordTable(manifest.blocks, manifest.hash, checked=True))
    return SharedMetadata(backend, None, manifest, _encoded_metadata(strings, ints), config=config)


def _encoded_metadata(strings: List[str], ints: List[int]) -> Optional[Tuple[List[str], List[int], int]]:
    """Where the message's ``.metadata`` starts (see :func:`_encode_shared`), or None without one."""
    return (strings, ints, 5) if ints[4] else None


def _rebuild_failure(name: str, message: str) -> BaseException:
    """The coordinator's exception as the same type here (checkpointing errors), or a wrapper naming it."""
    cls = getattr(errors_mod, name, None)
    if isinstance(cls, type) and issubclass(cls, errors_mod.CheckpointingException):
        return cls(message)
    return errors_mod.DistributedCheckpointingError(f"rank 0 could not read the checkpoint metadata: {name}: {message}")


def read_local(checkpoint_dir: Any, trusted: bool = False) -> SharedMetadata:
    """What the coordinator reads (also the whole job's metadata in a single process)."""
    ck = checkpoint_dir if isinstance(checkpoint_dir, OpenedCheckpoint) else OpenedCheckpoint(checkpoint_dir, trusted)
    return shared_of(ck)


def shared_of(ck: OpenedCheckpoint) -> SharedMetadata:
    """What an opened checkpoint read, as a load uses it."""
    return SharedMetadata(ck.backend, ck.metadata, ck.manifest, config=ck.config)


def open_shared(checkpoint_dir: Any, group: Any = None, trusted: bool = False) -> Tuple[OpenedCheckpoint, SharedMetadata]:
    """Collective: open ``checkpoint_dir`` on the coordinator (``metadata.json``, manifest,
    ``.metadata``: read and checked once for the job) and give every rank an opened checkpoint of
    the same commit, built from one broadcast without touching storage. A failure on the
    coordinator is raised on every rank."""
    if not dist.is_distributed() or dist.get_world_size(group) == 1:
        ck = OpenedCheckpoint(checkpoint_dir, trusted)
        ck.shared = shared_of(ck)
        return ck, ck.shared
    coord = dist.coordinator_rank(group)
    payload: Optional[bytes] = None
    local: Optional[BaseException] = None
    ck: Optional[OpenedCheckpoint] = None
    raw = b""
    if dist.get_rank(group) == 0:
        try:
            ck = OpenedCheckpoint(checkpoint_dir, trusted)
            raw = _encode_shared(shared_of(ck))
            payload = zlib.compress(raw, _LEVEL)
        except Exception as e:  # every rank raises it, below
            payload, local = encode_failure(e), e
    payload = dist.broadcast_bytes(payload, src=coord, group=group)
    if local is not None:
        raise local
    if ck is not None:
        # the coordinator too plans from the broadcast form: chunk records of the keys it requests
        # only (from the full .metadata its reader would build a record of every chunk of the
        # job); the manifest and .metadata objects it read stay as they are
        ck.shared = SharedMetadata(ck.backend, ck.metadata, ck.manifest, _encoded_metadata(*decode(raw)), config=ck.config)
        return ck, ck.shared
    shared = decode_shared(payload)
    ck = OpenedCheckpoint(checkpoint_dir, trusted, config=shared.config, manifest=shared.manifest, shared=shared)
    return ck, shared
