"""Train a tiny tensor-parallel GPT with Lightning + ckpt_integration, driven by Hydra.

    python examples/train.py demo=true                      # both phases below, one command
    python examples/train.py parallel=tp2_dp1               # train with TP=2 (2 processes), async checkpoints
    python examples/train.py parallel=tp1_dp2 resume=true trainer.max_epochs=6   # resume with TP=1, DP=2
    python examples/train.py overwrite=true                 # fresh run, deleting the checkpoints in ckpt_dir
    python examples/train.py strategy=model_parallel parallel=tp2_dp2 ckpt_dir=checkpoints/fsdp   # DTensor TP + FSDP2
    python examples/train.py -m parallel=tp2_dp1,tp1_dp2    # one job per layout, each in ckpt_dir/<overrides>

Processes are launched here (torch.multiprocessing with a forkserver, gloo on CPU / NCCL on GPU), one per
rank: world size = parallel.tp * parallel.dp. ``strategy`` picks how the layout runs: ``ddp``
(``DistCkptDDPStrategy``, hand-written TP), ``model_parallel`` (``DistCkptModelParallelStrategy``,
DTensor TP + FSDP2) or ``single_device`` (``Trainer(plugins=[DistCkptIO()])`` alone, one process);
their weights load under each other (docs/hydra.md says what resumes where). Checkpoints go to ``ckpt_dir``
(``epoch=N-step=M.ckpt`` top-k directories plus ``last.ckpt``); ``resume=true`` continues
from the newest complete one (it says which, and at which step) in whatever layout ``parallel`` and
``strategy`` now say, and stops with an error when there is none. A fresh run (``resume=false``) refuses
to start over complete checkpoints in ``ckpt_dir`` unless ``overwrite=true``; ``demo=true`` is
a fresh run by definition and always starts from an empty ``ckpt_dir``. In a multirun (``-m``)
every job uses ``ckpt_dir/<its overrides>`` (:func:`job_ckpt_dir`), so jobs never share a directory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time

import fsspec
import hydra
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException
from multiprocessing import forkserver
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt_integration as ci  # noqa: E402
from ckpt_integration.hydra_config import register_configs, validate_config  # noqa: E402

register_configs()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete_checkpoints(ckpt_dir: str) -> list:
    """Names of the committed checkpoints (with ``metadata.json``) in ``ckpt_dir`` (local path or URL)."""
    return [p.rstrip("/").rsplit("/", 1)[-1] for p in ci.list_checkpoints(ckpt_dir)]


def prepare_ckpt_dir(cfg: DictConfig) -> None:
    """Create ``ckpt_dir``; for a fresh run (``resume=false``) clear what this run's checkpoints would mix with.

    Complete checkpoints are only deleted with ``overwrite=true``: a forgotten ``resume=true``
    must not throw a training run away. Leftovers of interrupted saves (``*.ckpt`` directories
    without ``metadata.json``) are always removed. Nothing else is touched: other files, and the
    subdirectories a multirun sweep's jobs write to (``<ckpt_dir>/<overrides>``), stay.
    """
    fs, d = fsspec.core.url_to_fs(cfg.ckpt_dir)
    if not cfg.resume and fs.isdir(d):
        found = _complete_checkpoints(cfg.ckpt_dir)
        if found and not cfg.overwrite:
            raise FileExistsError(
                f"{cfg.ckpt_dir} holds {len(found)} complete checkpoint(s) ({', '.join(sorted(found))}) and "
                "resume=false would delete them. Pass resume=true to continue from them, overwrite=true to "
                "delete them and start over, or another ckpt_dir=..."
            )
        for entry in fs.ls(d, detail=True):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry["type"] == "directory" and (name in found or ".ckpt" in name):
                fs.rm(entry["name"], recursive=True)
    fs.makedirs(d, exist_ok=True)


def resume_point(cfg: DictConfig) -> str:
    """The checkpoint ``resume=true`` continues from: the newest complete one in ``ckpt_dir`` (as Lightning's
    ``ckpt_path="last"`` with ``DistCkptModelCheckpoint``); with the memory tier on (``checkpoint=memory``),
    ``"last"`` itself, the newest of the memory snapshots and that checkpoint (an explicit path would be
    loaded as given, passing over newer snapshots). With no complete checkpoint there, stop: a run that
    silently trained from step 0 (e.g. after a first run that failed) would look like a resumed one."""
    from lightning.fabric.utilities.data import AttributeDict
    from omegaconf import ListConfig

    from ckpt_integration.lightning import latest_complete_checkpoint

    path = latest_complete_checkpoint(cfg.ckpt_dir)
    if path is None:
        fs, d = fsspec.core.url_to_fs(cfg.ckpt_dir)
        found = sorted(fs.ls(d, detail=False)) if fs.isdir(d) else []
        raise SystemExit(
            f"resume=true, but {cfg.ckpt_dir} holds no complete checkpoint to resume from"
            + (f" (only {', '.join(p.rsplit('/', 1)[-1] for p in found)}: interrupted saves?)" if found else "")
            + ". Run without resume=true to start training, or point ckpt_dir=... at the run to continue."
        )
    common = ci.load_common_state_dict(path, allowed_globals=[AttributeDict, DictConfig, ListConfig])
    layout = (ci.load_content_metadata(path) or {}).get("layout", {})
    print(f"== resuming from {path}: epoch {common.get('epoch')}, global step {common.get('global_step')} "
          f"(saved with TP={layout.get('tp', '?')}, DP={layout.get('dp', '?')})")
    if OmegaConf.select(cfg, "checkpoint.memory.every_n_train_steps"):
        print("== or from a newer memory snapshot, if one survived (ckpt_path='last')")
        return "last"
    return path


def job_ckpt_dir(cfg: DictConfig) -> str:
    """``cfg.ckpt_dir``; in a Hydra multirun, ``<ckpt_dir>/<this job's overrides>`` (e.g.
    ``checkpoints/tiny_gpt/parallel=tp1_dp2``) so that the jobs of a sweep never write into one directory.

    ``resume``, ``overwrite``, ``demo``, ``port``, ``ckpt_dir`` and ``trainer.max_epochs`` are left out of
    the name (``hydra.job.config.override_dirname.exclude_keys`` in ``configs/config.yaml``), so the same
    sweep with ``resume=true`` continues each job from its own checkpoints.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return cfg.ckpt_dir
    job = HydraConfig.get().job
    # A plain "/" join works for local paths and fsspec URLs alike.
    return cfg.ckpt_dir.rstrip("/") + "/" + (job.override_dirname or f"job{job.num}")


