"""Verified resume: the state a load returns equals what was saved, position by position.

Block digests prove that each byte read is the byte written; the delivery ledger
(:mod:`..planning.delivery`) that every requested element was filled exactly once. Neither
proves that a byte landed where it belongs: a row of one rank's slice copied into another
rank's tensor, a slice sent to the wrong rank, a peer copy of another rank, a factory part read
into another part's destination, a data-parallel replica that loaded a stale copy all pass
both. The check here compares the layout-independent fingerprint of what was loaded
(:mod:`..storage.fingerprint`, sums over global coordinates) with the one the save recorded:

1. **locally**: a requested region that is one saved chunk (a same-layout load: every request)
   is compared with that chunk's recorded fingerprint. No collective;
2. **at the key's owner** (one ``all_to_all``, only when some rank has regions that cut saved
   chunks): each region's sum goes to the rank that owns its key, which compares the main
   replicas' regions that are unions of whole saved chunks one by one (naming the rank), the
   others together with the chunks they cover (naming the ranks), and every other replica
   with the saved chunks it covers or with the main replica of the same region.

A key whose requested regions cover saved chunks only in part (``allow_shape_mismatch``, a
request of some layers only), or that was loaded in a dtype its values cannot be cast back
from exactly, is *not checkable*: the report lists it. A checkpoint without fingerprints
(saved before format 5, or by another tool) is not checkable at all: said once per directory.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from ..errors import CheckpointingException, StateVerificationError
from ..planning.boxes import Box, intersect
from ..planning.records import MessageWriter, decode
from ..storage.checkpoint_dir import Manifest
from ..storage.fingerprint import MASK64, Recorded, fingerprints
from . import dist
from .dist import Group
from .failure import Failure

logger = logging.getLogger(__name__)


@dataclass
class LoadedPart:
    """One requested region as loaded: its key, global box, elements, and whether this rank is its
    main replica; ``saved_dtype``: the dtype the checkpoint stores it in."""

    key: str
    box: Box
    data: torch.Tensor
    main: bool
    saved_dtype: torch.dtype


@dataclass
class StateReport:
    """What the check found on this rank: keys checked, keys not checkable (with why), problems."""

    checked: Set[str] = field(default_factory=set)
    unchecked: Dict[str, str] = field(default_factory=dict)
    problems: List[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_stats(self) -> Dict[str, Any]:
        return {"state_checked_keys": len(self.checked), "state_unchecked_keys": len(self.unchecked),
                "state_check_s": self.seconds}


def lossless(saved: torch.dtype, loaded: torch.dtype) -> bool:
    """Whether every value of ``saved`` survives a cast to ``loaded`` and back (so the loaded
    values can be checked in the saved dtype)."""
    if saved == loaded:
        return True
    if saved == torch.bool:
        return loaded != torch.bool and _has_limits(loaded)
    if loaded == torch.bool or not (_has_limits(saved) and _has_limits(loaded)):
        return False  # (bool keeps only 0/1; bit and packed dtypes have no values to compare)
    if saved.is_complex or loaded.is_complex:
        if not (saved.is_complex and loaded.is_complex):
            return False
        saved, loaded = saved.to_real(), loaded.to_real()
    if saved.is_floating_point and loaded.is_floating_point:
        s, l_ = torch.finfo(saved), torch.finfo(loaded)
        return l_.eps <= s.eps and l_.max >= s.max and l_.smallest_normal <= s.smallest_normal
    if not saved.is_floating_point and not loaded.is_floating_point:
        s, l_ = torch.iinfo(saved), torch.iinfo(loaded)
        return l_.min <= s.min and l_.max >= s.max
    return False


def _has_limits(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` has numeric limits (``finfo`` / ``iinfo``): not bool, bits or packed dtypes."""
    try:
        (torch.finfo if dtype.is_floating_point or dtype.is_complex else torch.iinfo)(dtype)
        return True
    except (TypeError, ValueError):
        return False


_noted: Set[str] = set()


def _note_once(where: str, message: str) -> None:
    if where not in _noted:
        _noted.add(where)
        logger.warning("%s: %s", where, message)


def _owner(key: str, world: int) -> int:
    return zlib.crc32(key.encode()) % world


