"""Incremental saves (``save(..., base=...)``, DistCkptIO's default): unchanged data files are hard-linked
from the earlier checkpoint instead of written, every checkpoint stays complete and exact in any layout,
deleting one never breaks another, and PyTorch DCP reads them."""

from __future__ import annotations

import logging
import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist

import ckpt_integration as ci
from ckpt_integration import ShardedObject, ShardedTensor
from ckpt_integration.storage.checksum import save_block_hash
from ckpt_integration.storage.incremental import base_files, unchanged
from ckpt_integration.tools import verify_checkpoint
from tests.dist_utils import run_distributed
from tests.layouts import global_tensor

MiB = 1 << 20
BASE, EMB, ADAPTER = (1024, 1024), (256, 256), (64, 512)  # base: 2 MiB (2 blocks) per rank's rows


def _data_files(path):
    """``{name: (inode, size)}`` of a checkpoint's data files."""
    out = {}
    for n in os.listdir(path):
        if n.endswith(".distcp"):
            st = os.stat(os.path.join(path, n))
            out[n] = (st.st_ino, st.st_size)
    return out


def _new_bytes(path, *earlier):
    """Bytes of ``path``'s data files that no earlier checkpoint holds (not hard links of theirs)."""
    seen = {ino for e in earlier for ino, _ in e.values()}
    return sum(size for ino, size in _data_files(path).values() if ino not in seen)


def _state(rank, world, step, changed_row=None):
    """A fine-tuning job's state on ``world`` ranks: a frozen base split by rows, a frozen replicated
    embedding, a trained adapter and its optimizer state (changing every step), a per-rank object."""
    rows = BASE[0] // world
    base = global_tensor("base", BASE)
    if changed_row is not None:  # one element of the frozen base changed (the last block of a shard)
        base[changed_row, -1] += 1
    frozen = torch.nn.Parameter(base[rank * rows:(rank + 1) * rows].clone(), requires_grad=False)
    emb = torch.nn.Parameter(global_tensor("emb", EMB), requires_grad=False)
    a_rows = ADAPTER[0] // world
    adapter = torch.nn.Parameter(global_tensor("adapter", ADAPTER)[rank * a_rows:(rank + 1) * a_rows] + step)
    return {
        "base.weight": ShardedTensor.from_rank_offsets("base.weight", frozen, (0, rank, world)),
        "emb.weight": ShardedTensor.from_rank_offsets("emb.weight", emb, replica_id=rank),
        "adapter.weight": ShardedTensor.from_rank_offsets("adapter.weight", adapter, (0, rank, world)),
        "opt.exp_avg": ShardedTensor.from_rank_offsets("opt.exp_avg", adapter.detach() * 0.5, (0, rank, world)),
        "rng": ShardedObject("rng", {"rank": rank, "step": step}, (world,), (rank,)),
        "global_step": step,
    }


def _columns(rank, world):
    """The tensors of :func:`_state` requested split by columns (another layout)."""
    def col(key, shape):
        cols = shape[1] // world
        return ShardedTensor.from_rank_offsets(key, torch.zeros(shape[0], cols), (1, rank, world))
    return {"base.weight": col("base.weight", BASE), "emb.weight": col("emb.weight", EMB),
            "adapter.weight": col("adapter.weight", ADAPTER), "opt.exp_avg": col("opt.exp_avg", ADAPTER)}


