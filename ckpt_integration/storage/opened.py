"""A checkpoint opened once: storage, commit marker, manifest and tensor metadata read one time,
pinned to the commit they belong to.

Every commit records a random ``commit_id`` in ``manifest.json``. An :class:`OpenedCheckpoint`
remembers the id it opened; each read through it checks, before it starts and after it
finished (and when it failed), that the directory still holds that commit. A directory replaced
(``last.ckpt`` rewritten by another save) or removed (top-k deletion) meanwhile makes the read
fail with :class:`~ckpt_integration.errors.CheckpointReplacedError` naming the path, instead of
returning data of two commits or reporting the other commit's files as damage
(``CorruptCheckpointError``). See docs/reading.md for what a reader may rely on.

When a checkpoint was committed and which commit a directory holds: read from the head of its
``manifest.json`` (one small ranged read on object stores), for listings (``commit_order``), for
numbering the next commit beside it (``next_commit_seq``) and for pinning an opened checkpoint
(``commit_identity``).

**Backends** (:class:`Backend`): what each storage format can do, how to read its metadata, its
reader. Both backends describe their content as a DCP ``Metadata`` (tensor keys with dtype, global shape
and chunks; object keys) and provide a :class:`CheckpointReader`, so the load path and the tools
are backend-agnostic: they ask the :class:`Backend` of a checkpoint (``backend_named`` /
``backend_of``) for a capability instead of comparing backend names.

Example::

    ck = locate("ckpt")                # the handle every helper below takes
    be = backend_of(ck)                # TORCH_DIST or ZARR, from the checkpoint's metadata.json
    md = be.read_metadata(ck, False)
    with be.open_reader(ck, md) as reader:
        reader.read_region(key, reader.chunks[key][0], box, out, dtype)
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ..errors import CheckpointingException, CheckpointReadError, CheckpointReplacedError, MismatchError
from ..planning.boxes import Box, intersect
from ..planning.reshard import ChunkIndex, ChunkRead
from . import checkpoint_dir as ckdir
from .checkpoint_dir import CONFIG_FILE, MANIFEST_FILE, SEALED_VERSION, WRITER_FILE, Manifest, is_plain_dcp, read_manifest
from .checksum import HEAD_SEAL, check_sealed, check_sha_manifest
from .filesystem import CheckpointLocation, Storage, locate, parent_of
from .chunk_index import compact_chunks_of, read_chunk_index
from .torch_dist import read_dcp_metadata
from .torch_dist_reader import MANIFEST_FROM_DIRECTORY, ChunkInfo, TorchDistReader
from .zarr_backend import ZarrReader


class CheckpointReader(Protocol):
    """What every backend's reader gives the load path and the tools (``TorchDistReader``,
    ``ZarrReader``). Every byte it returns was verified against the checkpoint's records
    (unless opened with ``verify_checksums=False``), and it reads only files inside the
    checkpoint."""

    metadata: Metadata
    chunks: Dict[str, List[ChunkInfo]]  # per tensor key: the stored chunks and where they are

    def validate_tensor(self, key: str) -> None:
        """Raise ``CorruptCheckpointError`` unless ``key``'s chunks tile its global shape."""

    def read_region(self, key: str, chunk: ChunkInfo, overlap: Box, out: torch.Tensor, dtype: torch.dtype) -> None:
        """Copy ``overlap`` (global coordinates, inside ``chunk``) of ``key`` into ``out``."""

    def read_bytes(self, storage_key: str) -> bytes:
        """The verified bytes of a stored object."""

    def close(self) -> None:
        """Release open files (the reader is unusable afterwards)."""

    def __enter__(self) -> "CheckpointReader": ...

    def __exit__(self, *exc: object) -> None: ...


@dataclass(frozen=True)
class Backend:
    """One storage format (``metadata.json``'s ``sharded_backend``) and what it supports.

    * ``dcp_metadata``: a PyTorch DCP ``.metadata`` describes the checkpoint (read once by a
      load's coordinator and broadcast; pinned by an opened checkpoint); otherwise each reader
      reads the backend's own index;
    * ``mapped_chunks``: chunks are plain row-major arrays at recorded offsets of local files,
      so the read-once and parallel planners can map and split them;
    * ``block_hash``: the digest algorithm of the backend's own records, or None when the
      manifest names it (``manifest.json``'s ``block_hash``).
    """

    name: str
    dcp_metadata: bool
    mapped_chunks: bool
    block_hash: Optional[str]
    read_metadata: Callable[[CheckpointLocation, bool], Metadata]
    open_reader: Callable[..., CheckpointReader]


