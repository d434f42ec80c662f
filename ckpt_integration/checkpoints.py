"""The committed checkpoints of a directory (a local path or an fsspec URL such as ``s3://...``), in order.

"Newest" is decided by what the jobs recorded, never by clocks alone: every commit writes into
``manifest.json`` the training step it holds (``global_step`` of Lightning, ``iteration`` of
Megatron-LM, or ``step=`` given to ``save``) and a commit sequence number, one more than
any checkpoint beside it. Checkpoints are ordered by step, then commit sequence, then the
time recorded at commit, then the modification time of ``metadata.json``, then the name.
Timestamps alone misorder checkpoints: object stores keep ``LastModified`` to the second (two
commits in one second tie), and the nodes of a shared filesystem have clocks that differ.
A committed checkpoint of ours whose manifest cannot be read is listed (first), but
:func:`newest_checkpoint` refuses to choose beside it: it may be the newest.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, Union

from .errors import CheckpointingException, CorruptCheckpointError
from .storage.claim import is_replace_sibling
from .storage.checkpoint_dir import CONFIG_FILE, MANIFEST_FILE, manifest_expected, read_manifest
from .storage.opened import commit_order
from .storage.filesystem import Storage, base_name, join, locate, storage_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitOrder:
    """What orders one committed checkpoint among others (``None``: not recorded)."""

    path: str
    step: Optional[int]
    commit_seq: Optional[int]
    created: Optional[float]
    mtime: Optional[float]
    # ours and committed, but its manifest cannot be read (missing, damaged, a newer format): why.
    # Its place among the others is unknown, so no checkpoint can be called the newest beside it
    damaged: Optional[str] = None

    def key(self) -> Tuple[Any, ...]:
        # missing values sort first (older): checkpoints of other writers record none
        is_last = base_name(self.path).startswith("last")
        return (_k(self.step), _k(self.commit_seq), _k(self.created), _k(self.mtime), is_last, self.path)

    def describe(self) -> str:
        parts = [f"global step {self.step}" if self.step is not None else "no step recorded",
                 f"commit {self.commit_seq}" if self.commit_seq is not None else "no commit number"]
        return ", ".join(parts)


def _k(v: Optional[float]) -> Tuple[int, Any]:
    return (0, 0) if v is None else (1, v)


def _mtime(storage: Storage, path: str) -> Optional[float]:
    """Modification time of ``path`` (seconds since the epoch), locally or through fsspec; None if unknown."""
    try:
        if not storage.remote:
            return os.path.getmtime(path)
        try:
            return storage.fs.modified(path).timestamp()
        except (NotImplementedError, AttributeError):
            info = storage.fs.info(path)
            for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
                v = info.get(key)
                if v is not None:
                    return v.timestamp() if hasattr(v, "timestamp") else float(v)
    except (OSError, ValueError, TypeError):
        pass
    return None


def commit_order_of(path: Union[str, os.PathLike]) -> CommitOrder:
    """The recorded order of one committed checkpoint (reads the head of its ``manifest.json``)."""
    ck = locate(path)
    storage, p = ck.storage, ck.path
    step, seq, created = commit_order(ck)
    mtime, damaged = None, None
    if created is None:  # no manifest (another writer): the commit marker's time is all there is
        mtime = _mtime(storage, ck.file(CONFIG_FILE))
        damaged = _unreadable_manifest(ck)
    return CommitOrder(os.fspath(path) if not storage.remote else p, step, seq, created, mtime, damaged)


def _unreadable_manifest(ck: Any) -> Optional[str]:
    """Why the manifest of a checkpoint saved with one cannot be read, or None (read fine, or a
    checkpoint of another writer, which has none)."""
    if not manifest_expected(ck):
        return None
    try:
        if read_manifest(ck.afresh()) is None:
            return f"its {MANIFEST_FILE} is missing"
    except CheckpointingException as e:
        return str(e)
    return None


def _committed(directory: Union[str, os.PathLike], suffix: Optional[str] = None, depth: int = 0) -> List[str]:
    storage, d = storage_for(directory)
    out = _committed_in(storage, d, suffix, depth)
    given = os.fspath(directory)
    if not storage.remote and not given.startswith("file://") and not os.path.isabs(given):
        out = [os.path.join(given, os.path.relpath(p, d)) for p in out]  # (a relative directory: as given)
    return out


def _committed_in(storage: Any, d: str, suffix: Optional[str], depth: int) -> List[str]:
    if not storage.isdir(d):
        return []
    out = []
    for n in storage.listdir(d):
        named = suffix is None or n.endswith(suffix)
        if is_replace_sibling(n) or not (named or depth > 0):
            continue
        p = join(d, n)
        if storage.exists(join(p, CONFIG_FILE)):  # (one lookup per entry: committed, or a directory to look into)
            if named:
                out.append(p)
        elif depth > 0 and storage.isdir(p):
            out += _committed_in(storage, p, suffix, depth - 1)
    return out


def ordered_checkpoints(directory: Union[str, os.PathLike], suffix: Optional[str] = None,
                        depth: int = 0) -> List[CommitOrder]:
    """The committed checkpoints inside ``directory``, oldest first (see the module doc): directly
    inside, or up to ``depth`` directories further down (a Lightning file name with ``/``, as
    ``"{epoch}-{train/loss:.2f}"``, nests its checkpoints)."""
    return sorted((commit_order_of(p) for p in _committed(directory, suffix, depth)), key=CommitOrder.key)


def list_checkpoints(directory: Union[str, os.PathLike]) -> List[str]:
    """Paths of the committed checkpoints directly inside ``directory``, oldest first.

    A checkpoint is committed once its ``metadata.json`` exists: every save writes it last,
    so the directories of interrupted saves, and any other files, are left out; so are the
    ``<name>.tmp-<id>`` / ``<name>.old-<id>`` siblings of an overwrite in progress (committed for a
    moment, then renamed or deleted: a reader must not pick them). A directory
    that does not exist holds none (``[]``). Order: the training step each checkpoint
    recorded (``global_step`` / ``iteration`` of its common state, or ``save(..., step=)``),
    then the order of their commits (a number written at commit), then time; the last
    entry is the newest.

    Example::

        ci.list_checkpoints("checkpoints/tiny_gpt")
        # ['checkpoints/tiny_gpt/epoch=2-step=45.ckpt', 'checkpoints/tiny_gpt/last.ckpt']
    """
    return [c.path for c in ordered_checkpoints(directory)]


def abandoned_checkpoints(found: List[CommitOrder], run_of: Optional[Callable[[str], Optional[Tuple[int, float]]]],
                          left_by: Optional[Tuple[int, float]] = None) -> List[CommitOrder]:
    """The checkpoints of ``found`` (oldest first) on a timeline a later run abandoned: a run resumed from an
    earlier step than they hold (a rollback) and committed after them.

    ``run_of(path)``: the run that saved a checkpoint, as ``(step it started from, time it started)``, or None
    when not recorded (then nothing is abandoned). Only the run of the checkpoint committed last is asked (once,
    and only when that one is not also the newest by step): a checkpoint holding a later step than that run
    started from, committed before that run started, belongs to the timeline it left. Without this a rollback
    followed by a crash resumes the abandoned timeline, which holds the higher steps.

    ``left_by``: ``(step, time)`` of a run known otherwise (the memory tier's newest snapshot: its step and when
    the run that took it started): a checkpoint of a later step committed before that run started is of a
    timeline it left too (that run went on from an earlier step).
    """
    committed = [c for c in found if c.created is not None]
    if not committed:
        return []
    out = []
    if left_by is not None:
        out = [c for c in committed if c.step is not None and c.step > left_by[0] and c.created < left_by[1]]
    # (commit numbers count per directory: across the subdirectories a nested file name makes, the commit times)
    one_dir = len({os.path.dirname(c.path.rstrip("/")) for c in committed}) == 1
    last = max(committed, key=lambda c: (_k(c.commit_seq) if one_dir else (0, 0), c.created))
    run = run_of(last.path) if run_of is not None and last is not found[-1] else None
    if run is not None:
        from_step, started = run
        out += [c for c in committed if c.step is not None and c.step > from_step and c.created < started
                and c is not last and c not in out]
    return out


def newest_checkpoint(directory: Union[str, os.PathLike], suffix: Optional[str] = None, why: str = "",
                      depth: int = 0, run_of: Optional[Callable[[str], Optional[Tuple[int, float]]]] = None,
                      left_by: Optional[Tuple[int, float]] = None) -> Optional[str]:
    """The newest committed checkpoint in ``directory`` (names ending in ``suffix``; ``depth``: as for
    :func:`ordered_checkpoints`), or None.

    ``run_of``, ``left_by``: what the runs that saved them recorded, and a run known otherwise (see
    :func:`abandoned_checkpoints`): the checkpoints of a timeline a rollback abandoned are then left out
    (Lightning's strategies record their runs); None when every checkpoint is.

    Logs which one was chosen and why (``why`` says what asked, e.g. ``ckpt_path="last"``).
    A committed checkpoint of ours whose manifest cannot be read (deleted, emptied, damaged, a
    newer format) has no known place among the others; it may be the newest, so rather than
    resume from an older one without a word, this raises :class:`CorruptCheckpointError` naming it
    and the newest readable one. Checkpoints of other writers (no manifest) are ordered by time.
    """
    found = ordered_checkpoints(directory, suffix, depth)
    if not found:
        return None
    damaged = [c for c in found if c.damaged]
    if damaged:  # (it may be the newest: resuming from another one would silently lose its steps)
        readable = [c for c in found if not c.damaged]
        newest = f"the newest readable one is {readable[-1].path} ({readable[-1].describe()})" if readable else "none is readable"
        raise CorruptCheckpointError(
            f"{why + ': ' if why else ''}cannot tell which checkpoint in {directory} is the newest: "
            + "; ".join(f"{c.path} is committed but cannot be ordered ({c.damaged})" for c in damaged)
            + f"; {newest}. Check it with `ckpt-integration verify`, then repair or remove it, or resume from "
            "an explicit path")
    left = abandoned_checkpoints(found, run_of, left_by) if run_of is not None or left_by is not None else []
    if len(left) == len(found):
        return None  # (every checkpoint is of a timeline the run known otherwise left)
    if left:
        gone = {c.path for c in left}
        found = [c for c in found if c.path not in gone]
        logger.info("%sleft out %d checkpoint(s) of a timeline a later run abandoned (it resumed from an earlier "
                    "step and committed after them): %s", f"{why}: " if why else "", len(left),
                    ", ".join(f"{base_name(c.path)} ({c.describe()})" for c in left))
    best = found[-1]
    reason = f"{best.describe()}"
    if len(found) > 1:
        runner = found[-2]
        reason += f"; the next newest, {base_name(runner.path)}, has {runner.describe()}"
    logger.info("%s%s is the newest of %d committed checkpoint(s) in %s (%s; ordered by global step, then commit "
                "number, then time)", f"{why}: " if why else "", best.path, len(found), directory, reason)
    return best.path


def newest_beside(checkpoint_dir: Union[str, os.PathLike]) -> Optional[str]:
    """The newest committed checkpoint in the directory that holds ``checkpoint_dir`` (the base of an
    incremental save to ``checkpoint_dir``; that path itself counts when it holds a committed
    checkpoint, which an overwrite replaces), or None."""
    storage, p = storage_for(checkpoint_dir)
    parent = os.path.dirname(p.rstrip("/")) or "."
    found = ordered_checkpoints(parent)
    return found[-1].path if found else None


def save_base(
    base: Union[None, str, os.PathLike, Callable[[], Optional[str]]], checkpoint_dir: Union[str, os.PathLike]
) -> Union[None, str, Callable[[], Optional[str]]]:
    """What a save's ``base=`` argument becomes for :func:`~.execution.save.prepare_save`: a path, or for
    ``"auto"`` a function the coordinator calls to find the newest checkpoint beside the target."""
    if isinstance(base, str) and base == "auto":
        return lambda: newest_beside(checkpoint_dir)
    return base if base is None or callable(base) else storage_for(base)[1]  # (resolved now: see storage_for)


__all__ = ["CommitOrder", "abandoned_checkpoints", "commit_order_of", "list_checkpoints", "newest_beside",
           "newest_checkpoint", "ordered_checkpoints", "save_base"]
