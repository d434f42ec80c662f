"""Snapshot files of the memory tier in a node's shared-memory directory.

Layout, all under ``<directory>/<job_id>/`` (nothing outside it is ever read or removed)::

    node-id                    random id of this node's memory (new once the directory is lost)
    r00003/s0.rec              commit record of rank 3's snapshot in slot 0
    r00003/s0-<gen>.bin        the slot's tensor bytes ("arena": staging buffers are slices of it)

A node holds the directories of its own ranks and of the ranks whose copies it keeps (see
:mod:`.plan`); a copy is byte-for-byte the owner's files, its record included.

**Commit protocol.** A slot is valid only while its record exists and verifies: before a
slot's bytes are overwritten its record is removed, and the new record is written last (to a
temporary name, then renamed). A process killed at any point leaves the slot without a record
(invalid) and the other slot untouched. Records are the whole metadata of a snapshot:

    b"CIMEMREC" | crc32 (u32) | header length (u64) | blob length (u64) | header (JSON) | blob

The CRC32 covers both lengths, the header and the blob. The header names job, owner, step,
world size, the incarnation that wrote it, the shards and the regions of the arena files with
the digest of every 1 MiB block (the durable format's block checksums: ``block_hash``, XXH3-64
since record format 2; format-1 records have CRC32s); the blob (a
``torch.save`` archive, read with the safe unpickler) holds the common state and the
ShardedObjects. Files are preallocated (``posix_fallocate``), so a full tmpfs is an error at
allocation instead of a ``SIGBUS`` in the middle of a copy.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import re
import shutil
import struct
import uuid

try:  # pragma: no cover - POSIX only
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import CheckpointingException, CorruptCheckpointError, MemoryCheckpointError, MemorySpaceError, format_size
from ..planning.dtypes import dtype_from_name, element_size
from ..storage.fs import atomic_write_bytes
from ..storage.checksum import CRC32, DEFAULT_BLOCK_SIZE, BlockHash, block_hash, crc32, save_block_hash

logger = logging.getLogger(__name__)

MAGIC = b"CIMEMREC"
FORMAT = 2  # 2: "block_hash" names the regions' block digests; 1: CRC32s
_FORMATS = (1, 2)
_PREFIX = struct.Struct("<8sIQQ")
_ALIGN = 4096  # regions of an arena start on page boundaries
_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_OWNER_RE = re.compile(r"^r(\d{5,})$")
_REC_RE = re.compile(r"^s([01])\.rec$")
_BIN_RE = re.compile(r"^s([01])-[0-9a-f]+\.bin$")
SLOTS = (0, 1)


def check_job_id(job_id: str) -> str:
    """``job_id`` as a directory name: letters, digits, ``._-`` (no separators, not ``.``/``..``)."""
    if not isinstance(job_id, str) or not _JOB_RE.match(job_id) or job_id in (".", ".."):
        raise ValueError(f"job_id must be 1-128 characters of letters, digits, '.', '_', '-' (not starting with "
                         f"'.' or '-'), got {job_id!r}")
    return job_id


def owner_dir(root: str, owner: int) -> str:
    return os.path.join(root, f"r{owner:05d}")


def record_path(root: str, owner: int, slot: int) -> str:
    return os.path.join(owner_dir(root, owner), f"s{slot}.rec")


def memory_identity(directory: str) -> str:
    """Which physical memory ``directory`` is: host name, boot id and the directory's device and
    inode (two ranks of one host given the same shared-memory directory, by any path, get the same
    identity; two simulated nodes on one host with directories of their own, different ones)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "-"
    os.makedirs(directory, exist_ok=True)
    st = os.stat(directory)
    return f"host {socket.gethostname()} (boot {boot[:8]}), device {st.st_dev}, inode {st.st_ino}"


