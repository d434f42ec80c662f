"""Issue 37 item 2: every tool passes one opened checkpoint down. Through ``ci.open_checkpoint``,
the small files of the checkpoint are read at most once in all: ``metadata.json`` and
``manifest.json`` and ``index.bin`` by the open, ``.metadata`` and ``common.pt`` at most once
by the tool. The one exception is ``verify``'s check, after its reads, that the directory still
holds the opened commit (it reports damage instead of raising, so a replacement meanwhile must be
told apart from damage): one more read of ``manifest.json``'s commit id."""

from __future__ import annotations

import collections
import contextlib
import io
import os

import pytest
import torch


def _state(n=3):
    import ckpt_integration as ci

    sd = {f"layer{i}.weight": ci.ShardedTensor.from_rank_offsets(f"layer{i}.weight", torch.rand(16, 8)) for i in range(n)}
    sd["obj"] = ci.ShardedObject("obj", {"seen": 7}, (1,), (0,))
    sd["step"] = 3
    return sd


def _request(n=3):
    import ckpt_integration as ci

    return {f"layer{i}.weight": ci.ShardedTensor.from_rank_offsets(f"layer{i}.weight", torch.zeros(16, 8)) for i in range(n)}


@pytest.fixture()
def counted(monkeypatch):
    """``(counts, watch)``: reads of files directly inside the watched directory, by file name."""
    from ckpt_integration.storage import filesystem as fsm

    counts: collections.Counter = collections.Counter()
    watched = []
    read_bytes, open_reader = fsm.Storage.read_bytes, fsm.Storage.open_reader

    def note(path):
        if watched and os.path.dirname(os.fspath(path)) == watched[0]:
            counts[os.path.basename(path)] += 1

    def rb(self, path, what="file"):
        note(path)
        return read_bytes(self, path, what)

    def orr(self, path, what="file"):
        note(path)
        return open_reader(self, path, what)

    monkeypatch.setattr(fsm.Storage, "read_bytes", rb)
    monkeypatch.setattr(fsm.Storage, "open_reader", orr)
    return counts, watched


TOOLS = {
    "load": lambda ci, t, ck, d: ci.load(_request(), ck),
    "load_common_state_dict": lambda ci, t, ck, d: ci.load_common_state_dict(ck),
    "verify": lambda ci, t, ck, d: t.verify_checkpoint(ck),
    "verify --state": lambda ci, t, ck, d: t.verify_checkpoint(ck, state=True),
    "inspect": lambda ci, t, ck, d: t.inspect_checkpoint(ck),
    "diff": lambda ci, t, ck, d: t.diff_checkpoints(ck, os.path.join(d, "b")),
    "convert torch_dist": lambda ci, t, ck, d: t.convert_checkpoint(ck, "torch_dist", os.path.join(d, "out")),
    "convert zarr": lambda ci, t, ck, d: t.convert_checkpoint(ck, "zarr", os.path.join(d, "out")),
    "convert safetensors": lambda ci, t, ck, d: t.convert_checkpoint(ck, "safetensors", os.path.join(d, "out")),
    "export hf": lambda ci, t, ck, d: t.export_checkpoint(ck, os.path.join(d, "out")),
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_each_small_file_is_read_at_most_once_through_one_opened_checkpoint(tmp_path, counted, tool):
    import ckpt_integration as ci
    from ckpt_integration import tools

    counts, watched = counted
    d = str(tmp_path)
    ci.save(_state(), os.path.join(d, "a"))
    ci.save(_state(), os.path.join(d, "b"))
    watched.append(os.path.join(d, "a"))
    with ci.open_checkpoint(os.path.join(d, "a")) as ck:
        assert dict(counts) == {"metadata.json": 1, "manifest.json": 1, "index.bin": 1}, counts
        with contextlib.redirect_stdout(io.StringIO()):
            out = TOOLS[tool](ci, tools, ck, d)
    if tool.startswith("verify"):
        assert out.ok, out.problems
    small = {k: v for k, v in counts.items() if not k.endswith(".distcp")}
    # (verify reads the manifest and the index again from storage: it checks what is stored, never a kept copy)
    fresh = 2 if tool.startswith("verify") else 1
    allowed = {"metadata.json": 1, "manifest.json": fresh, "index.bin": fresh,
               ".metadata": 1, "common.pt": 1}
    over = {k: v for k, v in small.items() if v > allowed.get(k, 1)}
    assert not over, f"{tool}: read more than once through one opened checkpoint: {over} (all: {small})"


@pytest.mark.parametrize("whole", [True, False], ids=["everything", "into a state"])
def test_fabric_load_reads_each_small_file_once_through_one_opened_checkpoint(tmp_path, counted, whole):
    import lightning as L

    import ckpt_integration as ci
    from ckpt_integration.lightning import DistCkptIO

    counts, watched = counted
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[DistCkptIO()])
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    path = str(tmp_path / "a")
    fabric.save(path, {"model": model, "step": 3})
    watched.append(path)
    with ci.open_checkpoint(path) as ck:
        counts.clear()
        if whole:
            out = fabric.load(ck)
            assert torch.equal(out["model"]["0.weight"], model[0].weight.detach()) and out["step"] == 3
        else:
            other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
            rest = fabric.load(ck, {"model": other})
            assert torch.equal(other[1].weight, model[1].weight) and rest == {"step": 3}
    small = {k: v for k, v in counts.items() if not k.endswith(".distcp")}
    assert small.get("metadata.json", 0) == 0 and small.get("manifest.json", 0) <= 1, small
    assert all(v <= 1 for v in small.values()), f"read more than once through one opened checkpoint: {small}"


