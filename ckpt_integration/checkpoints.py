"""The committed checkpoints of a directory (a local path or an fsspec URL such as ``s3://...``)."""

from __future__ import annotations

from typing import Any, List

from .storage.checkpoint_dir import CONFIG_FILE
from .storage.filesystem import join, storage_for


def list_checkpoints(directory: Any) -> List[str]:
    """Paths of the committed checkpoints directly inside ``directory``, sorted by name.

    A checkpoint is committed once its ``metadata.json`` exists: every save writes it last,
    so the directories of interrupted saves, and any other files, are left out. A directory
    that does not exist holds none (``[]``).

    Example::

        ci.list_checkpoints("checkpoints/tiny_gpt")
        # ['checkpoints/tiny_gpt/epoch=2-step=45.ckpt', 'checkpoints/tiny_gpt/last.ckpt']
    """
    storage, d = storage_for(directory)
    if not storage.isdir(d):
        return []
    return [join(d, n) for n in storage.listdir(d) if storage.exists(join(d, n, CONFIG_FILE))]