def _expected_columns(rank, world, step, changed_row=None):
    base = global_tensor("base", BASE)
    if changed_row is not None:
        base[changed_row, -1] += 1
    adapter = global_tensor("adapter", ADAPTER) + step
    full = {"base.weight": base, "emb.weight": global_tensor("emb", EMB), "adapter.weight": adapter,
            "opt.exp_avg": adapter * 0.5}
    return {k: v[:, rank * (v.shape[1] // world):(rank + 1) * (v.shape[1] // world)] for k, v in full.items()}


def _load_columns(rank, world, path, step, changed_row=None):
    out = ci.load(_columns(rank, world), path)
    for k, v in _expected_columns(rank, world, step, changed_row).items():
        assert torch.equal(out[k], v), (path, k)
    assert out["global_step"] == step


def _incremental_worker(rank, world, root):
    c1, c2, c3 = (os.path.join(root, n) for n in ("c1", "c2", "c3"))
    ci.save(_state(rank, world, 1), c1)  # the first save: frozen weights already in files of their own
    # async, within a staging budget smaller than one trained shard: what is linked is never staged
    req = ci.save(_state(rank, world, 2), c2, base="auto", async_sharded_save=True, staging_budget=96 * 1024)
    req.wait()
    assert req.staging.linked_files >= 1 and req.staging.waves >= 2, req.staging
    assert req.staging.bytes <= 2 * ADAPTER[0] // world * ADAPTER[1] * 4 + 4096, req.staging
    changed = BASE[0] - 1  # in rank 1's rows
    ci.save(_state(rank, world, 3, changed_row=changed), c3, base=c2)
    dist.barrier()
    trained = 2 * ADAPTER[0] * ADAPTER[1] * 4  # adapter + its optimizer state, all ranks
    frozen_shard = BASE[0] // world * BASE[1] * 4
    if rank == 0:
        f1, f2, f3 = _data_files(c1), _data_files(c2), _data_files(c3)
        # c2 wrote only what trains (plus archive headers and the small per-rank objects)
        assert _new_bytes(c2, f1) <= trained + 64 * 1024, (f1, f2)
        linked = sum(size for ino, size in f2.values() if ino in {i for i, _ in f1.values()})
        assert linked >= world * frozen_shard + EMB[0] * EMB[1] * 4
        # c3: the file of the shard with one changed element is written (with the embedding rank 1
        # stores beside it); everything else frozen is still linked
        emb = EMB[0] * EMB[1] * 4
        assert frozen_shard <= _new_bytes(c3, f2) <= frozen_shard + emb + trained + 64 * 1024, (f2, f3)
        assert os.stat(os.path.join(c3, "__0_1.distcp")).st_ino == f1["__0_1.distcp"][0]
    dist.barrier()
    for path, step, row in ((c2, 2, None), (c3, 3, changed)):
        _load_columns(rank, world, path, step, row)
    # deleting the first checkpoint breaks none of the others
    if rank == 0:
        shutil.rmtree(c1)
        for path in (c2, c3):
            report = verify_checkpoint(path)
            assert report.ok, report.problems
    dist.barrier()
    _load_columns(rank, world, c2, 2)
    # PyTorch DCP reads an incremental checkpoint with its own reader and planner
    import torch.distributed.checkpoint as dcp

    plain = {"base.weight": torch.zeros(BASE), "adapter.weight": torch.zeros(ADAPTER)}
    dcp.load(plain, storage_reader=dcp.FileSystemReader(c3))
    expected = global_tensor("base", BASE)
    expected[changed, -1] += 1
    assert torch.equal(plain["base.weight"], expected)
    assert torch.equal(plain["adapter.weight"], global_tensor("adapter", ADAPTER) + 3)


def test_incremental_saves_link_unchanged_files_and_every_checkpoint_stays_whole(tmp_path):
    """2 ranks, a frozen base and trained adapters: the second save writes only the trained bytes (the
    rest are hard links of the first's files), a shard with one changed element is written again, every
    checkpoint loads exactly in another layout, survives the deletion of the first, and DCP reads it."""
    run_distributed(_incremental_worker, 2, str(tmp_path), timeout=240)


def test_unchanged_compares_dtype_shape_and_every_block(tmp_path):
    """What decides that an item is unchanged: the digests the base recorded, block by block, plus its
    dtype and shape (equal bytes of another dtype or shape are a change)."""
    t = torch.randn(3 * MiB // 4)  # 3 blocks
    ci.save({"t": ShardedTensor.from_rank_offsets("t", t), "o": ShardedObject("o", {"x": 1}, (1,), (0,))},
            str(tmp_path / "c"))
    with ci.open_checkpoint(str(tmp_path / "c")) as opened:
        found, why = base_files(opened, 0, list(opened.metadata.state_dict_metadata))
    assert found is not None, why
    items = {it.key: it for its in found.files.values() for it in its}
    h = save_block_hash()
    assert unchanged(t, items["t"], h)
    last = t.clone()
    last[-1] += 1
    assert not unchanged(last, items["t"], h)  # the last block differs
    assert not unchanged(t.view(torch.int32), items["t"], h)  # same bytes, another dtype
    assert not unchanged(t.view(3, -1), items["t"], h)  # same bytes, another shape
    from ckpt_integration.storage.safe_pickle import torch_dumps

    obj = next(it for key, it in items.items() if key.startswith("o/"))  # (stored under its unique key)
    assert unchanged(torch_dumps([{"x": 1}]), obj, h)
    assert not unchanged(torch_dumps([{"x": 2}]), obj, h)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_an_incremental_save_of_strided_views_links_them(tmp_path, dtype):
    """Column blocks of a matrix (a tensor-parallel split by columns: views whose last stride is not 1). The
    incremental save over a save of the same views failed with a bare ``RuntimeError`` ("stride(-1) must be 1
    to view Half as Byte"): comparing them with the base viewed their strided memory as bytes. Now they are
    compared element by element, found unchanged and linked, and the checkpoint loads exactly."""
    full = torch.randn(1024, 2048, generator=torch.Generator().manual_seed(0)).to(dtype)  # 4-8 MiB
    cols = ((0, 1000), (1000, 1), (1001, 1047))  # (a column of its own: shape (n, 1), strides (2048, 1))

    def state():
        return {f"w{i}": ShardedTensor.from_global_offsets("w", full[:, a:a + n], tuple(full.shape), (0, a))
                for i, (a, n) in enumerate(cols)}

    ci.save(state(), str(tmp_path / "s1"))
    ci.save(state(), str(tmp_path / "s2"), base=str(tmp_path / "s1"))
    assert _new_bytes(str(tmp_path / "s2"), _data_files(str(tmp_path / "s1"))) == 0  # every block linked
    out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty_like(full))}, str(tmp_path / "s2"))
    assert torch.equal(out["w"], full)
    changed = full.clone()
    changed[-1, 1000] += 1  # the single column's last element: its item differs, the others do not
    full = changed
    ci.save(state(), str(tmp_path / "s3"), base=str(tmp_path / "s2"))
    out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty_like(full))}, str(tmp_path / "s3"))
    assert torch.equal(out["w"], full)


