"""Checksums of checkpoint bytes: block digests of tensor data (``manifest.json``), CRC32 of files.

**Block digests.** A tensor item's raw data is checksummed in blocks of ``block_size`` bytes
(plus one digest of the archive bytes before the data and one of those after it), so a ranged
read checks only the blocks it touches. The algorithm is recorded per checkpoint
(``manifest.json`` ``"block_hash"``) and every piece of code that computes or checks block
digests goes through one :class:`BlockHash`, looked up by that name with :func:`block_hash`:
``digest`` (one call over a whole block) and ``hasher`` (a running digest for a block that
arrives in pieces) compute, ``item_digest`` derives the whole-item digest from the block
digests, ``pack``/``unpack`` are the manifest's encoding.

* ``"xxh3_64"`` (new checkpoints; named in the manifest since format 3): XXH3-64 (seed 0) from the ``xxhash``
  package, 1.3 to 4 times the speed of zlib-ng's CRC32 here (benchmarks/crc_limit.py); it
  releases the GIL for inputs over 64 KiB, so reader threads verify in parallel. The item
  digest is XXH3-64 of the block digests as little-endian uint64, concatenated (no second
  pass over the data).
* ``"crc32"`` (chosen with :data:`SAVE_BLOCK_HASH`; the only one of formats 1 and 2): zlib's CRC32 (zlib-ng's SIMD implementation, which
  releases the GIL; the standard library's zlib without it - same values). The item digest is
  the CRC32 of the item's bytes, combined from the block CRC32s with :func:`crc32_combine`.

An item saved without a block record (objects, archives of an unusual layout) has the plain
digest of its bytes as its item digest, with either algorithm.

**Whole files** (``.metadata``, ``common.pt``, zarr chunks in ``zarr_index.json``, memory-tier
records) keep CRC32 (:func:`crc32`): they are small or read whole, and the key they are
recorded under (``"crc32"``) names the algorithm.

Megatron-Core's integrity manifest (``integrity.json``, core 0.18 and later), read and checked (storage layer).

A Megatron-Core checkpoint saved with integrity verification holds ``integrity.json``:
``{"algorithm": "sha256", "files": {name: hex digest}}`` over every file of the checkpoint
directory, written after ``metadata.json``. Such a checkpoint has no manifest of this library, so
its items carry no digests; the SHA-256 of every file is then what proves the bytes. When a
checkpoint without our manifest holds ``integrity.json``, opening it checks every file it lists
(read once, in 1 MiB pieces, on the coordinator of a collective open, as Megatron-Core's own
``verify_integrity_manifest`` does), and a missing, unreadable or different file is refused with a
:class:`~ckpt_integration.CorruptCheckpointError` naming it. ``verify`` reports the same.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
import re
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import xxhash

from ..errors import CorruptCheckpointError, UnknownBlockHashError
from .filesystem import CheckpointLocation

if TYPE_CHECKING:
    from typing_extensions import Buffer

try:  # pragma: no cover - depends on the environment
    from zlib_ng.zlib_ng import crc32 as _crc32
    from zlib_ng.zlib_ng import crc32_combine as _crc32_combine

    IMPLEMENTATION = "zlib-ng"
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32 as _crc32

    _crc32_combine = None
    IMPLEMENTATION = "zlib"

# Data block size of new checkpoints: the most a ranged read reads beyond what it needs is
# one block at each end of a contiguous run; the manifest grows by ~5.3 bytes per block.
DEFAULT_BLOCK_SIZE = 1 << 20


def crc32(data: Buffer, value: int = 0) -> int:
    """CRC32 of a bytes-like object, continuing from ``value`` (as :func:`zlib.crc32`)."""
    return _crc32(data, value)


# JSON files that carry their own CRC32s (manifest.json from format 7): one over the head (the fields a
# listing reads: format, version, commit order) written right after it, one over the rest written last
HEAD_SEAL = b', "head_crc32": '
WHOLE_SEAL = b', "manifest_crc32": '
_SEAL_VALUE = re.compile(rb"(\d{1,10})")


def sealed_json(entries: Sequence[Tuple[str, str]], head: int) -> str:
    """A JSON object of ``(key, JSON text)`` entries, in order, sealed: after the first ``head``
    entries, ``"head_crc32"``: the CRC32 of the text before it; last, ``"manifest_crc32"``: the CRC32
    of all the text before it. :func:`check_sealed` checks both (a listing checks the head alone)."""
    parts = [f"{json.dumps(k)}: {v}" for k, v in entries]
    first = ("{" + ", ".join(parts[:head])).encode()
    rest = (f"{HEAD_SEAL.decode()}{crc32(first)}" + "".join(", " + p for p in parts[head:])).encode()
    return (first + rest).decode() + f"{WHOLE_SEAL.decode()}{crc32(rest, crc32(first))}" + "}"


def check_sealed(data: bytes, where: str, whole: bool = True) -> None:
    """Check the CRC32s :func:`sealed_json` wrote (``whole=False``: the head's only, all a listing
    reads); :class:`CorruptCheckpointError` naming ``where`` when either is missing or differs."""
    for seal, what, at in ((HEAD_SEAL, "its head (format, step, commit order)", data.find(HEAD_SEAL)),
                           (WHOLE_SEAL, "its content", data.rfind(WHOLE_SEAL) if whole else -2)):
        if at == -2:
            continue
        m = _SEAL_VALUE.match(data, at + len(seal)) if at >= 0 else None
        end = m.end() if m is not None else -1
        if m is None or (seal is WHOLE_SEAL and data[end:].strip() != b"}"):
            raise CorruptCheckpointError(f"{where} is damaged: its own checksum of {what} is missing or malformed")
        if crc32(memoryview(data)[:at]) != int(m.group(1)):
            raise CorruptCheckpointError(f"{where} is damaged: {what} does not match its own checksum (a changed "
                                         "step, commit order or file record would otherwise go unnoticed)")


def write_recorded(ck: CheckpointLocation, name: str, data: bytes, durable: bool = True) -> Dict[str, int]:
    """Write the small file ``name`` of ``ck`` whole and atomically; returns its manifest entry (size
    and CRC32), what ``checkpoint_dir.read_verified_file`` checks at every read of it."""
    ck.write(name, data, durable)
    return {"size": len(data), "crc32": crc32(data)}


def check_zip_bytes(data: Buffer, what: str) -> None:
    """Raise :class:`CorruptCheckpointError` naming ``what`` when ``data``, a ``torch.save`` zip
    archive (an item of another writer's DCP checkpoint), cannot be read or a record of it fails its
    own CRC32 (``torch.load`` checks none: a flipped bit would load as a value). Bytes that are no zip
    archive (the legacy ``torch.save`` format) carry no CRCs and pass."""
    if bytes(memoryview(data)[:4]) == b"PK\x03\x04":
        check_zip_crcs(io.BytesIO(data), what)


def check_zip_crcs(source: Any, what: str) -> None:
    """Open the zip archive ``source`` (a path or a binary file) and read every record that has a CRC32
    (0: written without, as ``torch.save`` with ``compute_crc32`` off and this library's writer write
    them), checking it; raise :class:`CorruptCheckpointError` naming ``what`` (and the record) when the
    archive cannot be read or a record fails its check."""
    name = None
    try:
        with zipfile.ZipFile(source) as zf:
            for info in zf.infolist():
                name = info.filename
                if info.CRC:
                    with zf.open(info) as f:  # (zipfile compares the CRC32 at the end of the record)
                        while f.read(1 << 20):
                            pass
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, NotImplementedError) as e:
        where = "its zip archive" if name is None else f"record {name!r} of its zip archive"
        raise CorruptCheckpointError(f"{what} is damaged: {where} cannot be read or fails its CRC32 check ({e})") from None


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's crc32_combine)."""
    if _crc32_combine is not None:
        return _crc32_combine(crc1, crc2, len2)
    if len2 <= 0:
        return crc1
    tables = _shift_tables(len2)
    shifted = tables[0][crc1 & 0xFF] ^ tables[1][(crc1 >> 8) & 0xFF] ^ tables[2][(crc1 >> 16) & 0xFF] ^ tables[3][crc1 >> 24]
    return shifted ^ crc2


# --- pure-Python crc32_combine (only without zlib-ng): the CRC register is a linear map over
# GF(2); appending n zero bytes is a 32x32 bit matrix, built by squaring and cached per length
# (block, header and tail lengths repeat), then applied through four byte tables.
def _gf2_times(mat: Sequence[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: Sequence[int]) -> List[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


@functools.lru_cache(maxsize=64)
def _shift_tables(nbytes: int) -> List[List[int]]:
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    op = None
    n = nbytes
    while True:  # apply len2 zero bytes: squarings of the "one zero byte" operator
        even = _gf2_square(odd)
        if n & 1:
            op = even if op is None else [_gf2_times(even, c) for c in op]
        n >>= 1
        if not n:
            break
        odd = _gf2_square(even)
        if n & 1:
            op = odd if op is None else [_gf2_times(odd, c) for c in op]
        n >>= 1
        if not n:
            break
    cols = op  # column i: image of bit i
    return [[_gf2_times(cols, b << (8 * k)) for b in range(256)] for k in range(4)]


# --------------------------------------------------------------------------- block digests
CRC32 = "crc32"
XXH3_64 = "xxh3_64"
# The block digest new checkpoints record ("crc32": the same manifest format with 4-byte digests;
# tests write such checkpoints through it)
SAVE_BLOCK_HASH = XXH3_64


class _Crc32Hasher:
    """A running CRC32 with the interface of ``xxhash``'s hasher objects."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Buffer) -> None:
        self.value = _crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def _crc32_item(digests: Sequence[int], lengths: Sequence[int]) -> int:
    whole = 0
    for c, n in zip(digests, lengths):
        whole = crc32_combine(whole, int(c), int(n))
    return whole


def _xxh3_item(digests: Sequence[int], lengths: Sequence[int]) -> int:
    # the digests as little-endian u64s (struct, numpy takes ~1.5 us); a small item has three
    # (header, data, trailer): packed by a prepared Struct, not a format string built per item
    if len(digests) == 3:
        return xxhash.xxh3_64_intdigest(_PACK3(*digests))
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))


_PACK3 = struct.Struct("<3Q").pack


@dataclass(frozen=True)
class BlockHash:
    """One block-digest algorithm: what computes and checks the block digests of an item.

    ``digest(data)``: the digest of a whole block (a bytes-like object); ``hasher()``: a running
    digest (``update(data)`` per piece, ``intdigest()``) for a block read or written in pieces;
    ``item_digest(digests, lengths)``: the whole-item digest recorded in the manifest's
    ``items`` from the digests of the item's blocks (in order) and their lengths.
    """

    name: str  # as recorded in manifest.json
    label: str  # in messages
    width: int  # bytes per digest in the manifest's tables
    digest: Callable[[Any], int]
    hasher: Callable[[], Any]
    item_digest: Callable[[Sequence[int], Sequence[int]], int]

    def pack(self, digests: Sequence[int]) -> str:
        """Block digests as the manifest stores them: little-endian unsigned integers, base64."""
        return base64.b64encode(np.asarray(digests, dtype=f"<u{self.width}").tobytes()).decode("ascii")

    def unpack(self, text: str) -> np.ndarray:
        """Inverse of :meth:`pack` (raises ValueError for malformed input)."""
        return np.frombuffer(self._packed(text), dtype=f"<u{self.width}")

    def _packed(self, text: str) -> bytes:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
        if len(raw) % self.width:
            raise ValueError(f"block checksum table length is not a multiple of {self.width} bytes")
        return raw

    def show(self, value: int) -> str:
        """``value`` for a message, e.g. ``XXH3-64 0x0123456789abcdef``."""
        return f"{self.label} {int(value):#0{2 + 2 * self.width}x}"


_HASHES: Dict[str, BlockHash] = {
    CRC32: BlockHash(CRC32, "CRC32", 4, lambda data: _crc32(data), _Crc32Hasher, _crc32_item),
    XXH3_64: BlockHash(XXH3_64, "XXH3-64", 8, xxhash.xxh3_64_intdigest, xxhash.xxh3_64, _xxh3_item),
}
BLOCK_HASHES = tuple(_HASHES)


def block_hash(name: str, where: str = "") -> BlockHash:
    """The block-digest algorithm ``name``; :class:`UnknownBlockHashError` (naming ``where``, the
    file that records it) for a name this version does not know."""
    h = _HASHES.get(name) if isinstance(name, str) else None
    if h is None:
        raise UnknownBlockHashError(
            f"{where or 'the checkpoint'} records block checksums of algorithm {name!r}, which this version of "
            f"ckpt_integration does not know (known: {', '.join(BLOCK_HASHES)}); written by a newer version? "
            "Its data cannot be verified, so it is not loaded"
        )
    return h


def save_block_hash() -> BlockHash:
    """The algorithm new saves record (:data:`SAVE_BLOCK_HASH`)."""
    return block_hash(SAVE_BLOCK_HASH, "SAVE_BLOCK_HASH")


# --------------------------------------------------------------------------- Megatron-Core's integrity.json

INTEGRITY_FILE = "integrity.json"
_PIECE = 1 << 20


def read_sha_manifest(ck: CheckpointLocation) -> Optional[Dict[str, str]]:
    """``{file: sha256 hex}`` recorded in ``integrity.json``, or None when there is none."""
    path = ck.file(INTEGRITY_FILE)
    if not ck.exists(INTEGRITY_FILE):
        return None
    try:
        raw = json.loads(ck.read(INTEGRITY_FILE, "integrity manifest"))
    except ValueError as e:
        raise CorruptCheckpointError(f"{path} is damaged and cannot be decoded: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("files"), dict):
        raise CorruptCheckpointError(f"{path} is not an integrity manifest (no 'files' table)")
    algorithm = raw.get("algorithm", "sha256")
    if algorithm != "sha256":
        raise CorruptCheckpointError(f"{path} records digests of algorithm {algorithm!r}; only sha256 is known")
    files = raw["files"]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise CorruptCheckpointError(f"{path}: its 'files' table must map file names to hex digests")
    return files


def sha_problems(ck: CheckpointLocation, files: Dict[str, str]) -> List[Tuple[str, str]]:
    """``(message, file name)`` per recorded file that is missing, unreadable or whose SHA-256 differs."""
    out = []
    for name in sorted(files):
        try:
            reader = ck.open(name, "file", source=INTEGRITY_FILE)  # (containment checked there)
        except (OSError, CorruptCheckpointError) as e:
            out.append((f"{ck.file(name)}: missing or unreadable ({e})", name))
            continue
        h = hashlib.sha256()
        try:
            for at in range(0, reader.size, _PIECE):
                h.update(reader.read(at, min(_PIECE, reader.size - at)))
        except OSError as e:
            out.append((f"{ck.file(name)}: unreadable ({e})", name))
            continue
        finally:
            reader.close()
        if h.hexdigest() != files[name]:
            out.append((f"{ck.file(name)}: SHA-256 {h.hexdigest()[:16]}..., integrity.json records "
                        f"{files[name][:16]}...: the file is damaged", name))
    return out


def check_sha_manifest(ck: CheckpointLocation) -> bool:
    """Check every file ``integrity.json`` lists (see the module doc); False when there is none."""
    files = read_sha_manifest(ck)
    if files is None:
        return False
    problems = sha_problems(ck, files)
    if problems:
        raise CorruptCheckpointError(
            f"{ck} fails its integrity manifest ({INTEGRITY_FILE}, Megatron-Core): "
            + "; ".join(message for message, _ in problems))
    return True


__all__ = ["crc32", "crc32_combine", "write_recorded", "IMPLEMENTATION", "DEFAULT_BLOCK_SIZE", "BlockHash", "block_hash",
           "save_block_hash", "BLOCK_HASHES", "CRC32", "XXH3_64", "SAVE_BLOCK_HASH",
           "INTEGRITY_FILE", "check_sha_manifest", "read_sha_manifest", "sha_problems"]
