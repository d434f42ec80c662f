"""The ``torch_dist`` backend: PyTorch DCP's on-disk format.

Layout of a checkpoint directory (shared with PyTorch DCP and Megatron-Core)::

    __<rank>_<i>.distcp   data files: each item is a torch.save archive (tensor chunk)
                          or raw bytes (a ShardedObject, torch.save'd as [obj])
    .metadata             pickled torch.distributed.checkpoint.metadata.Metadata
    common.pt             common state (rank 0)            - see checkpoint_dir.py
    manifest.json         our checksums and save info      - see checkpoint_dir.py
    metadata.json         commit marker + backend/version  - see checkpoint_dir.py

Writes use one file per writer thread; every tensor item's data is checksummed in
blocks while it is written (:class:`~.tensor_record.BlockDigestWriter`), recorded in the
manifest. Reads check every byte they read against those blocks (or, for checkpoints
saved before block checksums, against the whole-item CRC32) and read only the blocks a
request touches (see :mod:`.region_read`). Every name in ``.metadata`` is checked to be a
plain file name inside the checkpoint before it is opened (see ``filesystem.checked_path``),
and declared shapes are checked against what the chunks can hold before anything is
allocated for them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union

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

from ..errors import CorruptCheckpointError, MismatchError, SaveConflictError, UnsafeCheckpointError
from ..planning.save_plan import split_into_buckets
from ..planning.written import WrittenTable
from . import checkpoint_dir as ckdir
from .checksum import DEFAULT_BLOCK_SIZE, BlockHash, save_block_hash, write_recorded
from .filesystem import CheckpointLocation, join, name_problem, writing
from .fs import tensor_buffer
from .incremental import BaseFiles, plan_reuse, take_file
from .region_read import run_parallel  # noqa: F401 (the writers' and loads' thread pool, re-exported)
from .safe_pickle import load_dcp_metadata
from .tensor_record import TEMPLATE_MAX_BYTES, BlockDigestWriter, DigestWriter, SmallItemWriter, archive_template, save_tensor

logger = logging.getLogger(__name__)

DCP_METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"
# block size of the data checksums of new saves (recorded per item, so readers need not know it)
BLOCK_SIZE = DEFAULT_BLOCK_SIZE
# Tensor items of at least ITEM_ALIGN_FROM bytes of data start at a multiple of ITEM_ALIGN bytes
# of their file (zero bytes before them, in no item), so that their data, which the archive places
# at a multiple of 64 bytes from the item's start, is 64-byte aligned in the file as the
# destination tensors are in memory: a copy from the page cache into a tensor at another offset
# modulo 64 ran ~16% slower here (5.6 against 6.6 GB/s on tmpfs). Smaller items stay adjacent:
# they are read in runs of adjacent items (see small_reads), which a gap would end.
ITEM_ALIGN = 64
ITEM_ALIGN_FROM = 1 << 20


# --------------------------------------------------------------------------- writing
@dataclass
class WriteRequest:
    """One item to store: a tensor chunk (``offsets`` set) or object bytes."""

    storage_key: str
    offsets: Optional[Tuple[int, ...]]
    data: Union[torch.Tensor, bytes]
    stable: bool = False  # expected unchanged at the next save (a frozen parameter): files of its own

    @property
    def nbytes(self) -> int:
        if isinstance(self.data, torch.Tensor):
            return self.data.numel() * self.data.element_size()
        return len(self.data)


@dataclass(frozen=True)
class WrittenItem:
    storage_key: str
    offsets: Optional[Tuple[int, ...]]
    relative_path: str
    offset: int
    length: int
    checksum: int  # the item digest (torch_dist: of the manifest's block_hash; zarr: CRC32)
    # tensor items: (data_offset, data_length, block_size, block digests), see BlockDigestWriter
    blocks: Optional[Tuple[int, int, int, List[int]]] = None

    @property
    def crc32(self) -> int:
        """``checksum`` under the name the zarr backend reads (its items record CRC32s)."""
        return self.checksum


_crc_lock = threading.Lock()
_crc_users = 0
_crc_local = threading.local()


def _setting_is_per_thread() -> bool:
    """Whether torch keeps ``serialization.config`` overrides per thread (a ``ContextVar``, as
    torch 2.13 does): then each writer thread must switch the archive members' CRC32s off itself."""
    cached = getattr(_setting_is_per_thread, "value", None)
    if cached is None:
        from torch.utils.serialization import config

        before = config.save.compute_crc32
        seen = []

        def flip() -> None:
            config.save.compute_crc32 = not before
            seen.append(config.save.compute_crc32)
            config.save.compute_crc32 = before

        t = threading.Thread(target=flip)
        t.start()
        t.join()
        cached = _setting_is_per_thread.value = config.save.compute_crc32 == before and seen == [not before]
    return cached


