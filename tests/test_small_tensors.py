"""Many small tensors: the templated archive writer writes exactly what torch.save writes."""

from __future__ import annotations

import io

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import ShardedTensor
from ckpt_integration.storage.tensor_record import BlockDigestWriter, save_tensor
from ckpt_integration.storage.torch_dist import _archive_member_crc_disabled, run_parallel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.complex64, torch.uint8, torch.float8_e4m3fn])
def test_template_archive_is_byte_identical_to_torch_save(dtype):
    with _archive_member_crc_disabled():
        for shape in [(1024,), (3, 5), (1,), (2, 3, 4), (7, 1)]:
            for seed in (0, 1):  # the second tensor of a shape comes from the cached template
                t = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 9).to(dtype)
                a, b = io.BytesIO(), io.BytesIO()
                wa, wb = BlockDigestWriter(a, t, 1 << 20), BlockDigestWriter(b, t, 1 << 20)
                torch.save(t, wa)
                save_tensor(t, wb)
                assert a.getvalue() == b.getvalue(), (dtype, shape)
                assert wa.finish() == wb.finish()


def test_many_small_tensors_round_trip_and_dcp_reads_them(tmp_path):
    import torch.distributed.checkpoint as dcp

    ts = {f"t{i}": torch.randn(i % 7 + 1, 3) for i in range(300)}
    ci.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in ts.items()}, tmp_path / "c")
    got = ci.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in ts.items()}, tmp_path / "c")
    assert all(torch.equal(got[k], v) for k, v in ts.items())
    out = {k: torch.zeros_like(v) for k, v in ts.items()}
    dcp.load(out, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in ts.items())


def test_run_parallel_runs_every_task_and_raises_the_first_error():
    done = []
    run_parallel(list(range(1000)), done.append, 3)
    assert sorted(done) == list(range(1000))

    def boom(i):
        if i == 500:
            raise ValueError("task 500")

    with pytest.raises(ValueError, match="task 500"):
        run_parallel(list(range(1000)), boom, 3)


@pytest.mark.parametrize("hash_name", ["xxh3_64", "crc32"])
def test_bulk_small_item_writer_writes_what_the_generic_writer_writes(tmp_path, monkeypatch, hash_name):
    """Small plain tensors go through SmallItemWriter (template parts, cached checksums, one large
    write): the data files and every item record (offsets, lengths, digests, block records) are
    exactly those of the generic per-item writer, for every kind of item in between, with either
    block digest (XXH3-64 of new saves, CRC32 of format 2)."""
    from ckpt_integration.storage import checksum, small_items

    monkeypatch.setattr(checksum, "SAVE_BLOCK_HASH", hash_name)
    from ckpt_integration.storage.torch_dist import WriteRequest, write_data_files

    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 64, generator=g)
    tensors = [torch.randn(n, generator=g).to(dt) for n in (1, 7, 1024) for dt in (torch.float32, torch.bfloat16, torch.int8)]
    tensors += [base[3:5], base[:, 1:3], base.t()[:2], torch.randn(300_000, generator=g),  # views, non-contiguous, > 1 MiB
                torch.randn(4, requires_grad=True), torch.zeros(0)]
    requests = [WriteRequest(f"k{i}", (0,) * t.dim(), t) for i, t in enumerate(tensors)]
    requests.insert(3, WriteRequest("obj/shard_0_1", None, b"object bytes"))
    (tmp_path / "bulk").mkdir()
    (tmp_path / "generic").mkdir()
    real, taken = small_items.SmallItemWriter.add, []
    monkeypatch.setattr(small_items.SmallItemWriter, "add", lambda self, t: taken.append(real(self, t)) or taken[-1])
    bulk = write_data_files(str(tmp_path / "bulk"), 0, requests, thread_count=2, durable=False)
    assert sum(x is not None for x in taken) == 9 + 1 + 1  # the small ones, a contiguous view, requires_grad
    monkeypatch.setattr(small_items.SmallItemWriter, "add", lambda self, t: None)
    generic = write_data_files(str(tmp_path / "generic"), 0, requests, thread_count=2, durable=False)
    for name in ("__0_0.distcp", "__0_1.distcp"):
        assert (tmp_path / "bulk" / name).read_bytes() == (tmp_path / "generic" / name).read_bytes()
    assert [tuple(x) for x in zip(*(getattr(bulk, f) for f in bulk.__slots__))] == \
           [tuple(x) for x in zip(*(getattr(generic, f) for f in generic.__slots__))]