def _open_torch_dist(
    ck: CheckpointLocation, metadata: Metadata, checksums: Optional[Dict[Tuple[str, int], int]] = None,
    verify_checksums: bool = True, manifest: Union[ckdir.Manifest, None, object] = MANIFEST_FROM_DIRECTORY,
) -> CheckpointReader:
    return TorchDistReader(ck, metadata, checksums, verify_checksums, manifest=manifest)


def _open_zarr(
    ck: CheckpointLocation, metadata: Metadata, checksums: Optional[Dict[Tuple[str, int], int]] = None,
    verify_checksums: bool = True, manifest: Union[ckdir.Manifest, None, object] = None,
) -> CheckpointReader:
    # the zarr index carries the chunk records and CRC32s; the DCP-shaped metadata is the reader's own
    return ZarrReader(ck, verify_checksums=verify_checksums, manifest=manifest if isinstance(manifest, ckdir.Manifest) else None)


TORCH_DIST = Backend(
    "torch_dist", dcp_metadata=True, mapped_chunks=True, block_hash=None,
    read_metadata=lambda ck, trusted: read_dcp_metadata(ck, trusted=trusted),
    open_reader=_open_torch_dist,
)
ZARR = Backend(
    "zarr", dcp_metadata=False, mapped_chunks=False, block_hash="crc32",
    read_metadata=lambda ck, trusted: ZarrReader(ck).metadata,
    open_reader=_open_zarr,
)
BACKENDS: Dict[str, Backend] = {b.name: b for b in (TORCH_DIST, ZARR)}


def backend_named(name: str) -> Backend:
    """The :class:`Backend` called ``name`` (``"torch_dist"``, ``"zarr"``)."""
    be = BACKENDS.get(name)
    if be is None:
        raise CheckpointingException(f"unknown checkpoint backend {name!r}; this library reads {sorted(BACKENDS)}")
    return be


def backend_of(ck: CheckpointLocation) -> Backend:
    """The backend that wrote the checkpoint (from its ``metadata.json``)."""
    return backend_named(ckdir.read_config(ck).sharded_backend)


def read_metadata(ck: CheckpointLocation, trusted: bool = False, backend: Optional[str] = None) -> Metadata:
    """The DCP-shaped ``Metadata`` of the checkpoint through its backend."""
    be = backend_named(backend) if backend else backend_of(ck)
    return be.read_metadata(ck, trusted)


#: Megatron-Core 0.19's layout: the common state as this ShardedObject inside the DCP data (no common.pt)
EMBEDDED_COMMON_KEY = "common_state"


def embedded_common_key(metadata: Optional[Metadata]) -> Optional[str]:
    """The storage key of a common state stored as the ``common_state`` ShardedObject (Megatron-Core 0.19
    layout: ``common_state/shard_0_1``), or None."""
    found = [k for k, v in ((metadata.state_dict_metadata or {}).items() if metadata is not None else ())
             if isinstance(v, BytesStorageMetadata)
             and (k == EMBEDDED_COMMON_KEY or k.startswith(EMBEDDED_COMMON_KEY + "/shard_"))]
    return sorted(found)[0] if found else None


def embedded_common_bytes(opened: CheckpointLocation) -> Optional[bytes]:
    """The bytes of the common state stored inside the DCP data of the opened checkpoint ``opened``
    (verified where its manifest records them), or None when it has none."""
    md = getattr(opened, "metadata", None)
    key = embedded_common_key(md)
    if key is None:
        return None
    reader = open_reader(opened, md, "torch_dist", manifest=getattr(opened, "manifest", None))
    try:
        return reader.read_bytes(key)
    finally:
        reader.close()


