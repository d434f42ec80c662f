"""Dtype names as checkpoints record them (``"float32"``, ``"bfloat16"``): one spelling for every
writer and reader of this library (``.metadata``'s companion index, the save's layouts, the
memory tier, the read-once exchange), with the lookups cached (once per tensor on hot paths)."""

from __future__ import annotations

from typing import Dict

import torch

from ..errors import CheckpointingException

_DTYPE_NAMES: Dict[torch.dtype, str] = {}
_ELEMENT_SIZES: Dict[torch.dtype, int] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def element_size(dtype: torch.dtype) -> int:
    size = _ELEMENT_SIZES.get(dtype)
    if size is None:
        size = _ELEMENT_SIZES[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointingException(f"unknown dtype {name!r}")
    return dt
