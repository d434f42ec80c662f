"""A save's directory from its claim to its replacement: which files of a directory this library
wrote, claiming a directory for one save, and putting a finished file or directory in place of
another (the library's one atomic-replace rule, :func:`replace`).

**The claim.**
Every save writes its marker ``ckpt_integration.json`` *first*, before any data, holding
a token unique to that save. The marker says three things:

* the directory's checkpoint files are ours (so a later save may clean up what a killed
  save left, and ``load`` reports such a directory as an interrupted save, while a
  complete PyTorch DCP checkpoint - ``.metadata`` and data files, no marker - loads as a
  foreign checkpoint);
* which save is writing there: the coordinator compares the token before it commits, so
  of two jobs saving into one directory at once the second committer fails;
* locally, the marker is also a lock: the coordinator holds ``flock`` on it for the whole save, so a
  save never cleans up (or mixes into) the files of a save still running; a killed process's lock
  vanishes with it. Object stores have no locks: a new prefix is claimed with a conditional PUT, a
  prefix an earlier save left is taken over (that save, if still running, fails at its commit).

What counts as ours (:func:`checkpoint_entry`): ``metadata.json``, ``.metadata``, ``chunk_index.bin``,
``common.pt``, ``manifest.json``, ``ckpt_integration.json``, ``zarr_index.json``, ``__<rank>_<i>.distcp``
(``<hint>__<rank>_<i>.distcp`` with a separation hint), the temporary names of atomic writes (``<one of those>.tmp-<n>``)
and the top-level arrays/objects listed in ``zarr_index.json``. Anything else in a target directory (a
user's ``notes.txt``, a nested checkpoint) makes a save refuse, naming it.

**The one atomic-replace rule.**
``save(overwrite=True)`` writes the new checkpoint into a staging sibling ``<dir>.tmp-*`` and,
once it is committed, puts it at ``<dir>``; ``convert``, ``export`` and the Lightning import write
their output beside ``OUT`` and put it there when complete. Both go through :func:`replace`, so
both keep the same promise: at every instant, and after a crash at any point, the old content or
the new one is complete (at the path, or - only on filesystems without an atomic exchange, between
the two renames - at the names the error and ``docs/format.md`` give).

The durability rule, in this order (``durable=True``):

1. **the new content is durable first**: every data file fsync'ed, then its directories (a save
   that wrote with ``durable=True`` has done so already and says ``data_synced=True``; the tools'
   writers have not, and :func:`sync_tree` does it here);
2. **one rename puts it in place**: a file over a file with ``rename(2)`` (atomic); where a
   directory is involved, an atomic exchange (Linux ``renameat2(RENAME_EXCHANGE)``), else two
   renames: the old one aside to ``<target>.old-<id>``, the new one in; if the second rename
   fails, the old one is moved back before the error is raised;
3. **the parent directory is fsync'ed**, so the rename itself survives a power loss;
4. only then is the old content removed (its commit marker first, see ``Storage.rmtree``).

On fsspec storage the same order holds where it means anything: an object is durable when its
PUT is acknowledged, and there is no directory to fsync; but object stores have no rename, so a
replacement there is refused (:func:`supports_replace`) instead of being emulated by copies that a
crash could leave half done.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, List, Optional, Set

from ..errors import CheckpointingException, CheckpointWriteError, SaveConflictError
from ..version import __version__
from .filesystem import CheckpointLocation, Storage, join, name_problem, writing
from .fs import fsync_dir, fsync_file

logger = logging.getLogger(__name__)

MARKER_FILE = "ckpt_integration.json"  # also checkpoint_dir.WRITER_FILE
FORMAT_NAME = "ckpt_integration"
CONFIG_FILE = "metadata.json"
ZARR_INDEX_FILE = "zarr_index.json"
KNOWN_FILES = frozenset({CONFIG_FILE, ".metadata", "chunk_index.bin", "index.bin", "common.pt", "manifest.json", MARKER_FILE,
                         ZARR_INDEX_FILE})
_DATA_FILE = re.compile(r"[^/\\]*__\d+_\d+\.distcp")  # with any separation-hint prefix
_TEMP_FILE = re.compile(r"(.+)\.tmp-[0-9-]+")

try:  # pragma: no cover - POSIX only
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None


# --------------------------------------------------------------------------- what is ours
def zarr_top_names(ck: CheckpointLocation, names: List[str]) -> Set[str]:
    """Top-level entries that ``zarr_index.json`` says are arrays or object files of the checkpoint."""
    if ZARR_INDEX_FILE not in names:
        return set()
    try:
        index = json.loads(ck.read(ZARR_INDEX_FILE, "zarr index"))
        keys = [k for k in index.get("tensors", {})] + [k for k in index.get("objects", [])]
    except Exception:  # a damaged index names nothing: its arrays then count as foreign
        return set()
    tops = set()
    for k in keys:
        if isinstance(k, str) and name_problem(k, nested=True) is None:
            tops.add(k.split("/", 1)[0])
            if "/" not in k:
                tops.add(f"{k}.pt")
    return tops


def checkpoint_entry(name: str, zarr_tops: Set[str] = frozenset()) -> bool:
    """Whether a directory entry is a file a checkpoint of ours (or Megatron-Core's) consists of."""
    if name in KNOWN_FILES or _DATA_FILE.fullmatch(name) or name in zarr_tops:
        return True
    m = _TEMP_FILE.fullmatch(name)
    return bool(m and m.group(1) in KNOWN_FILES)


def classify_entries(ck: CheckpointLocation) -> tuple:
    """``(ours, foreign)`` entry names of the directory (by name, see :func:`checkpoint_entry`)."""
    names = ck.listdir()
    tops = zarr_top_names(ck, names)
    ours = [n for n in names if checkpoint_entry(n, tops)]
    return ours, [n for n in names if n not in ours]


def read_marker(ck: CheckpointLocation) -> Optional[dict]:
    """The parsed marker of the directory if it is one of ours, else None (missing, damaged, foreign)."""
    try:
        raw = json.loads(ck.read(MARKER_FILE, "save marker"))
    except Exception:  # missing, a link out, not a file, damaged, hostile: not a marker of ours
        return None
    return raw if isinstance(raw, dict) and raw.get("format") == FORMAT_NAME else None


def describe_names(names: List[str], limit: int = 10) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


# --------------------------------------------------------------------------- locks
_HELD = "held"
_UNSUPPORTED = "unsupported"


def _try_lock(path: str) -> Any:
    """An fd of ``path`` with an exclusive flock; ``_HELD`` if another open file holds it;
    ``_UNSUPPORTED`` where the filesystem has no flock (some network filesystems)."""
    if fcntl is None:
        return _UNSUPPORTED
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return _HELD
    except OSError:
        os.close(fd)
        return _UNSUPPORTED


def _unlock(fd: int) -> None:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)  # also when a forked child still holds a copy of the fd
    except OSError:
        pass
    try:
        os.close(fd)
    except OSError:
        pass