ENTRY_POINTS = {
    "load": (lambda ci, t, p, d: ci.load(_request(), p), 1),
    "load_common_state_dict": (lambda ci, t, p, d: ci.load_common_state_dict(p), 1),
    "load_tensors_metadata": (lambda ci, t, p, d: ci.load_tensors_metadata(p), 1),
    "load_plain_tensors": (lambda ci, t, p, d: ci.load_plain_tensors(p), 1),
    "verify": (lambda ci, t, p, d: t.verify_checkpoint(p), 1),
    "verify --state": (lambda ci, t, p, d: t.verify_checkpoint(p, state=True), 1),
    "inspect": (lambda ci, t, p, d: t.inspect_checkpoint(p), 1),
    "diff": (lambda ci, t, p, d: t.diff_checkpoints(p, os.path.join(d, "b")), 2),  # two checkpoints
    "save": (lambda ci, t, p, d: ci.save(_state(), os.path.join(d, "c")), 1),
    "save overwrite": (lambda ci, t, p, d: ci.save(_state(), p, overwrite=True), 1),  # (through a staging sibling)
    "async save": (lambda ci, t, p, d: ci.save(_state(), os.path.join(d, "c"), async_sharded_save=True).wait(), 1),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_an_entry_point_resolves_the_path_it_is_given_once(tmp_path, monkeypatch, entry):
    """Issue 37 item 2: an entry point given a path turns it into the handle once
    (``filesystem.locate``) and passes that down; no helper below it resolves the path again (on an
    object store each resolution is an fsspec lookup). Before the handle, a load resolved its path
    3 times, ``diff`` 6, ``verify`` 12 and ``verify --state`` 16, and a save (the claim, the writers,
    the commit) the path it writes into 11 times (12 when overwriting)."""
    import sys

    import ckpt_integration as ci
    from ckpt_integration import tools
    from ckpt_integration.storage import filesystem as fsm
    from ckpt_integration.storage.filesystem import CheckpointLocation

    d = str(tmp_path)
    ci.save(_state(), os.path.join(d, "a"))
    ci.save(_state(), os.path.join(d, "b"))
    resolved = []
    real = fsm.storage_for

    def storage_for(path):
        if not isinstance(path, CheckpointLocation):
            resolved.append(os.fspath(path))
        return real(path)

    for module in list(sys.modules.values()):  # every module that imported it by name
        if getattr(module, "__name__", "").startswith("ckpt_integration") and getattr(module, "storage_for", None) is real:
            monkeypatch.setattr(module, "storage_for", storage_for)
    fn, most = ENTRY_POINTS[entry]
    with contextlib.redirect_stdout(io.StringIO()):
        fn(ci, tools, os.path.join(d, "a"), d)
    assert len(resolved) <= most, f"{entry} resolved its path {len(resolved)} times: {resolved}"


def test_the_handle_names_and_reads_the_files_of_its_directory(tmp_path):
    """The storage operations on a checkpoint's files are the handle's methods (``read``, ``open``,
    ``exists``, ``write``, ``remove``, ``listdir``, ``file``), locally and on an fsspec store, with
    the containment checks of every reader; and below the entry points no module names a file of
    a checkpoint by joining its path by hand or calls the storage's directory-relative readers
    itself (so no read can skip those checks)."""
    import pathlib
    import re

    from ckpt_integration.errors import UnsafeCheckpointError
    from ckpt_integration.storage.filesystem import locate

    for root in (str(tmp_path / "ck"), "memory://handle-test/ck"):
        ck = locate(root)
        ck.storage.makedirs(ck.path)
        assert not ck.exists("a.json") and ck.listdir() == []
        ck.write("a.json", b"{}")
        assert ck.exists("a.json") and ck.read("a.json") == b"{}" and ck.listdir() == ["a.json"]
        reader = ck.open("a.json")
        try:
            assert reader.size == 2 and reader.read(0, 2) == b"{}"
        finally:
            reader.close()
        assert ck.file("a.json") == (os.path.join(root, "a.json") if "://" not in root else root + "/a.json")
        with pytest.raises(UnsafeCheckpointError):
            ck.read("../a.json")
        ck.remove("a.json")
        assert not ck.exists("a.json")

    package = pathlib.Path(__file__).resolve().parents[1] / "ckpt_integration"
    by_hand = re.compile(r"\bjoin\([\w.]+\.path\b|\.(read_in|open_in)\(")
    found = [f"{p.relative_to(package)}:{i}" for p in package.rglob("*.py")
             if p.relative_to(package).as_posix() not in ("storage/filesystem.py",)
             for i, line in enumerate(p.read_text().splitlines(), 1) if by_hand.search(line)]
    assert found == []
