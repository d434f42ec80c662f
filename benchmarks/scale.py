#!/usr/bin/env python
"""Scale simulation of the checkpoint metadata path: 64 ... 16,384 ranks in one process.

Builds every simulated rank's shard records for a GPT layout (48 layers, hidden
8192, TP=8, PP=8, bf16 params, Adam with fp32 master copy, ``exp_avg``,
``exp_avg_sq`` and a per-parameter state object; with and without ZeRO-1) and
runs, rank by rank, the functions the real collectives call
(:mod:`ckpt_integration.planning.exchange`, :mod:`ckpt_integration.execution.shared_metadata`),
including the encoding and decoding of every message. Per-rank times are the CPU
time of the simulated rank's own steps (thread CPU clock), so other processes on a
shared machine do not inflate them; rank 0's commit is wall time (it writes files).
Messages move through
in-memory mailboxes; bytes are counted with the rule of
``ckpt_integration.execution.dist.traffic`` (what lands on a rank from the others,
including the per-rank sizes of an all-to-all).

Save: route (holder) -> chunk owner -> key owner (validation) -> write assignment
-> finalize message; rank 0's commit runs the library's torch_dist commit into a
temporary directory (tmpfs when available) and reports the metadata file sizes.
A repeated save with the same structure costs each rank one digest of its records
and a 4-integer all-reduce. Load: every rank decodes the same broadcast and plans
the reads of its own shards, so a few ranks are sampled.

Anchors on the same layout: Megatron-Core 0.16 ``validate_sharding_integrity`` (rank
0 over every rank's ShardedTensors, after an ``all_gather_object`` of them, whose
size is what every rank receives) and DCP's ``DefaultSavePlanner`` global plan
(dedup + metadata over every rank's local plan, gathered to rank 0), at the world
sizes where they stay under ``--anchor-max-records``.

Usage::

    python benchmarks/scale.py --worlds 64,256,1024 --json out.json       # quick
    python benchmarks/scale.py --json scale.json --markdown table.md        # full sweep
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ckpt_integration.planning.exchange import (  # noqa: E402
    assign_writes,
    detail_requests,
    chunk_owner_step,
    key_owner_step,
    route_shards,
)
from ckpt_integration.planning.written import WrittenTable, commit_layout, encode_finalize, gather_finalize  # noqa: E402
from ckpt_integration.planning.boxes import Box  # noqa: E402
from ckpt_integration.planning.shards import ShardMeta, object_storage_key  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale_anchors import anchor_dcp, anchor_megatron  # noqa: E402

MiB = 1 << 20
ESIZE = {"bfloat16": 2, "float32": 4, "object": 0}

# name, shape (in units of the hidden size h), tensor-parallel split axis (None: replicated)
LAYER_PARAMS = [
    ("self_attention.linear_qkv.weight", (3, 1), 0),
    ("self_attention.linear_qkv.bias", (3,), 0),
    ("self_attention.linear_qkv.layer_norm_weight", (1,), None),
    ("self_attention.linear_qkv.layer_norm_bias", (1,), None),
    ("self_attention.linear_proj.weight", (1, 1), 1),
    ("self_attention.linear_proj.bias", (1,), None),
    ("mlp.linear_fc1.weight", (4, 1), 0),
    ("mlp.linear_fc1.bias", (4,), 0),
    ("mlp.linear_fc1.layer_norm_weight", (1,), None),
    ("mlp.linear_fc1.layer_norm_bias", (1,), None),
    ("mlp.linear_fc2.weight", (1, 4), 1),
    ("mlp.linear_fc2.bias", (1,), None),
]
STATES = ("fp32_param", "exp_avg", "exp_avg_sq")


# --------------------------------------------------------------------------- the layout
@dataclass(frozen=True)
class Param:
    """One parameter shard of a model-parallel rank (the same on its data-parallel replicas)."""

    key: str
    global_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]  # with the prepended layer axis (size 1)
    prepend: int
    tp_replica: int  # 0 unless replicated over tensor parallelism (then the TP rank)

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return self.sizes[self.prepend :]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


class GPTLayout:
    """Megatron-Core GPT sharding: rank = tp + TP * (dp + DP * pp); layers stacked along axis 0."""

    def __init__(self, world: int, *, tp: int = 8, pp: int = 8, layers: int = 48, hidden: int = 8192,
                 vocab: int = 51200, zero: bool = False, row_aligned: bool = True):
        if world % (tp * pp):
            raise ValueError(f"world {world} is not a multiple of TP*PP = {tp * pp}")
        self.world, self.tp, self.pp, self.dp = world, tp, pp, world // (tp * pp)
        self.layers, self.hidden, self.vocab, self.zero = layers, hidden, vocab, zero
        self.row_aligned = row_aligned
        self._params: Dict[Tuple[int, int], List[Param]] = {}
        self._cache: Dict[Tuple[int, int, int], List[ShardMeta]] = {}

    def coords(self, rank: int) -> Tuple[int, int, int]:
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        return tp, dp, rank // (self.tp * self.dp)

    def params(self, tp: int, pp: int) -> List[Param]:
        got = self._params.get((tp, pp))
        if got is not None:
            return got
        h, out = self.hidden, []
        per = self.layers // self.pp

        def split(shape, axis):
            if axis is None:
                return (0,) * len(shape), tuple(shape), tp
            size = shape[axis] // self.tp
            off = [0] * len(shape)
            off[axis] = tp * size
            sizes = list(shape)
            sizes[axis] = size
            return tuple(off), tuple(sizes), 0

        if pp == 0:
            off, sizes, rep = split((self.vocab, h), 0)
            out.append(Param("embedding.word_embeddings.weight", (self.vocab, h), off, sizes, 0, rep))
        for i in range(per):
            layer = pp * per + i
            for name, units, axis in LAYER_PARAMS:
                shape = tuple(u * h for u in units)
                off, sizes, rep = split(shape, axis)
                out.append(Param(f"decoder.layers.{name}", (self.layers,) + shape, (layer,) + off, (1,) + sizes, 1, rep))
        if pp == self.pp - 1:
            for name in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
                out.append(Param(name, (h,), (0,), (h,), 0, tp))
            off, sizes, rep = split((self.vocab, h), 0)
            out.append(Param("output_layer.weight", (self.vocab, h), off, sizes, 0, rep))
        self._params[(tp, pp)] = out
        return out

    def rank_metas(self, rank: int) -> List[ShardMeta]:
        """The shard records ``prepare_save`` would build on ``rank`` (model + optimizer)."""
        tp, dp, pp = self.coords(rank)
        out: List[ShardMeta] = []
        params = self.params(tp, pp)
        for p in params:
            out.append(ShardMeta(p.key, "tensor", rank, "bfloat16", p.global_shape, p.offsets, p.sizes,
                                 (0, p.tp_replica, dp), p.numel * 2))
        if self.zero:
            out += self._zero_pieces(rank, tp, dp, params)
        else:
            for name in STATES:
                for p in params:
                    out.append(ShardMeta(f"optimizer.state.{name}.{p.key}", "tensor", rank, "float32", p.global_shape,
                                         p.offsets, p.sizes, (0, p.tp_replica, dp), p.numel * 4))
        for p in params:
            origin = all(o == 0 for o in p.offsets[p.prepend :])
            main = p.tp_replica == 0 and origin and (dp == 0 if not self.zero else self._owns_start(dp, params, p))
            gshape = p.global_shape[: p.prepend] or (1,)
            goff = p.offsets[: p.prepend] or (0,)
            out.append(ShardMeta(f"optimizer.param_state.{p.key}", "object", rank, "object", gshape, goff,
                                 (1,) * len(gshape), (0 if main else 1,), 0))
        return out

    # ZeRO-1 as ckpt_integration.optimizer.ZeroShardedOptimizer saves it: the DP rank's flat slice
    # of all local params, in model space (flat_range_to_boxes pieces), replica_id without the DP part
    def _slice(self, dp: int, params: Sequence[Param]) -> Tuple[List[int], int, int]:
        starts = [0]
        for p in params:
            starts.append(starts[-1] + p.numel)
        total = starts[-1]
        size = max(1, math.ceil(total / self.dp))
        start = min(total, dp * size)
        return starts, start, min(total, start + size)

    def _owns_start(self, dp: int, params: Sequence[Param], p: Param) -> bool:
        starts, a, b = self._slice(dp, params)
        i = params.index(p)
        return a <= starts[i] < b

    def _zero_pieces(self, rank: int, tp: int, dp: int, params: Sequence[Param]) -> List[ShardMeta]:
        """The saved pieces: whole rows per param (planning.flat_pieces, as the optimizer saves
        them since issue 19), or the held flat ranges as they are with ``row_aligned=False``."""
        from ckpt_integration.optimizer import flat_range_to_boxes
        from ckpt_integration.planning.flat_pieces import row_aligned_save, row_unit

        starts, a, b = self._slice(dp, params)
        if self.row_aligned:
            size = max(1, math.ceil(starts[-1] / self.dp))
            plan = row_aligned_save([p.numel for p in params], [row_unit(p.local_shape) for p in params], size, dp)
            ranges = {i: (starts[i] + lo, starts[i] + hi) for i, (lo, hi) in plan.saved.items()}
        else:
            ranges = {i: (max(a, starts[i]), min(b, starts[i + 1])) for i in range(len(params))}
        out = []
        for i, p in enumerate(params):
            lo, hi = ranges.get(i, (0, 0))
            if lo >= hi:
                continue
            for off, size in flat_range_to_boxes(p.local_shape, lo - starts[i], hi - starts[i]):
                goff = p.offsets[: p.prepend] + tuple(g + o for g, o in zip(p.offsets[p.prepend :], off))
                sizes = (1,) * p.prepend + tuple(size)
                for name in STATES:
                    out.append(ShardMeta(f"optimizer.state.{name}.{p.key}", "tensor", rank, "float32", p.global_shape,
                                         goff, sizes, (0, p.tp_replica, 0), math.prod(sizes) * 4))
        return out


# --------------------------------------------------------------------------- helpers
class Stat:
    """Per-rank values (time in seconds, bytes)."""

    def __init__(self, world: int):
        self.v = [0.0] * world

    def add(self, r: int, x: float) -> None:
        self.v[r] += x

    def summary(self) -> Dict[str, float]:
        s = sorted(self.v)
        return {"max": s[-1], "p50": s[len(s) // 2], "mean": sum(s) / len(s), "argmax": self.v.index(s[-1])}


def _timed(fn: Callable[[], Any], retry_above: float = 0.01) -> Tuple[Any, float]:
    """Result and CPU seconds of this thread: what the simulated rank itself computes, unaffected by
    other processes on a shared machine taking the core away (wall time would add that).

    The steps are pure functions, so a call above ``retry_above`` seconds is repeated twice and the
    fastest kept: kernel time from the simulation's own multi-GiB heap growing (page faults,
    charged to whichever rank allocates) is not a cost of the rank's work.
    """
    t = time.thread_time()
    out = fn()
    best = time.thread_time() - t
    for _ in range(2 if best > retry_above else 0):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return out, best


def _peak(fn: Callable[[], Any]) -> int:
    """Peak Python heap bytes allocated while ``fn`` runs (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _frame(a: bytes, b: bytes) -> bytes:  # as execution.exchange frames forwards + replies
    return len(a).to_bytes(4, "little") + a + b


def _unframe(m: bytes) -> Tuple[bytes, bytes]:
    n = int.from_bytes(m[:4], "little")
    return m[4 : 4 + n], m[4 + n :]


# --------------------------------------------------------------------------- save
def simulate_save(layout: GPTLayout, commit_dir: str, samples: int = 3) -> Dict[str, Any]:
    W = layout.world
    options = "True/True/torch_dist"
    t_rank, recv, sent = Stat(W), Stat(W), Stat(W)
    t_reuse = Stat(W)
    steps = {k: Stat(W) for k in ("route", "chunk_owner", "key_owner", "assign", "finalize_msg")}
    n_records = 0
    mail1: List[List[bytes]] = [[] for _ in range(W)]
    for r in range(W):
        metas = layout.rank_metas(r)
        n_records += len(metas)
        routed, dt = _timed(lambda: route_shards(metas, r, W, options))
        steps["route"].add(r, dt)
        t_reuse.add(r, dt)  # a repeated save computes the same digest, then one all-reduce
        for d, m in routed.messages.items():
            mail1[d].append(m)
            if d != r:
                sent.add(r, len(m))
                recv.add(d, len(m))
    busiest = max(range(W), key=lambda d: sum(map(len, mail1[d])))
    sample = sorted({0, busiest, W // 2, W - 1})[: max(samples, 1) + 1]
    kept1 = {d: list(mail1[d]) for d in sample}
    mail_f: List[List[bytes]] = [[] for _ in range(W)]
    mail_r: List[List[bytes]] = [[] for _ in range(W)]
    for d in range(W):
        (fwd, rep), dt = _timed(lambda: chunk_owner_step(mail1[d], W, balance=True))
        steps["chunk_owner"].add(d, dt)
        mail1[d] = []
        for k in set(fwd) | set(rep):
            framed = _frame(fwd.get(k, b""), rep.get(k, b""))
            f, a = _unframe(framed)  # decoding the frame is part of the receiver's work (cheap)
            if f:
                mail_f[k].append(f)
            if a:
                mail_r[k].append(a)
            if k != d:
                sent.add(d, len(framed))
                recv.add(k, len(framed))
    del mail1
    gc.collect()
    kept_f = {d: list(mail_f[d]) for d in sample}
    kept_r = {d: list(mail_r[d]) for d in sample}
    summaries: List[List[Any]] = [[] for _ in range(W)]
    problems: List[str] = []
    for d in range(W):
        (probs, summ), dt = _timed(lambda: key_owner_step(mail_f[d], validate=True))
        steps["key_owner"].add(d, dt)
        problems += probs
        summaries[d] = summ
        mail_f[d] = []
    del mail_f
    gc.collect()
    if problems:
        raise AssertionError(f"the simulated layout is invalid: {problems[:3]}")
    fin_msgs: List[bytes] = []
    written_per_rank: List[int] = [0] * W
    for r in range(W):
        metas = layout.rank_metas(r)
        mine, dt = _timed(lambda: assign_writes(metas, mail_r[r]))
        steps["assign"].add(r, dt)
        if detail_requests(mail_r[r]):  # identical replicas: every copy matches its main by digest
            raise AssertionError(f"rank {r}: a copy differs from its main replica in the simulated layout")
        mail_r[r] = []
        written = _fake_written(r, [metas[i] for i in mine])
        written_per_rank[r] = len(written)
        msg, dt = _timed(lambda: encode_finalize(None, written, summaries[r]))
        steps["finalize_msg"].add(r, dt)
        fin_msgs.append(msg)
        if r != 0:
            sent.add(r, len(msg) + 8)
            recv.add(0, len(msg) + 8)
    del mail_r
    gc.collect()
    # collectives around the exchange: step-1 all-reduce (4 ints), directory broadcast,
    # two all-to-all size vectors (int32), step-4 all-reduce (6 ints), commit status broadcast
    dir_bcast = 8 + len(pickle.dumps(("/checkpoints/iter_0001000", False)))
    fixed = 32 + dir_bcast + 2 * 4 * (W - 1) + 48 + 8 + len(pickle.dumps(None))
    for r in range(W):
        recv.add(r, fixed - (dir_bcast + 8 + len(pickle.dumps(None)) if r == 0 else 0))
        sent.add(r, 32 + 2 * 4 * (W - 1) + 48)
        t_rank.add(r, sum(s.v[r] for s in steps.values()))
    commit = simulate_commit(layout, fin_msgs, commit_dir)
    # peak heap of the sampled ranks' steps (+ the bytes they received)
    peaks = {}
    for d in sample:
        metas = layout.rank_metas(d)
        p = _peak(lambda: route_shards(metas, d, W, options))
        p = max(p, _peak(lambda: chunk_owner_step(kept1[d], W, balance=True)))
        p = max(p, _peak(lambda: key_owner_step(kept_f[d], validate=True)))
        p = max(p, _peak(lambda: assign_writes(metas, kept_r[d])))
        peaks[d] = p + recv.v[d]
    return {
        "records": n_records,
        "unique_chunks": commit["chunks"],
        "rank_time": t_rank.summary(),
        "reuse_time": t_reuse.summary(),
        "steps": {k: s.summary() for k, s in steps.items()},
        "received": recv.summary(),
        "sent": sent.summary(),
        "reuse_received": 32 + dir_bcast + 8 + len(pickle.dumps(None)),
        "peak_mem": {"max": max(peaks.values()), "ranks": peaks},
        "writers": sum(1 for n in written_per_rank if n),
        "commit": commit,
    }


_SPREAD, _U64 = 0x9E3779B97F4A7C15, (1 << 64) - 1  # simulated digests: an odd multiplier mod 2^64


def _fake_written(rank: int, metas: Sequence[ShardMeta], threads: int = 2) -> WrittenTable:
    """The items ``write_data_files`` would report: ``threads`` files, archives of nbytes + ~1 KiB."""
    pos = [0] * threads
    out = WrittenTable()
    for i, m in enumerate(metas):
        f = i % threads
        length = m.nbytes + 1088 if m.kind == "tensor" else 900
        if m.kind == "tensor":
            # one XXH3-64 digest per 1 MiB block of the data, as write_data_files records them for the
            # manifest (64-bit values spread over the whole range, as real digests are)
            nblocks = -(-m.nbytes // (1 << 20))
            blocks = (64, m.nbytes, 1 << 20, [((rank * 7919 + i * 31 + b) * _SPREAD) & _U64 for b in range(nblocks)])
            out.append(m.key, m.offsets, m.sizes, f"__{rank}_{f}.distcp", pos[f], length,
                       ((rank * 7919 + i) * _SPREAD) & _U64, blocks)
        else:
            out.append(object_storage_key(m.key, m.offsets, m.global_shape), None, None, f"__{rank}_{f}.distcp",
                       pos[f], length, i)
        pos[f] += length
    return out


def simulate_commit(layout: GPTLayout, fin_msgs: Sequence[bytes], commit_dir: str) -> Dict[str, Any]:
    """Rank 0: decode the finalize messages, build the layout, write the metadata files (real code)."""
    from ckpt_integration.execution.save import SAVE_BACKENDS, SavePlan

    os.makedirs(commit_dir, exist_ok=True)

    def run():
        _errors, written, summaries = gather_finalize(fin_msgs)
        lay = commit_layout(written, summaries)
        plan = SavePlan(rank=0, world_size=layout.world, group=None, checkpoint_dir=commit_dir, write_dir=commit_dir,
                        staging=False, common={"iteration": 1000, "args": {"hidden": layout.hidden}}, requests=[],
                        summaries=[], thread_count=2, durable=False)
        SAVE_BACKENDS["torch_dist"].commit(plan, lay)
        return lay

    t0 = time.perf_counter()
    lay, cpu = _timed(run, retry_above=float("inf"))  # writes files: once
    dt = time.perf_counter() - t0
    sizes = {n: os.path.getsize(os.path.join(commit_dir, n)) for n in (".metadata", "manifest.json", "common.pt", "index.bin")
             if os.path.exists(os.path.join(commit_dir, n))}
    chunks = len(lay.chunk_items) + len(lay.object_items)
    files = len(set(lay.written.file.tolist()))
    return {"time": dt, "cpu": cpu, "chunks": chunks, "files": files, "sizes": sizes, "input_bytes": sum(map(len, fin_msgs))}


# --------------------------------------------------------------------------- load
def simulate_load(layout: GPTLayout, commit_dir: str, samples: Sequence[int]) -> Dict[str, Any]:
    """Coordinator reads and encodes; sampled ranks decode and plan the reads of their own shards."""
    from ckpt_integration.storage.opened import saved_chunk_reads
    from ckpt_integration.execution.shared_metadata import decode_shared, encode_shared, read_local
    from ckpt_integration.storage.torch_dist_reader import TorchDistReader
    from ckpt_integration.storage.filesystem import locate

    shared, t_read = _timed(lambda: read_local(commit_dir))
    payload, t_enc = _timed(lambda: encode_shared(shared))
    per_rank = {}
    for r in samples:
        metas = [m for m in layout.rank_metas(r) if m.kind == "tensor"]

        def plan():
            sh = decode_shared(payload)
            # the manifest as broadcast, as a load's ranks open their readers (not read again)
            reader = TorchDistReader(locate(commit_dir), sh.metadata_for({m.key for m in metas}), manifest=sh.manifest)
            n = 0
            for m in metas:
                n += len(saved_chunk_reads(reader, m.key, Box(m.offsets, m.sizes)))
            return n

        gc.collect()
        n, dt = _timed(plan)
        per_rank[r] = {"time": dt, "reads": n, "peak_mem": _peak(plan) + len(payload)}
    return {
        "coordinator_read": t_read, "coordinator_encode": t_enc, "broadcast_bytes": len(payload),
        "rank_time_max": max(v["time"] for v in per_rank.values()),
        "peak_mem_max": max(v["peak_mem"] for v in per_rank.values()),
        "ranks": per_rank,
        "request_check": simulate_request_check(layout, decode_shared(payload), commit_dir),
    }


def simulate_request_check(layout: GPTLayout, shared: Any, commit_dir: str) -> Dict[str, Any]:
    """A same-layout load's request check by counting (``planning.request_check``), every rank:
    its rows (each request's saved chunk, found in the broadcast index), routed to the keys'
    owners, and each owner's count. Requests that are not one whole saved chunk would send the
    real load to the general check (the save's exchange, measured above): counted here are the
    rest. Per-rank time: finding the chunks is left out (a load does it while planning its reads,
    which the load plan above measures); routing and counting are in."""
    from ckpt_integration.planning.request_check import object_place, request_problems, route_requests
    from ckpt_integration.storage.chunk_index import compact_chunks_of

    W = layout.world
    compact = compact_chunks_of(shared.metadata_for(None))
    inbox: List[List[bytes]] = [[] for _ in range(W)]
    t_rank, recv = Stat(W), Stat(W)
    counted = total = 0
    for r in range(W):
        rows = []
        for m in layout.rank_metas(r):
            total += 1
            main = 1 if m.is_main else 0
            if m.kind == "object":
                rows.append((*object_place(m.storage_key), main))
                continue
            found = compact.whole_chunk_at(m.key, Box(m.offsets, m.sizes), commit_dir)
            if found is not None:
                rows.append((found[1], found[2], found[3], main))
        counted += len(rows)
        messages, dt = _timed(lambda: route_requests(rows, W))
        t_rank.add(r, dt)
        for d, msg in messages.items():
            inbox[d].append(msg)
            if d != r:
                recv.add(d, len(msg))
    problems = 0
    for r in range(W):
        found_here, dt = _timed(lambda: request_problems(inbox[r]))
        t_rank.add(r, dt)
        problems += len(found_here)
    return {"requests": total, "counted": counted, "problems": problems, "rank_time": t_rank.summary(),
            "received": recv.summary()}


# --------------------------------------------------------------------------- driver
def run(worlds: Sequence[int], zero_modes: Sequence[bool], anchor_max_records: int, tmp: str,
        anchors: bool = True, **shape: int) -> Dict[str, Any]:
    # The simulation keeps millions of objects alive that a real rank never has: without this,
    # full garbage collections would land in whichever simulated rank happens to trigger them.
    gc.disable()
    results: Dict[str, Any] = {"runs": [], "anchors": [], "layout": dict(shape)}
    for zero in zero_modes:
        for W in worlds:
            layout = GPTLayout(W, zero=zero, **shape)
            t0 = time.perf_counter()
            save = simulate_save(layout, os.path.join(tmp, f"ck_{W}_{int(zero)}"))
            load = simulate_load(layout, os.path.join(tmp, f"ck_{W}_{int(zero)}"), sorted({0, W // 2, W - 1}))
            row = {"world": W, "zero": zero, "save": save, "load": load, "wall": time.perf_counter() - t0}
            results["runs"].append(row)
            print(_row_text(row), flush=True)
            gc.collect()
    if anchors:
        stop = {"megatron": False, "dcp": False}
        for W in worlds:
            layout = GPTLayout(W, zero=False, **shape)
            records = sum(len(layout.rank_metas(r)) for r in range(0, W, max(1, W // 64))) * max(1, W // 64)
            entry: Dict[str, Any] = {"world": W, "records": records}
            for name, fn in (("megatron", anchor_megatron), ("dcp", anchor_dcp)):
                if stop[name] or records > anchor_max_records:
                    entry[name] = None
                    stop[name] = True
                    continue
                entry[name] = fn(layout)
                gc.collect()
            results["anchors"].append(entry)
            print(_anchor_text(entry), flush=True)
    gc.enable()
    return results


def _fmt_bytes(n: float) -> str:
    return f"{n / MiB:.2f} MiB" if n >= MiB / 10 else f"{n / 1024:.1f} KiB"


def _row_text(row: Dict[str, Any]) -> str:
    s, l = row["save"], row["load"]
    c, q = s["commit"], row["load"]["request_check"]
    return (
        f"W={row['world']:>6} zero={int(row['zero'])} records={s['records']:>9} chunks={s['unique_chunks']:>7} "
        f"rank max {s['rank_time']['max'] * 1e3:7.1f} ms (p50 {s['rank_time']['p50'] * 1e3:5.1f}) "
        f"recv max {_fmt_bytes(s['received']['max'])} (p50 {_fmt_bytes(s['received']['p50'])}) "
        f"peak {_fmt_bytes(s['peak_mem']['max'])} | commit {c['time']:.2f} s .metadata {_fmt_bytes(c['sizes']['.metadata'])} "
        f"manifest {_fmt_bytes(c['sizes']['manifest.json'])} files {c['files']} | reuse {s['reuse_time']['max'] * 1e3:.1f} ms "
        f"| load rank {l['rank_time_max'] * 1e3:.0f} ms bcast {_fmt_bytes(l['broadcast_bytes'])} peak {_fmt_bytes(l['peak_mem_max'])} "
        f"| counted check {q['counted']}/{q['requests']} requests, rank max {q['rank_time']['max'] * 1e3:.1f} ms, "
        f"recv max {_fmt_bytes(q['received']['max'])}, problems {q['problems']} "
        f"| wall {row['wall']:.0f} s"
    )


def _anchor_text(e: Dict[str, Any]) -> str:
    parts = [f"anchors W={e['world']:>6} records={e['records']}"]
    m, d = e.get("megatron"), e.get("dcp")
    parts.append("megatron: not run" if m is None else
                 f"megatron validate {m['validate_time']:.2f} s, recv/rank {_fmt_bytes(m['received_per_rank'])}, rank0 heap {_fmt_bytes(m['peak_mem_rank0'])}")
    parts.append("dcp: not run" if d is None else
                 f"dcp global plan {d['global_plan_time']:.2f} s, recv rank0 {_fmt_bytes(d['received_rank0'])}, heap {_fmt_bytes(d['peak_mem_rank0'])}")
    return " | ".join(parts)


def markdown(results: Dict[str, Any]) -> str:
    lines = [
        "| ZeRO | ranks | records (all ranks) | unique chunks | per-rank plan+validate max (p50) | received/rank/save max (p50) | "
        "peak heap/rank | repeated save/rank | rank 0 commit | .metadata | manifest.json | data files | load plan/rank | load broadcast |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["runs"]:
        s, l, c = row["save"], row["load"], row["save"]["commit"]
        lines.append(
            f"| {'yes' if row['zero'] else 'no'} | {row['world']:,} | {s['records']:,} | {s['unique_chunks']:,} | "
            f"{s['rank_time']['max'] * 1e3:.1f} ms ({s['rank_time']['p50'] * 1e3:.1f}) | "
            f"{_fmt_bytes(s['received']['max'])} ({_fmt_bytes(s['received']['p50'])}) | {_fmt_bytes(s['peak_mem']['max'])} | "
            f"{s['reuse_time']['max'] * 1e3:.1f} ms, {s['reuse_received']} B | {c['time']:.2f} s | "
            f"{_fmt_bytes(c['sizes']['.metadata'])} | {_fmt_bytes(c['sizes']['manifest.json'])} | {c['files']:,} | "
            f"{l['rank_time_max'] * 1e3:.0f} ms | {_fmt_bytes(l['broadcast_bytes'])} |"
        )
    lines += ["", "| ranks | Megatron-Core validate (rank 0) | MCore received/rank | MCore rank-0 heap | DCP global plan (rank 0) | DCP received by rank 0 | DCP rank-0 heap |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for e in results["anchors"]:
        m, d = e.get("megatron"), e.get("dcp")
        mc = ("not run", "", "") if m is None else (f"{m['validate_time']:.2f} s", _fmt_bytes(m["received_per_rank"]), _fmt_bytes(m["peak_mem_rank0"]))
        dc = ("not run", "", "") if d is None else (f"{d['global_plan_time']:.2f} s", _fmt_bytes(d["received_rank0"]), _fmt_bytes(d["peak_mem_rank0"]))
        lines.append(f"| {e['world']:,} | " + " | ".join(mc + dc) + " |")
    return "\n".join(lines) + "\n"


def plot(results: Dict[str, Any], path: str) -> bool:
    """Curves of per-rank time and bytes against the world size; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for zero in (False, True):
        rows = [r for r in results["runs"] if r["zero"] == zero]
        if not rows:
            continue
        w = [r["world"] for r in rows]
        lab = "ours, ZeRO-1" if zero else "ours"
        axes[0].plot(w, [r["save"]["rank_time"]["max"] for r in rows], "o-", label=lab + " (max rank)")
        axes[1].plot(w, [r["save"]["received"]["max"] / MiB for r in rows], "o-", label=lab + " (max rank)")
        axes[2].plot(w, [r["save"]["commit"]["time"] for r in rows], "o-", label=lab)
    an = results["anchors"]
    mw = [e["world"] for e in an if e.get("megatron")]
    axes[0].plot(mw, [e["megatron"]["validate_time"] for e in an if e.get("megatron")], "s--", label="Megatron-Core validate (rank 0)")
    axes[1].plot(mw, [e["megatron"]["received_per_rank"] / MiB for e in an if e.get("megatron")], "s--", label="Megatron-Core all_gather")
    dw = [e["world"] for e in an if e.get("dcp")]
    axes[2].plot(dw, [e["dcp"]["global_plan_time"] for e in an if e.get("dcp")], "s--", label="DCP global plan (rank 0)")
    for ax, title in zip(axes, ("planning + validation per rank [s]", "metadata received per rank per save [MiB]",
                                "rank 0: commit / global plan [s]")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="64,256,1024,4096,16384")
    ap.add_argument("--zero", default="both", choices=("both", "no", "yes"))
    ap.add_argument("--anchor-max-records", type=int, default=400_000,
                    help="skip an anchor once all ranks' records exceed this (memory: ~1 KiB per record)")
    ap.add_argument("--no-anchors", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--plot")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=8192)
    args = ap.parse_args(argv)
    shape = {"tp": args.tp, "pp": args.pp, "layers": args.layers, "hidden": args.hidden, "vocab": 6400 * args.tp}
    worlds = [int(w) for w in args.worlds.split(",")]
    zero_modes = {"both": (False, True), "no": (False,), "yes": (True,)}[args.zero]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ckpt-scale-") as tmp:
        results = run(worlds, zero_modes, args.anchor_max_records, tmp, anchors=not args.no_anchors, **shape)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    table = markdown(results)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.plot:
        print("plot:", args.plot if plot(results, args.plot) else "matplotlib is not installed; no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
