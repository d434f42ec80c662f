"""The base of an incremental save (execution layer): which earlier checkpoint a save compares with,
opened collectively, and which tensors are expected to stay unchanged (``storage/incremental.py``
decides what is linked)."""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable, Optional, Union

import torch

from ..errors import CheckpointingException
from ..storage.checkpoint_dir import note_once
from ..storage.incremental import BaseFiles, base_files
from .dist import Group, describe_error as _describe
from .shared_metadata import open_shared

logger = logging.getLogger(__name__)


def frozen(t: torch.Tensor) -> bool:
    """A parameter that does not train (``requires_grad=False``), or a view of one: expected to be saved
    unchanged at the next save, so an incremental save keeps it in data files of its own."""
    b = t._base if t._base is not None else t
    return isinstance(b, torch.nn.Parameter) and not b.requires_grad


def resolve_base(base: Union[None, str, os.PathLike, Callable[[], Optional[str]]], checkpoint_dir: str) -> Optional[str]:
    """Coordinator: the base checkpoint's path (``base`` itself, or what the callable returns), or None."""
    try:
        found = base() if callable(base) else base
    except Exception as e:  # (listing the directory failed): a save never fails for want of a base
        logger.warning("save to %s: no base checkpoint for an incremental save (%s); writing every byte", checkpoint_dir,
                       _describe(e))
        return None
    return None if found is None else os.fspath(found)


def open_base(path: Optional[str], backend: str, rank: int, group: Group, checkpoint_dir: str,
              keys: Iterable[str] = ()) -> Optional[BaseFiles]:
    """Collective: what this rank may take from the base checkpoint ``path`` (None: write every byte,
    said once on the coordinator)."""
    if path is None:
        return None
    if backend != "torch_dist":
        note_once(f"incremental saves apply to the torch_dist backend; the {backend} save to {checkpoint_dir} "
                 "writes every byte")
        return None
    try:
        opened, _ = open_shared(path, group)  # (a failure on the coordinator raises on every rank)
    except CheckpointingException as e:
        if rank == 0:
            logger.warning("save to %s: base checkpoint %s cannot be used (%s); writing every byte", checkpoint_dir,
                           path, _describe(e))
        return None
    try:
        found, why = base_files(opened, rank, keys)
    except Exception as e:  # (a local decision: linking is per rank)
        found, why = None, _describe(e)
    finally:
        opened.close()
    if found is None and rank == 0:
        logger.warning("save to %s: base checkpoint %s cannot be used: %s; writing every byte", checkpoint_dir, path, why)
    return found
