"""Megatron-Core's integrity manifest (``integrity.json``, core 0.18 and later), read and checked (storage layer).

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

import hashlib
import json
import os
from typing import Dict, List, Optional, Tuple, Union

from ..errors import CorruptCheckpointError
from .filesystem import join, storage_for

INTEGRITY_FILE = "integrity.json"
_PIECE = 1 << 20


def read_sha_manifest(directory: Union[str, os.PathLike]) -> Optional[Dict[str, str]]:
    """``{file: sha256 hex}`` recorded in ``integrity.json``, or None when there is none."""
    storage, root = storage_for(directory)
    path = join(root, INTEGRITY_FILE)
    if not storage.exists(path):
        return None
    try:
        raw = json.loads(storage.read_bytes(path, "integrity manifest"))
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


def sha_problems(directory: Union[str, os.PathLike], files: Dict[str, str]) -> List[Tuple[str, str]]:
    """``(message, file name)`` per recorded file that is missing, unreadable or whose SHA-256 differs."""
    storage, root = storage_for(directory)
    out = []
    for name in sorted(files):
        try:
            reader = storage.open_in(root, name, "file", source=INTEGRITY_FILE)  # (containment checked there)
        except (OSError, CorruptCheckpointError) as e:
            out.append((f"{join(root, name)}: missing or unreadable ({e})", name))
            continue
        h = hashlib.sha256()
        try:
            for at in range(0, reader.size, _PIECE):
                h.update(reader.read(at, min(_PIECE, reader.size - at)))
        except OSError as e:
            out.append((f"{join(root, name)}: unreadable ({e})", name))
            continue
        finally:
            reader.close()
        if h.hexdigest() != files[name]:
            out.append((f"{join(root, name)}: SHA-256 {h.hexdigest()[:16]}..., integrity.json records "
                        f"{files[name][:16]}...: the file is damaged", name))
    return out


def check_sha_manifest(directory: Union[str, os.PathLike]) -> bool:
    """Check every file ``integrity.json`` lists (see the module doc); False when there is none."""
    files = read_sha_manifest(directory)
    if files is None:
        return False
    problems = sha_problems(directory, files)
    if problems:
        raise CorruptCheckpointError(
            f"{storage_for(directory)[1]} fails its integrity manifest ({INTEGRITY_FILE}, Megatron-Core): "
            + "; ".join(message for message, _ in problems))
    return True


__all__ = ["INTEGRITY_FILE", "check_sha_manifest", "read_sha_manifest", "sha_problems"]
