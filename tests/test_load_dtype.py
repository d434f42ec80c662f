"""dtype on load: saved data is cast into the requested dtype, as Megatron-Core does.

The common case: bf16 checkpoints loaded into fp32 masters, and back. Checked for both
backends, resharded, into given tensors and allocated ones, with the local reader and
with the fully-parallel exchange on 2 ranks; ``strict_dtype=True`` refuses instead.
"""

from __future__ import annotations

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import ShardedTensor as ST
from ckpt_integration.errors import MismatchError

from .dist_utils import run_distributed

BF16 = (torch.arange(48, dtype=torch.float32).reshape(8, 6) / 8 - 2.3).to(torch.bfloat16)
I64 = torch.arange(-10, 14, dtype=torch.int64).reshape(4, 6) * 1_000_003
F32 = torch.linspace(-3, 3, 12).reshape(3, 4) / 7


def _save(path, backend, rank=0):
    ci.save(
        {"bf16": ST.from_rank_offsets("bf16", BF16.clone(), replica_id=rank),
         "i64": ST.from_rank_offsets("i64", I64.clone(), replica_id=rank),
         "f32": ST.from_rank_offsets("f32", F32.clone(), replica_id=rank)},
        path, sharded_strategy=backend,
    )


@pytest.fixture(scope="module", params=["torch_dist", "zarr"])
def ckpt(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param) / "c")
    _save(path, request.param)
    return path


def test_bf16_and_int64_saved_load_into_fp32(ckpt):
    # row halves of bf16 (resharded: saved whole), whole int64 into an allocated tensor
    out = ci.load(
        {"a": ST.from_rank_offsets("bf16", torch.full((4, 6), -1.0), (0, 1, 2)),
         "i": ST("i64", None, torch.float64, (4, 6), (4, 6), (0, 0), (1, 1))},
        ckpt, validate_access_integrity=False,
    )
    assert out["a"].dtype == torch.float32 and torch.equal(out["a"], BF16[4:].float())
    assert out["i"].dtype == torch.float64 and torch.equal(out["i"], I64.double())


def test_fp32_saved_loads_into_bf16_and_columns(ckpt):
    target = torch.zeros(3, 2, dtype=torch.bfloat16)
    out = ci.load({"f": ST.from_rank_offsets("f32", target, (1, 1, 2))}, ckpt, validate_access_integrity=False)
    assert out["f"] is target and torch.equal(target, F32[:, 2:].to(torch.bfloat16))


def test_parameter_destination_is_cast_in_place(ckpt):
    p = torch.nn.Parameter(torch.zeros(8, 6))
    ci.load({"p": ST.from_rank_offsets("bf16", p)}, ckpt)
    assert torch.equal(p.detach(), BF16.float())


def test_strict_dtype_refuses(ckpt):
    with pytest.raises(MismatchError, match=r"'bf16'.*bfloat16.*float32.*strict_dtype"):
        ci.load({"a": ST.from_rank_offsets("bf16", torch.empty(8, 6))}, ckpt, strict_dtype=True)
    same = ci.load({"a": ST.from_rank_offsets("bf16", torch.empty(8, 6, dtype=torch.bfloat16))}, ckpt, strict_dtype=True)
    assert torch.equal(same["a"], BF16)


def test_complex_into_real_is_refused(tmp_path):
    c = torch.complex(torch.ones(3), torch.arange(3.0))
    ci.save({"c": ST.from_rank_offsets("c", c)}, tmp_path / "c")
    with pytest.raises(MismatchError, match="imaginary"):
        ci.load({"c": ST.from_rank_offsets("c", torch.empty(3))}, tmp_path / "c")


def _parallel_cast(rank, world, path):
    _save(path, "torch_dist", rank)
    for strategy in ("fully_parallel", "two_stage"):
        # column halves of the bf16 tensor as fp32 on each rank
        want = ST.from_rank_offsets("bf16", torch.empty(8, 3), (1, rank, 2))
        out = ci.load({"w": want}, path, load_strategy=strategy)
        assert torch.equal(out["w"], BF16[:, 3 * rank:3 * rank + 3].float()), strategy
        # the same region wanted by both ranks: read once, sent to the other rank, cast on copy
        both = ci.load({"i": ST.from_rank_offsets("i64", torch.empty(4, 6, dtype=torch.float32), replica_id=rank)}, path,
                       load_strategy=strategy)
        assert torch.equal(both["i"], I64.float()), strategy


def test_cast_with_parallel_load_two_ranks(tmp_path):
    run_distributed(_parallel_cast, 2, str(tmp_path / "c"), timeout=120)
