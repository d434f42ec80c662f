"""Pretrain the tiny GPT of ``gpt.py`` with Lightning Fabric, in the style of LitGPT's pretraining loop.

    python examples/fabric_pretrain.py --devices 2 --strategy ddp --max-steps 8            # 2 processes
    python examples/fabric_pretrain.py --devices 2 --strategy model_parallel --max-steps 12 --resume
    python examples/fabric_pretrain.py --devices 1 --max-steps 16 --resume                   # one process
    python examples/fabric_pretrain.py --devices 2 --strategy model_parallel --data-parallel-size 2  # FSDP2

``Fabric(plugins=[DistCkptIO()])`` is the only checkpointing line: ``fabric.save(out_dir/step-N, state)``
writes a sharded directory checkpoint on every rank every ``--save-interval`` steps (in the background
with ``--async-save``), and ``--resume`` continues from the newest complete one under whatever
``--devices`` / ``--strategy`` this run has (``ddp``: DDP over plain layers, fused QKV;
``model_parallel``: DTensor tensor parallelism via ``gpt.parallelize``, over all devices, or FSDP2 over
``--data-parallel-size`` of them (times TP over the rest); ``fsdp``:
FSDP1, GPU only in Fabric). The batch of iteration ``i`` is drawn from a generator seeded with ``i`` and
split between the data-parallel ranks, so a resumed run sees the same global batches as an
uninterrupted one. ``--resume`` with nothing to resume stops with an error instead of starting over.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402

from ckpt_integration.lightning import DistCkptIO, latest_complete_checkpoint  # noqa: E402
from ckpt_integration.modules import ParallelLayout  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "model_parallel", "fsdp"])
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--out-dir", default="out/fabric_pretrain")
    p.add_argument("--max-steps", type=int, default=16)
    p.add_argument("--save-interval", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--corpus-chars", type=int, default=4000)
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="model_parallel: FSDP2 over this many devices, tensor parallel over the rest")
    p.add_argument("--dump-state", default=None,
                   help="a directory: rank 0 writes the whole state (every tensor gathered, CPU) right after each "
                        "save (saved-<step>.pt) and after the resume (loaded-<step>.pt), to compare exactly")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out-dir")
    p.add_argument("--log", default=None, help="write the per-step losses (rank 0) to this JSON file")
    return p.parse_args(argv)


def parallelize(model: gpt.GPT, mesh) -> gpt.GPT:
    """Fabric's ``parallelize_fn``: DTensor TP (and FSDP2 over a data-parallel dim) as ``gpt.parallelize``."""
    gpt.parallelize(model, mesh)
    return model


def make_strategy(args: argparse.Namespace):
    if args.devices == 1:
        return "auto"
    if args.strategy == "model_parallel":
        from lightning.fabric.strategies import ModelParallelStrategy

        dp = args.data_parallel_size
        if args.devices % dp:
            raise SystemExit(f"--data-parallel-size {dp} does not divide --devices {args.devices}")
        return ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=dp,
                                     tensor_parallel_size=args.devices // dp)
    return args.strategy


def get_batch(ds: gpt.CharDataset, it: int, global_batch: int, rank: int, dp: int):
    """The global batch of iteration ``it`` (same for any world size), this data-parallel rank's part."""
    g = torch.Generator().manual_seed(1000 + it)
    idx = torch.randint(len(ds), (global_batch,), generator=g)
    per = global_batch // dp
    xs, ys = zip(*(ds[int(i)] for i in idx[rank * per:(rank + 1) * per]))
    return torch.stack(xs), torch.stack(ys)


