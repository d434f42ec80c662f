"""``ci.open_checkpoint``: every entry point takes the opened object as well as a path, and a read
through it never returns data of another commit: a checkpoint replaced or removed meanwhile (by
another process) is a ``CheckpointReplacedError``, never mixed data and never ``CorruptCheckpointError``.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration.errors import CheckpointReplacedError, CorruptCheckpointError
from ckpt_integration.storage.filesystem import locate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(value: float, step: int):
    return {"w": ci.ShardedTensor.from_rank_offsets("w", torch.full((64, 16), value)),
            "b": ci.ShardedTensor.from_rank_offsets("b", torch.arange(8.0) + value),
            "step": step}


def _request():
    return {"w": ci.ShardedTensor.from_rank_offsets("w", torch.empty(64, 16)),
            "b": ci.ShardedTensor.from_rank_offsets("b", torch.empty(8))}


def _run(code: str) -> None:
    """Run ``code`` in another process (as another job would; forked with the package imported:
    tests/forked.py), with this checkout importable."""
    from tests import forked

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    res = forked.run([sys.executable, "-c", textwrap.dedent(code)], env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_every_entry_point_takes_a_path_or_the_opened_checkpoint(tmp_path, backend):
    from ckpt_integration.tools import convert_checkpoint, diff_checkpoints, inspect_checkpoint, verify_checkpoint

    if backend == "zarr":
        pytest.importorskip("zarr")
    path = str(tmp_path / "c")
    ci.save(_state(3.0, 7), path, sharded_strategy=backend, content_metadata={"format": 2})
    with ci.open_checkpoint(path) as ck:
        assert ck.backend == backend and ck.commit_id and ck.manifest.commit_id == ck.commit_id
        # it is a handle, not a path: code that turned it back into one (and read its files again)
        # now fails instead of passing silently
        with pytest.raises(TypeError):
            os.fspath(ck)
        assert ci.core.maybe_load_config(ck) is ck.config
        assert ci.get_default_load_sharded_strategy(ck).backend == backend
        for source in (path, ck):
            out = ci.load(_request(), source)
            assert torch.equal(out["w"], torch.full((64, 16), 3.0)) and torch.equal(out["b"], torch.arange(8.0) + 3)
            assert out["step"] == 7
            assert ci.load_common_state_dict(source)["step"] == 7
            assert ci.load_content_metadata(source) == {"format": 2}
            meta = ci.load_tensors_metadata(source)
            assert set(meta) == {"w", "b"} and meta["w"].global_shape == (64, 16)
            assert set(ci.load_sharded_metadata(source)) == {"w", "b"}
            plain = ci.load_plain_tensors(source)
            assert torch.equal(plain["w"], out["w"]) and torch.equal(plain["b"], out["b"])
            assert verify_checkpoint(source).ok
            assert inspect_checkpoint(source)["backend"] == backend
            assert diff_checkpoints(source, path).identical and diff_checkpoints(ck, source).identical
            res = convert_checkpoint(source, "torch", str(tmp_path / f"out_{type(source).__name__}.pt"), overwrite=True)
            assert torch.equal(torch.load(res.output, weights_only=True)["w"], out["w"])
    with pytest.raises(ValueError, match="closed"):
        ci.load_plain_tensors(ck)


def test_lightning_loading_paths_take_the_opened_checkpoint(tmp_path):
    from ckpt_integration.lightning import DistCkptIO, DistCkptSingleDeviceStrategy, load_checkpoint_dict, load_from_checkpoint
    from tests.lightning_helpers import TinyModule, assert_same, loader, trainer

    t = trainer(devices=1, strategy=DistCkptSingleDeviceStrategy(), plugins=[DistCkptIO()], max_epochs=1,
                default_root_dir=str(tmp_path))
    t.fit(TinyModule(), loader())
    path = t.checkpoint_callback.best_model_path
    with ci.open_checkpoint(path) as ck:
        by_path, by_ck = load_checkpoint_dict(path), load_checkpoint_dict(ck)
        assert by_ck["global_step"] == by_path["global_step"] == 4
        assert_same(by_ck["state_dict"], by_path["state_dict"], "state_dict")
        assert_same(DistCkptIO().load_checkpoint(ck)["state_dict"], DistCkptIO().load_checkpoint(path)["state_dict"])
        m_path, m_ck = load_from_checkpoint(TinyModule, path), load_from_checkpoint(TinyModule, ck)
        assert_same(dict(m_ck.state_dict()), dict(m_path.state_dict()), "module")
    # a stock Lightning .ckpt file goes to the module's own load_from_checkpoint, not opened as a directory
    stock = trainer(devices=1, max_epochs=1, default_root_dir=str(tmp_path / "stock"))
    stock.fit(TinyModule(), loader())
    stock_file = stock.checkpoint_callback.best_model_path
    assert os.path.isfile(stock_file)
    assert_same(dict(load_from_checkpoint(TinyModule, stock_file).state_dict()),
                dict(TinyModule.load_from_checkpoint(stock_file).state_dict()), "stock module")


def _storage_ops(monkeypatch):
    """Every storage operation as ``(operation, file name)``, in order."""
    from ckpt_integration.storage import filesystem as fsmod

    ops = []
    for name in ("exists", "isdir", "listdir", "size", "read_bytes", "open_reader"):
        real = getattr(fsmod.Storage, name)

        def inner(self, path, *a, _real=real, _name=name, **k):
            ops.append((_name, str(path).rstrip("/").rsplit("/", 1)[-1]))
            return _real(self, path, *a, **k)

        monkeypatch.setattr(fsmod.Storage, name, inner)
    return ops


def test_opened_once_reads_each_small_file_once(monkeypatch):
    """Issue 22: a load by path reads ``metadata.json``, the manifest, the chunk index and the common
    state once each (no helper goes back to storage for them), and through one opened checkpoint
    the requests of several entry points grow only with the data they read."""
    import uuid

    path = f"memory://opened-{uuid.uuid4().hex[:8]}/c"
    ci.save(_state(3.0, 7), path)
    ops = _storage_ops(monkeypatch)
    out = ci.load(_request(), path)
    assert torch.equal(out["w"], torch.full((64, 16), 3.0)) and out["step"] == 7
    small = ["metadata.json", "manifest.json", "index.bin", ".metadata", "common.pt"]
    # the index, not .metadata: a load does not unpickle DCP's metadata
    assert [o for o in ops if o[1] in small] == [("read_bytes", n) for n in small if n != ".metadata"], ops
    data_files = [o for o in ops if o[1] not in small]
    assert data_files and all(op == "open_reader" for op, _ in data_files) and len(set(data_files)) == len(data_files), ops
    ops.clear()
    with ci.open_checkpoint(path) as ck:
        # (format 6: the index at open, every item's place and digests; .metadata never)
        assert ops == [("read_bytes", "metadata.json"), ("read_bytes", "manifest.json"), ("read_bytes", "index.bin")]
        ops.clear()
        for _ in range(3):
            assert ci.load_common_state_dict(ck)["step"] == 7
            assert set(ci.load_tensors_metadata(ck)) == {"w", "b"}
            assert torch.equal(ci.load(_request(), ck)["b"], torch.arange(8.0) + 3)
        # common.pt once; then only what holds tensor data, once per load
        assert sorted(o for o in ops if o[1] in small) == [("read_bytes", "common.pt")], ops
        assert sorted(o for o in ops if o[1] not in small) == sorted(data_files * 3), ops


def test_inspect_and_verify_an_object_store_checkpoint(monkeypatch):
    """``inspect_checkpoint`` of an fsspec URL (it looked for the path on the local disk: "does not
    exist"), reading each small file once; ``verify_checkpoint`` of the same URL."""
    import uuid

    from ckpt_integration.tools import inspect_checkpoint, verify_checkpoint

    path = f"memory://inspect-{uuid.uuid4().hex[:8]}/c"
    ci.save(_state(3.0, 7), path)
    ops = _storage_ops(monkeypatch)
    info = inspect_checkpoint(path)
    assert info["backend"] == "torch_dist" and info["tensors"]["w"]["shape"] == [64, 16]
    assert info["common_state"] == {"keys": {"step": "int = 7"}, "groups": {}}
    small = [n for _, n in ops if n in ("metadata.json", "manifest.json", ".metadata", "index.bin", "common.pt")]
    assert sorted(small) == sorted(["metadata.json", "manifest.json", "index.bin", "common.pt"]), ops
    assert verify_checkpoint(path).ok


def test_open_a_plain_dcp_checkpoint(tmp_path):
    """A checkpoint of plain PyTorch DCP (``.metadata`` is its commit marker, no manifest) opens and
    loads through the opened object (opening one used to fail with "was removed")."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "dcp")
    dcp.save({"w": torch.arange(12.0).reshape(3, 4)}, checkpoint_id=path, no_dist=True)
    with ci.open_checkpoint(path) as ck:
        assert ck.manifest is None and ck.commit_id == ""
        out = ci.load({"w": ci.ShardedTensor.from_rank_offsets("w", torch.empty(3, 4))}, ck)
        assert torch.equal(out["w"], torch.arange(12.0).reshape(3, 4))
        assert torch.equal(ci.load_plain_tensors(ck)["w"], out["w"])


def test_checkpoint_replaced_by_another_process_while_open(tmp_path):
    """``last.ckpt`` rewritten by a save in another process (same keys and shapes, other values)."""
    last = str(tmp_path / "last.ckpt")
    ci.save(_state(1.0, 1), last)
    ck = ci.open_checkpoint(last)
    assert torch.equal(ci.load(_request(), ck)["w"], torch.full((64, 16), 1.0))
    _run(f"""
        import torch, ckpt_integration as ci
        ci.save({{"w": ci.ShardedTensor.from_rank_offsets("w", torch.full((64, 16), 2.0)),
                  "b": ci.ShardedTensor.from_rank_offsets("b", torch.arange(8.0) + 2.0), "step": 2}},
                {last!r}, overwrite=True)
    """)
    # every read through the opened object: the truthful error, naming the path (never the new
    # commit's values, which pass the new manifest's checks)
    for read in (lambda: ci.load(_request(), ck), lambda: ci.load_plain_tensors(ck),
                 lambda: ci.load(_request(), ck, verify_checksums=False)):
        with pytest.raises(CheckpointReplacedError, match=r"last\.ckpt was replaced by another commit"):
            read()
    # what was read already (the metadata, the common state) stays the opened commit's
    assert ci.load_tensors_metadata(ck)["w"].global_shape == (64, 16)
    assert ci.load_common_state_dict(ck)["step"] == 1
    # a fresh open reads the new commit
    with ci.open_checkpoint(last) as again:
        assert again.commit_id != ck.commit_id
        out = ci.load(_request(), again)
        assert torch.equal(out["w"], torch.full((64, 16), 2.0)) and out["step"] == 2
    # the data files swapped under the cached metadata of the old commit: still not "corrupt"
    _run(f"""
        import shutil, torch, ckpt_integration as ci
        ci.save({{"w": ci.ShardedTensor.from_rank_offsets("w", torch.full((64, 16), 5.0)),
                  "b": ci.ShardedTensor.from_rank_offsets("b", torch.arange(8.0)), "step": 5}},
                {str(tmp_path / "other")!r})
        shutil.rmtree({last!r})  # top-k deletion ...
    """)
    with pytest.raises(CheckpointReplacedError, match=r"last\.ckpt was removed") as ei:
        ci.load(_request(), ck)
    assert not isinstance(ei.value, CorruptCheckpointError)


def test_a_manifest_changed_or_deleted_under_an_opened_checkpoint_is_named(tmp_path):
    """After open: a flipped bit in the manifest's head kept the commit id a regex found there, so the handle
    read on (``verify`` of it said OK); a deleted manifest was reported as the whole checkpoint "removed"."""
    from ckpt_integration.tools.verify import verify_checkpoint

    path = tmp_path / "c"
    ci.save(_state(1.0, 30), str(path), step=30)
    manifest = path / "manifest.json"
    good = manifest.read_bytes()
    with ci.open_checkpoint(str(path)) as ck:
        data = bytearray(good)
        data[data.index(b'"step": 30') + len(b'"step": ')] ^= 0x01  # 30 -> 20
        manifest.write_bytes(bytes(data))
        # (a load through the handle reads the pinned commit, every byte checked against the pinned manifest)
        assert torch.equal(ci.load(_request(), ck)["w"], torch.full((64, 16), 1.0))
        with pytest.raises(CorruptCheckpointError, match=r"manifest\.json is damaged: its head"):
            verify_checkpoint(ck)
        manifest.unlink()
        with pytest.raises(CheckpointReplacedError, match=r"c was changed \(metadata\.json or manifest\.json is gone\)"):
            verify_checkpoint(ck)


def test_a_read_the_system_refuses_is_not_taken_for_a_replaced_checkpoint(tmp_path, monkeypatch):
    """The check that an opened checkpoint was not replaced took any error reading ``manifest.json``
    for "the manifest is gone": a rank out of file descriptors (EMFILE) raised
    ``CheckpointReplacedError`` for a checkpoint nobody touched. The system's error is raised."""
    import errno

    from ckpt_integration.errors import CheckpointReadError
    from ckpt_integration.storage.opened import commit_identity

    path = str(tmp_path / "c")
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(4))}, path)
    ck = locate(path)
    real = os.open

    def no_fds(p, *args, **kwargs):
        if str(p).endswith("manifest.json"):
            raise OSError(errno.EMFILE, "Too many open files", str(p))
        return real(p, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_fds)
    with pytest.raises(CheckpointReadError, match="too many open files"):
        commit_identity(ck)