@contextlib.contextmanager
def _archive_member_crc_disabled():
    """torch.save CRCs every archive member single-threaded; we checksum ourselves.

    Entered by every thread that writes archives: where torch keeps the setting per thread, it
    is switched off and restored in that thread (nesting allowed); where it is process-wide, a
    count of the writers switches it off for the first and back on after the last.
    """
    global _crc_users
    try:
        from torch.utils.serialization import config
    except ImportError:  # older torch: nothing to switch off
        yield
        return
    if _setting_is_per_thread():
        depth = getattr(_crc_local, "depth", 0)
        if depth == 0:
            _crc_local.saved = config.save.compute_crc32
            config.save.compute_crc32 = False
        _crc_local.depth = depth + 1
        try:
            yield
        finally:
            _crc_local.depth -= 1
            if _crc_local.depth == 0:
                config.save.compute_crc32 = _crc_local.saved
        return
    with _crc_lock:
        if _crc_users == 0:
            _archive_member_crc_disabled.saved = config.save.compute_crc32
            config.save.compute_crc32 = False
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                config.save.compute_crc32 = _archive_member_crc_disabled.saved


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning exactly its bytes (torch.save of a view would save the whole storage)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if (
        not t.is_contiguous()
        or t.storage_offset() != 0
        or t.untyped_storage().nbytes() != t.numel() * t.element_size()
    ):
        t = t.contiguous().clone() if t.is_contiguous() else t.contiguous()
    return t


# A device tensor of at least STREAM_FROM bytes is written through two pinned host buffers of
# DEVICE_CHUNK bytes, each chunk's copy from the device running while the chunk before it is
# checksummed and written. Its whole host copy (``t.cpu()``) took fresh pages every save and did
# one step after the other: 0.88x DCP's save from an H200 to tmpfs (docs/benchmarks.md, "GPU").
STREAM_FROM = 1 << 20
DEVICE_CHUNK = 16 << 20
STREAM_DEVICES = ("cuda",)  # (tests add "cpu" to run this path with host tensors)


def _streamed(t: torch.Tensor) -> Optional[Tuple[bytes, bytes]]:
    """The archive template to stream ``t``'s bytes into, for a large plain CUDA tensor (a parameter
    too: its detached data is one); else None."""
    if t.device.type not in STREAM_DEVICES or t.nbytes < STREAM_FROM or not t.is_contiguous():
        return None
    d = t.detach()
    return archive_template(d) if type(d) is torch.Tensor else None


def host_chunks(t: torch.Tensor, chunk: Optional[int] = None) -> Iterator[memoryview]:
    """``t``'s bytes (a contiguous CUDA tensor) in order, as views of two pinned host buffers taken
    in turn; a view is valid until the next one is asked for."""
    src = t.detach().reshape(-1).view(torch.uint8)
    n = src.numel()
    chunk = min(chunk or DEVICE_CHUNK, n)
    dev = t.device  # (named in every CUDA call: a writer thread's own current device is cuda:0)
    with torch.cuda.device(dev):
        # whatever produced the tensor, on any stream, has finished (as t.cpu() on this thread's
        # default stream would have waited); the copies then run on a stream of their own
        torch.cuda.synchronize(dev)
        stream = torch.cuda.Stream(dev)
        bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]  # (torch caches them)
    done = [torch.cuda.Event(), torch.cuda.Event()]

    def fetch(k: int, i: int) -> None:
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            bufs[k][: min(chunk, n - i)].copy_(src[i : i + chunk], non_blocking=True)
            done[k].record(stream)

    fetch(0, 0)
    for j, i in enumerate(range(0, n, chunk)):
        k = j % 2
        if i + chunk < n:
            fetch(1 - k, i + chunk)  # the other buffer's chunk was written at the last step
        done[k].synchronize()
        yield tensor_buffer(bufs[k])[: min(chunk, n - i)]