def tmpfs_without_huge_pages(directory: str, mounts: str = "/proc/mounts") -> Optional[str]:
    """The mount point when ``directory`` is on a tmpfs mounted without huge pages (``huge=never``,
    the default), else ``None``. There a restarted process maps or reads the snapshot files 4 KiB
    page by page: 0.71-0.80x the speed of ``memcpy`` plus digests on this VM, against 0.94x on a
    tmpfs mounted with ``huge=within_size`` (docs/memory.md, "How fast a restore is")."""
    try:
        with open(mounts) as f:
            table = [line.split() for line in f]
    except OSError:
        return None
    path = os.path.realpath(directory)
    best: Optional[List[str]] = None
    for m in table:
        if len(m) >= 4 and (path == m[1] or path.startswith(m[1].rstrip("/") + "/")):
            if best is None or len(m[1]) >= len(best[1]):
                best = m
    if best is None or best[2] != "tmpfs":
        return None
    huge = [o.split("=", 1)[1] for o in best[3].split(",") if o.startswith("huge=")]
    return best[1] if not huge or huge[-1] in ("never", "deny") else None


def advise_huge_pages(directory: str) -> None:
    """Say (INFO) when ``directory`` is a tmpfs without huge pages, and what mounting it with them gains."""
    plain = tmpfs_without_huge_pages(directory)
    if plain is not None:
        logger.info("memory tier: %s is a tmpfs without huge pages; mounted with huge=within_size, a restarted process "
                    "restores from it about 1.3x faster", plain)


def node_id(root: str) -> str:
    """This node's memory id, created once (the first rank of the node to ask wins)."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "node-id")
    try:
        fd = os.open(path + f".tmp-{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(uuid.uuid4().hex)
        try:
            os.link(path + f".tmp-{os.getpid()}", path)  # fails if another rank was first
        except FileExistsError:
            pass
        finally:
            os.unlink(path + f".tmp-{os.getpid()}")
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        raise MemoryCheckpointError(f"cannot create the memory tier's directory {root}: {e}") from None


# --------------------------------------------------------------------------- records
@dataclass
class Record:
    """A decoded commit record (see the module docstring)."""

    header: Dict[str, Any]
    blob: bytes
    raw: bytes = field(repr=False, default=b"")

    @property
    def owner(self) -> int:
        return int(self.header["owner"])

    @property
    def step(self) -> int:
        return int(self.header["step"])

    @property
    def incarnation(self) -> Tuple[int, str]:
        t, u = self.header["incarnation"]
        return int(t), str(u)

    @property
    def block_hash(self) -> BlockHash:
        """The algorithm of the regions' block digests."""
        return block_hash(self.header.get("block_hash", CRC32), "memory snapshot record")

    @property
    def regions(self) -> List[Tuple[str, int, int, np.ndarray]]:
        """``[(file, offset, nbytes, block digests)]`` (of :attr:`block_hash`)."""
        h = self.block_hash
        return [(f, int(o), int(n), h.unpack(c)) for f, o, n, c in self.header["regions"]]

    def files(self) -> Dict[str, int]:
        """Arena file name -> size in bytes."""
        return {str(k): int(v) for k, v in self.header["files"].items()}


def encode_record(header: Dict[str, Any], blob: bytes) -> bytes:
    head = json.dumps({**record_hash(), **header, "format": FORMAT}, sort_keys=True).encode()
    lengths = struct.pack("<QQ", len(head), len(blob))
    c = crc32(blob, crc32(head, crc32(lengths)))
    return _PREFIX.pack(MAGIC, c, len(head), len(blob)) + head + blob