@pytest.mark.parametrize("mode", ["opened", "path"])
def test_evaluation_job_reads_while_training_saves(tmp_path, mode):
    """Issue 23 item 1 / issue 22, short form of ``benchmarks/readers_beside_writer.py``: a reader
    process loads every new checkpoint (through ``open_checkpoint``, or by path) while a training
    process keeps saving (``last.ckpt`` replaced, step checkpoints rotated with top-2 deletion).
    Every load returns exactly one commit (every value equals the step it records) or says the
    checkpoint was replaced/removed; none is reported corrupt. By path, loads of a replaced
    ``last.ckpt`` were reported as ``CorruptCheckpointError`` (177 of 1,297 loads in 300 saves)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import readers_beside_writer as bench
    finally:
        sys.path.pop(0)
    met = 0
    for attempt in range(4):  # until the reader has met a replaced or removed checkpoint (timing decides)
        saves = 24 * (attempt + 1)
        res = bench.run(str(tmp_path / f"run{attempt}"), saves=saves, mode=mode, timeout=300)
        print("evaluation reader:", res)
        c = res["counts"]
        assert c["corrupt"] == c["mixed"] == c["other"] == 0, res
        assert c["ok"] >= 2, res  # at least the last round: last.ckpt and the newest step checkpoint
        met += c["replaced"] + c["gone"]
        if met:
            break
    # the case this test exists for happened: a checkpoint replaced or removed under the reader
    assert met > 0, res


def _resume_reads(rank, world, path):
    from ckpt_integration.lightning import DistCkptIO
    from ckpt_integration.optimizer import has_optimizer_state
    from ckpt_integration.storage import filesystem as fsmod

    def state(fill):
        return {"w": ci.ShardedTensor.from_rank_offsets("w", fill(4, 8), (0, rank, world)), "step": 3}

    ci.save(state(lambda *s: torch.full(s, float(rank))), path, content_metadata={"layout": "dp2"})
    ops = []
    real = fsmod.Storage.read_bytes

    def read_bytes(self, p, *a, **k):
        ops.append(str(p).rsplit("/", 1)[-1])
        return real(self, p, *a, **k)

    fsmod.Storage.read_bytes = read_bytes
    try:
        with DistCkptIO().opened_for_load(path) as ck:  # what the DistCkpt strategies and Fabric do
            assert ci.load_content_metadata(ck) == {"layout": "dp2"}
            out = ci.load(state(torch.empty), ck)
            assert not has_optimizer_state(ck, "optimizer")
            assert ci.load_sharded_metadata(ck)["w"].global_shape == (8, 8)
    finally:
        fsmod.Storage.read_bytes = real
    assert torch.equal(out["w"], torch.full((4, 8), float(rank))) and out["step"] == 3
    # the coordinator reads the small files once for the job; the other rank only the common state
    # (the index, not .metadata: the optimizer's metadata is decoded from it too)
    expected = ["metadata.json", "manifest.json", "index.bin", "common.pt"] if rank == 0 else ["common.pt"]
    assert sorted(ops) == sorted(expected), (rank, ops)


def test_a_resume_opens_the_checkpoint_once_for_the_job(tmp_path):
    """Issue 22: a Lightning/Fabric resume reads the content metadata, the state and the optimizer
    metadata through one collectively opened checkpoint (before: every rank read metadata.json,
    the manifest and .metadata again for each of those calls)."""
    from tests.dist_utils import run_distributed

    run_distributed(_resume_reads, 2, str(tmp_path / "c"))


def test_lightning_helpers_open_a_resolved_path_with_its_trusted_flag(tmp_path, monkeypatch):
    """``load_checkpoint_dict`` / ``load_from_checkpoint`` read the common state and the tensors
    through one opened checkpoint, opened after the path is resolved: an interrupted ``last.ckpt``
    still falls back to its newest complete sibling (opening the path first refused it as
    incomplete), and ``.metadata`` is read as trusted when the call says so (a global outside the
    metadata allow-list is refused without ``trusted`` and loads with it)."""
    import argparse
    import shutil

    from ckpt_integration.lightning import load_checkpoint_dict
    from ckpt_integration.storage import checkpoint_dir as ckdir
    from ckpt_integration.storage.torch_dist import DCP_METADATA_FILE, read_dcp_metadata, write_dcp_metadata

    # (format 5: a .metadata rewritten after the save is what its loads read; format 6 loads read
    # index.bin only, tests/test_checkpoint_index.py)
    monkeypatch.setattr(ckdir, "SAVE_MANIFEST_VERSION", 5)
    good = str(tmp_path / "epoch=0.ckpt")
    ci.save(_state(3.0, 7), good)
    last = str(tmp_path / "last.ckpt")
    shutil.copytree(good, last)
    os.remove(os.path.join(last, "metadata.json"))  # an overwrite interrupted before its commit
    out = load_checkpoint_dict(last)
    assert out["step"] == 7 and torch.equal(out["state_dict"]["w"], torch.full((64, 16), 3.0))

    md = read_dcp_metadata(locate(good))
    md.planner_data = {"w": argparse.Namespace(note="not a metadata class")}
    manifest = ckdir.read_manifest(locate(good))
    manifest.files[DCP_METADATA_FILE] = write_dcp_metadata(locate(good), md)
    ckdir.write_manifest(locate(good), manifest)
    with pytest.raises(ci.CheckpointingException, match="argparse"):
        load_checkpoint_dict(good)
    assert torch.equal(load_checkpoint_dict(good, trusted=True)["state_dict"]["b"], torch.arange(8.0) + 3)


@pytest.mark.parametrize("entry", ["load", "load_plain_tensors", "open_checkpoint"])
def test_a_checkpoint_deleted_while_it_is_being_opened_is_named_not_a_bare_os_error(tmp_path, monkeypatch, entry):
    """Another process deletes the checkpoint (the library's own deletion, commit marker first) between
    the open's check that the commit marker exists and its read (probe: hit a few times per 30 s
    of loads beside a save-and-delete loop). The open raised a bare FileNotFoundError, which a
    caller catching CheckpointingException to take the next checkpoint does not catch."""
    from ckpt_integration.storage import filesystem as fsmod

    d = str(tmp_path / "ck")
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(4))}, d)
    real = fsmod.Storage.exists

    def exists(self, path):
        found = real(self, path)
        if found and path.endswith("ck/metadata.json"):
            monkeypatch.setattr(fsmod.Storage, "exists", real)
            self.rmtree(d)  # the deletion lands right after the check
        return found

    monkeypatch.setattr(fsmod.Storage, "exists", exists)
    with pytest.raises(ci.errors.CheckpointNotFoundError, match="ck"):
        if entry == "load":
            ci.load({"w": ci.ShardedTensor.from_rank_offsets("w", torch.empty(4))}, d)
        elif entry == "load_plain_tensors":
            ci.load_plain_tensors(d)
        else:
            ci.open_checkpoint(d)
