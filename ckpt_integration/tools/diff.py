"""``diff``: keys, shapes, dtypes and max abs difference of the tensors of two sources; for two checkpoint
directories also their common state (keys only on one side, values and types that differ, as
Megatron-Core's ``dict_utils.diff`` finds them) and the values of their ShardedObjects."""

from __future__ import annotations

import functools
import io
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch

from ..dict_utils import diff
from ..errors import UntrustedObjectError
from ..serialization import load_common_state_dict
from ..storage.opened import pinned
from .common import DEFAULT_MEMORY_BUDGET, ProgressFactory, dtype_name, no_progress, parse_size
from .sources import DistCheckpointSource, open_source, plan_blocks


@dataclass
class DiffReport:
    """Result of :func:`diff_checkpoints`; ``identical`` when keys, shapes, dtypes and values all match."""

    a: str
    b: str
    only_in_a: List[str] = field(default_factory=list)
    only_in_b: List[str] = field(default_factory=list)
    shape_mismatch: Dict[str, Tuple[List[int], List[int]]] = field(default_factory=dict)
    dtype_mismatch: Dict[str, Tuple[str, str]] = field(default_factory=dict)
    max_abs_diff: Dict[str, float] = field(default_factory=dict)
    objects_only_in_a: List[str] = field(default_factory=list)
    objects_only_in_b: List[str] = field(default_factory=list)
    #: ShardedObjects in both whose values differ: ``{storage key: (repr in A, repr in B)}``
    objects_differ: Dict[str, Tuple[str, str]] = field(default_factory=dict)
    #: common-state paths (``"a/b/0"``) only in A / only in B
    common_only_in_a: List[str] = field(default_factory=list)
    common_only_in_b: List[str] = field(default_factory=list)
    #: common-state values in both that differ: ``{path: (type and repr in A, type and repr in B)}``
    common_differ: Dict[str, Tuple[str, str]] = field(default_factory=dict)
    #: why the common state was not compared (it could not be read without ``trusted``), if so
    common_error: str = ""

    @property
    def differing(self) -> Dict[str, float]:
        return {k: v for k, v in self.max_abs_diff.items() if v != 0}

    @property
    def identical(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.shape_mismatch or self.dtype_mismatch
                    or self.differing or self.objects_only_in_a or self.objects_only_in_b or self.objects_differ
                    or self.common_only_in_a or self.common_only_in_b or self.common_differ or self.common_error)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "a": self.a, "b": self.b, "identical": self.identical,
            "only_in_a": self.only_in_a, "only_in_b": self.only_in_b,
            "shape_mismatch": self.shape_mismatch, "dtype_mismatch": self.dtype_mismatch,
            "max_abs_diff": {k: (v if math.isfinite(v) else str(v)) for k, v in self.max_abs_diff.items()},
            "objects_only_in_a": self.objects_only_in_a, "objects_only_in_b": self.objects_only_in_b,
            "objects_differ": self.objects_differ, "common_only_in_a": self.common_only_in_a,
            "common_only_in_b": self.common_only_in_b, "common_differ": self.common_differ,
            "common_error": self.common_error,
        }

    def format(self) -> str:
        lines = [f"A: {self.a}", f"B: {self.b}"]
        for title, items in (("only in A", self.only_in_a), ("only in B", self.only_in_b),
                             ("objects only in A", self.objects_only_in_a), ("objects only in B", self.objects_only_in_b),
                             ("common state only in A", self.common_only_in_a),
                             ("common state only in B", self.common_only_in_b)):
            if items:
                lines.append(f"{title} ({len(items)}):")
                lines += [f"  {k}" for k in items]
        if self.shape_mismatch:
            lines.append(f"shape differs ({len(self.shape_mismatch)}):")
            lines += [f"  {k}: {a} vs {b}" for k, (a, b) in self.shape_mismatch.items()]
        if self.dtype_mismatch:
            lines.append(f"dtype differs ({len(self.dtype_mismatch)}):")
            lines += [f"  {k}: {a} vs {b}" for k, (a, b) in self.dtype_mismatch.items()]
        for title, items in (("objects differ", self.objects_differ), ("common state differs", self.common_differ)):
            if items:
                lines.append(f"{title} ({len(items)}):")
                lines += [f"  {k}: {a} vs {b}" for k, (a, b) in items.items()]
        if self.common_error:
            lines.append(f"common state and objects not compared: {self.common_error}")
        diff = self.differing
        if diff:
            lines.append(f"values differ ({len(diff)} of {len(self.max_abs_diff)} common tensors):")
            lines += [f"  {k}: max abs diff {v:.6g}" for k, v in diff.items()]
        lines.append("identical" if self.identical else "different")
        return "\n".join(lines)


