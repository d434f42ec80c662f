"""Files shared by all backends: the commit marker, common state and manifest.

* ``metadata.json`` - ``{"sharded_backend", "sharded_backend_version",
  "common_backend", "common_backend_version"}`` exactly as Megatron-Core writes
  it (Megatron builds a dataclass from it, so no extra keys may go there). It
  is written **last**, atomically, after every rank's data is durable: a
  directory without it is an incomplete save and is never loaded.
* ``common.pt`` - the common (non-sharded) state, ``torch.save``'d by rank 0.
* ``manifest.json`` - our own record: format version, world size, per-file checksums, and per stored
  item its digest and the digests of its blocks of tensor data (XXH3-64 or CRC32, ``checksum.py``)
  as one binary table (``item_table.py``). Optional on load (Megatron/DCP lack it). Formats 1-3
  (JSON tables) are refused by loads and read only by ``convert`` (``item_table.py``).
* ``ckpt_integration.json`` - the save marker, written *first* by every save (see
  :mod:`.claim`): says that the directory is ours and that the checkpoint has a
  ``manifest.json``, so a deleted manifest is reported as damage instead of the
  checkpoint silently loading unchecked. A separate file because ``metadata.json``
  must stay Megatron's.

A directory without ``metadata.json`` is an interrupted save when it holds files only
our saves (or Megatron-Core's) write; a directory with only ``.metadata`` and data files
is a complete checkpoint of plain PyTorch DCP (``torch.distributed.checkpoint.save``),
which loads as a foreign checkpoint (tensors and objects; no common state, no checksums).

Every JSON file is parsed by :func:`load_json`: malformed or hostile content (deep
nesting included) raises :class:`CorruptCheckpointError`, never ``RecursionError``.
"""

from __future__ import annotations

import binascii
import io
import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Dict, Hashable, Iterable, Mapping, Optional, Tuple, Union

import torch

from ..errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsupportedCheckpointError,
)
from .checksum import BlockHash, block_hash, check_sealed, crc32, save_block_hash, sealed_json, write_recorded
from .fingerprint import Recorded
from .item_table import (LEGACY_VERSIONS, MANIFEST_FILE, BlockRecord, ItemTable, TableBlockRecords, TableItemDigests,
                         decode_text, refusal, upgrade)
from .checkpoint_index import INDEX_FILE, CheckpointIndex
from .claim import MARKER_FILE, interrupted_overwrite_hint
from .filesystem import CheckpointLocation, join
from .safe_pickle import object_payload, safe_torch_load

logger = logging.getLogger(__name__)

CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
WRITER_FILE = MARKER_FILE  # "ckpt_integration.json"
FORMAT_NAME = "ckpt_integration"
# 1-3: JSON item tables (item_table.py: converted, not loaded);
# 4: the per-item tables as one binary table in "tables" (see item_table.py), the block digest
# named by "block_hash"; 5: adds "fingerprints" (fingerprint.py); 6 (torch_dist): both, and the chunk
# records of chunk_index.bin, are one table in index.bin (checkpoint_index.py), which the manifest names in
# "files"; zarr checkpoints kept format 5 (their chunks are recorded in zarr_index.json); 7: the manifest seals
# itself (checksum.sealed_json: "head_crc32", "manifest_crc32"), items as in 6 (torch_dist) or 5 (zarr)
MANIFEST_VERSION = 7
SUPPORTED_MANIFEST_VERSIONS = (4, 5, 6, 7)
ZARR_MANIFEST_VERSION = 7
SEALED_VERSION = 7
# The format new saves write (tests write format-4 checkpoints through it)
SAVE_MANIFEST_VERSION = MANIFEST_VERSION

# backend -> supported versions of its on-disk layout
SUPPORTED_BACKENDS: Dict[str, Tuple[int, ...]] = {"torch_dist": (1,), "zarr": (1,)}
SUPPORTED_COMMON_BACKENDS: Dict[str, Tuple[int, ...]] = {"torch": (1,)}


