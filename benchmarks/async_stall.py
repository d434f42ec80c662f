#!/usr/bin/env python
"""Async save stall as training feels it: step time with a checkpoint every N steps vs without.

A training loop with real compute (an MLP trained with Adam on CPU; the state saved is
parameters + both Adam moments, a few hundred MiB) runs the same number of steps once
without checkpoints and once per checkpointing method, in the same process and run:

* ``ours sync``: ``ci.save`` (blocks for the whole save);
* ``ours async (caller snapshot)``: ``async_sharded_save`` with ``snapshot="caller"``
  (the previous behaviour: the host copy is made before the call returns);
* ``ours async``: ``async_sharded_save`` with the default background snapshot: the copy
  runs during the next forward/backward, the next ``optimizer.step()`` waits for it (global
  optimizer pre-hook), the write and commit run in the background;
* ``DCP async``: ``torch.distributed.checkpoint.async_save`` with a persistent
  ``DefaultStager`` (buffers reused across saves; pinned when CUDA exists), staging in the
  caller (``use_async_staging=False``, what ``async_save`` does by default);
* ``DCP async (async staging)``: the same stager with ``use_async_staging=True``; the loop
  waits for ``staging_completion`` before the next optimizer step, as DCP asks.

Stall per checkpoint = (loop time with checkpoints - loop time without) / checkpoints, the two
loops run back to back (alternating which goes first) and the median over ``--repeats`` such
pairs taken, so that a busy spell of a shared machine hits both loops of a pair alike; in % of a
synchronous save of ours (its mean call time). ``step ms`` is the fastest loop's mean step.
Each loop ends ``--every`` steps after its last save, so an async write still running there is
counted when it slows the steps. Also shown: how long the save call itself
blocked and how long the optimizer step waited for the snapshot, and the peak RSS (VmHWM) of a
process running a loop with two saves, each method in fresh processes (lowest of
``--mem-repeats``), above that of the same loop without checkpoints, as ``(state + extra) / state``.

Training uses ``--threads`` intra-op threads (default 1: the other core is free for the
background copy and write, as on a GPU host whose CPU cores are idle during compute; with
all cores busy computing, any background work slows the steps by its CPU time).

Usage::

    python benchmarks/async_stall.py                         # ~300 MiB state, /dev/shm
    python benchmarks/async_stall.py --state-mib 600 --every 5 --repeats 5 --json out.json
    python benchmarks/async_stall.py --quick                 # smoke run
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import _free_port, _status_kib  # noqa: E402  (this folder is on sys.path when run as a script)

MiB = 1 << 20


# --------------------------------------------------------------------------- memory (Linux /proc, stdlib only)
def peak_rss() -> Optional[int]:
    v = _status_kib("VmHWM")
    return None if v is None else v * 1024


# --------------------------------------------------------------------------- the training job
class Job:
    def __init__(self, args: argparse.Namespace):
        torch.manual_seed(0)
        # params + 2 Adam moments = 3 copies; square layers of `width`
        width = args.width
        per_layer = width * width * 4 * 3
        layers = max(1, round(args.state_mib * MiB / per_layer))
        mods: List[torch.nn.Module] = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width, bias=True), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*mods)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(args.batch, width)
        self.layers = layers
        self.step()  # creates the Adam state
        self.state_bytes = sum(t.numel() * t.element_size() for t in self.tensors().values())

    def step(self, before_update: Optional[Callable[[], None]] = None) -> None:
        self.opt.zero_grad(set_to_none=False)
        self.model(self.x).pow(2).mean().backward()
        if before_update is not None:
            before_update()
        self.opt.step()

    def tensors(self) -> Dict[str, torch.Tensor]:
        out = {}
        for name, p in self.model.named_parameters():
            out[name] = p.detach()
            st = self.opt.state.get(p, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    out[f"optimizer.{k}.{name}"] = st[k]
        return out

    def sharded(self) -> Dict[str, Any]:
        import ckpt_integration as ci

        sd: Dict[str, Any] = {k: ci.ShardedTensor.from_rank_offsets(k, t) for k, t in self.tensors().items()}
        sd["step"] = 1
        return sd


# --------------------------------------------------------------------------- methods
class Method:
    """One checkpointing method: ``save(path)`` at a checkpoint step, ``before_update()`` before each optimizer step."""

    name = ""

    def __init__(self, job: Job, args: argparse.Namespace):
        self.job, self.args = job, args
        self.blocking: List[float] = []
        self.step_wait: List[float] = []

    def save(self, path: str) -> None:
        raise NotImplementedError

    def before_update(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        self.drain()


class OursSync(Method):
    name = "ours sync"

    def save(self, path: str) -> None:
        import ckpt_integration as ci

        t0 = time.perf_counter()
        ci.save(self.job.sharded(), path, durable=self.args.durable)
        self.blocking.append(time.perf_counter() - t0)


class OursAsync(Method):
    def __init__(self, job: Job, args: argparse.Namespace, snapshot: str):
        super().__init__(job, args)
        from ckpt_integration.execution.async_save import AsyncCallsQueue

        self.name = "ours async" if snapshot == "background" else "ours async (caller snapshot)"
        self.queue = AsyncCallsQueue(snapshot=snapshot)
        self.reqs: List[Any] = []

    def save(self, path: str) -> None:
        import ckpt_integration as ci

        t0 = time.perf_counter()
        req = ci.save(self.job.sharded(), path, async_sharded_save=True, async_queue=self.queue,
                      durable=self.args.durable)
        self.blocking.append(time.perf_counter() - t0)
        self.reqs.append(req)
        self.queue.maybe_finalize_async_calls(blocking=False)

    def before_update(self) -> None:
        # nothing to do: optimizer.step() waits for the snapshot (global pre-hook); recorded afterwards
        self.queue.maybe_finalize_async_calls(blocking=False)

    def drain(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True)
        for r in self.reqs:
            if r.snapshot is not None:
                self.step_wait.append(r.snapshot.waited_seconds)
        self.reqs = []

    def close(self) -> None:
        self.drain()
        self.queue.close()


class DcpAsync(Method):
    def __init__(self, job: Job, args: argparse.Namespace, async_staging: bool):
        super().__init__(job, args)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        self.name = "DCP async (async staging)" if async_staging else "DCP async"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=async_staging, use_non_blocking_copy=cuda))
        self.async_staging = async_staging
        self.pending: Any = None
        self.staging: Any = None

    def save(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        self.drain()  # one save in flight, as ours
        t0 = time.perf_counter()
        resp = dcp.async_save(self.job.tensors(), checkpoint_id=path, async_stager=self.stager)
        self.blocking.append(time.perf_counter() - t0)
        self.pending = getattr(resp, "upload_completion", resp)
        self.staging = getattr(resp, "staging_completion", None)

    def before_update(self) -> None:
        if self.staging is not None:  # DCP: wait for staging before modifying the state
            t0 = time.perf_counter()
            self.staging.result()
            self.step_wait.append(time.perf_counter() - t0)
            self.staging = None

    def drain(self) -> None:
        self.before_update()
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self) -> None:
        self.drain()
        self.stager.close()


# --------------------------------------------------------------------------- loop
def run_loop(job: Job, method: Optional[Method], steps: int, every: int, root: str, tag: str) -> Dict[str, Any]:
    """``steps`` training steps; a save after every ``every``-th step except the last ``every``."""
    saves = 0
    t0 = time.perf_counter()
    for i in range(steps):
        job.step(method.before_update if method is not None else None)
        if method is not None and (i + 1) % every == 0 and i + 1 < steps:
            method.save(os.path.join(root, f"{tag}_{saves}"))
            saves += 1
    total = time.perf_counter() - t0
    if method is not None:
        method.drain()
    return {"total": total, "saves": saves}


def _make_method(name: str, job: Job, args: argparse.Namespace) -> Optional[Method]:
    return {
        "none": lambda: None,
        "ours sync": lambda: OursSync(job, args),
        "ours async (caller snapshot)": lambda: OursAsync(job, args, "caller"),
        "ours async": lambda: OursAsync(job, args, "background"),
        "DCP async": lambda: DcpAsync(job, args, False),
        "DCP async (async staging)": lambda: DcpAsync(job, args, True),
    }[name]()


def memory_probe(args: argparse.Namespace) -> Dict[str, Any]:
    """In a fresh process: the lifetime peak RSS (VmHWM) after a loop with two saves.

    Every probe process does the same up to the method (imports, model, one step), so the
    difference of two probes' peaks is what the method adds. Lifetime peaks, not peaks above
    the RSS at some point: memory freed but still resident (the allocator keeps it) would
    otherwise be reused by the method without showing.
    """
    torch.set_num_threads(args.threads)
    _init_group()
    # every probe imports the same modules, so only the method's own memory differs
    for mod in ("torch.distributed.checkpoint", "torch.distributed.checkpoint.staging",
                "ckpt_integration.execution.async_save"):
        importlib.import_module(mod)

    job = Job(args)
    job.step()
    root = tempfile.mkdtemp(prefix="async_stall_mem_", dir=args.dir)
    m = _make_method(args.mem_probe, job, args)
    try:
        run_loop(job, m, 3 * args.every, args.every, root, "mem")
    finally:
        if m is not None:
            m.close()
        shutil.rmtree(root, ignore_errors=True)
    return {"peak": peak_rss(), "state_bytes": job.state_bytes}


def run_memory_probes(args: argparse.Namespace, names: List[str]) -> Dict[str, Optional[int]]:
    """Extra peak RSS of each method over the loop without checkpoints, each in its own process."""
    import subprocess

    extras: Dict[str, Optional[int]] = {}
    for rep in range(args.mem_repeats):  # the lowest peak of each: allocator noise is tens of MiB
        for name in ["none", *names]:
            cmd = [sys.executable, os.path.abspath(__file__), "--mem-probe", name,
                   *(["--durable"] if args.durable else []), "--state-mib", str(args.state_mib),
                   "--width", str(args.width), "--batch", str(args.batch), "--every", str(args.every),
                   "--dir", args.dir, "--threads", str(args.threads)]
            env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
            here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env["PYTHONPATH"] = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise RuntimeError(f"memory probe {name!r} failed:\n{proc.stdout}\n{proc.stderr}")
            peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak"]
            if peak is not None:
                extras[name] = peak if extras.get(name) is None else min(extras[name], peak)
            else:
                extras.setdefault(name, None)
    base = extras.pop("none")
    return {k: (None if v is None or base is None else v - base) for k, v in extras.items()}


def _init_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():  # a 1-rank group: ours and DCP take their distributed paths
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)


def _clean(root: str) -> None:
    for n in os.listdir(root):
        shutil.rmtree(os.path.join(root, n), ignore_errors=True)


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    torch.set_num_threads(args.threads)
    _init_group()
    job = Job(args)
    root = tempfile.mkdtemp(prefix="async_stall_", dir=args.dir)
    names = ["ours sync", "ours async (caller snapshot)", "ours async"]
    if not args.skip_dcp:
        names += ["DCP async", "DCP async (async staging)"]
    extras = run_memory_probes(args, names) if not args.skip_memory else {}
    methods = [_make_method(n, job, args) for n in names]
    steps = (args.checkpoints + 1) * args.every
    res: Dict[str, Dict[str, Any]] = {"none": {"totals": []}}
    res.update({m.name: {"totals": [], "extra": extras.get(m.name)} for m in methods})
    try:
        for m in methods:  # warm-up: first save allocates buffers, plans, threads
            run_loop(job, m, 2 * args.every, args.every, root, "warm")
            m.blocking.clear()
            m.step_wait.clear()
            _clean(root)
        run_loop(job, None, args.every, args.every, root, "warm")
        for rep in range(args.repeats):
            for m in methods:
                # each method's loop next to a loop without checkpoints (alternating which goes
                # first): the pair sees the same machine load, their difference is the stall
                pair = {}
                for x in ((None, m) if rep % 2 == 0 else (m, None)):
                    r = run_loop(job, x, steps, args.every, root, f"r{rep}")
                    key = "none" if x is None else x.name
                    res[key]["totals"].append(r["total"])
                    res[key]["saves"] = r["saves"]
                    pair[key] = r["total"]
                    _clean(root)
                res[m.name].setdefault("diffs", []).append(pair[m.name] - pair["none"])
    finally:
        for m in methods:
            m.close()
        shutil.rmtree(root, ignore_errors=True)
    for m in methods:
        res[m.name]["blocking"] = m.blocking
        res[m.name]["step_wait"] = m.step_wait
        res[m.name].pop("peaks", None)
    return summarize(job, args, steps, res)


def summarize(job: Job, args: argparse.Namespace, steps: int, res: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    sync_save = statistics.mean(res["ours sync"]["blocking"])
    rows = {}
    for name, r in res.items():
        best = min(r["totals"])
        n = r.get("saves", 0)
        stall = statistics.median(r["diffs"]) / n if n and r.get("diffs") else 0.0
        extra = r.get("extra")
        blocked = (statistics.mean(r["blocking"]) + (statistics.mean(r["step_wait"]) if r.get("step_wait") else 0.0)
                   if r.get("blocking") else None)
        rows[name] = {
            "loop_s": best,
            "step_ms": 1000 * best / steps,
            "stall_per_ckpt_s": stall,
            "stall_pct_of_sync_save": 100 * stall / sync_save if n else 0.0,
            "blocking_s": statistics.mean(r["blocking"]) if r.get("blocking") else None,
            "step_wait_s": statistics.mean(r["step_wait"]) if r.get("step_wait") else None,
            "blocked_pct_of_sync_save": None if blocked is None else 100 * blocked / sync_save,
            "extra_peak_rss_mib": None if extra is None else extra / MiB,
            "mem_ratio": None if extra is None else (job.state_bytes + max(0, extra)) / job.state_bytes,
        }
    return {
        "config": {**vars(args), "layers": job.layers, "state_mib": job.state_bytes / MiB, "steps": steps,
                   "torch": torch.__version__},
        "sync_save_s": sync_save,
        "rows": rows,
    }


def format_table(out: Dict[str, Any]) -> str:
    c = out["config"]
    lines = [
        f"state {c['state_mib']:.0f} MiB ({c['layers']} x Linear({c['width']}) + Adam), batch {c['batch']}, "
        f"{c['steps']} steps, a checkpoint every {c['every']} ({c['checkpoints']} per loop), best of {c['repeats']}, "
        f"{c['threads']} training thread(s), dir {c['dir']}",
        f"ours sync save: {out['sync_save_s']:.3f} s per checkpoint",
        f"{'method':<28}{'step ms':>8}{'call s':>8}{'step wait s':>12}{'blocked %':>10}"
        f"{'stall/ckpt s':>13}{'stall %':>9}{'mem':>6}",
    ]
    lines.append("-" * len(lines[-1]))
    for name, r in out["rows"].items():
        def f(v, spec):
            return "-" if v is None or name == "none" else spec.format(v)

        lines.append(
            f"{name:<28}{r['step_ms']:>8.1f}{f(r['blocking_s'], '{:.3f}'):>8}{f(r['step_wait_s'], '{:.3f}'):>12}"
            f"{f(r['blocked_pct_of_sync_save'], '{:.1f}%'):>10}{f(r['stall_per_ckpt_s'], '{:.3f}'):>13}"
            f"{f(r['stall_pct_of_sync_save'], '{:.1f}%'):>9}{f(r['mem_ratio'], '{:.2f}'):>6}"
        )
    lines.append(
        "call = time in the save call; step wait = optimizer step waiting for the snapshot; blocked = call + step "
        "wait, % of ours sync save; stall = median over pairs of (loop time - loop time without checkpoints run next "
        "to it) / checkpoints, i.e. blocked "
        "+ the slowdown of the steps by background work; mem = (state + peak RSS above the same loop without "
        "checkpoints) / state"
    )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--state-mib", type=float, default=300, help="saved state: params + Adam moments (MiB)")
    p.add_argument("--width", type=int, default=2048, help="width of the square Linear layers")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--every", type=int, default=4, help="steps between checkpoints")
    p.add_argument("--checkpoints", type=int, default=3, help="checkpoints per loop")
    p.add_argument("--repeats", type=int, default=5, help="loop pairs (with / without checkpoints) per method")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for training")
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    p.add_argument("--durable", action="store_true", help="fsync before commit (ours; DCP always syncs)")
    p.add_argument("--skip-dcp", action="store_true")
    p.add_argument("--skip-memory", action="store_true", help="no peak-RSS probes (one process per method)")
    p.add_argument("--mem-repeats", type=int, default=2, help="memory probes per method; the lowest peak counts")
    p.add_argument("--mem-probe", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    a = p.parse_args(argv)
    if a.quick:
        a.state_mib, a.width, a.batch, a.every, a.checkpoints, a.repeats, a.mem_repeats = 6, 256, 16, 2, 2, 1, 1
    return a


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    if args.mem_probe:
        r = memory_probe(args)
        print(json.dumps(r))
        return r
    out = measure(args)
    print(format_table(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