def open_reader(
    ck: CheckpointLocation,
    metadata: Metadata,
    backend: Optional[str] = None,
    checksums: Optional[Dict[Tuple[str, int], int]] = None,
    verify_checksums: bool = True,
    manifest: Union[ckdir.Manifest, None, object] = MANIFEST_FROM_DIRECTORY,
) -> CheckpointReader:
    """A :class:`CheckpointReader` of the checkpoint ``ck``. Each reader reads its integrity records
    itself (manifest / zarr index), so every caller gets verified reads and the containment
    checks, unless ``manifest`` hands it the checkpoint's manifest already read and checked (a
    load's coordinator reads it once and broadcasts it; ``None``: the checkpoint has none).
    ``checksums`` is accepted for compatibility and ignored where the checkpoint has a manifest."""
    be = backend_named(backend) if backend else backend_of(ck)
    return be.open_reader(ck, metadata, checksums, verify_checksums, manifest)


class OpenedCheckpoint(CheckpointLocation):
    """One committed checkpoint, read once and pinned (use :func:`open_checkpoint`).

    Attributes: ``path`` (as given, fsspec URLs kept), ``storage``, ``config`` (``metadata.json``),
    ``backend``, ``manifest`` (``None`` for checkpoints of other writers), ``commit_id`` and
    ``metadata`` (the DCP ``Metadata``, read on first use from the chunk index, or from
    ``.metadata`` where the checkpoint has no usable index, verified against the manifest;
    ``None`` for zarr). Every ``ckpt_integration`` entry point that takes a checkpoint path accepts this
    object too, and passes it down: nothing below reads those files again.
    ``legacy=True`` (``convert``'s source) also opens manifest formats 1-3, which loads refuse.
    """

    def __init__(self, path: Any, trusted: bool = False, *, config: Any = None, manifest: Any = None,
                 metadata: Any = None, shared: Any = None, legacy: bool = False):
        where = locate(path)  # (a location given: its storage, not resolved again)
        super().__init__(where.storage, where.path)
        self.storage: Storage
        self.trusted = trusted
        self.commit_id: Optional[str] = None
        self.closed = False
        self._dcp_metadata: Any = None
        self._chunk_index: Any = None
        # a collective open (execution.shared_metadata.open_shared): what the coordinator read, as
        # the job's loads use it; on the other ranks ``.metadata`` comes from it, not from storage
        self.shared = shared
        self.file_cache = {}  # common.pt once, however many entry points ask for the common state
        if config is not None:  # adopted: read by another rank (execution.shared_metadata.open_shared)
            self.config, self.manifest, self.manifest_read = config, manifest, True
            self.backend = config.sharded_backend
            self.commit_id, self.dcp_metadata = identity_of(manifest), metadata
            return
        self.config = ckdir.read_config(self)  # a specific error for every way it is not a checkpoint
        self.backend = self.config.sharded_backend
        try:
            self.manifest = ckdir.read_manifest_checked(self, legacy)
            self.manifest_read = True
            self.commit_id = identity_of(self.manifest)  # the commit pinned: the manifest's
            if self.manifest is not None:
                self.manifest.index()  # format 6: index.bin, read and checked once, at open
        except Exception as e:
            self._raise_if_replaced(e)
            raise
        if self.manifest is None:  # nothing read later can be checked against it: pin by identity now
            check_sha_manifest(self)  # (Megatron-Core's integrity.json, where there is one)
            self.check()

    @property
    def metadata(self) -> Any:
        """The DCP ``Metadata`` of the opened commit (on first use: decoded from the chunk index, or
        ``.metadata`` read where there is no usable index; checked against the manifest; ``None``
        for zarr)."""
        return self.dcp_metadata

    @property  # type: ignore[override]
    def dcp_metadata(self) -> Any:
        if self._dcp_metadata is None and self.shared is not None and not self.closed:
            self._dcp_metadata = self.shared.full_metadata()
        if self._dcp_metadata is None and not self.closed and backend_named(self.backend).dcp_metadata:
            # from the chunk index, as every load plans (one small file, no unpickling); .metadata
            # itself where there is no usable index
            self._dcp_metadata = self.chunk_index().full()
        return self._dcp_metadata

    def _read_pickled_metadata(self) -> Any:
        """``.metadata`` itself, read and checked against the manifest (kept)."""
        if self._dcp_metadata is None:
            try:
                # (afresh: this object's own dcp_metadata is what is being read)
                self._dcp_metadata = read_dcp_metadata(self.afresh(), trusted=self.trusted, manifest=self.manifest)
            except Exception as e:
                self._raise_if_replaced(e)
                raise
            if self.manifest is None:
                self.check()
        return self._dcp_metadata

    @dcp_metadata.setter
    def dcp_metadata(self, value: Any) -> None:
        self._dcp_metadata = value

    def loaded_metadata(self) -> Any:
        """The DCP ``Metadata`` if it has been read or decoded already (None otherwise: nothing is
        read here)."""
        return self._dcp_metadata

    def chunk_index(self) -> Any:
        """The opened commit's chunk index (:class:`~.chunk_index.CompactMetadata`; None for zarr):
        ``chunk_index.bin`` when the manifest records it for this ``.metadata``, else encoded from
        ``.metadata`` (read on first use). What every load plans from."""
        if self.shared is not None and self.shared.compact is not None:
            return self.shared.compact
        if self._chunk_index is None and not self.closed and backend_named(self.backend).dcp_metadata:
            try:
                self._chunk_index = read_chunk_index(self, self.manifest, self._read_pickled_metadata)
            except Exception as e:
                self._raise_if_replaced(e)
                raise
        return self._chunk_index

    def verifies(self, verify_checksums: bool = True) -> bool:
        """Whether reads of this checkpoint are checked against the pinned manifest (every byte
        returned then belongs to the opened commit, so no identity check is needed after them)."""
        return bool(verify_checksums and self.manifest is not None and self.commit_id
                    and backend_named(self.backend).dcp_metadata)  # zarr: its index, read per reader

    # ------------------------------------------------------------------ pinning
    def check(self) -> None:
        """Raise :class:`CheckpointReplacedError` unless the directory still holds the opened commit."""
        self._raise_if_replaced(None)

    def _raise_if_replaced(self, cause: Optional[BaseException]) -> None:
        if self.commit_id is None:  # nothing pinned yet (the manifest itself failed): its own error stands
            return
        now = commit_identity(self)
        if now == self.commit_id:
            return
        gone = now is None and self.storage.isdir(self.path)  # (the directory is there, a commit file is not)
        what = f"changed ({CONFIG_FILE} or {MANIFEST_FILE} is gone)" if gone else "removed" if now is None else \
            "replaced by another commit"
        err = CheckpointReplacedError(
            f"{self.path} was {what} while it was being read (opened commit {self.commit_id or 'unknown'}"
            f"{'' if now is None else ', now ' + now}); nothing read from it is returned: open it again "
            "to read what it holds now")
        if cause is not None:
            raise err from cause
        raise err

    @contextmanager
    def reading(self, verified: bool = False) -> Iterator["OpenedCheckpoint"]:
        """A read of this commit: yields this object; fails with :class:`CheckpointReplacedError`
        if the block failed and the directory no longer holds the commit, or if it no longer holds
        it after the block.

        ``verified``: every byte the block returns was checked against the pinned manifest's
        digests (the default of every load); then a replacement shows as a digest mismatch or a
        missing file inside the block, and the check after it is skipped (no storage request).
        Otherwise one check after the read suffices: every commit has its own id, so a directory
        that holds the opened commit after the read held it during the read (a replacement in
        between would have left another id or no commit marker: a save rewriting in place removes
        ``metadata.json`` first)."""
        if self.closed:
            raise ValueError(f"{self.path}: the opened checkpoint is closed")
        try:
            yield self
        except MismatchError:  # the request, or ranks that disagree: not what storage holds, its own error stands
            raise
        except Exception as e:
            self._raise_if_replaced(e)
            raise
        if not (verified and self.verifies()):
            self.check()

    # ------------------------------------------------------------------ context manager
    def close(self) -> None:
        """Drop the cached metadata; later reads through this object are refused."""
        self.closed, self.dcp_metadata, self.file_cache, self.shared = True, None, None, None
        self._chunk_index = None

    def __enter__(self) -> "OpenedCheckpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"OpenedCheckpoint({self.path!r}, backend={self.backend!r}, commit_id={self.commit_id!r})"