def _marker_bytes(token: str) -> bytes:
    return json.dumps({"format": FORMAT_NAME, "library_version": __version__, "manifest": "manifest.json",
                       "save": token, "started": time.time()}).encode()


def _write_marker(where: CheckpointLocation, token: str, replace: bool, durable: bool) -> Optional[int]:
    """:func:`_write_marker_file`; an OS error (a full disk, no permission) is a
    :class:`CheckpointWriteError` naming the file, as for every other file of a save."""
    with writing(where.file(MARKER_FILE)):
        return _write_marker_file(where, token, replace, durable)


def _write_marker_file(where: CheckpointLocation, token: str, replace: bool, durable: bool) -> Optional[int]:
    """Write this save's marker; locally return an fd holding its lock (taken before it is visible).
    ``replace=False``: the marker must not exist (``FileExistsError`` otherwise): of two saves
    claiming a new directory at once exactly one succeeds."""
    path = where.file(MARKER_FILE)
    if where.storage.remote:
        try:
            where.write(MARKER_FILE, _marker_bytes(token), durable, exclusive=not replace)
        except FileExistsError:  # (a create whose answer was lost, retried by the client: ours if it names us)
            if (read_marker(where) or {}).get("save") != token:
                raise
        return None
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident() % 100000}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                pass  # no flock here: the token check at commit still catches a second save
        os.write(fd, _marker_bytes(token))
        if durable:
            os.fsync(fd)
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            os.remove(tmp)
        if durable:
            fsync_dir(where.path)
    except BaseException:
        _unlock(fd)
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return fd