def test_a_base_replaced_while_it_is_linked_is_checked_not_trusted(tmp_path, monkeypatch, caplog):
    """A process links a base file and checks it once; later saves link it again unread (it is the same file).
    That identity was taken before the link: another writer's ``overwrite=True`` of the base between the two
    put other bytes under the path, the link took them unread, and the committed checkpoint did not load
    (found by a probe). Now the check is skipped only when the inode linked is the one the identity names."""
    frozen = torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256)

    def state(f, step):
        return {"frozen": ShardedTensor.from_rank_offsets("frozen", f),
                "adapter": ShardedTensor.from_rank_offsets("adapter", torch.full((4, 4), float(step)))}

    last = str(tmp_path / "last")
    ci.save(state(frozen, 1), last)
    ci.save(state(frozen, 2), str(tmp_path / "s2"), base=last)  # links and checks last's frozen file once
    real_link, replaced = os.link, []

    def link(src, dst, *a, **k):
        if not replaced and os.path.dirname(src) == last:
            replaced.append(src)  # another writer replaces the base right now: same layout, other bytes
            monkeypatch.setattr(os, "link", real_link)
            ci.save(state(frozen + 1, 9), last, overwrite=True)
            monkeypatch.setattr(os, "link", link)
        return real_link(src, dst, *a, **k)

    monkeypatch.setattr(os, "link", link)
    with caplog.at_level(logging.WARNING, logger="ckpt_integration"):
        ci.save(state(frozen, 3), str(tmp_path / "s3"), base=last)
    monkeypatch.setattr(os, "link", real_link)
    assert replaced and "is not intact" in caplog.text
    out = ci.load({"frozen": ShardedTensor.from_rank_offsets("frozen", torch.empty(256, 256)),
                   "adapter": ShardedTensor.from_rank_offsets("adapter", torch.empty(4, 4))}, str(tmp_path / "s3"))
    assert torch.equal(out["frozen"], frozen) and torch.equal(out["adapter"], torch.full((4, 4), 3.0))


