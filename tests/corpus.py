"""The compatibility corpus: checkpoints written once by a released format, loaded by every later version.

``tests/data/corpus/format<N>/<name>/`` holds small checkpoints written by this module (``python -m
tests.corpus write``) and committed; ``tests/test_corpus.py`` loads them in every run from then
on, resharded and verified, and compares every tensor, object and common value exactly with
:func:`expected_full` / :data:`COMMON` / :func:`expected_object`. The expected values come from
integer arithmetic (no random generator whose stream could change between torch versions).

Never rewrite an existing set: a format change adds a new one (``write --only NAME`` writes just
that set) and the old ones keep loading, or a load refuses them naming ``ckpt-integration convert``.

The writing layout: 4 ranks, tensor parallel 2 x data parallel 2 (rank = dp * 2 + tp):
rows of ``embedding.weight`` and columns of ``decoder.linear.weight`` split over TP, a
pipeline-style stack split by layer over all 4 ranks, a replicated norm, ZeRO-1 optimizer state
(each DP rank a flat slice of its TP shard) and one object per TP rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import zlib
from pathlib import Path
from typing import Dict, Tuple

import torch

CORPUS_DIR = Path(__file__).parent / "data" / "corpus"

# name -> (backend, async save)
SETS: Dict[str, Tuple[str, bool]] = {
    "torch_dist-sync": ("torch_dist", False),
    "torch_dist-async": ("torch_dist", True),
    "zarr-sync": ("zarr", False),
}

SHAPES: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {
    "embedding.weight": ((64, 16), torch.float32),
    "decoder.linear.weight": ((24, 32), torch.bfloat16),
    "decoder.norm.weight": ((24,), torch.float32),
    "decoder.stack": ((4, 8, 8), torch.float16),
    "counts": ((10,), torch.int64),
    "optimizer.state.exp_avg.embedding.weight": ((64, 16), torch.float32),
}

COMMON = {"iteration": 7, "args": {"lr": 0.5, "name": "corpus", "layers": [1, 2, 3]}, "flag": True}
CONTENT_METADATA = {"distrib_optim_sharding_type": "dp_zero_gather_scatter", "corpus": 1}


def expected_full(key: str) -> torch.Tensor:
    """The whole saved tensor ``key``: integer arithmetic only, the same in every torch version."""
    shape, dtype = SHAPES[key]
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, dtype=torch.int64)
    v = (i * 2654435761 + zlib.crc32(key.encode())) % 2001 - 1000
    if dtype == torch.int64:
        return (v * 1_000_003).reshape(shape)
    return (v.to(torch.float64) / 16).to(dtype).reshape(shape)


def expected_object(tp: int) -> dict:
    return {"tp_rank": tp, "seed": 1234 + tp, "name": f"tp{tp}", "values": [tp, tp * 2.5]}


def sharded_state(rank: int, world: int = 4) -> dict:
    """The sharded state dict rank ``rank`` of the 4-rank TP2 x DP2 layout saves."""
    from ckpt_integration import ShardedObject, ShardedTensor

    tp, dp = rank % 2, rank // 2
    emb = expected_full("embedding.weight")
    lin = expected_full("decoder.linear.weight")
    stack = expected_full("decoder.stack")
    sd = {
        "embedding.weight": ShardedTensor.from_rank_offsets(
            "embedding.weight", emb[tp * 32:(tp + 1) * 32].clone(), (0, tp, 2), replica_id=dp),
        "decoder.linear.weight": ShardedTensor.from_rank_offsets(
            "decoder.linear.weight", lin[:, tp * 16:(tp + 1) * 16].clone(), (1, tp, 2), replica_id=dp),
        "decoder.norm.weight": ShardedTensor.from_rank_offsets(
            "decoder.norm.weight", expected_full("decoder.norm.weight").clone(), replica_id=rank),
        "decoder.layer": ShardedTensor.from_rank_offsets(
            "decoder.stack", stack[rank].clone(), (0, rank, world), prepend_axis_num=1),
        "counts": ShardedTensor.from_rank_offsets("counts", expected_full("counts").clone(), replica_id=rank),
        "rng": ShardedObject("rng", expected_object(tp), (2,), (tp,), replica_id=dp),
    }
    # ZeRO-1: DP rank dp owns half of the flattened TP shard [32, 16] (512 elements)
    shard = expected_full("optimizer.state.exp_avg.embedding.weight")[tp * 32:(tp + 1) * 32].reshape(-1)
    sd["optimizer.exp_avg"] = ShardedTensor.from_rank_offsets_flat(
        "optimizer.state.exp_avg.embedding.weight", shard[dp * 256:(dp + 1) * 256].clone(), (32, 16),
        (0, tp, 2), flattened_range=slice(dp * 256, (dp + 1) * 256), replica_id=0)
    return sd


def _write(rank: int, world: int, root: str, names) -> None:
    import ckpt_integration as ci
    from ckpt_integration import get_default_save_sharded_strategy

    for name in names:
        backend, is_async = SETS[name]
        target = os.path.join(root, name)
        strategy = get_default_save_sharded_strategy(backend)
        common = dict(COMMON)
        req = ci.save({**sharded_state(rank, world), **common}, target, strategy,
                      async_sharded_save=is_async, content_metadata=CONTENT_METADATA)
        if is_async:
            req.wait()


def format_of(directory: Path) -> int:
    """The manifest format a corpus set was written in."""
    import json

    return int(json.loads((directory / "manifest.json").read_text())["version"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["write"])
    ap.add_argument("--only", action="append", choices=sorted(SETS), help="write just these sets")
    ap.add_argument("--root", default=str(CORPUS_DIR), help="the corpus (sets land in <root>/format<N>/<name>)")
    args = ap.parse_args()
    names = args.only or sorted(SETS)
    import tempfile

    from tests.dist_utils import run_distributed

    with tempfile.TemporaryDirectory() as scratch:
        run_distributed(_write, 4, scratch, names, timeout=300)
        for name in names:
            written = Path(scratch) / name
            shutil.rmtree(written / ".tmp", ignore_errors=True)
            target = Path(args.root) / f"format{format_of(written)}" / name
            if target.exists():
                raise SystemExit(f"{target} exists: the corpus is never rewritten")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(written), str(target))
            print(f"wrote {target}")


if __name__ == "__main__":
    main()