# --------------------------------------------------------------------------- claims
@dataclass
class SaveClaim:
    """One save's hold on its write directory (``write_dir``: the checkpoint or its staging dir).

    Picklable (sent to the other ranks): the lock fds stay with the coordinator.
    """

    where: CheckpointLocation
    staging: bool
    token: str
    fds: List[int] = field(default_factory=list)
    created: bool = False  # the save made ``write_dir`` (a failed save then removes it, emptied)

    @property
    def write_dir(self) -> str:
        return self.where.path

    def __getstate__(self) -> dict:
        return {**self.__dict__, "fds": []}

    def owned(self) -> bool:
        """Whether ``write_dir`` still holds this save's marker (nobody took the directory over)."""
        path = self.where.file(MARKER_FILE)
        if not self.where.storage.remote and self.fds:
            try:
                return os.fstat(self.fds[0]).st_ino == os.stat(path).st_ino
            except OSError:
                return False
        marker = read_marker(self.where)
        return bool(marker and marker.get("save") == self.token)

    def check_owned(self, what: str = "commit") -> None:
        if not self.owned():
            raise SaveConflictError(
                f"cannot {what} the save to {self.write_dir}: another save took over the directory while this one "
                "was writing (two jobs saved to the same path at once); this save is abandoned, the other one decides"
            )

    def release(self) -> None:
        for fd in self.fds:
            _unlock(fd)
        self.fds = []


def claim_new(ck: CheckpointLocation, token: str, durable: bool = True) -> SaveClaim:
    """Claim a directory that is empty or holds only leftovers of dead saves of ours.

    Raises :class:`SaveConflictError` if it holds files this library did not write, or if
    another save is running there (locally: its marker is locked).
    """
    storage, directory = ck.storage, ck.path
    created, link = not storage.exists(directory), directory.rstrip(os.sep)
    if created and not storage.remote and os.path.islink(link):  # (realpath stops at a link in a loop)
        why = "leads back to itself" if os.path.islink(os.path.realpath(link)) else \
            "does not exist; create that directory or remove the link"
        raise CheckpointingException(f"cannot save to {directory}: it is a symbolic link to {os.readlink(link)}, which {why}")
    with writing(directory):
        storage.makedirs(directory)
    ours, foreign = classify_entries(ck)
    if not storage.remote and MARKER_FILE not in ours and not foreign and ours and all(map(_marker_temp, ours)):
        _remove_dead_marker_temps(ck, ours)  # (raises if another save is writing its marker right now)
        ours = []
    if not ours and not foreign:
        try:
            fd = _write_marker(ck, token, replace=False, durable=durable)
        except FileExistsError:
            raise SaveConflictError(f"cannot save to {directory}: another save started writing there at the same time") from None
        return SaveClaim(ck, False, token, [fd] if fd is not None else [], created)
    marker = read_marker(ck) if MARKER_FILE in ours else None
    if marker is None:
        names = foreign + [n for n in ours if n not in foreign]
        raise SaveConflictError(
            f"cannot save to {directory}: it holds files this library did not write ({describe_names(sorted(names))}). "
            "A save never mixes into or deletes such files: they may be another tool's checkpoint (PyTorch DCP, "
            "Megatron-Core) or an interrupted save of an older version. Remove them, or save to another directory"
        )
    if foreign:
        raise SaveConflictError(
            f"cannot save to {directory}: besides the files of an interrupted save it holds files this library did "
            f"not write ({describe_names(sorted(foreign))}); remove them, or save to another directory"
        )
    old = None
    if not storage.remote:
        old = _try_lock(ck.file(MARKER_FILE))
        if old == _HELD:
            raise SaveConflictError(
                f"cannot save to {directory}: another save is writing there right now (its marker "
                f"{MARKER_FILE} is locked by a running process, started {_started(marker)})"
            )
        if old == _UNSUPPORTED:
            logger.warning("%s: file locks are not supported here; taking over the leftovers of an earlier save "
                           "without knowing whether it still runs", directory)
    else:
        logger.warning("%s: taking over the files of an earlier save that never committed (object stores cannot "
                       "tell whether it still runs; if it does, it fails at its commit)", directory)
    try:
        logger.warning("removing %d files of an incomplete earlier save in %s", len(ours), directory)
        for n in ours:
            if n != MARKER_FILE:
                storage.remove_any(ck.file(n))
        fd = _write_marker(ck, token, replace=True, durable=durable)
    finally:
        if isinstance(old, int):
            _unlock(old)
    return SaveClaim(ck, False, token, [fd] if fd is not None else [])