def test_without_links_the_bytes_are_written_and_that_is_said_once(tmp_path, caplog):
    """A base on another filesystem (no hard link possible): every byte is written, a warning says so
    once, and the checkpoint is exact."""
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    base = os.path.join(shm, f"ckpt-incremental-{os.getpid()}")
    w = torch.nn.Parameter(torch.randn(256, 256), requires_grad=False)
    try:
        ci.save({"w": ShardedTensor.from_rank_offsets("w", w)}, base)
        with caplog.at_level(logging.WARNING, logger="ckpt_integration"):
            for i in range(2):
                ci.save({"w": ShardedTensor.from_rank_offsets("w", w)}, str(tmp_path / f"c{i}"), base=base)
        said = [r for r in caplog.records if "could not link or copy" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        assert all(st[0] not in {i for i, _ in _data_files(base).values()}
                   for st in _data_files(str(tmp_path / "c0")).values())
        out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(256, 256))}, str(tmp_path / "c1"))
        assert torch.equal(out["w"], w.detach())
    finally:
        shutil.rmtree(base, ignore_errors=True)


class _LoRA(torch.nn.Module):
    """A frozen base layer with a trained low-rank adapter."""

    def __init__(self, d: int, r: int):
        super().__init__()
        self.base = torch.nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(r, d) * 0.01)
        self.b = torch.nn.Parameter(torch.zeros(d, r))

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def _lora_module():
    import lightning as L

    class LoRAModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(*[_LoRA(256, 4) for _ in range(4)])
            self.embed = torch.nn.Embedding(512, 256)
            self.embed.requires_grad_(False)
            self.saved = {}

        def training_step(self, batch, _):
            x = self.embed(batch[0] % 512).float()
            loss = self.body(x).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

        def on_save_checkpoint(self, checkpoint):
            self.saved[self.global_step] = {k: v.detach().clone() for k, v in self.state_dict().items()}

    return LoRAModule()


