"""Shared by the tools: sizes (parse and print, binary units), the no-op progress bar, dtype helpers."""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Iterable, Optional, Protocol, Union

import torch

from ..errors import format_size  # (re-exported: the tools' summaries)

DEFAULT_MEMORY_BUDGET = 256 * 2**20
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
SAFETENSORS_INDEX = "model.safetensors.index.json"
READ_PIECE = 8 * 2**20  # bytes read (and checksummed) at a time where a whole record need not be held

ProgressFactory = Callable[..., Any]


class ProgressBar(Protocol):
    """What the tools call on a bar a :data:`ProgressFactory` made (tqdm's, or :func:`no_progress`'s)."""

    def update(self, n: int = 1) -> None: ...


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: Union[str, int]) -> int:
    """Parse ``"5GB"``, ``"500MB"``, ``"1.5GiB"``, ``"4096"`` into bytes (GB = 10^9, GiB = 2^30)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 5GB, 500MB, 64MiB, 4096)")
    number, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    power = "kmgtp".find(unit) + 1 if unit else 0
    return int(number * ((1024 if binary else 1000) ** power))


def no_progress(iterable: Optional[Iterable[Any]] = None, **_: object) -> Any:
    """The :data:`ProgressFactory` that draws nothing (the default of every tool; the CLI's with ``--quiet``)."""
    return _NullBar(iterable)


class _NullBar:
    def __init__(self, iterable: Optional[Iterable[Any]] = None):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).replace("torch.", "")


@functools.lru_cache(maxsize=None)
def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()