def check_state(parts: Sequence[LoadedPart], recorded: Optional[Recorded], rank: int, group: Group,
                where: str, local: bool = False) -> StateReport:
    """Collective over ``group`` (every rank calls it, after a load that succeeded everywhere):
    compare the fingerprints of ``parts`` with ``recorded``. Returns this rank's report; its
    ``problems`` (this rank's own findings and those of the keys it owns) fail the load.
    ``local``: no collective, this process owns every key (one process's whole tensors)."""
    import time

    t0 = time.perf_counter()
    report = StateReport()
    world = 1 if local else dist.get_world_size(group)
    if recorded is None:  # the same on every rank (one manifest): no collective
        _note_once(where, "the checkpoint records no fingerprints (saved before manifest format 5 or by another "
                          "tool): the loaded state was not checkable against what was saved")
        report.unchecked = {p.key: "no fingerprints recorded" for p in parts}
        return report
    # this rank's own comparisons; a failure in them is raised after the collectives below, which
    # every rank joins (a rank that left them would leave the others waiting)
    local_failure = Failure()
    outgoing: Dict[int, MessageWriter] = {}
    with local_failure.capture():
        outgoing = _compare_own(parts, recorded, rank, world, report)
    if local:
        if outgoing:
            _check_owned({rank: outgoing[0].tobytes()}, recorded, report)
    elif dist.all_reduce_ints([1 if outgoing else 0], "max", group)[0]:
        inbox = dist.all_to_all_bytes({d: w.tobytes() for d, w in outgoing.items()}, group)
        _check_owned(inbox, recorded, report)
    report.seconds = time.perf_counter() - t0
    e = local_failure.exc
    if e is not None:
        if isinstance(e, CheckpointingException):
            raise e
        raise CheckpointingException(f"load of {where}: the state check failed on rank {rank}: {type(e).__name__}: {e}") from e
    return report


def _compare_own(parts: Sequence[LoadedPart], recorded: Recorded, rank: int, world: int,
                 report: StateReport) -> Dict[int, "MessageWriter"]:
    """The parts this rank checks itself (whole saved chunks) into ``report``; the messages to the key
    owners for the others."""
    values: List[Tuple[torch.Tensor, Tuple[int, ...]]] = []
    kept: List[LoadedPart] = []
    for p in parts:
        if p.data.dtype != p.saved_dtype:
            if not lossless(p.saved_dtype, p.data.dtype):
                report.unchecked[p.key] = f"loaded as {p.data.dtype}, saved as {p.saved_dtype} (not exactly castable back)"
                continue
            if p.data.is_floating_point() and bool(torch.isnan(p.data).any()):
                # a cast keeps NaN a NaN but not its bits (bf16 0x7fff comes back as 0x7fc0, a
                # signalling NaN turns quiet): the saved bytes cannot be rebuilt to check them
                report.unchecked[p.key] = f"loaded as {p.data.dtype}, saved as {p.saved_dtype}, holds NaN (a cast keeps no NaN bits)"
                continue
            values.append((p.data.to(p.saved_dtype), p.box.offsets))
        else:
            values.append((p.data, p.box.offsets))
        kept.append(p)
    sums = fingerprints(values)
    outgoing: Dict[int, MessageWriter] = {}
    for p, fp in zip(kept, sums):
        same = recorded.chunk(p.key, p.box.offsets)
        if same is not None and same[0] == p.box.sizes:  # one saved chunk (a same-layout load: every request)
            report.checked.add(p.key)
            if same[1] != fp:
                report.problems.append(_differs(p.key, p.box, [rank], p.main))
            continue
        if p.key not in recorded:
            report.unchecked[p.key] = "no fingerprint recorded for it"
            continue
        w = outgoing.setdefault(_owner(p.key, world), MessageWriter())
        lo, hi = fp & 0xFFFFFFFF, fp >> 32
        w.add(w.sid(p.key), rank, 1 if p.main else 0, lo, hi, len(p.box.offsets), *p.box.offsets, *p.box.sizes)
    return outgoing


def _differs(key: str, box: Box, ranks: Sequence[int], main: bool) -> str:
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in sorted(set(ranks)))
    what = "" if main else " (a data-parallel replica: it must equal its main replica)"
    return (f"tensor {key!r}: the region {box} loaded on {who}{what} is not what was saved "
            "(its fingerprint differs from the checkpoint's)")


@dataclass
class _Part:
    rank: int
    main: bool
    box: Box
    fp: int


