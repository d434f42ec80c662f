"""Exit cleanly, every time: repeated ``torchrun`` jobs that save or load and exit (issue 23 item 0).

The last lines of most training scripts are a save (or a load) followed by
``destroy_process_group()`` and the end of the interpreter. A thread of the library left inside a
collective or a tensor operation at interpreter teardown, or a process group of its own still alive
then, aborts the process (``terminate called without an active exception``, SIGABRT, exit code -6)
although the checkpoint is complete; a scheduler then marks the job failed. Such aborts depend on
timing, so this script runs each case many times, optionally while other processes keep every core
busy (``--burn``), and counts the outcomes.

Cases (each a plain script run by ``torchrun --nproc-per-node R``; state: 2 tensors, one sharded,
one replicated, as a new user would write it):

* ``save``              ``ci.save(state, path)``, ``destroy_process_group()``, exit (no barrier after the save)
* ``save_no_destroy``   ``ci.save(state, path)``, exit without ``destroy_process_group()``
* ``load``              ``ci.load(state, path)``, ``destroy_process_group()``, exit
* ``async_destroy``     ``ci.save(..., async_sharded_save=True)``, ``destroy_process_group()``, exit without ``wait()``
* ``async_exit``        ``ci.save(..., async_sharded_save=True)``, exit without ``wait()`` or ``destroy_process_group()``
* ``dcp_save``          PyTorch DCP ``dcp.save`` then ``destroy_process_group()`` (the anchor the reporter compared with)
* ``dcp_save_no_destroy``  PyTorch DCP ``dcp.save``, exit without ``destroy_process_group()``
* ``dcp_load``          PyTorch DCP ``dcp.load`` (of a ``dcp.save`` checkpoint) then ``destroy_process_group()``
* ``dcp_async_destroy`` PyTorch DCP ``dcp.async_save``, ``destroy_process_group()``, exit without ``result()``
* ``torch_no_destroy``  no checkpoint at all: an all-reduce and a ``broadcast_object_list``, exit without
                        ``destroy_process_group()`` (what torch and gloo do on their own)
* ``lightning_fsdp2``   ``Trainer.fit`` under ``ModelParallelStrategy`` (FSDP2, ``precision="bf16-true"``) resumed
                        from a checkpoint a DDP run saved with ``DistCkptIO`` (the DDP run is made once, first)
* ``lightning_fsdp2_plain``  the same FSDP2 bf16-true fit from scratch without the plugin (Lightning and torch alone)

Counted per case: runs, exit code 0 on every rank, SIGABRT on some rank (``terminate called`` /
exit code -6), other failures, hangs (``--timeout``), checkpoints committed (save cases), mean
seconds per run. Needs only the repository on ``PYTHONPATH`` (works with torch >= 2.4)::

    python benchmarks/exit_stress.py --runs 20                       # 2 ranks, every case
    python benchmarks/exit_stress.py --runs 50 --ranks 2 4 --burn auto --cases save load
    python benchmarks/exit_stress.py --runs 10 --json /tmp/exit.json --show-failures 1

``--burn N`` keeps N busy-looping processes running during the runs (``auto``: one per core); on a
machine with many cores this is what changes the timing most.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HEADER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    import ckpt_integration as ci
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path, mib = sys.argv[1], float(sys.argv[2])
    rows = max(world, int(mib * 2**20 / 4 / 1024) // world * world)
    def state(fill=True):
        a = torch.arange(rows * 1024, dtype=torch.float32).view(rows, 1024)
        part = rows // world
        mine = a[rank * part:(rank + 1) * part].clone() if fill else torch.empty(part, 1024)
        b = torch.arange(16.0) if fill else torch.empty(16)
        return {"a": ci.ShardedTensor.from_rank_offsets("a", mine, (0, rank, world)),
                "b": ci.ShardedTensor.from_rank_offsets("b", b, replica_id=rank), "step": 7}
""")

DCP_STATE = ("import torch.distributed.checkpoint as dcp\n"
             "from torch.distributed.tensor import DTensor, Shard, init_device_mesh\n"
             "mesh = init_device_mesh('cpu', (world,))\n"
             "def dcp_state(fill=True):\n"
             "    s = state(fill)\n"
             "    return {'a': DTensor.from_local(s['a'].data, mesh, [Shard(0)]), 'b': s['b'].data, 'step': 7}\n")
DCP_SAVE = DCP_STATE + "dcp.save(dcp_state(), checkpoint_id=path)\n"
DCP_LOAD = (DCP_STATE + "sd = dcp_state(False)\ndcp.load(sd, checkpoint_id=path)\n"
            "assert torch.equal(sd['a'].to_local(), state()['a'].data)\n")