def data_file_name(rank: int, index: int, prefix: str = "") -> str:
    """``__<rank>_<index>.distcp`` as PyTorch DCP and Megatron-Core name data files; with a separation
    hint, ``<hint>__<rank>_<index>.distcp`` as Megatron-Core names the files of the hinted keys."""
    return f"{prefix}__{rank}_{index}{DATA_SUFFIX}"


# with at least this many small tensors among a rank's requests, they go to a bucket (thread, file)
# of their own: their per-item work is Python holding the GIL, and spread over several writer
# threads it only contends (10,000 tensors of 4 KiB in one process: 30 us each with one thread,
# 34-36 with two, 52-55 with four); the large requests keep every thread for their bytes
MANY_SMALL = 64


def _buckets(requests: Sequence[WriteRequest], picked: Sequence[int], threads: int) -> List[List[int]]:
    """The requests ``picked`` in buckets of similar bytes, one per thread; many small tensors in
    one more bucket by themselves (see ``MANY_SMALL``)."""
    if threads <= 1:  # (one bucket: no sizes to weigh, tens of thousands of requests for some models)
        return [list(picked)] if len(picked) else []
    limit = TEMPLATE_MAX_BYTES
    small = [i for i in picked if isinstance(requests[i].data, torch.Tensor) and requests[i].nbytes <= limit]
    if len(small) < MANY_SMALL:
        small = []
    taken = set(small)
    rest = [i for i in picked if i not in taken]
    out = [[rest[j] for j in b] for b in split_into_buckets([requests[i].nbytes for i in rest], threads)]
    return out + ([small] if small else [])


