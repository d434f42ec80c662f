"""The DCP front door: ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` with ``ci.dcp.Writer`` / ``ci.dcp.Reader``,
an FSDP2 model with AdamW on gloo ranks, resumed on another number of ranks, compared exactly."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from torch.distributed.checkpoint.api import CheckpointException  # (DCP's: a BaseException carrying every rank's)

import ckpt_integration as ci
from ckpt_integration.tools import verify_checkpoint
from tests.dist_utils import run_distributed
from tests.layouts import assert_same_state
from ckpt_integration.storage.filesystem import locate


def _model_and_optimizer(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps, rank, lr=None):
    for s in range(steps):
        if lr is not None:
            for g in opt.param_groups:
                g["lr"] = lr
        x = torch.arange(64, dtype=torch.float32).reshape(4, 16).add(rank + s) / 64
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _full(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # (a copy: the optimizer's ``step`` tensors come back as the live ones, which the next step increments)
    return copy.deepcopy({"model": model_sd, "optim": optim_sd})


def _save_worker(rank, world, root):
    import torch.distributed.checkpoint as dcp

    model, opt = _model_and_optimizer(world)
    _train(model, opt, 2, rank)
    dcp.save(_state(model, opt), storage_writer=ci.dcp.Writer(os.path.join(root, "sync")))
    ref = _full(model, opt)
    _train(model, opt, 1, rank)
    dcp.async_save(_state(model, opt), storage_writer=ci.dcp.Writer(os.path.join(root, "async"))).result()
    ref_async = _full(model, opt)
    if rank == 0:
        torch.save(ref, os.path.join(root, "ref_sync.pt"))
        torch.save(ref_async, os.path.join(root, "ref_async.pt"))
    # a committed checkpoint is never written over
    with pytest.raises(CheckpointException, match="already holds a committed checkpoint"):
        dcp.save(_state(model, opt), storage_writer=ci.dcp.Writer(os.path.join(root, "sync")))
    dist.barrier()


def _load_worker(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    for name in ("sync", "async"):
        model, opt = _model_and_optimizer(world)
        _train(model, opt, 1, rank, lr=0.0)  # (creates AdamW's state for the load to fill)
        state = _state(model, opt)
        dcp.load(state, storage_reader=ci.dcp.Reader(os.path.join(root, name)))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got = _full(model, opt)
        if rank == 0:
            assert_same_state(got, torch.load(os.path.join(root, f"ref_{name}.pt")), f"{name} on {world} rank(s)")


def _damaged_worker(rank, world, root):
    import torch.distributed.checkpoint as dcp

    model, opt = _model_and_optimizer(world)
    _train(model, opt, 1, rank, lr=0.0)
    state = _state(model, opt)
    with pytest.raises(CheckpointException, match="checksum mismatch") as info:
        dcp.load(state, storage_reader=ci.dcp.Reader(os.path.join(root, "bad")))
    assert ".distcp" in str(info.value)
    # PyTorch DCP's own reader returns the damaged values without a word
    from torch.distributed.checkpoint.state_dict import set_state_dict

    dcp.load(state, checkpoint_id=os.path.join(root, "bad"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = _full(model, opt)
    if rank == 0:
        with pytest.raises(AssertionError):
            assert_same_state(got, torch.load(os.path.join(root, "ref_sync.pt")))


def _flip_a_data_byte(path):
    """Flip one byte in the middle of the largest tensor's data (not its archive framing, which makes
    even PyTorch DCP's reader fail)."""
    from ckpt_integration.storage import checkpoint_dir as ckdir

    records = ckdir.read_manifest(locate(path)).block_records()
    (name, offset), rec = max(((rid, records[rid]) for rid in records), key=lambda x: x[1].data_length)
    at = offset + rec.data_offset + rec.data_length // 2
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def test_dcp_save_and_async_save_through_the_door_resume_exactly_on_1_and_4_ranks(tmp_path):
    """FSDP2 + AdamW on 2 gloo ranks, saved with ``dcp.save`` and ``dcp.async_save`` through
    ``ci.dcp.Writer``, resumed through ``ci.dcp.Reader`` on 1 and 4 ranks: weights and optimizer state
    equal, exactly. The checkpoints verify, ``ci.load`` and plain ``dcp.load`` read them, a flipped
    byte is refused naming the file (plain DCP returns it silently)."""
    root = str(tmp_path)
    run_distributed(_save_worker, 2, root, timeout=240)
    for world in (1, 4):
        run_distributed(_load_worker, world, root, timeout=240)
    for name in ("sync", "async"):
        report = verify_checkpoint(os.path.join(root, name))
        assert report.ok, report.problems
    ref = torch.load(os.path.join(root, "ref_sync.pt"))
    plain = ci.load_plain_tensors(os.path.join(root, "sync"))
    for k, v in ref["model"].items():
        assert torch.equal(plain[f"model.{k}"], v), k
    shutil.copytree(os.path.join(root, "sync"), os.path.join(root, "bad"))
    _flip_a_data_byte(os.path.join(root, "bad"))
    assert not verify_checkpoint(os.path.join(root, "bad")).ok
    run_distributed(_damaged_worker, 2, root, timeout=240)