def open_checkpoint(path: Any, trusted: bool = False) -> OpenedCheckpoint:
    """Open the committed checkpoint at ``path`` once (a local path or an fsspec URL).

    Use it as a context manager and pass it to any entry point instead of the path::

        with ci.open_checkpoint("ckpt/last.ckpt") as ck:
            state = ci.load(request, ck)
            step = ci.load_common_state_dict(ck)["global_step"]

    ``trusted`` as for :func:`~ckpt_integration.load` (used for ``.metadata``). Reads through it
    return data of the opened commit only, or raise :class:`CheckpointReplacedError`.
    """
    return OpenedCheckpoint(path, trusted=trusted)


@contextmanager
def opened(checkpoint: Any, trusted: bool = False, verified: bool = False) -> Iterator[OpenedCheckpoint]:
    """A pinned read of ``checkpoint``: the opened checkpoint given, or one opened here from a path
    (and closed after the block). Entry points pass what it yields down instead of the path.
    ``verified`` as for :meth:`OpenedCheckpoint.reading`."""
    ck = checkpoint if isinstance(checkpoint, OpenedCheckpoint) else OpenedCheckpoint(checkpoint, trusted=trusted)
    try:
        with ck.reading(verified=verified):
            yield ck
    finally:
        if ck is not checkpoint:
            ck.close()


