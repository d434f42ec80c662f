#!/usr/bin/env python
"""What this machine gives each of several processes at once: the floor under a multi-rank figure.

A 2-rank benchmark on a 2-core machine runs two processes at once; each is slower than alone
even with no collective between them (shared caches, memory bandwidth, a virtual machine's CPU
time). This runs the same single-process job (save a checkpoint of ``--small`` tensors, then load
it ``--repeats`` times; no process group, nothing shared) first alone, then as ``--procs``
processes started together, and prints each one's best save and load in microseconds per
tensor. The ratio is what a per-tensor cost measured in one process becomes at that many ranks
before any collective or waiting is added.

    python benchmarks/contention.py --small 10000 --procs 2 --repeats 8 --dir /dev/shm
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time


def _job(n: int, nbytes: int, repeats: int, directory: str) -> None:
    import torch

    import ckpt_integration as ci
    from ckpt_integration import ShardedTensor

    torch.set_num_threads(1)
    local = [torch.rand(max(1, nbytes // 4)) for _ in range(n)]
    dst = [torch.zeros_like(t) for t in local]
    sd = lambda ts: {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t) for i, t in enumerate(ts)}  # noqa: E731
    root = os.path.join(directory, f"ckpt_contention_{os.getpid()}")
    shutil.rmtree(root, ignore_errors=True)
    print("ready", flush=True)  # (the processes start their timed work together: see _run)
    sys.stdin.readline()
    saves, loads = [], []
    try:
        for rep in range(repeats):
            d = os.path.join(root, str(rep))
            request = sd(local)
            gc.collect()
            t0 = time.perf_counter()
            ci.save(request, d)
            saves.append(time.perf_counter() - t0)
            request = sd(dst)
            gc.collect()
            t0 = time.perf_counter()
            ci.load(request, d)
            loads.append(time.perf_counter() - t0)
            if rep:
                shutil.rmtree(os.path.join(root, str(rep - 1)), ignore_errors=True)
        assert all(torch.equal(a, b) for a, b in zip(local, dst)), "bad load"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"save_us": 1e6 * min(saves) / n, "load_us": 1e6 * min(loads) / n}), flush=True)


def _run(procs: int, args: argparse.Namespace) -> list:
    cmd = [sys.executable, os.path.abspath(__file__), "--job", "--small", str(args.small),
           "--small-bytes", str(args.small_bytes), "--repeats", str(args.repeats), "--dir", args.dir]
    running = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    for p in running:  # each has imported everything and built its state: all go at once
        if p.stdout.readline().strip() != "ready":
            raise SystemExit(f"a job failed before its work (exit {p.wait()})")
    for p in running:
        p.stdin.write("go\n")
        p.stdin.flush()
    out = []
    for p in running:
        stdout, _ = p.communicate(timeout=1800)
        if p.returncode:
            raise SystemExit(f"a job failed (exit {p.returncode})")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", type=int, default=10000, metavar="N", help="tensors per process")
    p.add_argument("--small-bytes", type=int, default=4096)
    p.add_argument("--procs", type=int, default=2, help="processes run at once")
    p.add_argument("--repeats", type=int, default=8, help="save + load rounds per process (best kept)")
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # (one of the processes measured)
    args = p.parse_args(argv)
    if args.job:
        _job(args.small, args.small_bytes, args.repeats, args.dir)
        return {}
    alone = _run(1, args)[0]
    together = _run(args.procs, args)
    print(f"{args.small} tensors of {args.small_bytes} B per process, best of {args.repeats}, us per tensor")
    print("| run | save | load |")
    print("|---|---:|---:|")
    print(f"| alone | {alone['save_us']:.1f} | {alone['load_us']:.1f} |")
    for i, r in enumerate(together):
        print(f"| {args.procs} at once, process {i} | {r['save_us']:.1f} | {r['load_us']:.1f} |")
    worst = max(r["load_us"] for r in together)
    print(f"slowest of {args.procs} at once / alone: save {max(r['save_us'] for r in together) / alone['save_us']:.2f}x, "
          f"load {worst / alone['load_us']:.2f}x")
    return {"alone": alone, "together": together}


if __name__ == "__main__":
    main()