def _separate(requests: Sequence[WriteRequest], hint: Optional[str], thread_count: int,
              picked: Optional[Sequence[int]] = None, stable: Set[int] = frozenset()) -> List[Tuple[str, List[int]]]:
    """``[(file name prefix, request indices)]`` buckets of the requests ``picked`` (default: all): the
    requests whose keys start with ``hint`` in files of their own (as Megatron-Core splits them), and
    the ``stable`` requests (expected unchanged at the next save: :mod:`.incremental`) in files of
    their own, each class with its share of the threads; with neither, ``thread_count`` buckets (see
    :func:`_buckets`)."""
    if hint:
        problem = name_problem(data_file_name(0, 0, hint))
        if problem or "/" in hint or "\\" in hint:
            raise MismatchError(f"separation_hint {hint!r} cannot begin a data file name: {problem or 'a path separator'}")
    classes: Dict[Tuple[bool, bool], List[int]] = {}
    for i in range(len(requests)) if picked is None else picked:
        hinted = bool(hint) and requests[i].storage_key.startswith(hint)
        classes.setdefault((hinted, i in stable), []).append(i)
    threads = max(1, thread_count // len(classes)) if len(classes) > 1 else thread_count
    out: List[Tuple[str, List[int]]] = []
    for (hinted, _), members in sorted(classes.items()):
        out += [(hint if hinted else "", b) for b in _buckets(requests, members, threads)]  # type: ignore[misc]
    return out


def write_data_files(
    target: CheckpointLocation,
    rank: int,
    requests: Sequence[WriteRequest],
    thread_count: int = 2,
    durable: bool = True,
    block_size: Optional[int] = None,
    separation_hint: Optional[str] = None,
    stop: Optional[Callable[[], None]] = None,
    fingerprints: Optional[Sequence[Optional[int]]] = None,
    base: Optional[BaseFiles] = None,
    taken_names: Set[str] = frozenset(),
) -> WrittenTable:
    """Write ``requests`` into ``__<rank>_<i>.distcp`` files, one per thread; fsync them.

    Tensor items get block digests (``block_size``, of ``checksum.SAVE_BLOCK_HASH``) besides
    their item digest, and the ``fingerprints`` given (one per request, None for objects;
    ``storage.fingerprint``), which the commit writes into the manifest. A failed
    write (disk full, permissions) raises :class:`CheckpointWriteError` naming the file.
    Items whose keys start with ``separation_hint`` go to files of their own,
    ``<hint>__<rank>_<i>.distcp``, so that ``remove_sharded_tensors(dir, hint)`` drops them
    by deleting those files (Megatron-Core's ``separation_hint``). ``stop``, called before each
    item, raises to abandon the write (an async save cut off by a preemption's grace period).
    With ``base`` (an earlier checkpoint's files this rank may take, :mod:`.incremental`), a base
    file holding exactly some of the requests, unchanged, is linked instead of written; requests
    marked ``stable`` or found unchanged go to files of their own. ``taken_names``: data files this
    save has already written or linked (a save in waves calls this once per wave).
    """
    if not requests:
        return WrittenTable()
    block_size = block_size or BLOCK_SIZE
    digest = save_block_hash()
    storage = target.storage
    linked, taken, stable = link_unchanged(target, requests, base, digest, stop, fingerprints, separation_hint)
    groups = _separate(requests, separation_hint, thread_count, [i for i in range(len(requests)) if i not in taken],
                       stable)
    buckets = [b for _, b in groups]
    names = _file_names(rank, [p for p, _ in groups], set(linked.files) | set(taken_names))

    def write_bucket(index: int, bucket: List[int]) -> WrittenTable:
        name = names[index]
        path = target.file(name)
        out = WrittenTable()
        try:
            f = storage.open_write(path, exclusive=True)
        except FileExistsError:
            raise SaveConflictError(
                f"cannot write {path}: the file exists, created by another save into the same directory "
                "(two jobs saving to one path at once); this save is abandoned"
            ) from None
        with writing(path), f, _archive_member_crc_disabled():  # (per thread: see there)
            small = SmallItemWriter(f, block_size, digest)
            for i in bucket:
                if stop is not None:
                    stop()
                req = requests[i]
                fp = fingerprints[i] if fingerprints is not None else None
                if isinstance(req.data, torch.Tensor) and req.offsets is not None:
                    done = small.add(req.data)
                    if done is not None:
                        out.append(req.storage_key, req.offsets, tuple(req.data.shape), name, *done, fingerprint=fp)
                        continue
                small.flush()
                start = f.tell()
                sizes = None
                if isinstance(req.data, torch.Tensor):
                    parts = _streamed(req.data)
                    t = req.data.detach() if parts is not None else _standalone(req.data)
                    pad = -start % ITEM_ALIGN if t.nbytes >= ITEM_ALIGN_FROM else 0
                    if pad:
                        f.write(bytes(pad))
                        start += pad
                    w = BlockDigestWriter(f, t, block_size, digest)
                    try:
                        if parts is not None:
                            w.write_archive(parts, host_chunks(t))
                        else:
                            save_tensor(t, w)
                    except Exception as e:
                        raise (w.error or e) from e  # torch wraps the OSError of a full disk
                    item_digest, blocks = w.finish()
                    sizes = tuple(t.shape) if req.offsets is not None else None
                else:
                    w = DigestWriter(f, digest)
                    w.write(req.data)
                    item_digest, blocks = w.digest, None
                out.append(req.storage_key, req.offsets, sizes, name, start, f.tell() - start, item_digest, blocks,
                           fingerprint=fp)
                small.pos = f.tell()
            small.flush()
            storage.sync(f, durable)
        return out

    with _archive_member_crc_disabled():
        if len(buckets) == 1 and not len(linked):
            return write_bucket(0, buckets[0])
        with ThreadPoolExecutor(max(1, len(buckets)), thread_name_prefix="ckpt-write") as pool:
            futures = [pool.submit(write_bucket, i, b) for i, b in enumerate(buckets)]
            results = [f.result() for f in futures]
    out = linked
    for r in results:
        out.extend(r)
    return out


def _file_names(rank: int, prefixes: Sequence[str], taken: Set[str]) -> List[str]:
    """The data file name of each bucket (``data_file_name`` numbered in order), skipping the names of
    files taken from a base checkpoint."""
    out: List[str] = []
    index = 0
    for prefix in prefixes:
        while data_file_name(rank, index, prefix) in taken:
            index += 1
        out.append(data_file_name(rank, index, prefix))
        index += 1
    return out


def link_unchanged(target: CheckpointLocation, requests: Sequence[WriteRequest], base: Optional[BaseFiles],
                   digest: BlockHash, stop: Optional[Callable[[], None]],
                   fingerprints: Optional[Sequence[Optional[int]]], hint: Optional[str] = None,
                   ) -> Tuple[WrittenTable, Set[int], Set[int]]:
    """Link the base files that hold exactly some of ``requests``, unchanged (see :mod:`.incremental`):
    ``(their items' rows, the requests they hold, the requests to write into stable files)``."""
    storage, directory = target.storage, target.path
    stable = {i for i, r in enumerate(requests) if r.stable}
    rows = WrittenTable()
    taken: Set[int] = set()
    if base is None:
        return rows, taken, stable
    reuse = plan_reuse(requests, base, digest, fingerprints, hint)
    stable |= reuse.unchanged
    for name, pairs in sorted(reuse.linked.items()):
        if stop is not None:
            stop()
        taken_here = take_file(reuse, name, directory, storage)
        if taken_here is None:
            continue  # (not as the base recorded it: said, and written from memory)
        if not taken_here:
            ckdir.note_once(f"incremental save: could not link or copy {join(base.directory, name)} into {directory} "
                     "(another filesystem, or links not supported there); writing the bytes instead (said once)",
                     key=f"link:{base.directory}")
            continue
        for i, it in pairs:
            taken.add(i)
            rows.append(it.key, it.offsets, it.sizes, name, it.start, it.length, it.digest, it.blocks,
                        fingerprint=fingerprints[i] if fingerprints is not None else None)
    if taken:
        logger.debug("%s: took %d data file(s) holding %d item(s) from %s", directory, len(set(rows.files)), len(taken),
                     base.directory)
    return rows, taken, stable


def make_dcp_metadata(
    tensors: Dict[str, Tuple[torch.dtype, Tuple[int, ...], List[Tuple[Tuple[int, ...], Tuple[int, ...]]]]],
    object_keys: Iterable[str],
    written: Iterable[WrittenItem],
) -> Metadata:
    """Build DCP ``Metadata``.

    ``tensors`` maps key -> (dtype, global shape, [(chunk offsets, chunk sizes)]).
    ``planner_data`` maps every key to itself so that DCP's own loaders
    (``dcp_to_torch_save``) produce a flat dict with our keys.
    """
    sd_meta: Dict[str, Any] = {}
    for key, (dtype, shape, chunk_list) in tensors.items():
        sd_meta[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
            chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in sorted(chunk_list)],
        )
    for key in object_keys:
        sd_meta[key] = BytesStorageMetadata()
    storage_data: Dict[MetadataIndex, _StorageInfo] = {}
    for item in written:
        info = _StorageInfo(item.relative_path, item.offset, item.length)
        offset = None if item.offsets is None else torch.Size(item.offsets)
        storage_data[MetadataIndex(item.storage_key, offset)] = info
    return Metadata(
        state_dict_metadata=sd_meta,
        planner_data={k: (k,) for k in sd_meta},
        storage_data=storage_data,
        storage_meta=StorageMeta(),
        version="1.0.0",
    )