@contextmanager
def pinned(*checkpoints: Any, verified: bool = False) -> Iterator[None]:
    """A pinned read of each of ``checkpoints`` that is an :class:`OpenedCheckpoint` (the tools'
    bodies run in it): every read inside is of the commit it pinned, or raises
    :class:`CheckpointReplacedError`. Paths pass as they are: the tool opens them itself where it
    can (after resolving them, or after telling a file from a checkpoint directory). ``verified``:
    every byte read inside is checked against the pinned manifest (as for
    :meth:`OpenedCheckpoint.reading`: no second read of the commit marker after the block)."""
    with contextlib.ExitStack() as stack:
        for ck in checkpoints:
            if isinstance(ck, OpenedCheckpoint):
                stack.enter_context(ck.reading(verified=verified))
        yield


# --------------------------------------------------------------------------- commit order
# The head of a manifest as json.dumps(asdict(Manifest)) writes it: "step" and "commit_seq" come
# right after the three leading fields, so the first bytes of the file hold them.
_ORDER_RE = re.compile(rb'^\{"format": "[^"]*", "version": \d+, "created": ([-+.eE0-9]+), '
                       rb'"step": (null|-?\d+), "commit_seq": (null|-?\d+)[,}]')
_VERSION_RE = re.compile(rb'^\{"format": "[^"]*", "version": (\d+)')
_HEAD_BYTES = 512


def _trusted_head(head: bytes, ck: CheckpointLocation) -> bool:
    """Whether the fields in a manifest's first bytes may be used as they are: a sealed head (format 7) is
    checked here (changed: :class:`CorruptCheckpointError` naming the file); a format-7 head without its seal
    in those bytes is not (the caller reads and checks the whole manifest); older formats have no seal."""
    if HEAD_SEAL in head:
        check_sealed(head, ck.file(MANIFEST_FILE), whole=False)
        return True
    v = _VERSION_RE.match(head)
    return v is None or int(v.group(1)) < SEALED_VERSION


def commit_order(ck: CheckpointLocation) -> Tuple[Optional[int], Optional[int], Optional[float]]:
    """``(step, commit_seq, created)`` recorded in a checkpoint's manifest; ``None`` for what it lacks.

    Reads the first bytes of ``manifest.json`` (one small ranged read on object stores; the
    whole file only if its head does not have the expected layout). A checkpoint without a
    readable manifest (other writers, damage) gives ``(None, None, None)``: listing
    checkpoints never fails because one of them is damaged; loading it does.
    """
    try:
        reader = ck.open(MANIFEST_FILE, "manifest")
        try:
            head = reader.read(0, min(reader.size, _HEAD_BYTES))
        finally:
            reader.close()
        m = _ORDER_RE.match(head) if _trusted_head(head, ck) else None
        if m is not None:
            step, seq = (None if g == b"null" else int(g) for g in m.groups()[1:])
            return step, seq, float(m.group(1))
        manifest = read_manifest(ck.afresh())  # (what the directory holds now)
    except CheckpointReadError:
        raise  # (the store did not answer: ordered as "no step", "last" took an older checkpoint without a word)
    except (OSError, CheckpointingException, ValueError):
        return None, None, None
    if manifest is None:
        return None, None, None
    created = manifest.created if isinstance(manifest.created, (int, float)) else None
    return manifest.step, manifest.commit_seq, created


_seq_lock = threading.Lock()
_last_seq: Dict[str, int] = {}


