"""A Lightning save killed with SIGKILL halfway through writing its data (issue 4).

Real ``Trainer.fit`` in 2 gloo processes (tiny GPT of ``examples/gpt.py``, ``DistCkptDDPStrategy``
+ ``DistCkptIO``, ``DistCkptModelCheckpoint(save_top_k=2, save_last=True)``):

1. one epoch: ``epoch=0-step=7.ckpt`` and ``last.ckpt`` are complete (shared by all cases);
2. resume with ``ckpt_path="last"`` for a second epoch; when a save of that run writes its data
   (the top-k save into the new ``epoch=1-step=14.ckpt``, or the next one, replacing
   ``last.ckpt`` through a staging directory), one rank writes half of its items to disk and
   SIGKILLs itself (no cleanup, no ``finally``): sync save (main thread) and async save
   (background writer thread), the victim being the coordinator (rank 0) or not (rank 1);
3. on disk: the step-7 checkpoints are byte-for-byte unchanged and load, the interrupted save
   is not complete, ``latest_complete_checkpoint`` / ``resolve_checkpoint_path("last.ckpt")``
   give complete checkpoints, and a new 2-process ``Trainer.fit(ckpt_path="last")`` resumes from
   the newest complete checkpoint: step 7 when the step-14 save was killed (reproducing the
   killed run's losses and committing step 14 under the same name), step 14 when only the
   following ``last.ckpt`` replacement was killed; no incomplete directory is left behind.

Each rank is a process in its own session, launched by ``tests.proc_launch`` (not ``run_distributed``, which
treats a dead rank as a failure); every wait has a deadline and everything left is SIGKILLed.
Running this file as a script is the rank's entry point (``python test_lightning_kill.py CFG``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
CHARS, BLOCK, GBS = 2000, 32, 8  # 7 steps per epoch
WORLD = 2
FIRST, INTERRUPTED = "epoch=0-step=7.ckpt", "epoch=1-step=14.ckpt"

# seconds on an idle machine, scaled to the load measured at each launch (tests.dist_utils.slowdown)
LAUNCH_TIMEOUT = 240.0  # for one 2-process launch
SURVIVOR_GRACE = 60.0  # the other rank may take this long to notice the dead one before it is killed


# --------------------------------------------------------------------------------------------
# the rank (runs in a subprocess)
# --------------------------------------------------------------------------------------------
def _install_kill(marker: str, kill_at: int) -> None:
    """Let this rank's first ``kill_at`` saves write their data; the next one writes half of its items
    to disk (synced), then SIGKILLs the process."""
    import threading

    from ckpt_integration.execution import save as save_mod

    real = save_mod.write_data_files  # what ``write_local`` (sync and async save) calls
    calls = []

    def write_half_then_die(target, rank, requests, thread_count=2, durable=True, **kwargs):
        directory = target.path  # (the write directory, as the storage handle)
        calls.append(directory)
        if len(calls) <= kill_at:
            return real(target, rank, requests, thread_count, durable, **kwargs)
        requests = list(requests)
        written = real(target, rank, requests[: max(1, len(requests) // 2)], 1, durable, **kwargs)
        info = {"dir": os.path.abspath(directory), "files": sorted(os.listdir(directory)),
                "written": len(written), "of": len(requests), "thread": threading.current_thread().name}
        with open(marker, "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)  # not reached

    save_mod.write_data_files = write_half_then_die


def _rank_main(cfg: dict) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    # generous (only a hang): the launcher's measured deadline stops slow runs; a dead peer is
    # noticed through its closed connections, not through this timeout
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))

    import lightning as L
    from lightning.pytorch.callbacks import Callback

    import gpt
    from ckpt_integration.lightning import DistCkptDDPStrategy, DistCkptIO, DistCkptModelCheckpoint

    out_path = f"{cfg['out']}-rank{rank}.json"
    record: dict = {}

    def dump():
        with open(out_path, "w") as f:
            json.dump(record, f)

    class Recorder(Callback):  # runs before the checkpoint callback (Lightning puts those last)
        def on_train_start(self, trainer, pl_module):
            record.update(start_step=int(trainer.global_step), start_epoch=int(trainer.current_epoch))
            dump()

        def on_train_epoch_end(self, trainer, pl_module):
            record["losses"] = {str(s): v for s, v in pl_module.step_losses}
            dump()

    if cfg.get("victim") == rank:
        _install_kill(cfg["marker"], cfg["kill_at"])
    L.seed_everything(0, verbose=False)
    module = gpt.GPTModule(vocab_size=gpt.vocab_size(CHARS), corpus_chars=CHARS)
    ckpt_cb = DistCkptModelCheckpoint(dirpath=cfg["dir"], save_top_k=2, monitor="train_loss", save_last=True,
                                      every_n_epochs=1)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=DistCkptDDPStrategy(),
                        plugins=[DistCkptIO(async_save=cfg["async_save"])], max_epochs=cfg["epochs"], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Recorder(), ckpt_cb],
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, gpt.make_dataloader(BLOCK, GBS, world, CHARS), ckpt_path=cfg["resume"])
    record.update(end_step=int(trainer.global_step), finished=True)
    dump()
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# the launcher (in the test process)
# --------------------------------------------------------------------------------------------
def _launch(tmp: str, name: str, cfg: dict, victim=None):
    """Run 2 ranks of ``_rank_main(cfg)``; returns (return codes, logs). Never hangs.

    With ``victim`` set, once that rank has exited the others get ``SURVIVOR_GRACE`` seconds
    before they are killed (a rank that notices the dead peer may raise or block in a collective).
    """
    from tests.proc_launch import launch

    rcs, _, logs = launch(__file__, tmp, name, cfg, WORLD, victim=victim, timeout=LAUNCH_TIMEOUT,
                          survivor_grace=SURVIVOR_GRACE, extra_path=(EXAMPLES,))
    return rcs, logs


def _tails(logs, n=4000):
    out = []
    for log in logs:
        with open(log, errors="replace") as f:
            out.append(f"--- {os.path.basename(log)} ---\n{f.read()[-n:]}")
    return "\n".join(out)


def _run_ok(tmp, name, cfg):
    rcs, logs = _launch(tmp, name, cfg)
    assert rcs == [0] * WORLD, f"{name}: return codes {rcs}\n{_tails(logs)}"
    records = []
    for r in range(WORLD):
        with open(os.path.join(tmp, f"{name}-rank{r}.json")) as f:
            records.append(json.load(f))
    assert all(rec.get("finished") for rec in records), records
    return records


def _digest(path: str) -> dict:
    """relative path -> sha256 of every file under ``path``."""
    out = {}
    for dirpath, _, files in os.walk(path):
        for n in files:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


# --------------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def first_epoch(tmp_path_factory):
    """One epoch in 2 processes (sync save): ``epoch=0-step=7.ckpt`` and ``last.ckpt``, complete.

    Returns (checkpoint dir, pristine copy). Each test restores the pristine copy at the *same*
    path before it resumes: ``ModelCheckpoint`` keeps its state (``last_model_path``, top-k) only
    when ``dirpath`` is unchanged, and a changed path would itself change which files it writes.
    """
    from ckpt_integration.lightning import is_complete_checkpoint

    tmp = str(tmp_path_factory.mktemp("first_epoch"))
    ckdir = os.path.join(tmp, "ckpt")
    _run_ok(tmp, "epoch0", dict(dir=ckdir, epochs=1, resume=None, async_save=False))
    assert sorted(os.listdir(ckdir)) == [FIRST, "last.ckpt"]
    assert all(is_complete_checkpoint(os.path.join(ckdir, n)) for n in os.listdir(ckdir))
    pristine = os.path.join(tmp, "pristine")
    shutil.copytree(ckdir, pristine)  # copy2: keeps mtimes (latest_complete_checkpoint orders by them)
    return ckdir, pristine


# (async_save, victim rank, kill_at): the save of the resumed run's epoch end that dies is the top-k
# one into the new epoch=1-step=14.ckpt (kill_at=0) or the next one, replacing last.ckpt (kill_at=1).
CASES = {
    "sync-rank1-new_dir": (False, 1, 0),
    "async-rank1-new_dir": (True, 1, 0),
    "sync-rank0_coordinator-new_dir": (False, 0, 0),
    "async-rank0_coordinator-new_dir": (True, 0, 0),
    "sync-rank0_coordinator-last_overwrite": (False, 0, 1),
    "async-rank1-last_overwrite": (True, 1, 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("async_save,victim,kill_at", list(CASES.values()), ids=list(CASES))
def test_save_killed_halfway_keeps_previous_checkpoint_and_last(tmp_path, first_epoch, async_save, victim, kill_at):
    import torch

    import ckpt_integration as ci
    from ckpt_integration.lightning import is_complete_checkpoint, latest_complete_checkpoint, resolve_checkpoint_path

    tmp = str(tmp_path)
    ckdir, pristine = first_epoch
    shutil.rmtree(ckdir, ignore_errors=True)
    shutil.copytree(pristine, ckdir)
    before = {n: _digest(os.path.join(ckdir, n)) for n in (FIRST, "last.ckpt")}
    marker = os.path.join(tmp, "killed.json")
    last = os.path.join(ckdir, "last.ckpt")

    # 2) resume for a second epoch; the victim dies halfway through writing the data of a save
    cfg = dict(dir=ckdir, epochs=2, resume="last", async_save=async_save, marker=marker, kill_at=kill_at)
    rcs, logs = _launch(tmp, "killed", cfg, victim=victim)
    assert rcs[victim] == -signal.SIGKILL, f"rank {victim} was not killed: return codes {rcs}\n{_tails(logs)}"
    assert rcs[1 - victim] != 0, f"the surviving rank finished as if nothing happened: {rcs}\n{_tails(logs)}"
    with open(marker) as f:
        killed = json.load(f)
    # it really died while writing the data of the intended save, in the thread that writes
    killed_name = os.path.basename(killed["dir"])
    assert os.path.dirname(killed["dir"]) == os.path.abspath(ckdir), killed
    if kill_at == 0:
        assert killed_name == INTERRUPTED, killed
    else:  # overwrite=True: written to a staging sibling, swapped in only once committed
        assert killed_name.startswith("last.ckpt.tmp-"), killed
    assert 0 < killed["written"] < killed["of"], killed
    assert f"__{victim}_0.distcp" in killed["files"] and "metadata.json" not in killed["files"], killed
    assert killed["thread"] == ("ckpt-async-save" if async_save else "MainThread"), killed
    with open(os.path.join(tmp, f"killed-rank{victim}.json")) as f:
        killed_run = json.load(f)
    assert killed_run["start_step"] == 7 and "finished" not in killed_run
    lost_losses = killed_run["losses"]  # steps 7..13, trained before the interrupted save
    assert sorted(map(int, lost_losses)) == list(range(7, 14))

    # 3) on disk: the step-7 checkpoints are untouched and load; the interrupted save is not complete
    names = sorted(os.listdir(ckdir))
    # a staging directory of the killed overwrite stays behind when the coordinator (rank 0) died;
    # when rank 0 survived, its async commit learned that rank 1 was gone and removed it
    leftover = [killed_name] if kill_at and victim == 0 else []
    # the killed top-k save's new directory: removed by the surviving coordinator's async commit
    # (a failed save removes the directory it made), left incomplete otherwise
    interrupted = [] if kill_at == 0 and victim == 1 and async_save else [INTERRUPTED]
    assert names == sorted([FIRST, "last.ckpt"] + interrupted + leftover), names
    assert not is_complete_checkpoint(killed["dir"])
    for n in (FIRST, "last.ckpt"):
        path = os.path.join(ckdir, n)
        assert is_complete_checkpoint(path), n
        assert _digest(path) == before[n], f"{n} was modified by the killed save"
        common = ci.load_common_state_dict(path)
        assert common["global_step"] == 7 and common["epoch"] == 0, n
        tensors = ci.load_plain_tensors(path)
        want = ci.load_plain_tensors(os.path.join(pristine, n))
        assert sorted(tensors) == sorted(want) and any(k.startswith("state_dict.") or "model." in k for k in tensors)
        for k, v in want.items():
            assert torch.equal(tensors[k], v), (n, k)
    assert resolve_checkpoint_path(last) == last  # "last" is the complete step-7 checkpoint
    latest = os.path.basename(latest_complete_checkpoint(ckdir) or "")
    if kill_at == 0:
        assert latest in (FIRST, "last.ckpt"), latest
        if interrupted:
            with pytest.raises(ci.IncompleteCheckpointError, match="not a complete checkpoint"):
                resolve_checkpoint_path(os.path.join(ckdir, INTERRUPTED))
    else:  # the top-k save before it was committed
        assert latest == INTERRUPTED, latest
        assert ci.load_common_state_dict(os.path.join(ckdir, INTERRUPTED))["global_step"] == 14

    # 4) ckpt_path="last" resumes from the newest complete checkpoint in 2 processes and finishes
    if kill_at == 0:
        # the step-14 top-k save was killed: "last" is the step-7 one; the lost steps are redone exactly
        records = _run_ok(tmp, "resumed", dict(dir=ckdir, epochs=2, resume="last", async_save=async_save))
        for rec in records:
            assert (rec["start_step"], rec["start_epoch"], rec["end_step"]) == (7, 1, 14), rec
        resumed = records[0]["losses"]
        assert sorted(map(int, resumed)) == list(range(7, 14))
        for s in resumed:  # same checkpoint, same layout, same ranks: the same continuation, bit for bit
            assert resumed[s] == lost_losses[s], (s, resumed[s], lost_losses[s])
    else:
        # the step-14 top-k save had committed before the last.ckpt replacement was killed: "last"
        # resumes from step 14 (the newest complete checkpoint), so no trained step is lost
        records = _run_ok(tmp, "resumed", dict(dir=ckdir, epochs=3, resume="last", async_save=async_save))
        for rec in records:
            assert (rec["start_step"], rec["start_epoch"], rec["end_step"]) == (14, 2, 21), rec
    end_step = 14 if kill_at == 0 else 21
    names = sorted(os.listdir(ckdir))
    # the redone (or next) save is committed and last.ckpt was replaced by it. A killed top-k save's
    # incomplete directory does not count as existing, so the redone save reuses its name (no "-v1"
    # copy beside debris)
    complete = [n for n in names if is_complete_checkpoint(os.path.join(ckdir, n))]
    assert ci.load_common_state_dict(os.path.join(ckdir, "last.ckpt"))["global_step"] == end_step
    assert os.path.basename(latest_complete_checkpoint(ckdir)) in complete
    assert ci.load_common_state_dict(latest_complete_checkpoint(ckdir))["global_step"] == end_step
    if kill_at == 0:
        assert sorted(complete) == sorted([FIRST, INTERRUPTED, "last.ckpt"]), names
        assert ci.load_common_state_dict(os.path.join(ckdir, INTERRUPTED))["global_step"] == 14
        assert _digest(os.path.join(ckdir, FIRST)) == before[FIRST]  # top-2 keeps the step-7 one
    assert not [n for n in names if ".old-" in n], names
    incomplete = sorted(set(names) - set(complete))
    # no debris: the killed top-k directory was reused, a killed last.ckpt.tmp-* staging dir removed
    assert incomplete == [], names


if __name__ == "__main__":  # one rank of a launch: python test_lightning_kill.py '<json cfg>'
    sys.path[:0] = [ROOT, EXAMPLES]
    _rank_main(json.loads(sys.argv[1]))
