"""Lightning with the memory tier: ``DistCkptIO(memory_every_n_train_steps=1, memory_replicas=2, ...)``.

2 gloo processes, each its own simulated node (its own ``memory_dir``), ``DistCkptDDPStrategy`` with
``TinyModule`` (AdamW, an HF-style LambdaLR stepping per step, a torchmetrics metric, extra state)
and ``DistCkptModelCheckpoint(save_last=True)`` at every epoch end (2 steps per epoch):

1. train; at step 3 (one step after the durable ``last.ckpt`` of step 2) wait for the memory
   snapshot, record the exact state, and SIGKILL rank 1;
2. ``trainer.fit(ckpt_path="last")`` in 2 new processes: the memory snapshot of step 3 is newer
   than ``last.ckpt``, so it is restored from each rank's own memory (logged per rank) with the
   exact weights, optimizer and scheduler state, metric and extra state, loop counters; the run
   finishes and the job's snapshots are removed from both nodes; with ``memory_persist_every_n=1``
   the snapshots were made durable on the way, the two newest kept;
3. a fresh run gets a SIGTERM on every rank at step 3: Lightning stops both ranks, and the newest
   snapshot (step 3) is written as ``preempted-step=3.ckpt`` before they exit; that durable
   checkpoint holds the step-3 state and records step 3;
4. on new nodes (every memory directory deleted), ``ckpt_path="last"`` takes the preempted
   checkpoint of step 3 over ``last.ckpt`` of step 2 and resumes from it exactly.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
from ckpt_integration.storage.filesystem import locate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank_main(cfg: dict) -> None:
    import datetime
    import logging

    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    from ckpt_integration.lightning import DistCkptDDPStrategy, DistCkptIO, DistCkptModelCheckpoint
    from tests.lightning_helpers import TinyModule, loader, snapshot, trainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(name)s: %(message)s")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    out: dict = {}
    path = f"{cfg['out']}-rank{rank}.json"

    def dump():
        with open(path, "w") as f:
            json.dump(out, f)

    class Recorder(Callback):
        def on_load_checkpoint(self, trainer, pl_module, checkpoint):
            torch.save({k: checkpoint[k] for k in ("loops", "global_step", "epoch", "lr_schedulers")},
                       f"{cfg['out']}-rank{rank}.loaded.pt")

        def on_train_start(self, trainer, pl_module):
            out["start_step"] = int(trainer.global_step)
            torch.save(snapshot(pl_module), f"{cfg['out']}-rank{rank}.start.pt")
            dump()

        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step != cfg.get("stop_at"):
                return
            io = trainer.strategy.checkpoint_io
            io.memory_tier.wait()  # the snapshot of this step is complete on every rank
            ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            torch.save({"snap": snapshot(pl_module), "loops": ckpt["loops"], "global_step": ckpt["global_step"],
                        "epoch": ckpt["epoch"], "lr_schedulers": ckpt["lr_schedulers"]},
                       f"{cfg['out']}-rank{rank}.killed.pt")
            out["stopped_at"] = int(trainer.global_step)
            dump()
            if cfg["how"] == "kill" and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if cfg["how"] == "exit":  # every rank gone at once (a job killed): its snapshots stay in memory
                os._exit(3)
            if cfg["how"] == "sigterm":  # a preemption signals every rank; Lightning stops them at the next batch
                os.kill(os.getpid(), signal.SIGTERM)

    if cfg.get("slow_persist"):  # a persist whose write takes longer than the grace period after a SIGTERM
        import time as _time

        from ckpt_integration.memory import tier as tier_mod

        real_write = tier_mod.write_local

        def slow(plan):
            end = _time.monotonic() + cfg["slow_persist"]
            try:
                while _time.monotonic() < end:  # items being written: the stop check runs before each
                    if plan.stop is not None:
                        plan.stop()
                    _time.sleep(0.05)
            except Exception:  # noqa: BLE001 - abandoned: the real write records it (it checks first too)
                pass
            return real_write(plan)
        tier_mod.write_local = slow
    io = DistCkptIO(memory_every_n_train_steps=1, memory_replicas=2, memory_dir=os.path.join(cfg["shm"], f"node{rank}"),
                    memory_job_id="lt", memory_ranks_per_node=1, memory_sigterm_grace_s=cfg.get("grace", 120),
                    memory_persist_every_n=cfg.get("persist"))
    ckpt_cb = DistCkptModelCheckpoint(dirpath=cfg["dir"], save_last=True, every_n_epochs=1, save_top_k=-1)
    t = trainer(devices=world, strategy=DistCkptDDPStrategy(), plugins=[io], max_epochs=cfg["epochs"],
                callbacks=[Recorder(), ckpt_cb])
    t.fit(TinyModule(), loader(), ckpt_path=cfg.get("resume"))
    out["end_step"] = int(t.global_step)
    out["ckpt_path"] = str(t.ckpt_path)
    out["finished"] = True
    dump()
    dist.barrier()
    dist.destroy_process_group()


def _launch(tmp, name, cfg, victim=None):
    from tests.proc_launch import launch

    return launch(__file__, tmp, name, cfg, 2, victim=victim, timeout=240.0, survivor_grace=60.0)


@pytest.mark.slow
def test_lightning_kill_resumes_from_memory_and_sigterm_persists(tmp_path):
    import torch

    import ckpt_integration as ci
    from ckpt_integration.lightning import is_complete_checkpoint
    from tests.lightning_helpers import assert_same
    from tests.proc_launch import tails

    tmp = str(tmp_path)
    shm, ckdir = os.path.join(tmp, "shm"), os.path.join(tmp, "ckpt")
    base = dict(shm=shm, dir=ckdir, epochs=3)

    # 1) train, rank 1 killed at step 3 (memory snapshot of step 3 complete; last.ckpt is step 2)
    rcs, outs, logs = _launch(tmp, "killed", {**base, "stop_at": 3, "how": "kill"}, victim=1)
    assert rcs[1] == -signal.SIGKILL and outs[1].get("stopped_at") == 3, f"{rcs}\n{tails(logs)}"
    assert ci.load_common_state_dict(os.path.join(ckdir, "last.ckpt"))["global_step"] == 2

    # 2) ckpt_path="last" resumes from memory, exactly (and makes every snapshot durable, keeping two)
    rcs, outs, logs = _launch(tmp, "resumed", {**base, "resume": "last", "persist": 1, "epochs": 4})
    assert rcs == [0, 0] and all(o.get("finished") for o in outs), f"{rcs}\n{tails(logs)}"
    text = tails(logs, 200000)
    for r in range(2):
        assert outs[r]["start_step"] == 3 and outs[r]["end_step"] == 8, outs[r]
        assert f"rank {r}: ckpt_integration.lightning.memory: rank {r}: resumed from the memory tier, step 3 (own memory)" in text
        killed = torch.load(os.path.join(tmp, f"killed-rank{r}.killed.pt"), weights_only=False)
        start = torch.load(os.path.join(tmp, f"resumed-rank{r}.start.pt"), weights_only=False)
        loaded = torch.load(os.path.join(tmp, f"resumed-rank{r}.loaded.pt"), weights_only=False)
        assert_same(start, killed["snap"], f"rank {r} state")
        for k in ("loops", "global_step", "epoch", "lr_schedulers"):
            assert_same(loaded[k], killed[k], f"rank {r} {k}")
    for node in ("node0", "node1"):  # the job finished: its snapshots are gone
        assert not os.path.exists(os.path.join(shm, node, "lt")), os.listdir(os.path.join(shm, node))
    # memory_persist_every_n=1: every snapshot made durable in the background, the two newest kept,
    # each a complete checkpoint that records its step and holds the saved state
    from ckpt_integration.storage import checkpoint_dir as ckd
    from ckpt_integration.tools import verify_checkpoint

    persisted = sorted(n for n in os.listdir(ckdir) if n.startswith("memory-step="))
    assert persisted == ["memory-step=6.ckpt", "memory-step=7.ckpt"], persisted  # 4 and 5 pruned
    for name in persisted:
        path = os.path.join(ckdir, name)
        assert ckd.read_manifest(locate(path)).step == int(name[len("memory-step="):-len(".ckpt")])
        report = verify_checkpoint(path, state=True)
        assert report.ok and report.state_checked > 0, report.format()

    # 3) SIGTERM at step 3 of a fresh run: the newest snapshot becomes durable before the exit
    ckdir2 = os.path.join(tmp, "ckpt2")
    rcs, outs, logs = _launch(tmp, "sigterm", {**base, "dir": ckdir2, "stop_at": 3, "how": "sigterm"})
    pre = os.path.join(ckdir2, "preempted-step=3.ckpt")
    assert is_complete_checkpoint(pre), f"{rcs} {os.listdir(ckdir2) if os.path.isdir(ckdir2) else None}\n{tails(logs)}"
    assert all(not o.get("finished") for o in outs), outs
    assert "SIGTERM: memory snapshot of step 3 is durable" in tails(logs, 200000)
    common = ci.load_common_state_dict(pre, allowed_globals=_allowed())
    killed = torch.load(os.path.join(tmp, "sigterm-rank0.killed.pt"), weights_only=False)
    assert common["global_step"] == 3
    assert_same(common["loops"], killed["loops"], "loops")
    assert_same(common["lr_schedulers"], killed["lr_schedulers"], "lr_schedulers")
    weights = ci.load_plain_tensors(pre)
    for name, value in killed["snap"]["state_dict"].items():
        assert torch.equal(weights[f"state_dict.{name}"] if f"state_dict.{name}" in weights else weights[name], value), name

    # 4) new nodes (every memory directory gone): ckpt_path="last" resumes from the preempted
    # checkpoint of step 3, not from last.ckpt of step 2, exactly
    import shutil

    shutil.rmtree(shm)
    assert ci.load_common_state_dict(os.path.join(ckdir2, "last.ckpt"))["global_step"] == 2
    rcs, outs, logs = _launch(tmp, "requeued", {**base, "dir": ckdir2, "resume": "last"})
    assert rcs == [0, 0] and all(o.get("finished") for o in outs), f"{rcs}\n{tails(logs)}"
    rank0 = torch.load(os.path.join(tmp, "sigterm-rank0.killed.pt"), weights_only=False)["snap"]
    for r in range(2):
        assert outs[r]["start_step"] == 3, (outs[r], tails(logs))
        killed = torch.load(os.path.join(tmp, f"sigterm-rank{r}.killed.pt"), weights_only=False)
        # a durable checkpoint keeps one copy of replicated state: the metric's rank-local values
        # are rank 0's on every rank after a durable resume (as Lightning's own checkpoints)
        killed["snap"]["metric"] = rank0["metric"]
        killed["snap"]["state_dict"].update({k: v for k, v in rank0["state_dict"].items() if k.startswith("metric.")})
        start = torch.load(os.path.join(tmp, f"requeued-rank{r}.start.pt"), weights_only=False)
        loaded = torch.load(os.path.join(tmp, f"requeued-rank{r}.loaded.pt"), weights_only=False)
        assert_same(start, killed["snap"], f"rank {r} state")
        for k in ("loops", "global_step", "epoch", "lr_schedulers"):
            assert_same(loaded[k], killed[k], f"rank {r} {k}")


@pytest.mark.slow
def test_lightning_memory_falls_back_to_the_durable_checkpoint_when_memory_cannot_serve(tmp_path):
    """docs/memory.md's fallbacks, each said in the log: every memory copy damaged (own and peer:
    the newest durable checkpoint is loaded instead); a restart on fewer nodes (1 rank: the
    snapshots of 2 ranks are restored from the surviving node's memory, resharded); a durable checkpoint that cannot be read (memory is
    taken, saying why, never by a silent guess)."""
    import glob
    import shutil

    import torch

    import ckpt_integration as ci
    from tests.damage import flip_byte
    from tests.lightning_helpers import assert_same
    from tests.proc_launch import launch, tails

    tmp = str(tmp_path)
    shm, ckdir = os.path.join(tmp, "shm"), os.path.join(tmp, "ckpt")
    base = dict(shm=shm, dir=ckdir, epochs=3)
    rcs, outs, logs = _launch(tmp, "gone", {**base, "stop_at": 3, "how": "exit"})
    assert all(o.get("stopped_at") == 3 for o in outs), f"{rcs}\n{tails(logs)}"
    durable = os.path.join(ckdir, "last.ckpt")
    assert ci.load_common_state_dict(durable)["global_step"] == 2
    saved = ci.load_plain_tensors(durable)
    weights = {k[len("state_dict."):]: v for k, v in saved.items() if k.startswith("state_dict.net")}

    def started_from_durable(name, world, cfg):
        rcs, outs, logs = launch(__file__, tmp, name, cfg, world, timeout=240.0)
        assert rcs == [0] * world and all(o.get("finished") for o in outs), f"{rcs}\n{tails(logs)}"
        for r in range(world):
            assert outs[r]["start_step"] == 2, (outs[r], tails(logs))
            # (it named the memory record Lightning had picked, not the checkpoint loaded)
            assert os.path.basename(outs[r]["ckpt_path"]) == "last.ckpt", outs[r]
            start = torch.load(os.path.join(tmp, f"{name}-rank{r}.start.pt"), weights_only=False)
            for k, v in weights.items():
                assert torch.equal(start["state_dict"][k], v), (name, r, k)
        return tails(logs, 200000)

    # 1) every copy of every snapshot damaged (a byte of each data file, both nodes)
    shm1, ck1 = os.path.join(tmp, "shm1"), os.path.join(tmp, "ck1")
    shutil.copytree(shm, shm1)
    shutil.copytree(ckdir, ck1)
    data = [f for f in glob.glob(os.path.join(shm1, "node*", "lt", "r*", "*")) if not f.endswith((".rec", "node-id"))]
    assert data
    for f in data:
        if os.path.getsize(f) > 64:
            flip_byte(f, os.path.getsize(f) // 2)
    text = started_from_durable("damaged", 2, {**base, "shm": shm1, "dir": ck1, "resume": "last"})
    assert "cannot resume from memory step 3" in text and "falling back to the durable checkpoint" in text, text[-3000:]

    # 2) a restart on fewer nodes (1 rank, node 1's memory gone): node 0 holds rank 0's snapshot and
    # its copy of rank 1's, so step 3 (newer than last.ckpt) is restored from memory, resharded,
    # exactly as rank 0 had it (replicated state keeps rank 0's values, as a durable resume does)
    shm2, ck2 = os.path.join(tmp, "shm2"), os.path.join(tmp, "ck2")
    shutil.copytree(shm, shm2)
    shutil.copytree(ckdir, ck2)
    shutil.rmtree(os.path.join(shm2, "node1"))
    rcs, outs, logs = launch(__file__, tmp, "smaller", {**base, "shm": shm2, "dir": ck2, "resume": "last"}, 1,
                             timeout=240.0)
    text = tails(logs, 200000)
    assert rcs == [0] and outs[0].get("finished") and outs[0]["start_step"] == 3, f"{rcs} {outs}\n{text[-3000:]}"
    assert "resumed from the memory tier, step 3 (memory of 2 rank(s), resharded" in text, text[-3000:]
    start = torch.load(os.path.join(tmp, "smaller-rank0.start.pt"), weights_only=False)
    was = torch.load(os.path.join(tmp, "gone-rank0.killed.pt"), weights_only=False)
    for part in ("state_dict", "optimizer", "scheduler", "extra", "metric", "global_step"):
        assert_same(start[part], was["snap"][part], f"smaller.{part}")

    # 2b) the job started over (its checkpoints deleted, no ckpt_path) on 1 rank and was killed after
    # its snapshot of step 1: the next resume goes on from that step, not from the abandoned run's
    # snapshot of step 3, which stayed in memory until the new run left it (at train start)
    shm5, ck5 = os.path.join(tmp, "shm5"), os.path.join(tmp, "ck5")
    shutil.copytree(shm, shm5)
    launch(__file__, tmp, "over", {**base, "shm": shm5, "dir": ck5, "stop_at": 1, "how": "exit"}, 1, timeout=240.0)
    rcs, outs, logs = launch(__file__, tmp, "over_resumed", {**base, "shm": shm5, "dir": ck5, "resume": "last"}, 1,
                             timeout=240.0)
    text = tails(logs, 200000)
    assert rcs == [0] and outs[0]["start_step"] == 1, f"{rcs} {outs}\n{text[-3000:]}"
    assert "resumed from the memory tier, step 1 (own memory)" in text, text[-3000:]

    # 3) the durable checkpoints cannot be read (their recorded checksums are gone): memory (step 3)
    # is taken, and every rank says why
    for m in glob.glob(os.path.join(ckdir, "*.ckpt", "manifest.json")):
        os.remove(m)
    rcs, outs, logs = _launch(tmp, "unreadable", {**base, "resume": "last"})
    text = tails(logs, 200000)
    assert rcs == [0, 0] and all(o["start_step"] == 3 for o in outs), f"{rcs} {outs}\n{text[-3000:]}"
    for r in range(2):
        assert f"rank {r}: the durable checkpoint" in text and "cannot be read" in text, text[-3000:]

    # 4) a SIGTERM whose grace period ends while the snapshot is being made durable: the processes
    # exit within it, said so, nothing half-written is ever taken; the next job resumes from the
    # newest complete checkpoint (memory gone: last.ckpt of step 2)
    ck4, shm4 = os.path.join(tmp, "ck4"), os.path.join(tmp, "shm4")
    import time

    t0 = time.monotonic()
    rcs, outs, logs = _launch(tmp, "slowterm", {**base, "dir": ck4, "shm": shm4, "stop_at": 3, "how": "sigterm",
                                                "grace": 1.0, "slow_persist": 60})
    assert time.monotonic() - t0 < 45, "the ranks outstayed the grace period, waiting for the persist"
    text = tails(logs, 200000)
    assert "could not be made durable within 1s" in text, f"{rcs}\n{text[-3000:]}"
    assert not os.path.exists(os.path.join(ck4, "preempted-step=3.ckpt", "metadata.json"))
    shutil.rmtree(shm4)
    rcs, outs, logs = _launch(tmp, "after_slowterm", {**base, "dir": ck4, "shm": shm4, "resume": "last"})
    assert rcs == [0, 0] and all(o["start_step"] == 2 for o in outs), f"{rcs} {outs}\n{tails(logs)[-3000:]}"


def _allowed():
    from lightning.fabric.utilities.data import AttributeDict

    return [AttributeDict]


if __name__ == "__main__":  # one rank of a launch: python test_lightning_memory.py '<json cfg>'
    sys.path.insert(0, ROOT)
    _rank_main(json.loads(sys.argv[1]))