def _marker_temp(name: str) -> bool:
    m = _TEMP_FILE.fullmatch(name)
    return bool(m and m.group(1) == MARKER_FILE)


def _remove_dead_marker_temps(ck: CheckpointLocation, names: List[str]) -> None:
    """A directory holding only temporary marker files: another save is writing its marker there right
    now (the writer locks it first: :class:`SaveConflictError`), or one was killed while it did (removed)."""
    for n in names:
        fd = _try_lock(ck.file(n))
        if fd == _HELD:
            raise SaveConflictError(f"cannot save to {ck.path}: another save started writing there at the same time")
        if isinstance(fd, int):
            _unlock(fd)
        try:
            ck.storage.remove_any(ck.file(n))
        except FileNotFoundError:  # (its save finished writing it: the exclusive marker write decides)
            pass


def _started(marker: dict) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(marker.get("started"))))
    except (TypeError, ValueError, OverflowError):
        return "at an unknown time"


def claim_staging(ck: CheckpointLocation, staging: str, token: str, durable: bool = True) -> SaveClaim:
    """Claim a fresh staging directory (``staging``: a sibling path on the same storage) for
    replacing the committed checkpoint ``ck``.

    Also locks the committed checkpoint's marker (if it has one), so two saves replacing
    the same checkpoint at once do not both proceed.
    """
    storage, checkpoint_dir = ck.storage, ck.path
    fds: List[int] = []
    current = _try_lock(ck.file(MARKER_FILE)) if not storage.remote else None
    if current == _HELD:
        raise SaveConflictError(f"cannot save to {checkpoint_dir}: another save is replacing it right now")
    if isinstance(current, int):
        fds.append(current)
    fresh = ck.at(staging)
    try:
        with writing(staging):
            os.makedirs(staging)
        fd = _write_marker(fresh, token, replace=False, durable=durable)
    except BaseException:
        for f in fds:
            _unlock(f)
        raise
    return SaveClaim(fresh, True, token, ([fd] if fd is not None else []) + fds)


def staging_is_dead(path: str) -> bool:
    """Whether an uncommitted ``<dir>.tmp-*`` staging directory belongs to no running save."""
    fd = _try_lock(join(path, MARKER_FILE))
    if isinstance(fd, int):
        _unlock(fd)
        return True
    return fd is None  # no marker: killed before it wrote one (or an older version's)


def library_entries(ck: CheckpointLocation) -> List[str]:
    """The entries of the directory that are checkpoint files (for cleaning up a failed save)."""
    return classify_entries(ck)[0]