def _is_exact(t: torch.Tensor) -> bool:
    """Integer or bool: compared exactly (a cast to float64 rounds integers beyond 2**53)."""
    return not (t.is_floating_point() or t.is_complex())


def _exact_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise exact equality of two integer/bool tensors of any dtypes (uint64 included)."""
    if a.dtype == b.dtype:
        return a == b
    ua, ub = a.dtype == torch.uint64, b.dtype == torch.uint64
    ia = a.view(torch.int64) if ua else a.to(torch.int64)  # every other integer dtype fits int64
    ib = b.view(torch.int64) if ub else b.to(torch.int64)
    eq = ia == ib
    if ua != ub:  # a uint64 >= 2**63 reads as a negative int64: equal only to a non-negative signed value
        eq &= (ib if ua else ia) >= 0
    return eq


@functools.lru_cache(maxsize=None)
def _has_values(dtype: torch.dtype) -> bool:
    """Whether ``dtype``'s elements convert to numbers (not so for ``bits8`` or ``float4_e2m1fn_x2``, which
    checkpoints store as they store any other dtype: diff crashed on them)."""
    t = _one(dtype)
    return _works(lambda: t.to(torch.complex128 if t.is_complex() else torch.float64))


@functools.lru_cache(maxsize=None)
def _has_equal(dtype: torch.dtype) -> bool:
    """Whether ``torch.equal`` takes ``dtype`` on the CPU (not complex32, nor the float8 types)."""
    t = _one(dtype)
    return _works(lambda: torch.equal(t, t))


def _one(dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(dtype.itemsize, dtype=torch.uint8).view(dtype)


def _works(fn: Any) -> bool:
    with warnings.catch_warnings():  # (complex32 says it is experimental)
        warnings.simplefilter("ignore")
        try:
            fn()
            return True
        except (RuntimeError, NotImplementedError, TypeError):
            return False


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference, for display; non-zero exactly when some element differs.

    Integer/bool values are compared exactly; the magnitude (computed in float64) is then at
    least 1, the smallest difference two integers can have.
    """
    if not (_has_values(a.dtype) and _has_values(b.dtype)):  # (bits8, float4_e2m1fn_x2: no arithmetic, bytes)
        same = a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))
        return 0.0 if same else math.inf
    if a.dtype == b.dtype and _has_equal(a.dtype) and torch.equal(a, b):
        return 0.0
    if _is_exact(a) and _is_exact(b):
        same = _exact_equal(a, b)
        if bool(same.all()):
            return 0.0
        d = (a.to(torch.float64) - b.to(torch.float64)).abs()[~same]
        return max(float(d.max()), 1.0)
    if a.is_complex() or b.is_complex():
        a, b = a.to(torch.complex128), b.to(torch.complex128)
    else:
        a, b = a.to(torch.float64), b.to(torch.float64)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if bool(same.all()):
        return 0.0
    d = (a - b).abs()[~same]
    if bool(torch.isnan(d).any()):
        return math.inf
    return float(d.max())


def _show(value: Any, limit: int = 80) -> str:
    """``<type> repr`` of a differing value, the repr cut to ``limit`` characters."""
    value = value.value if isinstance(value, _NaNEqual) else value
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= limit else text[:limit - 3] + '...'}"


def _at(tree: Any, path: Tuple[Any, ...]) -> Any:
    for k in path:
        if isinstance(k, type):  # a sharded value's data (dict_utils.diff's step into it)
            tree = tree.data
        else:
            tree = tree[k]
    return tree


def _path(path: Any) -> str:
    path = path if isinstance(path, tuple) else (path,)
    return "/".join(str(k) for k in path if not isinstance(k, type)) or "<root>"


