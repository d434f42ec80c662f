"""Pickling the objects the object collectives carry (:mod:`.dist`'s ``all_gather_object``,
``gather_object``, ``broadcast_object``): plain pickle, except for tensors of the dtypes whose own
pickling fails in torch (float8, uint16/32/64: ``UntypedStorage has no attribute dtype``), which
travel as their bytes. Messages between the ranks of one job: read back with ``pickle.loads``.

Example::

    pickle.loads(dumps({"scale": torch.ones(2, dtype=torch.float8_e4m3fn)}))["scale"].dtype
    # torch.float8_e4m3fn
"""

from __future__ import annotations

import copyreg
import io
import pickle
from typing import Any, Dict, Tuple

import torch

from ..storage.fs import byte_view

_PICKLES: Dict[torch.dtype, bool] = {}


def _reduce_tensor(t: torch.Tensor) -> Any:
    """A tensor as pickle takes it; as its bytes for dtypes whose own pickling fails in torch
    (float8, uint16/32/64: ``UntypedStorage has no attribute dtype``)."""
    ok = _PICKLES.get(t.dtype)
    if ok is None:
        try:
            pickle.loads(pickle.dumps(torch.zeros(1, dtype=t.dtype)))
            ok = True
        except Exception:
            ok = False
        _PICKLES[t.dtype] = ok
    if ok:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return _tensor_of_bytes, (byte_view(t.cpu().contiguous()).numpy().tobytes(), str(t.dtype)[6:], tuple(t.shape),
                              str(t.device))


def _tensor_of_bytes(raw: bytes, dtype: str, shape: Tuple[int, ...], device: str) -> torch.Tensor:
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return t.view(getattr(torch, dtype)).reshape(shape).to(device)


def dumps(obj: object) -> bytes:
    """``pickle.dumps`` that also carries tensors of every dtype (see :func:`_reduce_tensor`)."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, pickle.HIGHEST_PROTOCOL)
    p.dispatch_table = _DISPATCH
    p.dump(obj)
    return buf.getvalue()


_DISPATCH = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}