def remove_dead_staging(where: CheckpointLocation) -> None:
    """Delete the ``<dir>.tmp-*`` / ``<dir>.old-*`` siblings left by overwrite saves killed before they
    finished: a staging directory (committed or not: killed before or after its swap) or the old one.

    Called only while ``<dir>`` itself is committed and this save holds its claim (a save replacing
    ``<dir>`` holds it from its staging directory's creation to its swap), so such a sibling is the
    leftover of a save that is not running, and ``<dir>`` holds a complete checkpoint: the sibling is
    the older one, or the newer one of a save that never returned. One whose marker is still locked is
    left alone all the same. Only the names a save uses (``<dir>.tmp-`` / ``<dir>.old-`` and 8 hex
    digits) holding nothing but checkpoint files are ours: a user's ``<dir>.tmp-backup`` is never touched.
    """
    storage, checkpoint_dir = where.storage, where.path
    parent, base = os.path.split(sibling_stem(checkpoint_dir))
    for name in storage.listdir(parent or "."):
        path = join(parent, name)
        if (name.startswith((base + ".tmp-", base + ".old-")) and len(name) == len(base) + 13
                and is_replace_sibling(name) and storage.isdir(path)):
            if not staging_is_dead(path):
                continue
            foreign = classify_entries(where.at(path))[1]
            if foreign:
                logger.warning("leaving %s alone: it is named as a leftover of a save to %s, but holds files "
                               "that are not checkpoint files (%s)", path, checkpoint_dir, describe_names(foreign))
                continue
            what = "a committed" if storage.exists(join(path, CONFIG_FILE)) else "an uncommitted"
            logger.warning("removing %s: %s leftover of an earlier save to %s that did not finish (%s holds a "
                           "complete checkpoint)", path, what, checkpoint_dir, checkpoint_dir)
            storage.rmtree(path)


def remove_dead_partial(where: CheckpointLocation) -> bool:
    """Delete ``where`` if it holds only what a save of ours left when it was killed before its commit
    (our marker, not locked by a running save; no ``metadata.json``; nothing but checkpoint files):
    ``True`` when removed. Local directories only (an object store cannot tell a running save)."""
    if where.storage.remote or where.exists(CONFIG_FILE) or read_marker(where) is None:
        return False
    fd = _try_lock(where.file(MARKER_FILE))
    if not isinstance(fd, int):
        return False  # a save is writing there (or there are no locks to tell)
    try:
        if classify_entries(where)[1]:
            return False
        where.storage.rmtree(where.path)
    finally:
        _unlock(fd)
    return True


# --------------------------------------------------------------------------- the atomic-replace rule
def supports_replace(storage: Storage) -> bool:
    """Whether :func:`replace` can put one entry in place of another atomically on ``storage``."""
    return not storage.remote


def sibling_stem(target: str) -> str:
    """``target`` as its replace siblings' names begin; a name too long for a 13-byte suffix within the
    filesystem's 255 bytes is cut short and tagged with its hash (an overwrite could not name its staging)."""
    parent, base = os.path.split(target.rstrip(os.sep))
    if len(base.encode()) <= 242:
        return target.rstrip(os.sep)
    tag = hashlib.sha1(base.encode()).hexdigest()[:8]
    return os.path.join(parent, base.encode()[:233].decode(errors="ignore") + "~" + tag)


def old_name(target: str) -> str:
    """Where the two-rename fallback moves the old ``target`` aside (``<target>.old-<id>``)."""
    return f"{sibling_stem(target)}.old-{uuid.uuid4().hex[:8]}"


def staging_name(target: str, token: str) -> str:
    """Where an overwrite save writes the new ``target`` before it is put in place (``<target>.tmp-<id>``)."""
    return f"{sibling_stem(target)}.tmp-{token[:8]}"


# the two names above: both can hold a committed checkpoint for a moment, then vanish
_SIBLING = re.compile(r"\.(tmp|old)-[0-9a-f]{8}$")


def is_replace_sibling(name: str) -> bool:
    """Whether ``name`` is a :func:`staging_name` or :func:`old_name` (a reader must not pick it)."""
    return _SIBLING.search(name) is not None


def sync_tree(path: str) -> None:
    """fsync every regular file below ``path`` (or ``path`` itself, a file), then every directory
    bottom-up, so that the whole tree is durable before a rename makes it visible."""
    if not os.path.isdir(path) or os.path.islink(path):
        fsync_file(path)
        return
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_dir(root)