def _check_owned(inbox: Dict[int, bytes], recorded: Recorded, report: StateReport) -> None:
    """The key owner's comparisons (see the module docstring)."""
    by_key: Dict[str, List[_Part]] = defaultdict(list)
    for src in sorted(inbox):
        strings, ints = decode(inbox[src])
        p = 0
        while p < len(ints):
            kid, r, main, lo, hi, nd = ints[p : p + 6]
            p += 6
            box = Box(tuple(ints[p : p + nd]), tuple(ints[p + nd : p + 2 * nd]))
            p += 2 * nd
            by_key[strings[kid]].append(_Part(r, bool(main), box, (lo & 0xFFFFFFFF) | ((hi & 0xFFFFFFFF) << 32)))
    for key, parts in sorted(by_key.items()):
        chunks = [(Box(o, s), v) for o, s, v in recorded.chunks(key)]
        report.checked.add(key)
        mains = [p for p in parts if p.main]
        rest: List[_Part] = []
        for p in mains:
            expected = _whole_chunks(p.box, chunks)
            if expected is None:
                rest.append(p)
            elif expected != p.fp:
                report.problems.append(_differs(key, p.box, [p.rank], True))
        if rest:
            covered: Dict[int, int] = defaultdict(int)
            for p in rest:
                for i, (cb, _) in enumerate(chunks):
                    ov = intersect(cb, p.box)
                    if ov is not None:
                        covered[i] += ov.numel
            if all(n == chunks[i][0].numel for i, n in covered.items()):
                expected = sum(chunks[i][1] for i in covered) & MASK64
                if expected != sum(p.fp for p in rest) & MASK64:
                    report.problems.append(_differs(key, _span(p.box for p in rest), [p.rank for p in rest], True))
            else:
                report.checked.discard(key)
                report.unchecked[key] = "its requested regions cover saved chunks only in part"
        for p in parts:
            if p.main:
                continue
            expected = _whole_chunks(p.box, chunks)
            if expected is None:
                twin = next((m for m in mains if m.box == p.box), None)
                expected = twin.fp if twin is not None else None
            if expected is None:
                report.unchecked.setdefault(key, "a replica's region is neither whole saved chunks nor a main replica's")
            elif expected != p.fp:
                report.problems.append(_differs(key, p.box, [p.rank], False))


def _whole_chunks(box: Box, chunks: Sequence[Tuple[Box, int]]) -> Optional[int]:
    """The recorded fingerprint of ``box`` when it is a union of whole saved chunks, else None."""
    inside, total = 0, 0
    for cb, v in chunks:
        ov = intersect(cb, box)
        if ov is None:
            continue
        if ov != cb:
            return None
        inside += cb.numel
        total += v
    return total & MASK64 if inside == box.numel else None


def _span(boxes: Iterable[Box]) -> Box:
    bs = list(boxes)
    lo = [min(b.offsets[a] for b in bs) for a in range(len(bs[0].offsets))]
    hi = [max(b.offsets[a] + b.sizes[a] for b in bs) for a in range(len(bs[0].offsets))]
    return Box(tuple(lo), tuple(h - l for l, h in zip(lo, hi)))


def raise_problems(report: StateReport, where: str, rank: int) -> None:
    """This rank's findings as a :class:`StateVerificationError` (the load's agreement fails every rank)."""
    if report.problems:
        shown = report.problems[:5]
        more = f" (and {len(report.problems) - 5} more)" if len(report.problems) > 5 else ""
        raise StateVerificationError(f"load of {where}, checked on rank {rank}: " + "; ".join(shown) + more
                                     + "; nothing of this load is returned")


VERIFY_STATE_ENV = "CKPT_INTEGRATION_VERIFY_STATE"


def default_verify_state() -> bool:
    """Whether loads check the loaded state when the caller does not say: ``CKPT_INTEGRATION_VERIFY_STATE=1``."""
    return os.environ.get(VERIFY_STATE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def verify_loaded_state(parts: List[LoadedPart], manifest: Optional[Manifest], rank: int, group: Group, where: str,
                        stats: Dict[str, Any]) -> None:
    """Collective: the state check of a load that succeeded on every rank (its figures added to
    ``stats``); raises on every rank when any rank or key owner found a difference."""
    report = None
    failure = Failure()
    with failure.capture():
        recorded = manifest.recorded_fingerprints() if manifest is not None else None
        report = check_state(parts, recorded, rank, group, where)
        stats.update(report.as_stats())
        raise_problems(report, where, rank)
    failure.agree(group, f"load of {where} failed its state check")
    if report is not None and report.unchecked:
        keys = sorted(report.unchecked)
        logger.info("load of %s: %d key(s) not checkable against the saved state, e.g. %r: %s", where, len(keys),
                    keys[0], report.unchecked[keys[0]])


def check_whole_tensors(tensors: Dict[str, torch.Tensor], manifest: Optional[Manifest], where: str, stats: Dict[str, Any]) -> None:
    """One process: whole tensors against the fingerprints recorded at save (figures added to ``stats``)."""
    recorded = manifest.recorded_fingerprints() if manifest is not None else None
    parts = [LoadedPart(k, Box((0,) * t.dim(), tuple(t.shape)), t, True, t.dtype) for k, t in tensors.items()]
    report = check_state(parts, recorded, 0, None, where, local=True)
    stats.update(report.as_stats())
    raise_problems(report, where, 0)