def _strategy(cfg: DictConfig, gpu: bool) -> object:
    """The Lightning strategy ``cfg.strategy.name`` asks for."""
    from ckpt_integration.lightning import DistCkptDDPStrategy, DistCkptModelParallelStrategy

    backend = "nccl" if gpu else "gloo"
    if cfg.strategy.name == "model_parallel":  # DTensor TP + FSDP2 in GPTModule.configure_model
        return DistCkptModelParallelStrategy(data_parallel_size=cfg.parallel.dp, tensor_parallel_size=cfg.parallel.tp,
                                             process_group_backend=backend)
    if cfg.strategy.name == "single_device":  # Lightning's own choice; the DistCkptIO plugin alone does the rest
        return "auto"
    return DistCkptDDPStrategy(tensor_parallel_size=cfg.parallel.tp, process_group_backend=backend)


#: the warnings a run prints on every rank that say nothing about it (everything else is shown)
NOISY_WARNINGS = (
    r".*does not have many workers.*",  # the tiny in-memory corpus needs no loader workers
    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",  # Lightning's use of torch's pytree API
    r"The number of training batches .* is smaller than the logging interval.*",
    r".*GPU available but not used.*",
)


def _worker(rank: int, cfg_dict: dict, port: int, result_path: str, resume: str = "") -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (ignored by the forkserver: see run; Lightning handles it)
    world = cfg_dict["parallel"]["tp"] * cfg_dict["parallel"]["dp"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
                      WORLD_SIZE=str(world), NODE_RANK="0", OMP_NUM_THREADS="1")
    import warnings

    for pattern in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    import lightning as L
    import torch
    from hydra.utils import instantiate

    import gpt
    from ckpt_integration.lightning import DistCkptModelCheckpoint

    torch.set_num_threads(1)
    cfg = OmegaConf.create(cfg_dict)
    L.seed_everything(cfg.trainer.seed, verbose=False)
    gpu = cfg.trainer.accelerator in ("gpu", "cuda")
    plugin = instantiate(cfg.checkpoint)  # DistCkptIO(async_save=..., load_strategy=..., ...)
    strategy = _strategy(cfg, gpu)
    ckpt_cb = DistCkptModelCheckpoint(dirpath=cfg.ckpt_dir, save_top_k=cfg.trainer.save_top_k, monitor="train_loss",
                                      save_last=cfg.trainer.save_last, every_n_epochs=1)
    m = cfg.model
    module = gpt.GPTModule(vocab_size=gpt.vocab_size(m.corpus_chars), d_model=m.d_model, n_heads=m.n_heads,
                           n_layers=m.n_layers, block_size=m.block_size, lr=m.lr, corpus_chars=m.corpus_chars)
    trainer = L.Trainer(accelerator="gpu" if gpu else "cpu", devices=world, strategy=strategy, plugins=[plugin],
                        max_epochs=cfg.trainer.max_epochs, callbacks=[ckpt_cb], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, log_every_n_steps=cfg.trainer.log_every_n_steps)
    loader = gpt.make_dataloader(m.block_size, cfg.trainer.global_batch_size, cfg.parallel.dp, m.corpus_chars)
    trainer.fit(module, loader, ckpt_path=resume or None)
    if rank == 0:
        with open(result_path, "w") as f:
            fs, d = fsspec.core.url_to_fs(cfg.ckpt_dir)
            names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(d, detail=False))
            json.dump({"losses": module.step_losses, "checkpoints": names}, f)


