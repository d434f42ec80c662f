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
import os
import pickle
import re
from typing import IO, Any, BinaryIO, Iterable, Optional, Set, Tuple, Union

import torch

from ..errors import CorruptCheckpointError, UnsafeCheckpointError, UntrustedObjectError

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
    # Megatron-Core >= 0.1x stores every rank's SavePlan in ``Metadata.all_local_plans``
    # (used to reuse plans on the next save). These are plain dataclasses / an Enum of
    # DCP's planner module: unpickling them builds data, it calls no user code.
    ("torch.distributed.checkpoint.planner", n)
    for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # DCP's own FileSystemWriter keeps ``StorageMeta.checkpoint_id`` as the Path it was given;
    # rebuilding a path object from its string parts runs no code
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
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

    def __setstate__(self, state: object) -> None:
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
        raise UntrustedObjectError(
            f"refusing to unpickle global '{module}.{name}' from DCP metadata: it is not a "
            "checkpoint-metadata class and could run code. If you trust this checkpoint, "
            "load it with trusted=True."
        )


def _safe_getattr(obj: object, name: str) -> Any:
    # Only torch dtype/layout/memory_format attributes (e.g. torch.float32) pass.
    if obj is torch and name in _TORCH_ATTRS:
        return getattr(torch, name)
    raise UntrustedObjectError(f"refusing getattr({obj!r}, {name!r}) in checkpoint metadata")


def _layout_by_name(name: str) -> torch.layout:
    # torch pickles layouts as _get_layout("torch.strided"); resolve only real layouts.
    value = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(value, torch.layout):
        raise UnsafeCheckpointError(f"unknown torch layout {name!r} in checkpoint metadata")
    return value


def load_dcp_metadata(f: BinaryIO, trusted: bool = False) -> Any:
    """Unpickle a DCP ``.metadata`` file; restricted unless ``trusted``."""
    if not hasattr(f, "peek"):
        # the C unpickler reads a stream without ``peek`` (a BytesIO) one opcode at a time, and
        # with it in large blocks: 155 -> 88 ms for a .metadata of 20,000 chunks
        f = io.BufferedReader(f, buffer_size=1 << 20)
    if trusted:
        return pickle.load(f)
    return _RestrictedMetadataUnpickler(f).load()


# torch's weights-only unpickler names refused globals as "Unsupported global: GLOBAL x.y"
# or "Trying to load unsupported GLOBAL x.y whose module x is blocked" (case differs).
_UNSUPPORTED_GLOBAL = re.compile(r"(?:Unsupported global: GLOBAL|global) ([\w.]+)", re.IGNORECASE)
# Other refusals of the weights-only unpickler (objects it will not build or call).
_REFUSAL_MARKERS = ("allowlisted", "unrecognized function", "must be imported", "Unsupported class")


def _is_refusal(message: str) -> bool:
    return bool(_UNSUPPORTED_GLOBAL.search(message)) or any(m in message for m in _REFUSAL_MARKERS)


def safe_torch_load(
    f: Union[str, os.PathLike, IO[bytes]],
    trusted: bool = False,
    allowed_globals: Optional[Iterable[Any]] = None,
    what: str = "checkpoint object",
) -> Any:
    """``torch.load`` that refuses to execute code unless ``trusted``.

    ``what`` names the file/object in the error message. Raises
    :class:`UnsafeCheckpointError` for objects outside the allow-list and
    :class:`CorruptCheckpointError` for bytes that are not a readable archive.
    """
    if trusted:
        try:
            return torch.load(f, map_location="cpu", weights_only=False)
        except (RuntimeError, EOFError, pickle.UnpicklingError, UnicodeDecodeError) as e:
            # damaged archive / pickle stream (errors raised by the objects' own code pass through)
            raise CorruptCheckpointError(f"{what} is damaged and cannot be read: {e}") from None
    allowed = [collections.OrderedDict, *(_extra_safe_globals), *(allowed_globals or ())]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not _is_refusal(str(e)):
            # torch wraps every error of the weights-only unpickler in UnpicklingError,
            # including damaged streams ("Unsupported operand 142"): that is corruption,
            # not an unsafe object, and must not tell the user to pass trusted=True.
            detail = str(e).split("WeightsUnpickler error:")[-1].strip().split("\n")[0]
            raise CorruptCheckpointError(f"{what} is damaged and cannot be decoded: {detail}") from None
        m = _UNSUPPORTED_GLOBAL.search(str(e))
        name = m.group(1) if m else "an object outside the allow-list"
        raise UntrustedObjectError(
            f"refusing to load {what}: it contains '{name}', which is not on the safe "
            f"allow-list and could run code. If you trust this checkpoint, pass trusted=True; "
            f"to allow just this class pass allowed_globals=[{name}] (or call "
            f"ckpt_integration.add_safe_globals)."
        ) from None
    except UnsafeCheckpointError:
        raise
    except Exception as e:
        # Any other failure while decoding untrusted bytes (bad zip records, invalid
        # UTF-8 in names, impossible sizes -> MemoryError/OverflowError, rebuild
        # TypeErrors, ...) means the bytes are damaged; report it as such, naming ``what``.
        raise CorruptCheckpointError(f"{what} is damaged and cannot be read: {type(e).__name__}: {e}") from None


def torch_dumps(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def object_payload(stored: Any) -> Any:
    """A ShardedObject's value from what its archive holds: saves store it as a one-element list
    (Megatron-Core's layout), unwrapped here. Only for ShardedObject payloads: a plain DCP byte
    item is stored as it is."""
    return stored[0] if isinstance(stored, list) and len(stored) == 1 else stored
