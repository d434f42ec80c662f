"""Sharded values of other libraries, recognised and converted to ours by their fields.

A Megatron-Core model's ``sharded_state_dict()`` returns Megatron's own
``ShardedTensor`` / ``ShardedObject`` / ``ShardedTensorFactory`` /
``LocalNonpersistentObject``. ``save`` and ``load`` accept them: each is converted to
the class of the same name in :mod:`ckpt_integration.mapping` from its fields (key,
data, dtype, shapes, offsets, replica_id, prepend_axis_num, allow_shape_mismatch,
flattened_range, a factory's build/merge functions, ...). Recognition goes by class
name along the class hierarchy, so Megatron is never imported here (and any library
with classes of these names and fields works the same way).

A value that *looks* sharded but cannot be converted (a class of one of these names
without the fields, an object carrying ``key``/``global_shape``/``global_offset``,
a DTensor split across ranks) is refused with an error naming its position: left in
the state dict it would be pickled into the common state by rank 0 alone, and every
other rank's part would be lost.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

from .dict_utils import empty_like, format_path
from .errors import CheckpointingException
from .mapping import LocalNonpersistentObject, ShardedBase, ShardedObject, ShardedTensor, ShardedTensorFactory

#: class names recognised (most specific first: a factory is also a ShardedBase)
KINDS = ("ShardedTensorFactory", "ShardedTensor", "ShardedObject", "LocalNonpersistentObject")
_OURS = (ShardedBase, LocalNonpersistentObject)
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_kind_by_type: Dict[type, Optional[str]] = {}


def _kind_by_name(cls: type) -> Optional[str]:
    kind = _kind_by_type.get(cls, "?")
    if kind == "?":
        names = {c.__name__ for c in cls.__mro__}
        kind = next((k for k in KINDS if k in names), None)
        if kind is None and "ShardedBase" in names:
            kind = "ShardedBase"
        _kind_by_type[cls] = kind
    return kind


def sharded_kind(x: object) -> Optional[str]:
    """``"ShardedTensor"``, ``"ShardedObject"``, ``"ShardedTensorFactory"`` or
    ``"LocalNonpersistentObject"`` for ours and other libraries' instances of these classes;
    ``None`` for anything else."""
    if isinstance(x, _PLAIN):
        return None
    kind = _kind_by_name(type(x))
    return kind if kind in KINDS else None


def is_foreign(x: object) -> bool:
    """An instance of another library's sharded class (not one of ours)."""
    return not isinstance(x, _OURS) and not isinstance(x, _PLAIN) and _kind_by_name(type(x)) is not None


def _describe(x: object) -> str:
    cls = type(x)
    return f"{cls.__module__}.{cls.__qualname__}"


def _fields(x: object, required: Tuple[str, ...], optional: Dict[str, Any]) -> Dict[str, Any]:
    missing = [f for f in required if not hasattr(x, f)]
    if missing:
        raise AttributeError(f"it has no {', '.join(missing)}")
    out = {f: getattr(x, f) for f in required}
    out.update({f: getattr(x, f, d) for f, d in optional.items()})
    if isinstance(out.get("replica_id"), list):
        out["replica_id"] = tuple(out["replica_id"])
    return out


def _convert(x: object, kind: str) -> Any:
    if kind == "ShardedTensor":
        f = _fields(
            x,
            ("key", "data", "dtype", "local_shape", "global_shape", "global_offset"),
            {"axis_fragmentations": None, "replica_id": 0, "prepend_axis_num": 0, "allow_shape_mismatch": False,
             "flattened_range": None},
        )
        return ShardedTensor(**f)
    if kind == "ShardedObject":
        return ShardedObject(**_fields(x, ("key", "data", "global_shape", "global_offset"), {"replica_id": 0}))
    if kind == "ShardedTensorFactory":
        f = _fields(x, ("key", "data", "build_fn", "merge_fn"), {"replica_id": 0, "flattened_range": None})
        return ShardedTensorFactory(**f)
    if kind == "LocalNonpersistentObject":
        if hasattr(x, "obj"):
            return LocalNonpersistentObject(x.obj)
        if callable(getattr(x, "unwrap", None)):
            return LocalNonpersistentObject(x.unwrap())
        raise AttributeError("it has neither obj nor unwrap()")
    raise AttributeError(f"{kind} is an abstract base; only its subclasses {', '.join(KINDS[:3])} can be saved")