SCRIPTS: Dict[str, str] = {
    "save": "ci.save(state(), path)\ndist.destroy_process_group()\n",
    "save_no_destroy": "ci.save(state(), path)\n",
    "load": ("out = ci.load(state(False), path)\n"
             "assert torch.equal(out['a'], state()['a'].data) and out['step'] == 7\n"
             "dist.destroy_process_group()\n"),
    "async_destroy": "req = ci.save(state(), path, async_sharded_save=True)\ndist.destroy_process_group()\n",
    "async_exit": "req = ci.save(state(), path, async_sharded_save=True)\n",
    "dcp_save": DCP_SAVE + "dist.destroy_process_group()\n",
    "dcp_save_no_destroy": DCP_SAVE,
    "dcp_load": DCP_LOAD + "dist.destroy_process_group()\n",
    # DCP's async save, the process group destroyed before the future's result(), exit
    "dcp_async_destroy": DCP_STATE + "fut = dcp.async_save(dcp_state(), checkpoint_id=path)\ndist.destroy_process_group()\n",
    # torch alone: the collectives of a save's metadata exchange, then exit without destroy_process_group()
    "torch_no_destroy": ("t = torch.ones(4)\ndist.all_reduce(t)\nout = [None]\n"
                         "dist.broadcast_object_list(out if rank else ['ok'], src=0)\n"),
}

LIGHTNING = textwrap.dedent("""
    import os, sys, torch
    import lightning as L
    from torch import nn
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    stage, ckdir = sys.argv[1], sys.argv[2]

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        def configure_model(self):
            if stage in ("fsdp2", "plain"):
                from torch.distributed.fsdp import fully_shard
                mesh = self.device_mesh["data_parallel"]
                fully_shard(self.net[1], mesh=mesh)
                fully_shard(self.net, mesh=mesh)
        def training_step(self, batch, i):
            x, y = batch
            return ((self.net(x).squeeze(-1) - y.to(x.dtype)) ** 2).mean()
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    world = int(os.environ["WORLD_SIZE"])
    if stage == "ddp":
        kw = dict(strategy="ddp", max_epochs=1)
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy
        kw = dict(strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                  precision="bf16-true", max_epochs=2)
    cb = DistCkptModelCheckpoint(dirpath=ckdir if stage == "ddp" else os.path.join(ckdir, "fsdp2"), save_last=True)
    if stage == "plain":  # the same FSDP2 bf16-true fit from scratch, without the plugin (the anchor)
        trainer = L.Trainer(accelerator="cpu", devices=world, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, **kw)
        trainer.fit(Module(), loader)
    else:
        trainer = L.Trainer(accelerator="cpu", devices=world, plugins=[DistCkptIO()], logger=False, callbacks=[cb],
                            enable_progress_bar=False, enable_model_summary=False, **kw)
        trainer.fit(Module(), loader, ckpt_path=None if stage == "ddp" else os.path.join(ckdir, "last.ckpt"))
""")

CASES = list(SCRIPTS) + ["lightning_fsdp2", "lightning_fsdp2_plain"]
LOADS = ("load", "dcp_load")
ABORT_RE = re.compile(r"terminate called|SIGABRT|exitcode\s*:\s*-6\b|Signals?\.SIGABRT|signal 6", re.I)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _burn() -> None:  # pragma: no cover - runs in the burner processes
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def _torchrun(script: str, args: List[str], ranks: int, timeout: float) -> Dict[str, object]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), script, *args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        # a hung job: end torchrun and its workers (their own session), then collect what they printed
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        rc = None
    return {"rc": rc, "out": out, "s": time.perf_counter() - t0}


def _outcome(run: Dict[str, object]) -> str:
    if run["rc"] is None:
        return "hung"
    if ABORT_RE.search(str(run["out"])):
        return "abort"
    return "clean" if run["rc"] == 0 else "failed"


def _committed(path: str) -> bool:
    return os.path.exists(os.path.join(path, "metadata.json")) or os.path.exists(os.path.join(path, ".metadata"))