def next_commit_seq(ck: CheckpointLocation) -> int:
    """The commit sequence number for a checkpoint about to be committed at ``ck``.

    One more than every number recorded by the committed checkpoints beside it (same parent
    directory), so commits are ordered by what the jobs recorded, not by clocks: the siblings'
    manifests are read once per parent directory and process, later commits count on.
    """
    parent = parent_of(ck.path)
    key = parent if ck.storage.remote else os.path.realpath(parent)  # (one directory, however it is spelled)
    with _seq_lock:
        last = _last_seq.get(key)
        if last is None:
            last = 0
            here = ck.at(parent)
            try:  # (a listing that fails is not an empty directory: the commit would be numbered 1, the oldest)
                names = here.listdir() if ck.storage.isdir(parent) else []
            except FileNotFoundError:
                names = []
            for n in names:
                sibling = ck.at(here.file(n))
                if sibling.exists(CONFIG_FILE):
                    seq = commit_order(sibling)[1]
                    if seq is not None:
                        last = max(last, seq)
        _last_seq[key] = last + 1
        return last + 1


# --------------------------------------------------------------------------- commit identity
_ID_RE = re.compile(rb'"commit_id": "([0-9a-f]*)"')


def commit_identity(ck: CheckpointLocation) -> Optional[str]:
    """Which commit the directory of ``ck`` holds now: ``None`` when it holds no committed checkpoint (removed,
    or being rewritten in place: no ``metadata.json``), else the manifest's ``commit_id``.

    Checkpoints written before commit ids (or by other tools) are identified by what their
    manifest has (creation time and save token), or by ``""`` without a manifest: for those an
    opened checkpoint can notice a removal but not every replacement (see docs/reading.md).
    Costs one existence check and one small read (the manifest's head) on any storage.
    """
    if not ck.exists(CONFIG_FILE):
        return "" if is_plain_dcp(ck) else None  # plain DCP: ``.metadata`` is its commit marker
    try:
        reader = ck.open(MANIFEST_FILE, "manifest")
    except CheckpointReadError:
        raise  # (the system refused the read, EMFILE or EIO: no sign that the checkpoint changed)
    except (OSError, CheckpointingException):  # no manifest: ours mid-replacement, or a foreign checkpoint
        return None if ck.exists(WRITER_FILE) else ""
    try:
        head = reader.read(0, min(reader.size, _HEAD_BYTES))
    finally:
        reader.close()
    m = _ID_RE.search(head) if _trusted_head(head, ck) else None  # (a changed head names no commit)
    if m is not None and m.group(1):
        return m.group(1).decode()
    return identity_of(read_manifest(ck.afresh()))  # (never what was opened)


def identity_of(manifest: Optional[Manifest]) -> str:
    """The commit identity :func:`commit_identity` reports for a checkpoint with this manifest."""
    if manifest is None:
        return ""
    return manifest.commit_id or f"created={manifest.created!r} save={manifest.save}"


_indexes: "weakref.WeakKeyDictionary[Any, Dict[str, ChunkIndex]]" = weakref.WeakKeyDictionary()


def saved_chunk_reads(reader: CheckpointReader, key: str, request: Box) -> List[ChunkRead]:
    """Reads filling ``request`` from the saved chunks of ``key`` (``source`` = the reader's chunk record).

    When the metadata came from :mod:`.shared_metadata`, a binary search in the
    broadcast's integers (sorted by the coordinator): O(log n) per request, chunk
    records materialised only for the chunks read. Otherwise the key's
    :class:`ChunkIndex` is built from the reader's chunk list on first use and kept as
    long as the reader lives.
    """
    compact = compact_chunks_of(getattr(reader, "metadata", None))
    if compact is not None and key in compact:
        return compact.chunk_reads(key, request, getattr(reader, "directory", ""))
    chunks = reader.chunks[key]
    if len(chunks) == 1:  # the common case of many small tensors: no index to build
        common = intersect(request, chunks[0].box)
        return [] if common is None else [ChunkRead(chunks[0].box, common, chunks[0])]
    per_reader = _indexes.get(reader)
    if per_reader is None:
        per_reader = _indexes[reader] = {}
    index = per_reader.get(key)
    if index is None:
        index = per_reader[key] = ChunkIndex([c.box for c in chunks], chunks)
    return index.reads(request)