def test_lora_fine_tuning_under_lightning_writes_the_frozen_base_once(tmp_path):
    """``Trainer(plugins=[DistCkptIO()])`` with ``ModelCheckpoint(save_top_k=2)`` for 4 epochs: after the
    first checkpoint each writes at most the adapters, their optimizer state and small metadata (the
    frozen base is hard-linked), the top-k deletions break none of the kept ones, and each loads exactly."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from ckpt_integration.lightning import DistCkptIO

    seen: dict = {}

    class Count(Callback):  # each new checkpoint's bytes not shared with an earlier one, counted from the files
        def _count(self, trainer):
            for name in sorted(os.listdir(tmp_path / "ckpts")) if (tmp_path / "ckpts").exists() else ():
                path = str(tmp_path / "ckpts" / name)
                if name not in seen and os.path.exists(os.path.join(path, "metadata.json")):
                    seen[name] = (_new_bytes(path, *[f for _, f in seen.values()]), _data_files(path))

        def on_train_epoch_start(self, trainer, pl_module):
            self._count(trainer)

        def on_fit_end(self, trainer, pl_module):
            self._count(trainer)

    L.seed_everything(0, verbose=False)
    m = _lora_module()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(64)), batch_size=8)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=2, monitor="step", mode="max",
                           every_n_epochs=1, filename="{epoch}-{step}")
    t = L.Trainer(max_epochs=4, accelerator="cpu", devices=1, plugins=[DistCkptIO()], callbacks=[ckpt, Count()],
                  logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    t.fit(m, data)
    assert len(seen) == 4, seen
    frozen = sum(p.numel() * 4 for p in m.parameters() if not p.requires_grad)
    trained = sum(p.numel() * 4 for p in m.parameters() if p.requires_grad)
    first, *later = [seen[n][0] for n in sorted(seen, key=lambda n: int(n.split("step=")[1].split(".")[0]))]
    assert first >= frozen
    for written in later:  # adapters + AdamW's exp_avg and exp_avg_sq + ~2 KiB of archive framing per item
        assert written <= 3 * trained + 128 * 1024 < frozen / 4, (written, trained, frozen)
    kept = sorted(os.listdir(tmp_path / "ckpts"))
    assert len(kept) == 2, kept  # top-k deleted the first two checkpoints
    for name in kept:
        path = str(tmp_path / "ckpts" / name)
        assert verify_checkpoint(path).ok
        step = int(name.split("step=")[1].split(".")[0])
        loaded = ci.load_plain_tensors(path)
        for k, v in m.saved[step].items():
            assert torch.equal(loaded[k], v), (name, k)


@pytest.mark.parametrize("where", ["header", "data", "trailer"])
def test_a_base_file_damaged_on_disk_is_never_linked(tmp_path, caplog, where):
    """A base data file whose bytes changed on disk since its save (a bad sector, a tool writing in
    place) was linked into the new checkpoint: the new save's rows are computed from memory and equal
    the base's, so the new checkpoint failed its own digests, and every later incremental save (``base=
    "auto"`` with top-k deletion) linked it again: no kept checkpoint loaded. The linked file is now
    read and checked first; a damaged one is written from memory, and that is said."""
    first, second = str(tmp_path / "s1"), str(tmp_path / "s2")
    ci.save(_state(0, 1, 1), first)
    frozen = max(_data_files(first), key=lambda n: _data_files(first)[n][1])  # the frozen base's file
    path = os.path.join(first, frozen)
    at = {"header": 100, "data": 5000, "trailer": os.path.getsize(path) - 30}[where]
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x04]))
    with caplog.at_level(logging.WARNING, logger="ckpt_integration"):
        ci.save(_state(0, 1, 2), second, base=first)
    assert f"{frozen} is not intact" in caplog.text and "writing its items from memory" in caplog.text
    assert _data_files(second)[frozen][0] != _data_files(first)[frozen][0]  # written, not linked
    out = ci.load(_state(0, 1, 0), second)
    want = _state(0, 1, 2)
    for k in ("base.weight", "emb.weight", "adapter.weight", "opt.exp_avg"):
        assert torch.equal(out[k], want[k].data), k
    assert verify_checkpoint(second).ok


def test_a_base_file_checked_once_is_checked_again_after_it_changed(tmp_path, caplog):
    """Each save of a job links the same base files: one found intact is not read again by the process
    (the benchmark's later incremental saves pay nothing), until its identity changes (written in place)."""
    s1, s2, s3 = (str(tmp_path / n) for n in ("s1", "s2", "s3"))
    ci.save(_state(0, 1, 1), s1)
    ci.save(_state(0, 1, 2), s2, base=s1)  # reads s1's frozen file, intact: remembered
    frozen = max(_data_files(s2), key=lambda n: _data_files(s2)[n][1])
    assert _data_files(s2)[frozen][0] == _data_files(s1)[frozen][0]  # linked
    time.sleep(0.01)
    with open(os.path.join(s2, frozen), "r+b") as f:  # (the same inode as s1's)
        f.seek(5000)
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 0x04]))
    with caplog.at_level(logging.WARNING, logger="ckpt_integration"):
        ci.save(_state(0, 1, 3), s3, base=s2)
    assert f"{frozen} is not intact" in caplog.text
    out = ci.load(_state(0, 1, 0), s3)
    assert torch.equal(out["base.weight"], _state(0, 1, 3)["base.weight"].data)

    # remembered across the job's next saves (each link changes the file's change time: not read again) ...
    from ckpt_integration.storage import incremental

    checks = []
    real = incremental._damage
    incremental._damage = lambda *a: (checks.append(a[1]), real(*a))[1]
    try:
        for i, n in enumerate(("s4", "s5")):
            ci.save(_state(0, 1, 4 + i), str(tmp_path / n), base=str(tmp_path / ("s3" if i == 0 else "s4")))
        assert len([c for c in checks if c.endswith(frozen)]) == 1, checks  # (s4 read it; s5 did not)
        # ... until damage that puts the modification time back (as bit rot leaves it): the change time moves
        s5 = str(tmp_path / "s5")
        st = os.stat(os.path.join(s5, frozen))
        with open(os.path.join(s5, frozen), "r+b") as f:
            f.seek(5000)
            b = f.read(1)
            f.seek(5000)
            f.write(bytes([b[0] ^ 0x04]))
        os.utime(os.path.join(s5, frozen), ns=(st.st_atime_ns, st.st_mtime_ns))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ckpt_integration"):
            ci.save(_state(0, 1, 6), str(tmp_path / "s6"), base=s5)
        assert f"{frozen} is not intact" in caplog.text  # (it was linked, unread, into s6)
        out = ci.load(_state(0, 1, 0), str(tmp_path / "s6"))
        assert torch.equal(out["base.weight"], _state(0, 1, 6)["base.weight"].data)
    finally:
        incremental._damage = real