def write_dcp_metadata(target: CheckpointLocation, metadata: Metadata, durable: bool = True) -> Dict[str, int]:
    """Write ``.metadata``; returns ``{"size", "crc32"}`` for the manifest."""
    return write_recorded(target, DCP_METADATA_FILE, dumps_dcp_metadata(metadata), durable)


def read_dcp_metadata(ck: CheckpointLocation, trusted: bool = False, manifest: Optional[ckdir.Manifest] = None) -> Metadata:
    """``.metadata``, checked against the manifest (read once: the bytes checked are the bytes
    unpickled) and unpickled restrictedly unless ``trusted``. ``manifest``: the checkpoint's
    manifest when the caller has read it already (else it is read here). An opened checkpoint:
    the ``.metadata`` it read."""
    if ck.dcp_metadata is not None:
        return ck.dcp_metadata
    path = ck.file(DCP_METADATA_FILE)
    if manifest is None:
        manifest = ckdir.read_manifest(ck)
    try:
        data = ckdir.read_verified_file(ck, DCP_METADATA_FILE, manifest, "tensor metadata file")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: the torch_dist checkpoint has no tensor metadata") from None
    try:
        md = load_dcp_metadata(io.BytesIO(data), trusted=trusted)
    except RecursionError:
        raise CorruptCheckpointError(f"{path} is damaged: its pickle is nested too deeply") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
        raise CorruptCheckpointError(f"{path} is damaged and cannot be decoded: {e!r}") from None
    except Exception as e:  # pickle.UnpicklingError and friends

        if isinstance(e, UnsafeCheckpointError):  # (named: a garbled global name is damage, not an attack)
            raise type(e)(f"{path}: {e} (a name no library defines means the file is damaged)") from None
        raise CorruptCheckpointError(f"{path} is damaged and cannot be decoded: {e!r}") from None
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CorruptCheckpointError(f"{path} does not hold DCP metadata (got {type(md).__name__})")
    _check_entries(md, path)
    return md