@dataclass
class CheckpointingConfig:
    """Contents of ``metadata.json``: which backends wrote the checkpoint (Megatron-compatible)."""

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1


@dataclass
class Manifest:
    """Contents of ``manifest.json`` (our addition; absent in foreign checkpoints)."""

    format: str = FORMAT_NAME
    version: int = MANIFEST_VERSION
    created: float = field(default_factory=time.time)
    # Order of commits (what "newest" means, see ckpt_integration.checkpoints): the job's training step and a
    # number that grows with every commit into the parent directory; first in the file (listings read its head).
    step: Optional[int] = None
    commit_seq: Optional[int] = None
    # this commit's identity (a random hex string, unique per commit; "" in older checkpoints):
    # an opened checkpoint checks it to notice that its directory now holds another commit
    commit_id: str = ""
    # format 7: CRC32 of the text before it (what listings read), and last, of the whole text before it
    head_crc32: Optional[int] = None
    world_size: int = 1
    # the block digest algorithm (checksum.block_hash) of the item table's digests
    block_hash: Optional[str] = None
    # file name -> {"size": bytes, "crc32": ...}
    files: Dict[str, Dict[str, int]] = field(default_factory=dict)
    library_version: str = ""
    save: str = ""  # token of the save that wrote the checkpoint (see claim.py)
    # format 5: every saved chunk's layout-independent fingerprint (key, box, value), base64 of
    # fingerprint.encode_groups ("" when the save recorded none)
    fingerprints: str = ""
    # per stored item ("file", offset): the digest of its bytes and, for tensor items, where its data
    # lies and the digests of its blocks (bytes before the data, each data block, bytes after it;
    # empty ones left out), as one binary table, base64 (item_table.py); last in the file
    tables: str = ""
    manifest_crc32: Optional[int] = None

    def __post_init__(self) -> None:
        if self.block_hash is None:
            self.block_hash = save_block_hash().name

    @property
    def keeps_index(self) -> bool:
        """Whether the items are in ``index.bin`` (format 6, and 7 of torch_dist) or in the manifest."""
        v = self.version
        return isinstance(v, int) and (v == 6 or (v >= SEALED_VERSION and INDEX_FILE in self.files))

    @property
    def hash(self) -> BlockHash:
        """The block digest algorithm of this checkpoint (raises UnknownBlockHashError if unknown)."""
        return block_hash(self.block_hash, MANIFEST_FILE)

    def index(self) -> Optional[CheckpointIndex]:
        """Format 6: the checkpoint's ``index.bin``, read and checked (``files``) on first use; missing or
        damaged: :class:`CorruptCheckpointError` naming it. None for formats 4-5 (``tables``)."""
        got = self.__dict__.get("_index")
        if got is not None or not self.keeps_index:
            return got
        at = self.__dict__.pop("_index_at", None)  # (kept until read: an opened checkpoint holds this manifest)
        if at is None:  # (a manifest built in memory: nothing to read it from)
            raise CorruptCheckpointError(f"format {self.version} keeps its items in {INDEX_FILE}, which was not read")
        try:
            raw = read_verified_file(at, INDEX_FILE, self, "checkpoint index")
            self.attach_index(CheckpointIndex(raw, self.hash, at.file(INDEX_FILE)))
        except (FileNotFoundError, CorruptCheckpointError) as e:
            self.__dict__["_index_at"] = at  # (asked again: read again, the same verdict)
            if isinstance(e, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(f"{at.file(INDEX_FILE)} is missing: the checkpoint's index (every item's "
                                         "place and digests) is lost, so its data cannot be verified") from None
        return self.__dict__["_index"]

    def attach_index(self, index: CheckpointIndex) -> None:
        """Use ``index`` (read here, or broadcast by a load's coordinator) as this manifest's index."""
        self.__dict__["_index"] = index

    def item_table(self, where: str = MANIFEST_FILE) -> ItemTable:
        """The decoded ``tables`` (one per ``tables`` text; :class:`CorruptCheckpointError` naming
        ``where`` if damaged); format 6: the table of its index's rows."""
        cached = self.__dict__.get("_item_table")
        if cached is not None and cached[0] is self.tables:
            return cached[1]
        index = self.index()
        out = index.item_table() if index is not None else decode_text(self.tables, self.hash, where)
        self.attach_item_table(out)
        return out

    def recorded_fingerprints(self, where: str = MANIFEST_FILE) -> Optional[Recorded]:
        """The fingerprints of the saved chunks (format 5; format 6: its index's rows; None: none recorded);
        a damaged table raises :class:`CorruptCheckpointError` naming ``where``."""
        index = self.index()
        if index is not None:
            return index.fingerprints()
        if not self.fingerprints:
            return None
        cached = self.__dict__.get("_fingerprints")
        if cached is not None and cached[0] is self.fingerprints:
            return cached[1]
        try:
            out = Recorded(self.fingerprints)
        except (ValueError, TypeError, binascii.Error) as e:
            raise CorruptCheckpointError(f"{where} is damaged: its fingerprint table: {e}") from None
        self.__dict__["_fingerprints"] = (self.fingerprints, out)
        return out

    def attach_item_table(self, table: ItemTable) -> None:
        """Use ``table`` (decoded from bytes that travelled without the base64 text, e.g. a load's
        broadcast) as this manifest's tables. (The mapping views are kept here, not on
        the table: they refer to it, and a table holding them would be a reference cycle.)"""
        self.__dict__["_item_table"] = (self.tables, table, TableItemDigests(table), TableBlockRecords(table))

    def checksums(self) -> Mapping[Tuple[str, int], int]:
        """``(file, offset) -> item digest`` over the item table (read-only: every reader of this
        manifest shares it; each entry converted when it is used)."""
        self.item_table()
        return self.__dict__["_item_table"][2]

    def block_records(self) -> Mapping[Tuple[str, int], BlockRecord]:
        """``(file, offset) -> BlockRecord`` of every tensor item saved with block checksums, over
        the item table (each record decoded on first use)."""
        self.item_table()
        return self.__dict__["_item_table"][3]


def manifest_text(manifest: "Manifest") -> str:
    """The manifest as JSON text (e.g. for a load's broadcast): the text it was read from, while
    its tables are those read (re-encoding tens of thousands of entries costs ~20 us each)."""
    cached = manifest.__dict__.get("_text")
    if cached is not None and cached[0] is manifest.tables:
        try:
            return bytes(cached[1]).decode("utf-8")
        except UnicodeDecodeError:  # valid JSON in another encoding: re-encode below
            pass
    return json.dumps(manifest_fields(manifest))


def manifest_fields(manifest: "Manifest") -> Dict[str, Any]:
    """The manifest's fields as a dict for ``json.dumps``, without ``dataclasses.asdict``'s deep copy
    (its tables have an entry per stored item: tens of thousands with many small tensors).
    Format 4 is written without ``fingerprints``, as its writers wrote it; format 6 without both
    (they are in index.bin)."""
    version = manifest.version if isinstance(manifest.version, int) else 5
    gone = ("fingerprints",) if version < 5 else ("fingerprints", "tables") if manifest.keeps_index else ()
    gone += ("head_crc32", "manifest_crc32") if version < SEALED_VERSION else ()
    return {f.name: getattr(manifest, f.name) for f in fields(manifest) if f.name not in gone}


def manifest_format(h: BlockHash) -> Dict[str, Any]:
    """The ``version`` and ``block_hash`` of a new manifest whose blocks use ``h``."""
    return {"version": SAVE_MANIFEST_VERSION, "block_hash": h.name}


ZARR_INDEX_FILE = "zarr_index.json"
CHUNK_INDEX_FILE = "chunk_index.bin"  # see chunk_index.py
_DATA_MARKERS = (".metadata", CHUNK_INDEX_FILE, INDEX_FILE, COMMON_FILE, MANIFEST_FILE, WRITER_FILE, ZARR_INDEX_FILE)
# files only our saves (and Megatron-Core's) write: with them and no commit marker a
# directory is an interrupted save, not a plain PyTorch DCP checkpoint
_OURS_ONLY = (CHUNK_INDEX_FILE, INDEX_FILE, COMMON_FILE, MANIFEST_FILE, WRITER_FILE, ZARR_INDEX_FILE)
_OUR_INDEXES = (CHUNK_INDEX_FILE, INDEX_FILE, ZARR_INDEX_FILE)  # (of those, what no other writer has: not common.pt)
DCP_METADATA_FILE = ".metadata"


def load_json(data: bytes, path: str) -> Any:
    """Parse a checkpoint JSON file; anything malformed or hostile raises CorruptCheckpointError."""
    try:
        return json.loads(data)
    except RecursionError:
        raise CorruptCheckpointError(f"{path} is damaged: its JSON is nested too deeply to be a checkpoint file") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, too many digits, bad bytes
        raise CorruptCheckpointError(f"{path} is not valid JSON: {e}") from None


def looks_like_partial_save(ck: CheckpointLocation) -> bool:
    """Whether the directory holds files of a save that never committed."""
    try:
        names = ck.listdir()
    except OSError:
        return False
    return any(n.endswith(".distcp") or n in _DATA_MARKERS or n.endswith(".zarr") for n in names)


def is_plain_dcp(ck: CheckpointLocation) -> bool:
    """A complete checkpoint of plain PyTorch DCP: ``.metadata`` (DCP writes it last), no
    ``metadata.json`` and none of the files only our (or Megatron-Core's) saves write."""
    try:
        names = set(ck.listdir())
    except OSError:
        return False
    return DCP_METADATA_FILE in names and CONFIG_FILE not in names and not names.intersection(_OURS_ONLY)


def read_config(ck: CheckpointLocation) -> CheckpointingConfig:
    """Parse ``metadata.json`` with a specific error for every way a path can fail to be a checkpoint
    (an opened checkpoint: what it read at open)."""
    if ck.config is not None:
        return ck.config
    path = ck.file(CONFIG_FILE)
    raw_bytes: Optional[bytes] = None
    if ck.storage.remote:
        # Object stores: the commit marker first (one request, and strongly consistent where a
        # listing may lag behind a fresh commit); the checks below only explain a missing one.
        try:
            raw_bytes = ck.read(CONFIG_FILE, "commit marker")
        except (FileNotFoundError, CorruptCheckpointError):
            raw_bytes = None
    if raw_bytes is None:
        try:
            found = _config_or_explain(ck, path)
        except FileNotFoundError:  # the marker went between the check and the read (a deletion or a
            found = _config_or_explain(ck, path, again=True)  # replacement): explained once more
        if isinstance(found, CheckpointingConfig):
            return found
        raw_bytes = found
    return _parse_config(load_json(raw_bytes, path), ck.path, path)


def _config_or_explain(ck: CheckpointLocation, path: str, again: bool = False) -> Union[CheckpointingConfig, bytes]:
    """The commit marker's bytes (a plain PyTorch DCP checkpoint: its config), or the specific
    error for why the directory has none (``FileNotFoundError``: the marker went between the
    check and the read; ``again``: named as removed)."""
    storage, directory = ck.storage, ck.path
    if not storage.exists(directory):
        raise CheckpointNotFoundError(
            f"{directory} is not a distributed checkpoint: checkpoint directory {directory} does not exist"
            + interrupted_overwrite_hint(ck)
        )
    if not storage.isdir(directory):
        raise CheckpointNotFoundError(
            f"{directory} is a file, not a checkpoint directory (for a torch.save file use torch.load)"
        )
    if not storage.exists(path):
        if is_plain_dcp(ck):
            _note_unchecked(directory, "a PyTorch DCP checkpoint (no metadata.json): loaded as a foreign checkpoint, "
                                       "tensors and objects only (no common state)")
            return CheckpointingConfig("torch_dist", 1)
        if looks_like_partial_save(ck):
            raise IncompleteCheckpointError(
                f"{directory} is not a distributed checkpoint: it holds an incomplete checkpoint (files of a save, "
                f"no {CONFIG_FILE} commit marker), so the save that wrote it did not finish; use an "
                f"earlier checkpoint (a complete PyTorch DCP checkpoint would have {DCP_METADATA_FILE} and none of "
                f"{', '.join(_OURS_ONLY)})"
            )
        raise CheckpointNotFoundError(f"{directory} is not a distributed checkpoint: it has no {CONFIG_FILE}")
    try:
        return ck.read(CONFIG_FILE, "commit marker")
    except FileNotFoundError:
        if not again:
            raise
        raise CheckpointNotFoundError(f"{directory}: its {CONFIG_FILE} was removed while the checkpoint was being "
                                      "opened (it is being deleted or replaced by another process)") from None


def _parse_config(raw: object, directory: str, path: str) -> CheckpointingConfig:
    if not isinstance(raw, dict) or "sharded_backend" not in raw:
        raise CorruptCheckpointError(f"{path} does not describe a checkpoint (no 'sharded_backend')")
    known = {"sharded_backend", "sharded_backend_version", "common_backend", "common_backend_version"}
    unknown = set(raw) - known
    if unknown:
        raise UnsupportedCheckpointError(f"{path} has unknown fields {sorted(unknown)}; written by a newer version?")
    # Field types are checked before use: e.g. a list as backend name would otherwise
    # escape as "TypeError: unhashable type" from the lookups below.
    for name, typ in (("sharded_backend", str), ("common_backend", str), ("sharded_backend_version", int), ("common_backend_version", int)):
        if name in raw and (not isinstance(raw[name], typ) or isinstance(raw[name], bool)):
            raise CorruptCheckpointError(f"{path}: field {name!r} must be a {typ.__name__}, "
                                         f"got {type(raw[name]).__name__} {raw[name]!r}")
    config = CheckpointingConfig(**raw)
    versions = SUPPORTED_BACKENDS.get(config.sharded_backend)
    if versions is None:
        raise UnsupportedCheckpointError(f"{path}: unknown sharded backend {config.sharded_backend!r}; "
                                         f"supported: {sorted(SUPPORTED_BACKENDS)} (a newer writer, or a damaged file)")
    if config.sharded_backend_version not in versions:
        raise UnsupportedCheckpointError(f"{path}: {config.sharded_backend} format version "
                                         f"{config.sharded_backend_version} is not supported (supported: {list(versions)})")
    cversions = SUPPORTED_COMMON_BACKENDS.get(config.common_backend)
    if cversions is None or config.common_backend_version not in cversions:
        raise UnsupportedCheckpointError(f"{path}: unsupported common backend {config.common_backend!r} "
                                         f"version {config.common_backend_version}")
    return config


def check_strategy_version(directory: str, config: CheckpointingConfig, strategy: object) -> None:
    """A load strategy given as ``(backend, version)`` (or an object with ``backend``/``version``)
    must name the checkpoint's format version, as in Megatron-Core: ``("torch_dist", 2)`` on a
    version-1 checkpoint is refused instead of silently reading it as version 1."""
    if isinstance(strategy, tuple) and len(strategy) >= 2:
        version = strategy[1]
    else:
        version = getattr(strategy, "version", None) if strategy is not None and not isinstance(strategy, str) else None
    if version is None:
        return
    if isinstance(version, bool) or not isinstance(version, int) or version != config.sharded_backend_version:
        raise UnsupportedCheckpointError(
            f"{directory} is a {config.sharded_backend} checkpoint of format version {config.sharded_backend_version}, "
            f"but the load strategy asks for version {version!r}; pass sharded_strategy=({config.sharded_backend!r}, "
            f"{config.sharded_backend_version}) or leave it out (detected from the checkpoint)")


def write_config(ck: CheckpointLocation, config: CheckpointingConfig, durable: bool = True, exclusive: bool = False) -> None:
    """Write the commit marker (atomically). Call only when everything else is durable. ``exclusive``:
    fail with ``FileExistsError`` if a commit marker exists already (two saves committing into one
    directory: exactly one succeeds)."""
    ck.write(CONFIG_FILE, json.dumps(asdict(config)).encode(), durable, exclusive=exclusive)


def save_common(ck: CheckpointLocation, common_state_dict: Mapping[str, object], durable: bool = True) -> Dict[str, int]:
    """Write ``common.pt``; returns ``{"size", "crc32"}`` for the manifest."""
    buf = io.BytesIO()
    try:
        torch.save(common_state_dict, buf)
    except Exception as e:  # noqa: BLE001 - pickling raises TypeError, AttributeError, PicklingError...
        raise CheckpointingException(f"the common state cannot be saved to {ck.file(COMMON_FILE)}: "
                                     f"{_unpicklable(common_state_dict)} ({type(e).__name__}: {e})") from None
    return write_recorded(ck, COMMON_FILE, buf.getvalue(), durable)


def _unpicklable(value: object, path: str = "") -> str:
    """Which entry of ``value`` cannot be pickled (the first met, by its key path), for the error."""
    items = value.items() if isinstance(value, Mapping) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    found = next(filter(None, (_unpicklable(v, f"{path}.{k}" if path else str(k)) for k, v in items)), "")
    if not found and path:  # (its entries pickle: the value itself, then)
        try:
            torch.save(value, io.BytesIO())
        except Exception:  # noqa: BLE001 - the one to name
            found = f"{path!r} ({type(value).__name__})"
    return found or ("" if path else "a value in it")


def read_verified_file(ck: CheckpointLocation, name: str, manifest: Optional["Manifest"], what: str = "file") -> bytes:
    """The bytes of a small whole file (``common.pt``, ``.metadata``), checked against its
    manifest entry (size and CRC32) when there is one. Read once: the bytes checked are
    the bytes returned. Containment and regular-file checks as every reader's open."""
    cache = ck.file_cache
    if cache is not None and name in cache:  # an opened checkpoint: read and checked once
        return cache[name]
    data = ck.read(name, what)
    entry = (manifest.files.get(name) if manifest else None) or {}
    if "crc32" in entry and (len(data) != entry.get("size", len(data)) or crc32(data) != entry["crc32"]):
        raise CorruptCheckpointError(
            f"{ck.file(name)} is damaged: its size/checksum differs from the one recorded at save time "
            f"({len(data)} bytes, CRC32 {crc32(data):#010x}; recorded {entry.get('size')} bytes, "
            f"CRC32 {int(entry['crc32']):#010x})"
        )
    if cache is not None:
        cache[name] = data
    return data


def load_common(ck: CheckpointLocation, trusted: bool = False, allowed_globals: Optional[Iterable[Any]] = None,
                manifest: Optional[Manifest] = None, embedded: Optional[Callable[[], Optional[bytes]]] = None) -> Any:
    """The common state (``common.pt``), checksum-verified; ``{}`` for a plain PyTorch DCP checkpoint.

    ``manifest``: the checkpoint's manifest when the caller has read (and checked) it already,
    e.g. broadcast by a load's coordinator; ``None``: read here. ``embedded``: where there is no
    ``common.pt``, returns the bytes of a common state stored inside the DCP data (Megatron-Core
    0.19's ``common_state`` object, :func:`~.opened.embedded_common_bytes`), or None."""
    root = ck.path
    path = join(root, COMMON_FILE)
    if manifest is None:
        manifest = read_manifest_checked(ck)
    embedded_used = False
    try:
        data = read_verified_file(ck, COMMON_FILE, manifest, "common state file")
    except FileNotFoundError:
        if is_plain_dcp(ck):
            return {}
        data = embedded() if embedded is not None else None
        if data is None:
            raise CorruptCheckpointError(f"{path} is missing: the checkpoint has no common state (neither common.pt "
                                         "nor a 'common_state' object in its data)") from None
        path = f"the 'common_state' object in {root}"
        embedded_used = True
    try:
        out = safe_torch_load(io.BytesIO(data), trusted=trusted, allowed_globals=allowed_globals, what=path)
    except (RuntimeError, EOFError) as e:
        raise CorruptCheckpointError(f"{path} is damaged and cannot be read: {e}") from None
    return object_payload(out) if embedded_used else out  # (embedded: a ShardedObject's payload)


def write_manifest(ck: CheckpointLocation, manifest: Manifest, durable: bool = True, rendered: Optional[Dict[str, str]] = None) -> None:
    """Write ``manifest.json`` (before the commit marker). The marker :data:`WRITER_FILE`
    that says the checkpoint has one was written when the save began (see :mod:`.claim`).

    ``rendered``: fields given as JSON text already (the per-item tables of a large commit,
    :func:`.item_table.table_of_written`), written in place of the manifest's own value of that field.
    """
    ck.write(MANIFEST_FILE, manifest_json(manifest, rendered).encode(), durable)


def manifest_json(manifest: Manifest, rendered: Optional[Dict[str, str]] = None) -> str:
    """The text of ``manifest.json``: ``json.dumps`` of its fields, in order, with ``rendered``
    fields spliced in as given."""
    fields_ = manifest_fields(manifest)
    rendered = rendered or {}
    if isinstance(manifest.version, int) and manifest.version >= SEALED_VERSION:  # (fields in order: the head first)
        entries = [(k, json.dumps(v)) for k, v in fields_.items() if k not in ("head_crc32", "manifest_crc32")]
        return sealed_json([(k, rendered.get(k, v)) for k, v in entries], head=6)
    return "{" + ", ".join(f"{json.dumps(k)}: {rendered[k] if k in rendered else json.dumps(v)}" for k, v in fields_.items()) + "}"


def manifest_deleted(ck: CheckpointLocation) -> bool:
    """Whether ``manifest.json`` is gone from a checkpoint that was saved with one (damage)."""
    return manifest_expected(ck) and not ck.exists(MANIFEST_FILE)


def manifest_expected(ck: CheckpointLocation) -> bool:
    """Whether the checkpoint was saved with a ``manifest.json`` (so its absence is damage): it has our
    marker :data:`WRITER_FILE`, or, that lost too, an index only our saves write (Megatron-Core and
    PyTorch DCP write neither: their checkpoints load unverified, a note says so)."""
    # (an error of the storage propagates: taken for "not ours", it would load the checkpoint unchecked)
    return ck.exists(WRITER_FILE) or bool(set(ck.listdir()).intersection(_OUR_INDEXES))


def read_manifest(ck: CheckpointLocation, legacy: bool = False) -> Optional[Manifest]:
    """Our manifest, or ``None`` for checkpoints written by other tools (an opened checkpoint: the
    manifest it pinned). Formats 1-3 raise :class:`UnsupportedCheckpointError` naming the command
    that converts them; ``legacy=True`` (what ``convert`` opens its source with) reads them as
    the current format (:func:`.item_table.upgrade`)."""
    if ck.manifest_read:
        return ck.manifest
    directory = ck.path
    path = ck.file(MANIFEST_FILE)
    try:
        data = ck.read(MANIFEST_FILE, "manifest")
    except FileNotFoundError:
        return None
    raw = load_json(data, path)
    version = raw.get("version") if isinstance(raw, dict) else None
    old = version in LEGACY_VERSIONS and type(version) is int
    if old and not legacy:
        raise refusal(directory, path, version, SUPPORTED_MANIFEST_VERSIONS)
    if isinstance(version, int) and not old and version not in SUPPORTED_MANIFEST_VERSIONS:
        raise UnsupportedCheckpointError(
            f"{path} has format version {version} (supported: {list(SUPPORTED_MANIFEST_VERSIONS)}); "
            "written by a newer version of ckpt_integration?"
        )
    sealed = version in SUPPORTED_MANIFEST_VERSIONS and version >= SEALED_VERSION
    if sealed or (isinstance(raw, dict) and ("head_crc32" in raw or "manifest_crc32" in raw)):  # (sealed: checked whatever its version says)
        check_sealed(bytes(data), path)
    try:
        if old:
            raw = upgrade(raw, 5)  # (the last format whose items are in the manifest, as theirs were)
        manifest = Manifest(**raw)
        # Parse the checksum tables now, so that wrong shapes/values (valid JSON, not a
        # manifest) fail here as CorruptCheckpointError rather than later as
        # ValueError/AttributeError in the middle of a load.
        if not isinstance(manifest.files, dict):
            raise TypeError("'files' must be an object")
        if not all(isinstance(v, dict) for v in manifest.files.values()):
            raise TypeError("every 'files' entry must be an object")
        for name in ("step", "commit_seq"):
            v = getattr(manifest, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise TypeError(f"{name!r} must be an integer or null, got {v!r}")
        if not isinstance(manifest.commit_id, str):
            raise TypeError(f"'commit_id' must be a string, got {manifest.commit_id!r}")
        if manifest.keeps_index:
            if "block_hash" not in raw or "tables" in raw or "fingerprints" in raw or "crc32" not in manifest.files.get(
                    INDEX_FILE, {}):
                raise TypeError(f"format {manifest.version} names its block checksum algorithm ('block_hash') and keeps its items in "
                                f"{INDEX_FILE} (recorded in 'files' with its CRC32), not in 'tables' or 'fingerprints'")
            block_hash(manifest.block_hash, path)
            manifest.__dict__["_index_at"] = ck  # (read on first use: listings and pins need only the manifest)
            manifest.__dict__["_text"] = (manifest.tables, data)
            return manifest
        if "block_hash" not in raw or "tables" not in raw:
            raise TypeError(f"format {manifest.version} names its block checksum algorithm ('block_hash') and keeps "
                            "its item table in 'tables'")
        if (manifest.version >= 5) != ("fingerprints" in raw) or not isinstance(manifest.fingerprints, str):
            raise TypeError(f"format {manifest.version} {'has' if manifest.version >= 5 else 'has no'} 'fingerprints' (a string)")
        manifest.recorded_fingerprints(path)  # format 5: decoded and checked here
        block_hash(manifest.block_hash, path)  # an unknown algorithm: UnknownBlockHashError naming the file
        manifest.item_table(path)  # decoded and checked here (damage names the file)
        if not old:
            manifest.__dict__["_text"] = (manifest.tables, data)  # see manifest_text
        return manifest
    except (TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"{path} is damaged: {e}") from None


def read_manifest_checked(ck: CheckpointLocation, legacy: bool = False) -> Optional[Manifest]:
    """:func:`read_manifest`, but a missing manifest of a checkpoint saved with one is damage. ``None``
    (load unchecked) only for checkpoints of other writers (Megatron-Core, PyTorch DCP), with a note
    logged once per directory."""
    if ck.manifest_read:  # checked when it was opened
        return ck.manifest
    manifest = read_manifest(ck, legacy)
    if manifest is not None:
        return manifest
    path = ck.path
    if manifest_expected(ck):
        raise CorruptCheckpointError(
            f"{join(path, MANIFEST_FILE)} is missing, but {WRITER_FILE} says the checkpoint was saved with it: "
            "the recorded checksums are lost, so its data cannot be verified (refusing to load it unchecked)"
        )
    _note_unchecked(path, "no manifest.json (written by another tool, e.g. Megatron-Core or PyTorch DCP): "
                          "no checksums of ours; tensor data is checked against its zip records' CRC32s")
    return None


_noted: set = set()


def note_once(message: str, key: Optional[Hashable] = None) -> None:
    """Log ``message`` as a warning once per process for ``key`` (default: the message itself): what would
    otherwise repeat at every load or save (a foreign checkpoint read unverified, a fallback)."""
    key = message if key is None else key
    if key not in _noted:
        _noted.add(key)
        logger.warning("%s", message)


def _note_unchecked(directory: str, message: str) -> None:
    note_once(f"{directory}: {message}")