def test_a_file_checked_for_some_items_is_checked_again_for_the_others(tmp_path, caplog):
    """The "found intact" cache held files, not items: once ``remove_sharded_tensors`` left a base recording
    fewer items of a shared data file, a save against it checked those only, and a later save against a
    checkpoint recording all of them linked the file unread, its damaged bytes into the new checkpoint."""
    from ckpt_integration.storage import incremental

    torch.manual_seed(0)  # (frozen parameters: one data file of their own, linked by later saves)
    a, b = (torch.nn.Parameter(torch.randn(256, 256), requires_grad=False) for _ in range(2))
    w = torch.randn(16, 16)

    def state(keys, step):
        d = {k: ShardedTensor.from_rank_offsets(k, t) for k, t in (("A", a), ("B", b)) if k in keys}
        d["w"] = ShardedTensor.from_rank_offsets("w", w + step)
        return d

    s0, s1, s2, s3 = (str(tmp_path / n) for n in ("s0", "s1", "s2", "s3"))
    incremental._INTACT.clear()
    ci.save(state("AB", 0), s0, thread_count=1)
    frozen = max(_data_files(s0), key=lambda n: _data_files(s0)[n][1])  # A and B, one file
    ci.save(state("AB", 1), s1, thread_count=1, base=s0)
    assert _data_files(s1)[frozen][0] == _data_files(s0)[frozen][0]
    with open(os.path.join(s0, frozen), "r+b") as f:  # B's bytes damaged in place (s0's and s1's inode)
        f.seek(os.path.getsize(os.path.join(s0, frozen)) - 1000)
        f.write(b"\xff" * 8)
    ci.remove_sharded_tensors(s0, "B")
    ci.save(state("A", 2), s2, thread_count=1, base=s0)  # checks A only: intact
    with caplog.at_level(logging.WARNING, logger="ckpt_integration"):
        ci.save(state("AB", 3), s3, thread_count=1, base=s1)
    assert f"{frozen} is not intact" in caplog.text
    req = {k: ShardedTensor.from_rank_offsets(k, torch.empty(256, 256)) for k in "AB"}
    out = ci.load(req, s3)
    assert torch.equal(out["A"], a) and torch.equal(out["B"], b)


