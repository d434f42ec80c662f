"""Loading pickled checkpoint parts without executing code from them.

* ``.metadata`` (a pickled DCP ``Metadata``) is read by :func:`load_dcp_metadata`
  with an unpickler that resolves only the DCP metadata dataclasses, torch
  dtypes/sizes and builtin containers.
* ``common.pt`` and ShardedObject payloads are ``torch.save`` archives; they are
  read with ``torch.load(weights_only=True)`` plus an explicit allow-list.

Anything else is refused with :class:`UnsafeCheckpointError`, naming the global
and how to opt in: ``trusted=True`` (arbitrary code may run - only for
checkpoints you produced) or ``allowed_globals=[...]`` / :func:`add_safe_globals`.
"""

from __future__ import annotations

import collections
import io
import pickle
import re
from typing import Any, BinaryIO, Iterable, Optional, Set, Tuple

import torch

from ..errors import UnsafeCheckpointError

# (module, name) pairs allowed inside DCP ``.metadata`` files.
_DCP_METADATA_ALLOWED: Set[Tuple[str, str]] = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch", "device"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "getattr"),  # torch pickles dtypes/layouts as getattr(torch, name)
    # Megatron-Core's placeholder classes that older checkpoints reference
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"),
}

_TORCH_ATTRS = {
    n for n in dir(torch) if isinstance(getattr(torch, n, None), (torch.dtype, torch.layout, torch.memory_format))
}

_extra_safe_globals: list = []


def add_safe_globals(globals_: Iterable[Any]) -> None:
    """Allow more classes/functions in common state and ShardedObjects, process-wide.

    Example: ``add_safe_globals([argparse.Namespace])``.
    """
    _extra_safe_globals.extend(globals_)


class _Placeholder:
    """Stands in for Megatron-Core's empty marker classes when megatron is absent."""

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_state"] = state


class _RestrictedMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _safe_getattr
        if module == "torch" and name in _TORCH_ATTRS:
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout_by_name
        if (module, name) in _DCP_METADATA_ALLOWED:
            if module.startswith("megatron."):
                try:
                    return super().find_class(module, name)
                except (ImportError, AttributeError):
                    return _Placeholder
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"refusing to unpickle global '{module}.{name}' from DCP metadata: it is not a "
            "checkpoint-metadata class and could run code. If you trust this checkpoint, "
            "load it with trusted=True."
        )


def _safe_getattr(obj: Any, name: str) -> Any:
    # Only torch dtype/layout/memory_format attributes (e.g. torch.float32) pass.
    if obj is torch and name in _TORCH_ATTRS:
        return getattr(torch, name)
    raise UnsafeCheckpointError(f"refusing getattr({obj!r}, {name!r}) in checkpoint metadata")


def _layout_by_name(name: str) -> torch.layout:
    # torch pickles layouts as _get_layout("torch.strided"); resolve only real layouts.
    value = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(value, torch.layout):
        raise UnsafeCheckpointError(f"unknown torch layout {name!r} in checkpoint metadata")
    return value


def load_dcp_metadata(f: BinaryIO, trusted: bool = False) -> Any:
    """Unpickle a DCP ``.metadata`` file; restricted unless ``trusted``."""
    if trusted:
        return pickle.load(f)
    return _RestrictedMetadataUnpickler(f).load()


_UNSUPPORTED_GLOBAL = re.compile(r"(?:Unsupported global: GLOBAL|global) ([\w.]+)")


def safe_torch_load(
    f: Any,
    trusted: bool = False,
    allowed_globals: Optional[Iterable[Any]] = None,
    what: str = "checkpoint object",
) -> Any:
    """``torch.load`` that refuses to execute code unless ``trusted``.

    ``what`` names the file/object in the error message.
    """
    if trusted:
        return torch.load(f, map_location="cpu", weights_only=False)
    allowed = [collections.OrderedDict, *(_extra_safe_globals), *(allowed_globals or ())]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        m = _UNSUPPORTED_GLOBAL.search(str(e))
        name = m.group(1) if m else "an object outside the allow-list"
        raise UnsafeCheckpointError(
            f"refusing to load {what}: it contains '{name}', which is not on the safe "
            f"allow-list and could run code. If you trust this checkpoint, pass trusted=True; "
            f"to allow just this class pass allowed_globals=[{name}] (or call "
            f"ckpt_integration.add_safe_globals)."
        ) from None


def torch_dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