def replace(storage: Storage, staged: str, target: str, *, durable: bool = True, data_synced: bool = False) -> None:
    """Put ``staged`` (a complete file or directory, a sibling of ``target`` on the same
    filesystem) at ``target``, replacing what is there, by the rule of this module.

    ``durable=False`` skips every fsync (throwaway data, as ``save(durable=False)``);
    ``data_synced``: the caller already fsync'ed the files and directories of ``staged``.
    After a failure ``target`` holds the old content (or, if the failure came after the
    rename, the new one) and ``staged`` whatever did not end up at ``target``, for the caller
    to discard; only if the old content cannot be moved back after a failed second rename
    does the error name where it is instead.

    Example::

        storage, out = storage_for("out.safetensors")
        replace(storage, ".out.safetensors.tmp", out)
    """
    if not supports_replace(storage):
        raise CheckpointingException(
            f"cannot replace {target} atomically: object stores have no rename; write to a new location "
            "and delete the old one afterwards")
    if durable and not data_synced:
        sync_tree(staged)
    parent = os.path.dirname(os.path.join(os.getcwd(), target.rstrip(os.sep)))  # (not abspath: "link/.." as the kernel reads it)
    if not os.path.lexists(target):
        storage.rename(staged, target)  # nothing to keep: one rename
        _sync_parent(storage, parent, durable)
        return
    if not _is_dir(staged) and not _is_dir(target):
        storage.rename(staged, target)  # rename(2) replaces a file atomically
        _sync_parent(storage, parent, durable)
        return
    if storage.exchange(staged, target):
        _sync_parent(storage, parent, durable)
        _remove_old(storage, staged)  # the exchange left the old content at the staged name
        return
    old = old_name(target)
    storage.rename(target, old)
    try:
        storage.rename(staged, target)
    except BaseException as e:
        _move_back(storage, old, target, e)
        raise
    _sync_parent(storage, parent, durable)
    _remove_old(storage, old)


def _is_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def _sync_parent(storage: Storage, parent: str, durable: bool) -> None:
    if durable:
        storage.sync_dir(parent)


def _move_back(storage: Storage, old: str, target: str, cause: BaseException) -> None:
    """The second rename of the fallback failed: the old content goes back to ``target`` (the
    caller discards ``staged``, the unfinished replacement, as after any other failure)."""
    try:
        storage.rename(old, target)
    except OSError as e:
        out = CheckpointWriteError(
            f"replacing {target} failed between its two renames ({type(cause).__name__}: {cause}) and the old "
            f"content could not be moved back ({e}): it is complete at {old}; rename it back to {target}")
        out.errno = e.errno  # (strerror left unset: it would replace the message in str())
        raise out from cause


def _remove_old(storage: Storage, old: str) -> None:
    """Delete the replaced content. The new one is in place already: a failure here leaves debris
    with a recognisable name, which is logged, not raised."""
    try:
        if _is_dir(old):
            storage.rmtree(old)
        else:
            storage.remove(old)
    except OSError as e:
        logger.warning("replaced %s, but could not delete the old content at %s: %s", old, old, e)


def interrupted_overwrite_hint(ck: CheckpointLocation) -> str:
    """Where an ``overwrite=True`` save that crashed mid-swap left the checkpoints, if it did.

    Only the two-rename fallback (filesystems without an atomic exchange) can leave
    ``<dir>`` missing, with the old checkpoint at ``<dir>.old-*`` and the new committed
    one at ``<dir>.tmp-*``; nothing is lost, and this says where to find it.
    """
    storage, directory = ck.storage, ck.path
    if storage.remote:
        return ""
    parent, base = os.path.split(sibling_stem(directory))
    try:
        names = storage.listdir(parent or ".")
    except OSError:
        return ""
    found = [
        join(parent, n) for n in names
        if n.startswith(base + ".old-") or n.startswith(base + ".tmp-")
        if storage.exists(join(parent, n, CONFIG_FILE))
    ]
    if not found:
        return ""
    return (
        "; a save with overwrite=True was interrupted while replacing it, and these complete "
        f"checkpoints remain: {', '.join(found)} (.tmp-* is the newer one); rename one back to {directory}"
    )