def run(cfg: DictConfig) -> dict:
    """Launch ``parallel.tp * parallel.dp`` processes for one training run; returns rank 0's losses."""
    validate_config(cfg)
    world = cfg.parallel.tp * cfg.parallel.dp
    prepare_ckpt_dir(cfg)
    resume = resume_point(cfg) if cfg.resume else ""
    result = os.path.join(tempfile.mkdtemp(), "result.json")
    t0 = time.time()
    cfg_dict = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # plain values for the workers
    # forkserver: one clean server process imports torch and Lightning once, every rank of every run is
    # forked from it (no CUDA / threads in the server, so this is as safe as spawn, without re-importing)
    mp.get_context("forkserver").set_forkserver_preload(["torch", "lightning"])
    # A scheduler's SIGTERM (SLURM, `timeout`, `kill -TERM -<pgid>`) reaches every process of the job. The
    # ranks then save where they are before they exit (DistCkptIO's preemption path), but torch interrupts
    # a rank with SIGINT as soon as the process that forked it ends: the forkserver (started here with
    # SIGTERM ignored, which it keeps; each rank restores the default) and this launcher (which waits) stay.
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    preempted = []
    try:
        forkserver.ensure_running()
        signal.signal(signal.SIGTERM, lambda signum, frame: preempted.append(signum))
        mp.start_processes(_worker, args=(cfg_dict, cfg.port or _free_port(), result, resume),
                           nprocs=world, start_method="forkserver")
    except ProcessException:  # (a rank ended by the signal, or by Lightning's SIGTERMException)
        if not preempted:
            raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if preempted or not os.path.exists(result):  # (ranks signalled alone end training early, without a result)
        print(f"== stopped by SIGTERM: the ranks stopped at one batch, their save in flight committed or abandoned "
              f"within checkpoint.sigterm_grace_s; resume=true continues from the newest checkpoint in {cfg.ckpt_dir}")
        raise SystemExit(128 + signal.SIGTERM)
    with open(result) as f:
        out = json.load(f)
    losses = out["losses"]
    print(f"[{cfg.strategy.name} TP={cfg.parallel.tp} DP={cfg.parallel.dp}, {world} processes, async_save={cfg.checkpoint.async_save}, "
          f"load_strategy={cfg.checkpoint.load_strategy}] {len(losses)} steps in {time.time() - t0:.1f}s")
    if losses:
        print(f"  step {losses[0][0]:3d}: loss {losses[0][1]:.4f}  ->  step {losses[-1][0]:3d}: loss {losses[-1][1]:.4f}")
    print(f"  checkpoints in {cfg.ckpt_dir}: {out['checkpoints']}")
    return out


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    cfg.ckpt_dir = job_ckpt_dir(cfg)
    if not cfg.demo:
        run(cfg)
        return
    # demo: train with the configured layout (default TP=2, DP=1), then resume with TP=1, DP=2
    validate_config(cfg)  # (both phases' settings, before the first one runs)
    total = cfg.trainer.max_epochs
    # the demo is a fresh run by definition: phase 1 wipes its ckpt_dir (overwrite=true), so the
    # README command works when run again
    first = OmegaConf.merge(cfg, {"resume": False, "overwrite": True, "demo": False,
                                  "trainer": {"max_epochs": max(1, total // 2)}})
    print(f"== phase 1: train {first.trainer.max_epochs} epochs with TP={first.parallel.tp}, DP={first.parallel.dp}")
    a = run(first)
    second = OmegaConf.merge(cfg, {"resume": True, "demo": False, "parallel": {"tp": 1, "dp": 2}})
    print(f"== phase 2: resume from '{cfg.ckpt_dir}/last.ckpt' with TP=1, DP=2 until epoch {total}")
    b = run(second)
    end, start = a["losses"][-1], b["losses"][0]
    print(f"== loss before the switch: step {end[0]} = {end[1]:.4f}; after resuming with a new layout: "
          f"step {start[0]} = {start[1]:.4f} (a fresh model starts at {a['losses'][0][1]:.4f})")
    problem, note = continuity(a["losses"], b["losses"])
    if note:
        print(f"== {note}")
    if problem:
        raise SystemExit(f"resume did not continue the run: {problem}")
    print("== OK: the run continued from the checkpoint under a different parallel layout")


def continuity(before: list, after: list) -> tuple:
    """(problem or None, note or None) of the demo's phases, from their ``(step, loss)`` lists: the
    resumed run starts at the next step, and with the trained weights: its loss is nearer phase 1's
    last loss than a fresh model's. A phase 1 that lowered the loss by less than 0.2 cannot tell
    those apart: then only the step is checked (a small model trained briefly is no failure)."""
    (_, fresh), (end_step, end), (start_step, start) = before[0], before[-1], after[0]
    if start_step != end_step + 1:
        return f"it started at step {start_step}, not {end_step + 1}", None
    if fresh - end < 0.2:
        return None, (f"phase 1 lowered the loss by {fresh - end:.3f} only: the loss cannot tell a resumed run "
                      "from a fresh one, so only the step was checked (train longer for that check)")
    if abs(start - end) > abs(start - fresh):
        return "the loss after resuming is a fresh model's", None
    return None, None


if __name__ == "__main__":
    main()
