"""The region reader (``storage/region_read.py``): exact values for any request.

Random boxes of random N-d chunks, read checked and unchecked into contiguous,
non-contiguous and other-dtype destinations, with tiny pieces and checksum blocks so that
every read crosses many of both. (The damage cases are in ``test_faults.py``.)
"""

import random

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import ShardedTensor
from ckpt_integration.planning.boxes import Box
from ckpt_integration.storage import region_read
from ckpt_integration.storage import torch_dist as td
from ckpt_integration.storage.opened import open_reader, read_metadata
from ckpt_integration.storage.filesystem import locate

@pytest.mark.parametrize("scatter_min", [1, 4096])
def test_region_reads_return_exact_values_for_any_box_dtype_and_destination(tmp_path, monkeypatch, scatter_min):
    """Random boxes of random N-d chunks, read (checked and unchecked) into contiguous,
    non-contiguous and other-dtype destinations, with tiny pieces and blocks so that reads
    cross many of both: always exactly the saved values."""
    monkeypatch.setattr(region_read, "PIECE", 512)
    monkeypatch.setattr(region_read, "DIRECT_PIECE", 300)
    monkeypatch.setattr(region_read, "SLACK", 1024)
    monkeypatch.setattr(region_read, "SCATTER_MIN", scatter_min)  # 1: rows of non-contiguous outputs read in place
    rng = random.Random(0)
    for trial in range(12):
        ndim = rng.randint(0, 3)
        shape = tuple(rng.randint(1, 9) for _ in range(ndim))
        dtype = rng.choice([torch.float32, torch.int16, torch.float64, torch.bfloat16])
        full = (torch.arange(max(1, torch.Size(shape).numel())).reshape(shape) * 7 % 251).to(dtype)
        monkeypatch.setattr(td, "BLOCK_SIZE", rng.choice([16, 64, 100]))
        d = str(tmp_path / str(trial))
        ci.save({"w": ShardedTensor.from_rank_offsets("w", full.clone())}, d)
        md = read_metadata(locate(d))
        for verify in (True, False):
            with open_reader(locate(d), md, verify_checksums=verify) as reader:
                chunk = reader.chunks["w"][0]
                for _ in range(6):
                    starts = tuple(rng.randint(0, s - 1) for s in shape)
                    lens = tuple(rng.randint(1, s - o) for s, o in zip(shape, starts))
                    want = full[tuple(slice(o, o + n) for o, n in zip(starts, lens))]
                    out_dtype = rng.choice([dtype, torch.float64])
                    big = torch.zeros(tuple(n + 2 for n in lens), dtype=out_dtype)
                    out = big[tuple(slice(1, 1 + n) for n in lens)] if rng.random() < 0.5 else torch.zeros(lens, dtype=out_dtype)
                    reader.read_region("w", chunk, Box(starts, lens), out, dtype)
                    assert torch.equal(out, want.to(out_dtype)), (shape, starts, lens, dtype, out_dtype, verify)


def test_reads_after_the_piece_size_grows_again(tmp_path, monkeypatch):
    """A thread's scratch buffer is sized by ``PIECE + SLACK`` when first used; reads after those
    grow (here: the tiny pieces above undone, which made ``test_faults.py`` fail after this file)
    must not use the smaller buffer kept from before."""
    full = torch.arange(256 * 192, dtype=torch.float32).reshape(256, 192)
    d = str(tmp_path / "c")
    ci.save({"w": ShardedTensor.from_rank_offsets("w", full.clone())}, d, durable=False)
    request = lambda: {"w": ShardedTensor.from_rank_offsets("w", torch.empty(256, 64), (1, 1, 3))}  # noqa: E731 - columns
    monkeypatch.setattr(region_read, "PIECE", 512)
    monkeypatch.setattr(region_read, "SLACK", 1024)
    load = lambda: ci.load(request(), d, thread_count=1, validate_access_integrity=False)["w"]  # noqa: E731 - a part
    assert torch.equal(load(), full[:, 64:128])
    monkeypatch.undo()
    assert torch.equal(load(), full[:, 64:128])