def looks_sharded(x: object) -> Optional[str]:
    """Why ``x`` (not one of ours) looks like a sharded value, or ``None``."""
    if isinstance(x, _OURS) or isinstance(x, _PLAIN):
        return None
    kind = _kind_by_name(type(x))
    if kind is not None:
        return f"an instance of a class named {kind}"
    if type(x).__name__ == "DTensor" and hasattr(x, "placements"):
        if any(type(p).__name__ != "Replicate" for p in x.placements):
            return f"a DTensor with placements {tuple(x.placements)}, split across ranks"
        return None
    d = getattr(x, "__dict__", None)
    if isinstance(d, dict) and {"key", "global_shape", "global_offset"} <= d.keys():
        return "an object with key, global_shape and global_offset"
    return None


def to_native(x: object, path: Union[Tuple[Any, ...], str] = ()) -> Any:
    """Our class for another library's sharded value (converted by its fields); ``x`` itself
    for anything else. Raises :class:`CheckpointingException` naming ``path`` and the class
    if ``x`` looks sharded but cannot be converted."""
    if isinstance(x, _OURS) or isinstance(x, _PLAIN):
        return x
    kind = _kind_by_name(type(x))
    if kind is None:
        return x
    try:
        return _convert(x, kind)
    except CheckpointingException as e:
        raise CheckpointingException(f"{_where(path)}: {_describe(x)} converted to ckpt_integration.{kind}: {e}") from e
    except (AttributeError, TypeError, ValueError) as e:
        raise CheckpointingException(
            f"{_where(path)}: {_describe(x)} is named like a sharded value ({kind}) but cannot be converted to "
            f"ckpt_integration.{kind} ({e}); left as it is it would be pickled into the common state by rank 0 "
            "alone. Use ckpt_integration's classes (or Megatron-Core's) for sharded values"
        ) from e


def _where(path: Union[Tuple[Any, ...], str]) -> str:
    return format_path(path) if isinstance(path, tuple) else str(path)


def convert_foreign(x: object, path: Tuple[Any, ...] = ()) -> Any:
    """A copy of the nested dicts/lists of ``x`` (dict types kept, leaves shared) with every
    other library's sharded value replaced by ours (see :func:`to_native`)."""
    if isinstance(x, dict):
        out = empty_like(x)
        for k, v in x.items():
            # (our own values as they are, without a call each: once per tensor of a save or load)
            out[k] = v if isinstance(v, _OURS) else convert_foreign(v, path + (k,))
        return out
    if isinstance(x, list):
        return [v if isinstance(v, _OURS) else convert_foreign(v, path + (i,)) for i, v in enumerate(x)]
    return to_native(x, path)


def refuse_sharded_looking(x: object, path: Union[Tuple[Any, ...], str]) -> None:
    """Raise if a common-state value is, or (inside tuples/sets) holds, a sharded value.

    Sharded values are found in dicts and lists only; anywhere else they would be pickled
    into ``common.pt`` by rank 0 instead of saved by every rank.
    """
    if isinstance(x, _PLAIN):
        return
    if isinstance(x, _OURS) or sharded_kind(x) is not None:
        raise CheckpointingException(
            f"{type(x).__name__} {getattr(x, 'key', '')!r} at {_where(path)} is not in a dict or list: sharded "
            "values must sit in dicts and lists of the state dict (a tuple or set would save it as common state "
            "from rank 0); use a list instead"
        )
    why = looks_sharded(x)
    if why is not None:
        raise CheckpointingException(
            f"{_where(path)}: {_describe(x)} is {why}: saved as common state it would be pickled by rank 0 alone and "
            "the other ranks' parts lost. Describe it with ckpt_integration.ShardedTensor / ShardedObject (for a "
            "DTensor, modules.default_sharded_state_dict does that), or pass a plain value"
        )
    if isinstance(x, (tuple, set, frozenset)):
        for i, v in enumerate(x):
            refuse_sharded_looking(v, f"{_where(path)}[{i}]")


__all__ = ["KINDS", "sharded_kind", "is_foreign", "looks_sharded", "to_native", "convert_foreign", "refuse_sharded_looking"]