def decode_record(raw: bytes, where: str) -> Record:
    """Parse and verify a record; :class:`CorruptCheckpointError` naming ``where`` otherwise."""
    if len(raw) < _PREFIX.size:
        raise CorruptCheckpointError(f"memory snapshot record {where} is truncated ({len(raw)} bytes)")
    magic, c, hl, bl = _PREFIX.unpack_from(raw)
    if magic != MAGIC or _PREFIX.size + hl + bl != len(raw):
        raise CorruptCheckpointError(f"memory snapshot record {where} is damaged (bad magic or length)")
    head, blob = raw[_PREFIX.size:_PREFIX.size + hl], raw[_PREFIX.size + hl:]
    if crc32(blob, crc32(head, crc32(struct.pack("<QQ", hl, bl)))) != c:
        raise CorruptCheckpointError(f"memory snapshot record {where} fails its CRC32 check")
    header = json.loads(head)
    if header.get("format") not in _FORMATS:
        raise CorruptCheckpointError(f"memory snapshot record {where} has unknown format {header.get('format')!r}")
    if header["format"] == 1 and "block_hash" in header:
        raise CorruptCheckpointError(f"memory snapshot record {where} is damaged: format 1 has CRC32 block checksums")
    if header["format"] >= 2:
        if "block_hash" not in header:
            raise CorruptCheckpointError(f"memory snapshot record {where} is damaged: it does not name its block checksums")
        block_hash(header["block_hash"], f"memory snapshot record {where}")
    _check_layout(header, where)
    return Record(header, bytes(blob), raw)


def _check_layout(header: Dict[str, Any], where: str) -> None:
    """Every region lies inside its arena file, and every tensor shard (its dtype, element offset,
    sizes and strides) inside its region: what restore, persist and an elastic restart view the
    bytes through. Their CRC32 vouches for the record's bytes, not for the writer that made them;
    a record that does not add up is damage named here, never an out-of-range view (or a
    ``MemoryError`` from a huge count) in the middle of a restore."""
    try:
        files = {str(k): int(v) for k, v in header["files"].items()}
        spans = []
        for name, offset, nbytes, _ in header["regions"]:
            offset, nbytes = int(offset), int(nbytes)
            if name not in files or offset < 0 or nbytes < 0 or offset + nbytes > files[name]:
                raise ValueError(f"region [{offset}, {offset + nbytes}) of {name!r} lies outside its arena file")
            spans.append(nbytes)
        for s in header["shards"]:
            if s["kind"] != "tensor":
                continue
            size, stride, region, first = list(s["size"]), list(s["stride"]), int(s["region"]), int(s["elem_offset"])
            if not (0 <= region < len(spans) and len(size) == len(stride) and first >= 0
                    and all(int(n) >= 0 for n in size + stride) and 0 <= int(s["prepend_axis_num"]) <= len(s["global_shape"])):
                raise ValueError(f"the entry of tensor {s['key']!r} is inconsistent")
            last = first + sum((int(n) - 1) * int(st) for n, st in zip(size, stride)) if all(size) else first - 1
            if (last + 1) * element_size(dtype_from_name(s["dtype"])) > spans[region]:
                raise ValueError(f"tensor {s['key']!r} reaches past the end of its region {region}")
    except (KeyError, TypeError, ValueError, AttributeError, CheckpointingException) as e:  # (an unknown dtype)
        raise CorruptCheckpointError(f"memory snapshot record {where} is damaged: {e}") from None


def write_record(root: str, owner: int, slot: int, raw: bytes) -> None:
    """Commit a slot: write the record under a temporary name and rename it into place (a failed
    write removes the temporary file and raises :class:`MemorySpaceError` / :class:`MemoryCheckpointError`
    naming the record: a bare ``OSError`` named no file, and left the temporary file behind)."""
    path = record_path(root, owner, slot)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)  # (a rank that stages no bytes has no arena file there)
        atomic_write_bytes(path, raw, durable=False)  # (shared memory: nothing to make durable)
    except OSError as e:
        kind = MemorySpaceError if e.errno in (errno.ENOSPC, errno.EDQUOT) else MemoryCheckpointError
        raise kind(f"memory snapshot record {path} cannot be written: {e.strerror or e} "
                   f"({format_size(shutil.disk_usage(root).free) if os.path.isdir(root) else '?'} free there)") from None


def invalidate(root: str, owner: int, slot: int) -> None:
    """Remove a slot's record before its bytes change (the slot is invalid from here on)."""
    try:
        os.unlink(record_path(root, owner, slot))
    except FileNotFoundError:
        pass