def test_a_base_data_file_that_is_a_symbolic_link_is_written_not_linked(tmp_path, caplog):
    """``os.link`` of a symbolic link links the link: a base whose data file was a symbolic link (into
    itself, as deduplicating tools leave them) gave the new checkpoint a link into the base, committed
    without a word, which loads then refused (or which broke when the base was deleted)."""
    torch.manual_seed(0)
    frozen = torch.nn.Parameter(torch.randn(512, 512), requires_grad=False)

    def state(step):
        return {"frozen": ShardedTensor.from_rank_offsets("frozen", frozen),
                "w": ShardedTensor.from_rank_offsets("w", torch.full((64, 64), float(step)))}

    s0, s1 = str(tmp_path / "s0"), str(tmp_path / "s1")
    ci.save(state(0), s0)
    name = max(_data_files(s0), key=lambda n: _data_files(s0)[n][1])
    os.rename(os.path.join(s0, name), os.path.join(s0, "frozen.bin"))
    os.symlink(os.path.join(s0, "frozen.bin"), os.path.join(s0, name))
    with caplog.at_level(logging.WARNING, logger="ckpt_integration"):
        ci.save(state(1), s1, base=s0)
    assert "symbolic link" in caplog.text
    assert not os.path.islink(os.path.join(s1, name))
    shutil.rmtree(s0)
    req = {"frozen": ShardedTensor.from_rank_offsets("frozen", torch.empty(512, 512)),
           "w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 64))}
    out = ci.load(req, s1)
    assert torch.equal(out["frozen"], frozen) and torch.equal(out["w"], torch.full((64, 64), 1.0))


def test_a_base_file_that_kept_the_bytes_of_removed_items_is_written_anew(tmp_path):
    """``remove_sharded_tensors`` keeps a data file whose last items it removed, bytes and all. A save that
    linked it recorded the file's size as the end of its last kept item: ``verify`` then called the new
    checkpoint damaged, and the next incremental save took the file for damaged and wrote it again."""
    torch.manual_seed(0)
    w, m = torch.randn(512, 512), torch.randn(512, 512)
    pre = str(tmp_path / "pretrained")
    ci.save({"model.w": ShardedTensor.from_rank_offsets("model.w", w),
             "optimizer.m": ShardedTensor.from_rank_offsets("optimizer.m", m)}, pre, thread_count=1)
    ci.remove_sharded_tensors(pre, "optimizer.")  # (its bytes stay: they end the file)
    frozen = torch.nn.Parameter(w.clone(), requires_grad=False)
    state = {"model.w": ShardedTensor.from_rank_offsets("model.w", frozen),
             "adapter": ShardedTensor.from_rank_offsets("adapter", torch.zeros(8, 512))}
    s1 = str(tmp_path / "s1")
    ci.save(state, s1, base=pre)
    assert verify_checkpoint(s1).ok
    out = ci.load({"model.w": ShardedTensor.from_rank_offsets("model.w", torch.empty(512, 512))}, s1)
    assert torch.equal(out["model.w"], w)
    ci.save(state, str(tmp_path / "s2"), base=s1)  # now linked whole
    assert _new_bytes(str(tmp_path / "s2"), _data_files(s1)) < 64 * 1024


def test_separation_hint_splits_a_base_file_that_mixed_its_keys(tmp_path):
    """A base saved without ``separation_hint`` holds model and optimizer items in one file; a save with the
    hint linked it whole, so ``remove_sharded_tensors(path, hint)`` of the new checkpoint freed nothing."""
    from ckpt_integration.strategies import TorchDistSaveShardedStrategy

    torch.manual_seed(0)
    w, m = torch.randn(512, 512), torch.randn(512, 512)

    def state():
        return {"model.w": ShardedTensor.from_rank_offsets("model.w", w),
                "optimizer.m": ShardedTensor.from_rank_offsets("optimizer.m", m)}

    base, new = str(tmp_path / "base"), str(tmp_path / "new")
    ci.save(state(), base, thread_count=1)
    ci.save(state(), new, TorchDistSaveShardedStrategy("torch_dist", 1, separation_hint="optimizer."), thread_count=1,
            base=base)
    before = sum(size for _, size in _data_files(new).values())
    ci.remove_sharded_tensors(new, "optimizer.")
    assert before - sum(size for _, size in _data_files(new).values()) >= m.numel() * 4
    out = ci.load({"model.w": ShardedTensor.from_rank_offsets("model.w", torch.empty(512, 512))}, new)
    assert torch.equal(out["model.w"], w)