def _check_entries(md: Metadata, path: str) -> None:
    """The fields every reader of the entries uses are there and of their types (a damaged pickle can
    rename a field: readers then failed with a raw ``AttributeError``); a few attribute tests per chunk."""
    try:
        for key, entry in md.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                ok = isinstance(entry.properties.dtype, torch.dtype) and isinstance(entry.size, tuple) and \
                    isinstance(entry.chunks, list) and all(isinstance(c.offsets, tuple) and isinstance(c.sizes, tuple)
                                                           for c in entry.chunks)
            else:
                ok = isinstance(entry, BytesStorageMetadata)
            if not ok:
                raise TypeError(f"entry {key!r} is not tensor or bytes metadata")
        if not isinstance(md.storage_data, dict):
            raise TypeError("its storage index is not a dict")
    except (AttributeError, TypeError) as e:
        raise CorruptCheckpointError(f"{path} is damaged: {e}") from None


# --------------------------------------------------------------------------- reading


# --------------------------------------------------------------------------- .metadata in fewer bytes
class _CompactPickler(pickle.Pickler):
    """Pickles DCP ``Metadata`` into the same objects in fewer bytes (plain ``pickle.load``,
    as DCP's ``FileSystemReader`` reads it, rebuilds them unchanged).

    The default pickling of a dataclass is ``cls.__new__`` plus a ``__dict__`` with its field
    names, ~40 bytes per object before any value, and every ``torch.Size`` is written out again
    even where a chunk's offsets repeat in its storage index. Here the three per-chunk classes
    are rebuilt by calling them with their fields (positional), equal offsets/sizes tuples and
    keys and file names are one object each (a memo reference of 2-5 bytes after the first), which
    about halves the bytes per chunk (~150 -> ~75): ZeRO-1 checkpoints have tens of thousands
    of chunks at scale (docs/format.md).
    """

    def __init__(self, f: IO[bytes]):
        super().__init__(f, protocol=4)
        self._tuples: Dict[Tuple[int, ...], Tuple[int, ...]] = {}
        self._strings: Dict[str, str] = {}

    def _t(self, v: Sequence[int]) -> Tuple[int, ...]:
        t = tuple(v)
        return self._tuples.setdefault(t, t)

    def reducer_override(self, obj: object) -> Any:
        cls = type(obj)
        if cls is torch.Size:
            return torch.Size, (self._t(obj),)
        if cls is ChunkStorageMetadata:
            return ChunkStorageMetadata, (obj.offsets, obj.sizes)
        if cls is MetadataIndex:
            # MetadataIndex.__init__ makes the offset a torch.Size again
            fqn = self._strings.setdefault(obj.fqn, obj.fqn)
            return MetadataIndex, (fqn, None if obj.offset is None else self._t(obj.offset), obj.index)
        if cls is _StorageInfo and getattr(obj, "transform_descriptors", None) is None:
            path = self._strings.setdefault(obj.relative_path, obj.relative_path)
            return _StorageInfo, (path, obj.offset, obj.length)
        return NotImplemented


def dumps_dcp_metadata(metadata: Metadata) -> bytes:
    """``.metadata`` bytes (see :class:`_CompactPickler`)."""
    buf = io.BytesIO()
    _CompactPickler(buf).dump(metadata)
    return buf.getvalue()


