"""Writing a tool's output OUT: the checks on OUT, a staging sibling, the commit, the discard.

``convert``, ``export`` and the Lightning import all write their output the same way: OUT may not
be (or hold, or lie inside) the source; an existing OUT is kept unless ``overwrite``; the output is
written into a hidden sibling of OUT and put in place by :func:`commit_output` only when complete
(:func:`ckpt_integration.storage.claim.replace`: fsync'ed, then renamed, then the parent
directory fsync'ed), so a failed or interrupted run never damages an old OUT; a failed run's
partial output is removed by :func:`discard_output`.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, field
from typing import List, Tuple

from ..errors import CheckpointingException
from ..storage import claim as claims
from ..storage.checkpoint_dir import CONFIG_FILE
from ..storage.filesystem import storage_for

__all__ = ["ConvertResult", "check_not_source", "check_output", "staging_path", "commit_output", "discard_output",
           "disk_usage"]


@dataclass
class ConvertResult:
    """What :func:`~ckpt_integration.tools.convert_checkpoint` wrote.

    ``files``: the names in the output directory (the file name for a torch output);
    ``file_count`` / ``file_bytes``: every file written, counted recursively (zarr writes one
    file per chunk), and their total size;
    ``skipped``: ShardedObject keys not written (torch / safetensors outputs hold tensors);
    ``skipped_common``: common-state entries not written, each with the reason.
    """

    output: str
    to: str
    tensors: int = 0
    bytes: int = 0
    files: List[str] = field(default_factory=list)
    file_count: int = 0
    file_bytes: int = 0
    skipped: List[str] = field(default_factory=list)
    skipped_common: List[str] = field(default_factory=list)


def _contains(parent: str, child: str) -> bool:
    """Whether resolved path ``child`` is ``parent`` or lies below it."""
    return os.path.commonpath([parent, child]) == parent


def check_not_source(src: str, out: str) -> None:
    """Refuse an OUT that is SRC, holds SRC or lies inside SRC (resolved, symlinks followed).

    Replacing such an OUT would delete or change the source before (or while) it is read.
    """
    s, o = os.path.realpath(src), os.path.realpath(out)
    if s == o:
        raise CheckpointingException(
            f"output {out} is the source {src} itself: converting in place would destroy the source; choose another OUT")
    if _contains(o, s):
        raise CheckpointingException(
            f"output {out} contains the source {src}: replacing it would delete the source; choose another OUT")
    if _contains(s, o):
        raise CheckpointingException(
            f"output {out} lies inside the source {src}: writing there would change the source; choose another OUT")


def check_output(out: str, overwrite: bool, is_dir: bool) -> None:
    """OUT must not exist (or be an empty directory, for directory outputs) unless ``overwrite``, nor lie
    inside a checkpoint (a file there makes every later overwrite of that checkpoint refuse it as foreign)."""
    if os.path.lexists(out) and not overwrite and (not is_dir or not os.path.isdir(out) or os.listdir(out)):
        raise CheckpointingException(f"{out} already exists; pass --overwrite to replace it")
    parent = os.path.dirname(os.path.realpath(out))
    while parent != os.path.dirname(parent):
        if os.path.exists(os.path.join(parent, CONFIG_FILE)):
            raise CheckpointingException(f"output {out} lies inside the checkpoint {parent}: writing there would add "
                                         "a file the checkpoint's own saves refuse to replace; choose another OUT")
        parent = os.path.dirname(parent)


def staging_path(out: str, is_dir: bool) -> str:
    """A fresh hidden sibling of OUT to write into; :func:`commit_output` moves it to OUT.

    A sibling (same filesystem) so that the final move is a rename, and so that the old
    OUT stays intact until the new output is complete.
    """
    parent, base = os.path.split(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{base}.convert-tmp-{uuid.uuid4().hex[:8]}")
    if is_dir:
        os.mkdir(tmp)
    return tmp


def commit_output(tmp: str, out: str) -> None:
    """Put the finished output ``tmp`` in place of OUT (durably; only now is an old OUT removed)."""
    storage, out = storage_for(out)
    claims.replace(storage, tmp, out)


def _remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def discard_output(tmp: str) -> None:
    """Remove a failed run's partial output (and a writer's ``.partial`` file)."""
    for path in (tmp, tmp + ".partial"):
        try:
            _remove_path(path)
        except OSError:
            pass  # best effort: the original error is the one to report


def disk_usage(path: str) -> Tuple[int, int]:
    """``(number of files, total bytes)`` of a file or of a directory tree."""
    if not os.path.isdir(path):
        return 1, os.path.getsize(path)
    count = size = 0
    for root, _, names in os.walk(path):
        for name in names:
            count += 1
            size += os.path.getsize(os.path.join(root, name))
    return count, size