def run_case(case: str, ranks: int, runs: int, work: str, mib: float, timeout: float) -> Dict[str, object]:
    """Run ``case`` ``runs`` times on ``ranks`` ranks; returns the counts and the failing outputs."""
    d = os.path.join(work, f"{case}-{ranks}")
    os.makedirs(d, exist_ok=True)
    script = os.path.join(d, "job.py")
    prepared = os.path.join(d, "prepared")
    if case.startswith("lightning"):
        with open(script, "w") as f:
            f.write(LIGHTNING)
    if case == "lightning_fsdp2":
        first = _torchrun(script, ["ddp", prepared], ranks, timeout)
        if first["rc"] != 0:
            return {"case": case, "ranks": ranks, "error": "the DDP run that makes the checkpoint failed",
                    "output": str(first["out"])[-4000:]}
    elif case in SCRIPTS:
        with open(script, "w") as f:
            f.write(HEADER + SCRIPTS[case])
        if case in ("load", "dcp_load"):  # the checkpoint every run loads
            with open(os.path.join(d, "make.py"), "w") as f:
                f.write(HEADER + ("ci.save(state(), path)\n" if case == "load" else DCP_SAVE)
                        + "dist.barrier()\ndist.destroy_process_group()\n")
            made = _torchrun(os.path.join(d, "make.py"), [prepared, str(mib)], ranks, timeout)
            if made["rc"] != 0:
                return {"case": case, "ranks": ranks, "error": "making the checkpoint failed",
                        "output": str(made["out"])[-4000:]}
    counts = {"clean": 0, "abort": 0, "failed": 0, "hung": 0}
    committed, seconds, failures = 0, [], []
    for i in range(runs):
        target = os.path.join(d, f"ck{i}")
        if case.startswith("lightning"):
            args = ["fsdp2" if case == "lightning_fsdp2" else "plain", prepared]
        else:
            args = [prepared if case in LOADS else target, str(mib)]
        run = _torchrun(script, args, ranks, timeout)
        kind = _outcome(run)
        counts[kind] += 1
        seconds.append(float(run["s"]))
        if case in SCRIPTS and case not in LOADS + ("torch_no_destroy",) and _committed(target):
            committed += 1
        if kind != "clean":
            failures.append({"run": i, "kind": kind, "rc": run["rc"], "output": str(run["out"])[-4000:]})
        shutil.rmtree(target, ignore_errors=True)
        if case == "lightning_fsdp2":
            shutil.rmtree(os.path.join(prepared, "fsdp2"), ignore_errors=True)
    return {"case": case, "ranks": ranks, "runs": runs, **counts, "committed": committed,
            "mean_s": sum(seconds) / max(1, len(seconds)), "failures": failures}


def _table(results: List[Dict[str, object]]) -> str:
    head = f"{'case':<22}{'ranks':>6}{'runs':>6}{'exit 0':>8}{'SIGABRT':>9}{'other':>7}{'hung':>6}{'committed':>11}{'s/run':>8}"
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['case']:<22}{r['ranks']:>6}  {r['error']}")
            continue
        saves = r["case"] in SCRIPTS and r["case"] not in LOADS + ("torch_no_destroy",)
        lines.append(f"{r['case']:<22}{r['ranks']:>6}{r['runs']:>6}{r['clean']:>8}{r['abort']:>9}{r['failed']:>7}"
                     f"{r['hung']:>6}{(str(r['committed']) if saves else '-'):>11}{r['mean_s']:>8.1f}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=10, help="runs per case and rank count")
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    p.add_argument("--burn", default="0", help="busy processes during the runs: a number or 'auto' (one per core)")
    p.add_argument("--mib", type=float, default=0.25, help="size of the sharded tensor (MiB)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a run counts as hung")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--show-failures", type=int, default=1, help="print the output of this many failing runs per case")
    a = p.parse_args(argv)
    burn = (os.cpu_count() or 1) if a.burn == "auto" else int(a.burn)
    work = a.dir or tempfile.mkdtemp(prefix="exit_stress-")
    burners = [mp.Process(target=_burn, daemon=True) for _ in range(burn)]
    for b in burners:
        b.start()
    import torch

    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} cores, {burn} burner(s), "
          f"{a.runs} runs per case", flush=True)
    results = []
    try:
        for ranks in a.ranks:
            for case in a.cases:
                r = run_case(case, ranks, a.runs, work, a.mib, a.timeout)
                results.append(r)
                print(_table([r]).splitlines()[-1], flush=True)
    finally:
        for b in burners:
            b.terminate()
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(_table(results))
    for r in results:
        for f in r.get("failures", [])[: a.show_failures]:
            print(f"\n--- {r['case']} on {r['ranks']} ranks, run {f['run']}: {f['kind']} (torchrun exit {f['rc']}) ---")
            print(f["output"][-2500:])
        if "error" in r:
            print(f"\n--- {r['case']}: {r['error']} ---\n{r['output'][-2500:]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"burn": burn, "results": results}, f, indent=1)
    bad = sum(int(r.get("abort", 0)) + int(r.get("failed", 0)) + int(r.get("hung", 0)) + ("error" in r) for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