def main(fabric: L.Fabric, args: argparse.Namespace) -> None:
    out_dir = Path(args.out_dir)
    ds = gpt.CharDataset(gpt.make_corpus(args.corpus_chars), args.block_size)
    parallel = args.strategy == "model_parallel" and fabric.world_size > 1
    with fabric.init_module():
        model = gpt.GPT(ds.vocab_size, args.d_model, args.n_heads, args.n_layers, args.block_size, ParallelLayout(),
                        dtensor=parallel)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.8)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 0}

    if args.resume:
        # the newest checkpoint whose save committed (an interrupted save never counts)
        resume = latest_complete_checkpoint(str(out_dir), suffix="") if out_dir.is_dir() else None
        if resume is None:
            raise SystemExit(f"--resume: no complete checkpoint in {out_dir} (run without --resume to start)")
        fabric.load(resume, state)
        fabric.print(f"Resumed from {resume} at step {state['iter_num']} "
                     f"({fabric.world_size} process(es), strategy {args.strategy if fabric.world_size > 1 else 'single'})")
        dump_state(fabric, args, state, "loaded")

    # data parallel ranks: every rank (ddp), or the rows of the (data_parallel, tensor_parallel) mesh
    dp = args.data_parallel_size if parallel else fabric.world_size
    dp_rank = fabric.global_rank // (fabric.world_size // dp)
    losses = {}
    t0 = time.perf_counter()
    while state["iter_num"] < args.max_steps:
        it = state["iter_num"]
        x, y = get_batch(ds, it, args.global_batch_size, dp_rank, dp)
        logits = model(x.to(fabric.device))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(fabric.device).reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses[it] = float(fabric.all_reduce(loss.detach(), reduce_op="mean"))
        state["iter_num"] += 1
        fabric.print(f"iter {it}: loss {losses[it]:.4f}")
        if state["iter_num"] % args.save_interval == 0:
            path = out_dir / f"step-{state['iter_num']:08d}"
            fabric.save(path, state)
            fabric.print(f"Saving checkpoint to {str(path)!r}")
            dump_state(fabric, args, state, "saved")
    fabric.strategy.checkpoint_io.teardown()  # async: wait until the last checkpoint is committed
    fabric.print(f"Training time: {time.perf_counter() - t0:.2f}s")
    if args.log and fabric.global_rank == 0:
        Path(args.log).write_text(json.dumps(losses))


def dump_state(fabric: L.Fabric, args: argparse.Namespace, state: dict, what: str) -> None:
    """``--dump-state``: the whole state as one process would hold it (DTensor / FSDP2 shards
    gathered by ``torch.distributed.checkpoint.state_dict``; collective), written by rank 0."""
    if not args.dump_state:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optimizer = state["model"], state["optimizer"]
    model_sd, optim_sd = get_state_dict(model.module, optimizer.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if fabric.global_rank == 0:
        model_sd, optim_sd = _fused_qkv(model_sd, optim_sd)
        os.makedirs(args.dump_state, exist_ok=True)
        torch.save({"model": model_sd, "optimizer": optim_sd, "scheduler": state["scheduler"].state_dict(),
                    "iter_num": state["iter_num"]}, os.path.join(args.dump_state, f"{what}-{state['iter_num']}.pt"))
    fabric.barrier()


def _fused_qkv(model_sd: dict, optim_sd: dict):
    """Name the state of ``gpt.DTensorBlock``'s separate ``q``, ``k``, ``v`` as ``gpt.Block``'s fused
    ``qkv`` (their rows stacked, one AdamW ``step``), so that dumps of either block compare directly."""
    parts = ("q", "k", "v")

    def split(name: str):
        """(``blocks.i.<part>``'s prefix ``blocks.i``, the part, the leaf) or None for other names."""
        head, _, leaf = name.rpartition(".")
        base, _, part = head.rpartition(".")
        return (base, part, leaf) if part in parts and base.startswith("blocks.") else None

    def fuse(table: dict, merge) -> dict:
        out = {}
        for name, value in table.items():
            at = split(name)
            if at is None:
                out[name] = value
            elif at[1] == "q":
                base, _, leaf = at
                out[f"{base}.qkv.{leaf}"] = merge([table[f"{base}.{p}.{leaf}"] for p in parts])
        return out

    def merge_state(states):
        out = {}
        for k, v in states[0].items():
            if k == "step":
                assert all(torch.equal(s["step"], v) for s in states), "q, k and v took different steps"
                out[k] = v
            else:
                out[k] = torch.cat([s[k] for s in states])
        return out

    model_sd = fuse(model_sd, torch.cat)
    optim_sd = dict(optim_sd, state=fuse(optim_sd.get("state", {}), merge_state))
    groups = []
    for g in optim_sd.get("param_groups", []):
        names = []
        for name in g["params"]:
            at = split(name) if isinstance(name, str) else None
            if at is None:
                names.append(name)
            elif at[1] == "q":
                names.append(f"{at[0]}.qkv.{at[2]}")
        groups.append(dict(g, params=names))
    optim_sd["param_groups"] = groups
    return model_sd, optim_sd


def setup(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=make_strategy(args),
                      plugins=[DistCkptIO(async_save=args.async_save)])
    fabric.launch(main, args)


if __name__ == "__main__":
    setup(parse())