def read_record(root: str, owner: int, slot: int) -> Optional[Record]:
    """The slot's verified record, ``None`` if there is none; raises if it is damaged."""
    path = record_path(root, owner, slot)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    return decode_record(raw, path)


@dataclass(frozen=True)
class Entry:
    """One valid slot found in a node directory (what :func:`scan` reports)."""

    owner: int
    slot: int
    step: int
    incarnation: Tuple[int, str]
    world_size: int


def scan(root: str, job_id: str) -> List[Entry]:
    """Every slot of ``job_id`` in this node's directory whose record verifies.

    A damaged record is skipped with a warning (the slot does not count). Records of another
    job cannot be in ``root`` (it is the job's own directory); a record naming another job is
    refused all the same.
    """
    out: List[Entry] = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return out
    for name in names:
        m = _OWNER_RE.match(name)
        if not m:
            continue
        owner = int(m.group(1))
        for slot in SLOTS:
            try:
                rec = read_record(root, owner, slot)
            except (CorruptCheckpointError, ValueError, KeyError, OSError) as e:
                logger.warning("memory tier: ignoring slot %d of rank %d in %s: %s", slot, owner, root, e)
                continue
            if rec is None:
                continue
            h = rec.header
            if h.get("job_id") != job_id or h.get("owner") != owner or h.get("slot") != slot:
                logger.warning("memory tier: ignoring %s: it names job %r, rank %r, slot %r", record_path(root, owner, slot),
                               h.get("job_id"), h.get("owner"), h.get("slot"))
                continue
            out.append(Entry(owner, slot, rec.step, rec.incarnation, int(h["world_size"])))
    return out


# --------------------------------------------------------------------------- arenas
def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _map(path: str, size: int) -> torch.Tensor:
    """A shared (``MAP_SHARED``) read-write mapping of a whole file, as a uint8 tensor."""
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def _preallocate(path: str, size: int, what: str) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        fd = -1
        os.unlink(path)
        free = shutil.disk_usage(os.path.dirname(path)).free
        raise MemorySpaceError(
            f"{what}: cannot allocate {format_size(size)} in {os.path.dirname(path)} ({e.strerror}; "
            f"{format_size(free)} free): give the node's shared memory more room or use fewer replicas"
        ) from None
    finally:
        if fd >= 0:
            os.close(fd)


