"""Helpers for nested state dicts (dicts and lists nested in any combination).

Pure functions, no I/O. Paths are tuples of dict keys / list indices.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Iterator, Tuple, Union

Path = Tuple[Any, ...]


def empty_like(d: dict) -> dict:
    """A new, empty dict of the same type as ``d`` (an OrderedDict stays one, a
    ``defaultdict`` keeps its factory); a plain dict where the type cannot be copied."""
    if type(d) is dict:
        return {}
    try:
        out = copy.copy(d)
        out.clear()
        return out
    except Exception:  # an exotic mapping subclass: keep the values, lose the type
        return {}


def nested_items(x: object, path: Path = ()) -> Iterator[Tuple[Path, Any]]:
    """Yield ``(path, leaf)`` for every non-container leaf of a nested dict/list."""
    # (leaves yielded here, not by a generator of their own: once per tensor of a save or load)
    if isinstance(x, dict):
        items: Iterable[Tuple[Any, Any]] = x.items()
    elif isinstance(x, list):
        items = enumerate(x)
    else:
        yield path, x
        return
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from nested_items(v, path + (k,))
        else:
            yield path + (k,), v


def nested_values(x: object) -> Iterator[Any]:
    """Yield every leaf of a nested dict/list."""
    for _, v in nested_items(x):
        yield v


def dict_list_map_inplace(f: Callable[[Any], Any], x: object) -> Any:
    """Replace every leaf ``v`` with ``f(v)`` in place; returns ``x`` (or ``f(x)`` for a leaf)."""
    # (``f`` called here for leaves, not through a call of this function each: once per tensor)
    if isinstance(x, dict):
        for k, v in x.items():  # (only values are replaced: the keys stay as they are)
            x[k] = dict_list_map_inplace(f, v) if isinstance(v, (dict, list)) else f(v)
        return x
    if isinstance(x, list):
        for i, v in enumerate(x):
            x[i] = dict_list_map_inplace(f, v) if isinstance(v, (dict, list)) else f(v)
        return x
    return f(x)


def dict_list_map_outplace(f: Callable[[Any], Any], x: object) -> Any:
    """Like :func:`dict_list_map_inplace` but builds new containers (of the same dict types)."""
    if isinstance(x, dict):
        out = empty_like(x)
        for k, v in x.items():
            out[k] = dict_list_map_outplace(f, v)
        return out
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def extract_matching_values(
    x: Union[dict, list], predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> Tuple[Any, Any]:
    """Split a nested structure into (matching, non-matching) parts by leaf predicate.

    A container appears on a side only where it holds something of that side, except
    that empty containers are kept on the non-matching side: they are state too (an
    empty ``lr_lambdas`` entry, empty hyper-parameters) and must survive a round trip.
    Dict types are kept (an OrderedDict stays one). Lists keep their positions as dict
    keys when ``return_lists_as_dicts`` is set, so that a later :func:`merge` puts each
    value back in its slot.
    """

    if isinstance(x, dict):
        matching, other = {}, empty_like(x)
        for k, v in x.items():
            if isinstance(v, (dict, list)):
                m, o = extract_matching_values(v, predicate, return_lists_as_dicts)
                if m:
                    matching[k] = m
                if o or not v:
                    other[k] = o
            elif predicate(v):
                matching[k] = v
            else:
                other[k] = v
        return matching, other
    if isinstance(x, list):
        if return_lists_as_dicts:
            m, o = extract_matching_values(dict(enumerate(x)), predicate, True)
            return m, o
        matching_l, other_l = [], []
        for v in x:
            if isinstance(v, (dict, list)) and v:
                m, o = extract_matching_values(v, predicate, return_lists_as_dicts)
                if m:
                    matching_l.append(m)
                if o:
                    other_l.append(o)
            elif isinstance(v, (dict, list)):
                other_l.append(v)  # an empty container is state of its own
            elif predicate(v):
                matching_l.append(v)
            else:
                other_l.append(v)
        return matching_l, other_l
    raise TypeError(f"expected a dict or list, got {type(x).__name__}")


def merge(x1: object, x2: object, key: Path = ()) -> Any:
    """Merge ``x2`` into ``x1`` recursively (in place for dicts); returns the result.

    A dict with integer keys merges into a list position by position (the
    inverse of ``extract_matching_values(..., return_lists_as_dicts=True)``).
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                x1[k] = v2
            else:
                x1[k] = merge(x1[k], v2, key + (k,))
        return x1
    if isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if not isinstance(k, int) or not 0 <= k < len(x1):
                raise ValueError(f"cannot merge key {k!r} into a list of length {len(x1)} at {key}")
            x1[k] = merge(x1[k], v2, key + (k,))
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(
                f"cannot merge lists of different lengths ({len(x1)} and {len(x2)}) at {key}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key + (i,))
        return x1
    if isinstance(x1, dict) and not x1:
        return x2
    if isinstance(x2, dict) and not x2:
        return x1
    raise ValueError(
        f"duplicate value at {key}: {type(x1).__name__} and {type(x2).__name__} "
        "(both the checkpoint and the request define it)"
    )


def format_path(path: Path) -> str:
    """Human-readable form of a nested path, e.g. ``model.layers[0].weight``."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<root>"


def diff(x1: object, x2: object, prefix: Path = ()) -> Tuple[list, list, list]:
    """Recursive comparison of two nested structures (Megatron-Core's ``dict_utils.diff``).

    Returns ``(only_left, only_right, mismatch)``: paths (tuples) present only in ``x1``,
    only in ``x2``, and ``(path, type(left), type(right))`` for values present in both that
    differ (tensors and numpy arrays element-wise; sharded values by their ``data``).
    Lists and tuples are compared position by position; extra positions count as only
    left/right (as paths, where Megatron-Core gives bare indices).

    Example: ``diff({"a": 1, "b": 2}, {"a": 1, "c": 3, "b": 5})`` ->
    ``([], [("c",)], [(("b",), int, int)])``
    """
    only_left: list = []
    only_right: list = []
    mismatch: list = []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1 if k not in x2]
        only_right = [prefix + (k,) for k in x2 if k not in x1]
        pairs = [(k, x1[k], x2[k]) for k in x1 if k in x2]
    elif isinstance(x1, (list, tuple)) and type(x1) is type(x2):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        pairs = list(zip(range(len(x1)), x1, x2))
    elif type(x1) is type(x2) and hasattr(x1, "replica_id") and hasattr(x1, "data"):
        return diff(x1.data, x2.data, prefix + (type(x1),))  # a sharded value: compare what it holds
    else:
        if _values_differ(x1, x2):
            mismatch.append((prefix, type(x1), type(x2)))
        return only_left, only_right, mismatch
    for k, v1, v2 in pairs:
        left, right, mis = diff(v1, v2, prefix + (k,))
        only_left += left
        only_right += right
        mismatch += mis
    return only_left, only_right, mismatch


def _values_differ(x1: object, x2: object) -> bool:
    import torch  # local: keep this module importable without torch for docs tooling

    if type(x1) is not type(x2):
        return True
    if type(x1).__name__ == "DTensor":  # compare local shards: DTensor ops may be collectives
        return _values_differ(x1.to_local(), x2.to_local()) or x1.placements != x2.placements
    if isinstance(x1, torch.Tensor):
        return x1.shape != x2.shape or x1.dtype != x2.dtype or not torch.equal(x1.cpu(), x2.cpu())
    if type(x1).__module__ == "numpy" and hasattr(x1, "shape"):
        import numpy as np

        return x1.shape != x2.shape or not np.array_equal(x1, x2)
    try:
        return bool(x1 != x2)
    except Exception:  # e.g. an ambiguous truth value: treat as different
        return True
