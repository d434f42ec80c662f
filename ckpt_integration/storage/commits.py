"""When a checkpoint was committed and which commit a directory holds: read from the head of its
``manifest.json`` (one small ranged read on object stores), for listings (``commit_order``), for
numbering the next commit beside it (``next_commit_seq``) and for pinning an opened checkpoint
(``commit_identity``)."""

from __future__ import annotations

import re
import threading
from typing import Dict, Optional, Tuple

from ..errors import CheckpointingException
from .checkpoint_dir import CONFIG_FILE, MANIFEST_FILE, WRITER_FILE, Manifest, is_plain_dcp, read_manifest
from .filesystem import join, parent_of, storage_for

# --------------------------------------------------------------------------- commit order
# The head of a manifest as json.dumps(asdict(Manifest)) writes it: "step" and "commit_seq" come
# right after the three leading fields, so the first bytes of the file hold them.
_ORDER_RE = re.compile(rb'^\{"format": "[^"]*", "version": \d+, "created": [-+.eE0-9]+, '
                       rb'"step": (null|-?\d+), "commit_seq": (null|-?\d+)[,}]')
_HEAD_BYTES = 512


def commit_order(directory: str) -> Tuple[Optional[int], Optional[int], Optional[float]]:
    """``(step, commit_seq, created)`` recorded in a checkpoint's manifest; ``None`` for what it lacks.

    Reads the first bytes of ``manifest.json`` (one small ranged read on object stores; the
    whole file only if its head does not have the expected layout). A checkpoint without a
    readable manifest (other writers, damage) gives ``(None, None, None)``: listing
    checkpoints never fails because one of them is damaged; loading it does.
    """
    storage, directory = storage_for(directory)
    try:
        reader = storage.open_in(directory, MANIFEST_FILE, "manifest")
        try:
            head = reader.read(0, min(reader.size, _HEAD_BYTES))
        finally:
            reader.close()
        m = _ORDER_RE.match(head)
        if m is not None:
            step, seq = (None if g == b"null" else int(g) for g in m.groups())
            created = float(re.match(rb'^\{"format": "[^"]*", "version": \d+, "created": ([-+.eE0-9]+)', head).group(1))
            return step, seq, created
        manifest = read_manifest(directory)
    except (OSError, CheckpointingException, ValueError):
        return None, None, None
    if manifest is None:
        return None, None, None
    created = manifest.created if isinstance(manifest.created, (int, float)) else None
    return manifest.step, manifest.commit_seq, created


_seq_lock = threading.Lock()
_last_seq: Dict[str, int] = {}


def next_commit_seq(checkpoint_dir: str) -> int:
    """The commit sequence number for a checkpoint about to be committed at ``checkpoint_dir``.

    One more than every number recorded by the committed checkpoints beside it (same parent
    directory), so commits are ordered by what the jobs recorded, not by clocks: the siblings'
    manifests are read once per parent directory and process, later commits count on.
    """
    parent = parent_of(checkpoint_dir)
    with _seq_lock:
        last = _last_seq.get(parent)
        if last is None:
            last = 0
            storage, p = storage_for(parent)
            try:
                names = storage.listdir(p) if storage.isdir(p) else []
            except OSError:
                names = []
            for n in names:
                sibling = join(p, n)
                if storage.exists(join(sibling, CONFIG_FILE)):
                    seq = commit_order(sibling)[1]
                    if seq is not None:
                        last = max(last, seq)
        _last_seq[parent] = last + 1
        return last + 1


# --------------------------------------------------------------------------- commit identity
_ID_RE = re.compile(rb'"commit_id": "([0-9a-f]*)"')


def commit_identity(directory: str) -> Optional[str]:
    """Which commit ``directory`` holds now: ``None`` when it holds no committed checkpoint (removed,
    or being rewritten in place: no ``metadata.json``), else the manifest's ``commit_id``.

    Checkpoints written before commit ids (or by other tools) are identified by what their
    manifest has (creation time and save token), or by ``""`` without a manifest: for those an
    opened checkpoint can notice a removal but not every replacement (see docs/reading.md).
    Costs one existence check and one small read (the manifest's head) on any storage.
    """
    storage, directory = storage_for(directory)
    if not storage.exists(join(directory, CONFIG_FILE)):
        return "" if is_plain_dcp(directory) else None  # plain DCP: ``.metadata`` is its commit marker
    try:
        reader = storage.open_in(directory, MANIFEST_FILE, "manifest")
    except (OSError, CheckpointingException):  # no manifest: ours mid-replacement, or a foreign checkpoint
        return None if storage.exists(join(directory, WRITER_FILE)) else ""
    try:
        head = reader.read(0, min(reader.size, _HEAD_BYTES))
    finally:
        reader.close()
    m = _ID_RE.search(head)
    if m is not None and m.group(1):
        return m.group(1).decode()
    return identity_of(read_manifest(directory))


def identity_of(manifest: Optional[Manifest]) -> str:
    """The commit identity :func:`commit_identity` reports for a checkpoint with this manifest."""
    if manifest is None:
        return ""
    return manifest.commit_id or f"created={manifest.created!r} save={manifest.save}"