def test_the_reader_reads_plain_dcp_checkpoints_and_refuses_an_uncommitted_door_save(tmp_path, caplog):
    import torch.distributed.checkpoint as dcp

    sd = {"w": torch.randn(8, 8), "step": 3}
    dcp.save(sd, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    out = {"w": torch.zeros(8, 8), "step": 0}
    dcp.load(out, storage_reader=ci.dcp.Reader(str(tmp_path / "plain")), no_dist=True)
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 3
    assert any("tensor data is checked against its zip records' CRC32s" in r.getMessage() for r in caplog.records)
    dcp.save(sd, storage_writer=ci.dcp.Writer(str(tmp_path / "ours")), no_dist=True)
    os.remove(tmp_path / "ours" / "metadata.json")  # as if the save had been killed before its commit
    with pytest.raises(CheckpointException, match="no committed checkpoint"):
        dcp.load(out, storage_reader=ci.dcp.Reader(str(tmp_path / "ours")), no_dist=True)


def test_overwrite_through_the_door_replaces_only_once_committed(tmp_path, monkeypatch):
    """``Writer(overwrite=True)`` writes beside the committed checkpoint and swaps at the commit: a save
    that fails on the way leaves the old checkpoint whole and loadable."""
    import torch.distributed.checkpoint as dcp

    import ckpt_integration.dcp as door

    path = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(8)}, storage_writer=ci.dcp.Writer(path), no_dist=True)
    dcp.save({"w": torch.full((8,), 2.0)}, storage_writer=ci.dcp.Writer(path, overwrite=True), no_dist=True)
    out = {"w": torch.zeros(8)}
    dcp.load(out, storage_reader=ci.dcp.Reader(path), no_dist=True)
    assert torch.equal(out["w"], torch.full((8,), 2.0))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(door, "write_data_files", disk_full)
    with pytest.raises(CheckpointException, match="No space left"):
        dcp.save({"w": torch.full((8,), 3.0)}, storage_writer=ci.dcp.Writer(path, overwrite=True), no_dist=True)
    monkeypatch.undo()
    out = {"w": torch.zeros(8)}
    dcp.load(out, storage_reader=ci.dcp.Reader(path), no_dist=True)
    assert torch.equal(out["w"], torch.full((8,), 2.0)) and verify_checkpoint(path).ok
    dcp.save({"w": torch.full((8,), 4.0)}, storage_writer=ci.dcp.Writer(path, overwrite=True), no_dist=True)
    dcp.load(out, storage_reader=ci.dcp.Reader(path), no_dist=True)
    assert torch.equal(out["w"], torch.full((8,), 4.0))
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # (the failed save's staging directory was taken over and cleaned)


# every file the door's reader reads, and the damage each must refuse (a flipped byte of the two JSON
# files may leave valid JSON of other values, which their own checks do not promise to see)
_DOOR_FILES = {".metadata": "mtef", "__0_0.distcp": "mtef", "__0_1.distcp": "mtef", "index.bin": "mtef",
               "manifest.json": "mte", "metadata.json": "mte"}