class _NaNEqual:
    """A float or floating tensor holding NaN, equal to another whose NaNs are at the same places and
    whose other values are equal (as ``diff`` compares tensors: a checkpoint equals itself)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __ne__(self, other: object) -> bool:
        a, b = self.value, getattr(other, "value", None)
        if isinstance(a, float):
            return not (isinstance(b, float) and math.isnan(b))
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return True
        return not bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())

    def __eq__(self, other: object) -> bool:
        return not self.__ne__(other)

    def __repr__(self) -> str:
        return repr(self.value)


def _by_value(x: Any) -> Any:
    """``x`` with each ``io.BytesIO`` as its bytes (its ``==`` is identity: equal buffers compared
    unequal), and each NaN-holding float or tensor as a :class:`_NaNEqual` (NaN differs from itself)."""
    if isinstance(x, io.BytesIO):
        return x.getvalue()
    if isinstance(x, float) and math.isnan(x):
        return _NaNEqual(x)
    if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) and bool(torch.isnan(x).any()):
        return _NaNEqual(x)
    if isinstance(x, dict):
        return {k: _by_value(v) for k, v in x.items()}
    return type(x)(_by_value(v) for v in x) if isinstance(x, (list, tuple)) and type(x) in (list, tuple) else x


def _compare_common(sa: DistCheckpointSource, sb: DistCheckpointSource, trusted: bool, report: DiffReport) -> None:
    """The common state and the ShardedObjects' values of two checkpoint directories."""
    try:
        ca, cb = load_common_state_dict(sa.checkpoint, trusted=trusted), load_common_state_dict(sb.checkpoint, trusted=trusted)
        oa = {k: sa.read_object(k) for k in sa.objects if k in set(sb.objects)}
        ob = {k: sb.read_object(k) for k in oa}
    except UntrustedObjectError as e:  # a class the restricted unpickler refuses without --trusted
        # (only that refusal is a note: damaged or missing data is an error, as for tensors)
        report.common_error = str(e).splitlines()[0]
        return
    ca, cb = _by_value(ca), _by_value(cb)
    only_a, only_b, mismatch = diff(ca, cb)
    report.common_only_in_a = sorted(_path(p) for p in only_a)
    report.common_only_in_b = sorted(_path(p) for p in only_b)
    for entry in mismatch:
        p = entry[0]
        report.common_differ[_path(p)] = (_show(_at(ca, p)), _show(_at(cb, p)))
    for key in sorted(oa):
        va, vb = _by_value(oa[key]), _by_value(ob[key])
        if any(diff(va, vb)):
            report.objects_differ[key] = (_show(va), _show(vb))


def diff_checkpoints(a: str, b: str, *, memory_budget: Any = DEFAULT_MEMORY_BUDGET, trusted: bool = False,
                     progress: ProgressFactory = no_progress) -> DiffReport:
    """Compare the tensors of two sources (checkpoint dirs, torch.save or safetensors) block by block; for
    two checkpoint directories also the common state and the ShardedObjects' values."""
    with pinned(a, b, verified=True):  # (an opened checkpoint: its commit, pinned)
        budget = parse_size(memory_budget)
        with open_source(a, trusted=trusted) as sa, open_source(b, trusted=trusted) as sb:
            report = DiffReport(sa.path, sb.path)
            ka, kb = set(sa.tensors), set(sb.tensors)
            report.only_in_a = sorted(ka - kb)
            report.only_in_b = sorted(kb - ka)
            if isinstance(sa, DistCheckpointSource) and isinstance(sb, DistCheckpointSource):
                # ShardedObjects exist only in checkpoint directories; compare their keys there
                oa, ob = set(sa.objects), set(sb.objects)
                report.objects_only_in_a, report.objects_only_in_b = sorted(oa - ob), sorted(ob - oa)
                _compare_common(sa, sb, trusted, report)
            common = sorted(ka & kb)
            bar = progress(total=sum(sa.tensors[k].nbytes for k in common), unit="B", unit_scale=True, desc="diff")
            try:
                for key in common:
                    ia, ib = sa.tensors[key], sb.tensors[key]
                    if ia.shape != ib.shape:
                        report.shape_mismatch[key] = (list(ia.shape), list(ib.shape))
                        bar.update(ia.nbytes)
                        continue
                    if ia.dtype != ib.dtype:
                        report.dtype_mismatch[key] = (dtype_name(ia.dtype), dtype_name(ib.dtype))
                    worst = 0.0
                    big = ia if ia.nbytes >= ib.nbytes else ib
                    for box in plan_blocks(ia.shape, big.dtype, max(budget // 2, 1)):
                        ta, tb = sa.read_block(key, box), sb.read_block(key, box)
                        worst = max(worst, _max_abs_diff(ta, tb))
                        bar.update(ta.numel() * ta.element_size())
                        del ta, tb
                    report.max_abs_diff[key] = worst
            finally:
                bar.close()
        return report