class Arena:
    """The arena files of one owner's slot in this node's directory, mapped.

    ``allocate(sizes)`` (the :class:`~ckpt_integration.execution.staging.StateDictStager`
    allocator) makes one new file for a batch of buffers and returns slices of its mapping;
    ``locate(tensor)`` says where a staged tensor's bytes are; ``ensure(files)`` makes the
    files of a peer's copy exist with the given sizes (reusing mappings of the same size).
    """

    def __init__(self, root: str, owner: int, slot: int, tag: str):
        self.dir = owner_dir(root, owner)
        self.slot = slot
        self.tag = tag  # makes file names unique per incarnation
        self.maps: Dict[str, torch.Tensor] = {}
        self._ids: Dict[str, Tuple[int, int]] = {}  # name -> (device, inode) of the file mapped
        self._gen = 0

    def allocate(self, sizes: Sequence[int]) -> List[torch.UntypedStorage]:
        os.makedirs(self.dir, exist_ok=True)
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += _aligned(max(1, n))
        name = f"s{self.slot}-{self.tag}{self._gen:04x}.bin"
        self._gen += 1
        path = os.path.join(self.dir, name)
        _preallocate(path, total, f"memory snapshot slot {self.slot}")
        t = _map(path, total)
        self.maps[name], self._ids[name] = t, _file_id(path)
        storage = t.untyped_storage()
        return [storage[o:o + n] for o, n in zip(offsets, sizes)]

    def locate(self, t: torch.Tensor) -> Tuple[str, int]:
        """(file, byte offset of ``t``'s storage) for a tensor viewing one of the arena's buffers."""
        ptr = t.untyped_storage().data_ptr()
        name = self.locate_ptr(ptr)
        return name, ptr - self.maps[name].data_ptr()

    def locate_ptr(self, ptr: int) -> str:
        """The file whose mapping holds address ``ptr``."""
        for name, m in self.maps.items():
            base = m.data_ptr()
            if base <= ptr < base + m.numel():
                return name
        raise MemoryCheckpointError("a staged buffer is not in the memory arena (internal error)")

    def ensure(self, files: Dict[str, int]) -> Dict[str, torch.Tensor]:
        """Mapped files named and sized as ``files`` (a peer's copy), created as needed."""
        os.makedirs(self.dir, exist_ok=True)
        for name in files:
            if not _BIN_RE.match(name) or not name.startswith(f"s{self.slot}-"):
                raise CorruptCheckpointError(f"memory snapshot copy names an invalid file {name!r}")
        for name in list(self.maps):
            if name not in files or self.maps[name].numel() != files[name]:
                del self.maps[name]
        for name, size in files.items():
            if name not in self.maps:
                path = os.path.join(self.dir, name)
                if not os.path.exists(path) or os.path.getsize(path) != size:
                    if os.path.exists(path):
                        os.unlink(path)
                    _preallocate(path, size, f"copy of a peer's memory snapshot (slot {self.slot})")
                self.maps[name], self._ids[name] = _map(path, size), _file_id(path)
        return {name: self.maps[name] for name in files}

    def mapped(self, name: str, size: int) -> Optional[torch.Tensor]:
        """This process's mapping of file ``name`` when it still maps the file of that name in the
        directory (same device and inode, ``size`` bytes), else None. The pages a snapshot staged
        into are already in this process's page tables: a restore in the process that saved
        (a rollback) copies from them at memory speed instead of reading the file."""
        m = self.maps.get(name)
        if m is None or m.numel() != size:
            return None
        try:
            same = _file_id(os.path.join(self.dir, name)) == self._ids.get(name)
        except OSError:
            return None
        return m if same else None

    def retain(self, keep: Sequence[str]) -> None:
        """Delete this slot's files not in ``keep`` (after the stager let go of them)."""
        keep = set(keep)
        for name in list(self.maps):
            if name not in keep:
                del self.maps[name]
        remove_slot_files(self.dir, self.slot, keep)

    def close(self) -> None:
        self.maps.clear()
        self._ids.clear()


def remove_slot_files(directory: str, slot: int, keep: Iterable[str] = ()) -> None:
    """Delete the arena files of ``slot`` in an owner's ``directory``, except ``keep``."""
    keep = set(keep)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        m = _BIN_RE.match(name)
        if m and int(m.group(1)) == slot and name not in keep:
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def drop_other_runs(root: str, owners: Iterable[int], incarnation: Tuple[int, str], lowest: int) -> List[Tuple[int, int]]:
    """Delete the slots of ``owners`` on this node that another run (incarnation) of the job committed
    for a step ``>= lowest``: record first (the slot is invalid from then on), then its files.
    Returns ``(owner, step)`` of each slot deleted. A damaged record is left (it counts for nothing)."""
    dropped = []
    for owner in owners:
        for slot in SLOTS:
            try:
                rec = read_record(root, owner, slot)
                run, step = (rec.incarnation, rec.step) if rec is not None else (tuple(incarnation), 0)
            except (CorruptCheckpointError, ValueError, KeyError, TypeError, OSError):
                continue
            if run != tuple(incarnation) and step >= lowest:
                invalidate(root, owner, slot)
                remove_slot_files(owner_dir(root, owner), slot)
                dropped.append((owner, step))
    return dropped