@pytest.mark.parametrize("name,kind", [(n, k) for n, kinds in _DOOR_FILES.items() for k in kinds])
def test_reader_refuses_every_damaged_file(tmp_path, name, kind):
    """A missing (m), truncated (t), emptied (e) or byte-flipped (f) file fails ``dcp.load`` through the
    reader with an error naming the file (DCP wraps it in its ``CheckpointException``); the caller's
    tensors are never given unverified bytes."""
    import torch.distributed.checkpoint as dcp

    from tests.damage import flip_byte

    state = {"a": torch.arange(4096.0).view(64, 64), "b": torch.arange(10), "c": {"x": torch.ones(3, 3)}}
    path = str(tmp_path / "ck")
    dcp.save(state, storage_writer=ci.dcp.Writer(path), no_dist=True)
    assert sorted(f for f in os.listdir(path) if f not in ("common.pt", "ckpt_integration.json")) == sorted(_DOOR_FILES)
    target = os.path.join(path, name)
    size = os.path.getsize(target)
    if kind == "m":
        os.remove(target)
    elif kind in "te":
        os.truncate(target, size // 2 if kind == "t" else 0)
    else:
        flip_byte(target, size // 2)
    out = {"a": torch.zeros(64, 64), "b": torch.zeros(10, dtype=torch.int64), "c": {"x": torch.zeros(3, 3)}}
    with pytest.raises(CheckpointException) as info:
        dcp.load(out, storage_reader=ci.dcp.Reader(path), no_dist=True)
    text = str(info.value)  # (DCP keeps the class of errors of its reads, not of its metadata read)
    assert path in text and name in text, text[-600:]  # the checkpoint and the file named
    if name not in ("manifest.json", "metadata.json", ".metadata"):
        assert "CorruptCheckpointError" in text, text[-600:]


def _transient_metadata_worker(rank, world, path):
    import torch.distributed.checkpoint as dcp

    import ckpt_integration.dcp as door

    real, calls = door.read_dcp_metadata, []

    def flaky(*args, **kwargs):  # rank 1's first read of .metadata fails (an object store gave up)
        calls.append(1)
        if rank == 1 and len(calls) == 1:
            raise ci.errors.CheckpointReadError(f"reading {path}/.metadata failed after 4 attempt(s)")
        return real(*args, **kwargs)

    door.read_dcp_metadata = flaky
    try:
        out = {"w": torch.zeros(8, 4)}
        with pytest.raises(CheckpointException, match="failed after 4 attempt"):
            dcp.load(out, storage_reader=ci.dcp.Reader(path))
        # every rank raised; none read the metadata a second time (DCP's rank-local fallback, which
        # would take that rank out of the load's collectives while the others wait in them)
        assert len(calls) == 1, calls
        dist.barrier()
    finally:
        door.read_dcp_metadata = real


def test_a_failed_metadata_read_on_one_rank_fails_the_load_on_every_rank(tmp_path):
    """DCP retries ``read_metadata(rank=...)`` when the first read fails, and a rank whose retry works
    then loads without collectives while the others wait in theirs. The reader takes no ``rank``: the
    load fails on every rank, at once, with the rank's error."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ck")
    dcp.save({"w": torch.arange(32.0).view(8, 4)}, storage_writer=ci.dcp.Writer(path), no_dist=True)
    run_distributed(_transient_metadata_worker, 2, path, timeout=60)


def _uncoordinated_worker(rank, world, path):
    import torch.distributed.checkpoint as dcp

    with pytest.raises(ci.CheckpointingException, match="use_collectives=False"):
        dcp.save({f"w{rank}": torch.full((4,), float(rank))}, storage_writer=ci.dcp.Writer(path), use_collectives=False)
    dist.barrier()
    assert not os.path.exists(os.path.join(path, "metadata.json"))  # nothing committed
    # a checkpoint per rank, each saved on its own
    mine = f"{path}-{rank}"
    dcp.save({"w": torch.full((4,), float(rank))}, storage_writer=ci.dcp.Writer(mine), no_dist=True)
    out = {"w": torch.zeros(4)}
    dcp.load(out, storage_reader=ci.dcp.Reader(mine), no_dist=True)
    assert torch.equal(out["w"], torch.full((4,), float(rank)))
    # the manifest counts the ranks that saved (it said the world's size: 2 here)
    assert ci.open_checkpoint(mine).manifest.world_size == 1
    alone = dist.new_group([1])
    if rank == 1:
        dcp.save({"w": torch.ones(4)}, storage_writer=ci.dcp.Writer(f"{path}-group"), process_group=alone)
        assert ci.open_checkpoint(f"{path}-group").manifest.world_size == 1
    dist.barrier()
    # DCP's plan caching reuses the first save's plans, which carried that save's directory: the second save's
    # files went into the first checkpoint (SaveConflictError naming it) and every later save failed
    from torch.distributed.checkpoint import DefaultSavePlanner

    for step in (1, 2, 3):
        dcp.save({f"w{rank}": torch.full((4,), float(10 * step + rank))}, planner=DefaultSavePlanner(enable_plan_caching=True),
                 storage_writer=ci.dcp.Writer(f"{path}-cached-{step}"))
    for step in (1, 2, 3):
        out = {f"w{rank}": torch.zeros(4)}
        dcp.load(out, storage_reader=ci.dcp.Reader(f"{path}-cached-{step}"))
        assert torch.equal(out[f"w{rank}"], torch.full((4,), float(10 * step + rank))), (step, out)
    # an overwrite's staging directory cannot reach the other ranks through a cached plan: refused on every rank
    with pytest.raises(CheckpointException, match="plan caching"):
        dcp.save({f"w{rank}": torch.zeros(4)}, planner=DefaultSavePlanner(enable_plan_caching=True),
                 storage_writer=ci.dcp.Writer(f"{path}-cached-3", overwrite=True))
    out = {f"w{rank}": torch.zeros(4)}
    dcp.load(out, storage_reader=ci.dcp.Reader(f"{path}-cached-3"))
    assert torch.equal(out[f"w{rank}"], torch.full((4,), float(30 + rank)))  # (the old checkpoint, whole)
    dist.barrier()


def test_an_uncoordinated_save_of_a_job_is_refused_on_every_rank(tmp_path):
    """``dcp.save(use_collectives=False)`` on several ranks into one path committed the first rank's part
    alone (the other ranks failed against its claim): now every rank refuses before writing. A save by
    one rank (``no_dist``, or a group of one) records one rank, not the world's size. Saves with DCP's plan
    caching each write their own checkpoint (an overwrite is refused: its staging directory cannot travel)."""
    run_distributed(_uncoordinated_worker, 2, str(tmp_path / "ck"), timeout=60)


def _relative_path_worker(rank, world, root):
    import threading

    import torch.distributed.checkpoint as dcp

    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    for d, v in ((a, 1.0), (b, 2.0)):
        dcp.save({"w": torch.full((4,), v)}, storage_writer=ci.dcp.Writer(os.path.join(d, "ck")))
    gate, real = threading.Event(), ci.dcp.Writer.write_data

    def held(self, *args, **kwargs):  # the background part of async_save waits until the caller moved on
        if threading.current_thread() is not threading.main_thread():
            gate.wait(60)
        return real(self, *args, **kwargs)

    ci.dcp.Writer.write_data = held
    os.chdir(a)
    fut = dcp.async_save({"w": torch.full((4,), 3.0)}, storage_writer=ci.dcp.Writer("ck", overwrite=True))
    os.chdir(b)
    gate.set()
    fut.result()
    ci.dcp.Writer.write_data = real
    for d, v in ((a, 3.0), (b, 2.0)):
        out = {"w": torch.zeros(4)}
        dcp.load(out, storage_reader=ci.dcp.Reader(os.path.join(d, "ck")))
        assert torch.equal(out["w"], torch.full((4,), v)), (d, out["w"])


def test_a_relative_path_is_the_one_of_the_call_also_for_dcp_async_save(tmp_path):
    """``dcp.async_save(..., storage_writer=ci.dcp.Writer("ck", overwrite=True))`` resolved the relative
    path in DCP's background thread: after a ``chdir`` (Hydra's) it replaced another run's checkpoint at
    the same relative path, the one asked for untouched. The writer resolves it when it is made."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    run_distributed(_relative_path_worker, 1, str(tmp_path), timeout=60)