def _file_id(path: str) -> Tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def open_files(root: str, owner: int, files: Dict[str, int]) -> Dict[str, torch.Tensor]:
    """Read-only views of a committed slot's files (``MAP_PRIVATE``: nothing is written back)."""
    out = {}
    d = owner_dir(root, owner)
    for name, size in files.items():
        if not _BIN_RE.match(name):
            raise CorruptCheckpointError(f"memory snapshot record names an invalid file {name!r}")
        path = os.path.join(d, name)
        if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) != size:
            raise CorruptCheckpointError(f"memory snapshot file {path} is missing or has the wrong size")
        out[name] = torch.from_file(path, shared=False, size=size, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    return out


# --------------------------------------------------------------------------- checksums
def record_hash() -> Dict[str, str]:
    """The header entry naming the block digests of new records (the durable saves' algorithm)."""
    return {"block_hash": save_block_hash().name}


def block_digests(buf: torch.Tensor, block: int = DEFAULT_BLOCK_SIZE, h: Optional[BlockHash] = None) -> str:
    """Packed block digests (of ``h``, default: :func:`record_hash`'s) of ``buf`` (uint8,
    contiguous) in blocks of ``block`` bytes."""
    h = h or save_block_hash()
    a = buf.numpy()
    return h.pack([h.digest(a[o:o + block]) for o in range(0, len(a), block)])


def verify_region(buf: np.ndarray, digests: np.ndarray, where: str, h: BlockHash, block: int = DEFAULT_BLOCK_SIZE) -> None:
    """Check every block of a region; :class:`CorruptCheckpointError` names the first bad one."""
    n = len(buf)
    if len(digests) != (n + block - 1) // block:
        raise CorruptCheckpointError(f"{where}: {len(digests)} block checksums for {n} bytes")
    for i, o in enumerate(range(0, n, block)):
        if h.digest(buf[o:o + block]) != int(digests[i]):
            raise CorruptCheckpointError(f"{where}: {h.label} mismatch in block {i} (bytes {o}..{min(n, o + block)})")


def node_usage(root: str) -> int:
    """Bytes this job's files take in the node directory (space a new snapshot may reuse)."""
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(dirpath, n))
            except OSError:
                pass
    return total


def owners(root: str) -> List[int]:
    """The owners with a directory on this node (own snapshots and copies, of any job size)."""
    try:
        return sorted(int(m.group(1)) for m in map(_OWNER_RE.match, os.listdir(root)) if m)
    except FileNotFoundError:
        return []


class RankLock:
    """``rank``'s place in this node's directory of the job, locked for a tier's life: two tiers given one
    ``job_id`` and directory (one per data-parallel group, say: both have a rank 0) would overwrite
    each other's snapshots and restore another rank's state. ``problem``: why it is not held (another
    open tier holds it). Released by :meth:`release`, or when the object goes (a tier that failed to start)."""

    def __init__(self, root: str, rank: int, job_id: str) -> None:
        os.makedirs(root, exist_ok=True)
        self.path = os.path.join(root, f".r{rank:05d}.lock")
        self.problem: Optional[str] = None
        self.fd: Optional[int] = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            if fcntl is not None:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
            self.problem = (f"memory tier: rank {rank}'s place in {root} is taken by another MemoryCheckpoints of job_id "
                            f"{job_id!r} that is still open (two tiers of one job_id and directory, e.g. one per "
                            "data-parallel group, would overwrite each other's snapshots): give each its own job_id")
        except OSError:  # (no flock on this filesystem: nothing to tell the tiers apart)
            pass

    def release(self, remove: bool = False) -> None:
        """Let go of the lock (``remove``: and its file, as the job's directory goes)."""
        if remove and self.fd is not None:
            with contextlib.suppress(OSError):
                os.remove(self.path)
        if self.fd is not None:
            os.close(self.fd)  # (releases the lock)
            self.fd = None

    __del__ = release


def remove_owner(root: str, owner: int) -> None:
    """Delete an owner's directory (both slots, records first so nothing half-valid remains)."""
    for slot in SLOTS:
        invalidate(root, owner, slot)
    shutil.rmtree(owner_dir(root, owner), ignore_errors=True)


def remove_job(root: str) -> None:
    """Delete the job's directory on this node when nothing of it is left but ``node-id``."""
    try:
        rest = [n for n in os.listdir(root) if n != "node-id"]
    except FileNotFoundError:
        return
    if not rest:
        shutil.rmtree(root, ignore_errors=True)
