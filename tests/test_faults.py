"""Fault injection: real checkpoints, damaged in every way the fault campaign found.

Each test damages checkpoints written by ``save`` (flips, truncations, swaps between
checkpoints of the same layout, absolute/``..`` paths, links, FIFOs, hostile JSON and
shapes, key collisions, concurrent saves, a full disk) and asserts a clear library error
(a ``CheckpointingException`` subclass naming the file/key), nothing wrong returned, and
earlier checkpoints intact. Data tensors are a few hundred KiB with the checksum block size
lowered to 16 KiB, so ranged reads cross many blocks quickly.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import time
import zlib

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import (
    CheckpointingException,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ShardedObject,
    ShardedTensor,
)
from ckpt_integration.errors import (
    CheckpointWriteError,
    SaveConflictError,
    ShardingIntegrityError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from ckpt_integration.storage import checkpoint_dir as ckdir
from ckpt_integration.storage import torch_dist as td
from tests.damage import reindex, deadline, flip_byte, write_manifest, write_zarr_index
from tests.dist_utils import run_distributed
from ckpt_integration.storage.filesystem import locate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, COLS = 256, 192  # 192 KiB of float32: 12 checksum blocks of 16 KiB


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(td, "BLOCK_SIZE", 16 << 10)


def _full(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def _save(d, seed: int = 0, **kw) -> torch.Tensor:
    w = _full(seed)
    ci.save({"w": ShardedTensor.from_rank_offsets("w", w.clone()), "o": ShardedObject("o", {"seed": seed}, (1,), (0,)),
             "step": seed}, str(d), thread_count=1, **kw)
    return w


def _load_box(d, rows: slice, cols: slice, **kw) -> torch.Tensor:
    """Load a part of ``w`` (a resharded request: rows and/or columns of the saved chunk)."""
    r0, r1 = rows.start or 0, rows.stop or ROWS
    c0, c1 = cols.start or 0, cols.stop or COLS
    out = torch.full((r1 - r0, c1 - c0), float("nan"))
    ci.load({"w": ShardedTensor.from_global_offsets("w", out, (ROWS, COLS), (r0, c0))}, str(d),
            validate_access_integrity=False, **kw)
    return out


REQUESTS = {  # every kind of partial request: columns (strided), row ranges (direct), a small box
    "columns": (slice(None), slice(64, 128)),
    "rows": (slice(100, 200), slice(None)),
    "box": (slice(120, 140), slice(10, 20)),
}


def _data_file(d) -> str:
    return os.path.join(str(d), "__0_0.distcp")


def _w_item(d):
    with open(os.path.join(str(d), ".metadata"), "rb") as f:
        md = pickle.load(f)  # our own, freshly written checkpoint
    return next(v for k, v in md.storage_data.items() if k.fqn == "w")


# =========================================================================== silent wrong data
@pytest.mark.parametrize("block_hash", ["xxh3_64", "crc32"])
def test_damaged_data_is_never_returned_by_partial_reads(tmp_path, monkeypatch, block_hash):
    """Flips (archive header, first/middle/last data rows, archive trailer), truncation and a swap
    with the same file of another checkpoint of the same layout: a partial request either raises
    CorruptCheckpointError naming the file or returns exactly the saved values (it read no
    damaged byte); requests that read the damaged block always raise. Both block digests: XXH3-64
    (new saves) and CRC32 (written through the writer's switch)."""
    from ckpt_integration.storage import checksum

    monkeypatch.setattr(checksum, "SAVE_BLOCK_HASH", block_hash)
    good = tmp_path / "good"
    want = _save(good, seed=1)
    man = json.loads((good / "manifest.json").read_text())
    assert (man["version"], man.get("block_hash")) == (ckdir.MANIFEST_VERSION, block_hash)
    other = tmp_path / "other"
    _save(other, seed=2)  # same layout, other values
    item = _w_item(good)
    row = lambda r, c=0: item.offset + 1024 + (r * COLS + c) * 4  # noqa: E731 - a data byte (header < 1 KiB)
    damages = {  # damage -> the requests that must raise
        "flip_header": (lambda d: flip_byte(_data_file(d), item.offset + 100), set(REQUESTS)),
        "flip_first_rows": (lambda d: flip_byte(_data_file(d), row(2)), {"columns"}),
        "flip_middle": (lambda d: flip_byte(_data_file(d), row(130, 15)), set(REQUESTS)),
        "flip_last_rows": (lambda d: flip_byte(_data_file(d), row(ROWS - 2, 100)), {"columns"}),
        "flip_trailer": (lambda d: flip_byte(_data_file(d), item.offset + item.length - 100), set(REQUESTS)),
        "truncate": (lambda d: os.truncate(_data_file(d), item.offset + item.length - 5000), set(REQUESTS)),
        "swap": (lambda d: shutil.copy(_data_file(other), _data_file(d)), set(REQUESTS)),
    }
    for name, (damage, must_raise) in damages.items():
        d = tmp_path / name
        shutil.copytree(good, d)
        damage(d)
        for req, (rows, cols) in REQUESTS.items():
            try:
                got = _load_box(d, rows, cols)
            except CorruptCheckpointError as e:
                assert "__0_0.distcp" in str(e), (name, req, str(e))
                continue
            assert req not in must_raise, f"{name}: request {req!r} read damaged bytes without an error"
            assert torch.equal(got, want[rows, cols]), f"{name}: request {req!r} returned wrong values"
        with pytest.raises(CorruptCheckpointError):
            ci.load_plain_tensors(str(d))
    assert torch.equal(_load_box(good, slice(None), slice(64, 128)), want[:, 64:128])  # the original is intact


def test_every_partial_read_is_checked_on_memory_urls():
    import fsspec

    url = f"memory://faults-{os.getpid()}-{time.time_ns()}/ckpt"
    want = _save(url, seed=3)
    assert torch.equal(_load_box(url, slice(None), slice(64, 128)), want[:, 64:128])
    fs = fsspec.filesystem("memory")
    path = url + "/__0_0.distcp"
    raw = bytearray(fs.cat_file(path))
    raw[_w_item_remote(url).offset + 1024 + (130 * COLS + 15) * 4] ^= 0x10  # inside every request
    fs.pipe_file(path, bytes(raw))
    for rows, cols in REQUESTS.values():
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            _load_box(url, rows, cols)


def _w_item_remote(url):
    from ckpt_integration.storage.torch_dist import read_dcp_metadata

    md = read_dcp_metadata(locate(url))
    return next(v for k, v in md.storage_data.items() if k.fqn == "w")


def test_checkpoint_in_the_old_format_is_checked_whole(tmp_path, monkeypatch):
    """Manifest format 1 (whole-item CRC32s only, as written before block checksums): loads refuse it
    naming ``ckpt-integration convert``; ``convert``'s reader reads and checks the whole item for a
    partial read, returns what an undamaged one holds and refuses a flip far from the request."""
    from ckpt_integration.errors import UnsupportedCheckpointError
    from ckpt_integration.planning.boxes import Box
    from ckpt_integration.storage import checksum
    from ckpt_integration.tools.sources import open_source

    monkeypatch.setattr(checksum, "SAVE_BLOCK_HASH", "crc32")  # then made format 1
    d = tmp_path / "old"
    want = _save(d, seed=4)
    man = json.loads((d / "manifest.json").read_text())
    items = {f"{f}@{o}": v for (f, o), v in ckdir.read_manifest(locate(d)).checksums().items()}
    man = {k: man[k] for k in ("format", "created", "world_size", "files", "library_version")}
    man.update(version=1, items=items)
    write_manifest(d / "manifest.json", man)
    with pytest.raises(UnsupportedCheckpointError, match="manifest format 1.*ckpt-integration convert"):
        _load_box(d, slice(None), slice(0, 10))

    def read(rows, cols):
        r0, r1, _ = rows.indices(ROWS)
        c0, c1, _ = cols.indices(COLS)
        with open_source(str(d)) as src:
            return src.read_block("w", Box((r0, c0), (r1 - r0, c1 - c0)))

    for rows, cols in REQUESTS.values():
        assert torch.equal(read(rows, cols), want[rows, cols])
    flip_byte(_data_file(d), _w_item(d).offset + 1024 + 3 * COLS * 4)  # far from every request
    for rows, cols in REQUESTS.values():
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            read(rows, cols)


def test_deleted_manifest_is_damage_not_a_foreign_checkpoint(tmp_path):
    d = tmp_path / "c"
    _save(d)
    os.remove(d / "manifest.json")
    with pytest.raises(CorruptCheckpointError, match="manifest.json is missing"):
        _load_box(d, slice(None), slice(0, 10))


def test_plain_dcp_checkpoint_loads_as_foreign(tmp_path, caplog):
    """A complete checkpoint of torch.distributed.checkpoint.save (no metadata.json): its tensors
    load, with a note that nothing is checked; a DCP save that never finished is incomplete."""
    import torch.distributed.checkpoint as dcp

    want = _full(5)
    d = tmp_path / "dcp"
    with pytest.warns(UserWarning):
        dcp.save({"w": want.clone()}, checkpoint_id=str(d))
    with caplog.at_level("WARNING"):
        out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS))}, str(d))
    assert torch.equal(out["w"], want)
    assert any("no checksums" in r.getMessage() for r in caplog.records)
    assert torch.equal(ci.load_plain_tensors(str(d))["w"], want)
    # a damaged storage offset in a tensor's data.pkl: the tensor would reach past its storage, into the
    # archive's other records; it was read from there (shifted values), where dcp.load raises. The zip
    # record's CRC32 now catches it first; the range check stands for archives written without CRC32s
    small = tmp_path / "small"
    with pytest.warns(UserWarning):
        dcp.save({"v": torch.arange(20.0).reshape(4, 5)}, checkpoint_id=str(small))
    data = (small / "__0_0.distcp").read_bytes()
    at = data.index(b"QK\x00K\x04K\x05\x86") + 2  # (persistent id, storage offset 0, shape (4, 5))
    (small / "__0_0.distcp").write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:])
    for load in (lambda: ci.load_plain_tensors(str(small)),
                 lambda: ci.load({"v": ShardedTensor.from_rank_offsets("v", torch.zeros(4, 5))}, str(small))):
        with pytest.raises(CorruptCheckpointError, match=r"data.pkl is truncated or fails its CRC32 check"):
            load()
    # a record loads refuse (a garbled rebuild function): verify said OK ("an unusual layout"); its
    # data.pkl's CRC32 now names it first
    (small / "__0_0.distcp").write_bytes(data.replace(b"_rebuild_tensor_v2", b"_rebuild_tensorOv2"))
    with pytest.raises(CorruptCheckpointError, match="data.pkl is truncated or fails its CRC32 check"):
        ci.load_plain_tensors(str(small))
    from ckpt_integration.tools.verify import verify_checkpoint

    report = verify_checkpoint(str(small))
    assert not report.ok and "fails its CRC32 check" in report.format(), report.format()
    (small / "__0_0.distcp").write_bytes(data)
    assert verify_checkpoint(str(small)).ok
    # a field name of .metadata damaged (valid pickle, no checksum): was a raw AttributeError
    md = (small / ".metadata").read_bytes()
    assert md.count(b"properties") == 1
    (small / ".metadata").write_bytes(md.replace(b"properties", b"propertyes"))
    for load in (lambda: ci.load_plain_tensors(str(small)), lambda: ci.load_tensors_metadata(str(small))):
        with pytest.raises(CorruptCheckpointError, match=r"\.metadata is damaged: .*'properties'"):
            load()
    os.remove(d / ".metadata")  # DCP writes .metadata last: without it the save did not finish
    with pytest.raises(IncompleteCheckpointError, match="incomplete"):
        ci.load_plain_tensors(str(d))
    # our own interrupted saves stay interrupted (the marker tells them apart)
    ours = tmp_path / "ours"
    _save(ours)
    os.remove(ours / "metadata.json")
    with pytest.raises(IncompleteCheckpointError):
        ci.load_plain_tensors(str(ours))


# =========================================================================== containment
def _rewrite_metadata(d, edit) -> None:
    """Edit ``.metadata`` and record the new bytes in the manifest: a consistently crafted checkpoint."""
    path = os.path.join(str(d), ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    edit(md)
    data = pickle.dumps(md)
    with open(path, "wb") as f:
        f.write(data)
    man_path = os.path.join(str(d), "manifest.json")
    man = json.loads(open(man_path).read())
    man["files"][".metadata"] = {"size": len(data), "crc32": zlib.crc32(data)}
    open(man_path, "w").write(json.dumps(man))
    reindex(d)  # (format 6: loads read index.bin, made to say what the edited .metadata says)


@pytest.mark.parametrize("name", ["ABSOLUTE", "../outside.distcp", "sub/__0_0.distcp"])
def test_data_file_names_outside_the_checkpoint_are_refused(tmp_path, name):
    outside = tmp_path / "outside.distcp"
    d = tmp_path / "sub" / "c"
    d.mkdir(parents=True)
    shutil.rmtree(d)
    _save(d)
    shutil.copy(_data_file(d), outside)  # a readable copy outside: it must not be read
    target = str(outside) if name == "ABSOLUTE" else name

    def edit(md):
        for k, v in list(md.storage_data.items()):
            md.storage_data[k] = type(v)(target, v.offset, v.length)

    _rewrite_metadata(d, edit)
    for call in (lambda: _load_box(d, slice(None), slice(0, 10)), lambda: ci.load_plain_tensors(str(d)),
                 lambda: ci.load({"o": ShardedObject("o", None, (1,), (0,))}, str(d))):
        with pytest.raises(UnsafeCheckpointError, match="only name files inside"):
            call()


def test_links_leading_outside_are_refused_unless_allowed(tmp_path, monkeypatch):
    d = tmp_path / "c"
    want = _save(d, seed=6)
    store = tmp_path / "dedup"
    store.mkdir()
    for name in ("__0_0.distcp", "common.pt", ".metadata"):
        shutil.move(str(d / name), str(store / name))
        os.symlink(store / name, d / name)
        with pytest.raises(UnsafeCheckpointError, match="symbolic link leading outside"):
            ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS))}, str(d))
    monkeypatch.setenv("CKPT_INTEGRATION_ALLOW_SYMLINKS", "1")  # documented opt-in (deduplicated storage)
    out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS))}, str(d))
    assert torch.equal(out["w"], want) and out["step"] == 6
    monkeypatch.delenv("CKPT_INTEGRATION_ALLOW_SYMLINKS")
    # a link inside the checkpoint to a file inside it is fine; a link to the checkpoint too
    inner = tmp_path / "c2"
    _save(inner, seed=7)
    os.rename(inner / "common.pt", inner / "common.real")
    os.symlink("common.real", inner / "common.pt")
    os.symlink(inner, tmp_path / "latest")
    assert ci.load_common_state_dict(str(tmp_path / "latest"))["step"] == 7


@pytest.mark.parametrize("name", ["common.pt", ".metadata", "index.bin", "__0_0.distcp", "manifest.json",
                                  "metadata.json"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_special_files_give_an_error_not_a_hang(tmp_path, name, kind):
    d = tmp_path / "c"
    w = _save(d)
    os.remove(d / name)
    os.mkfifo(d / name) if kind == "fifo" else os.mkdir(d / name)
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS))}
    if name == ".metadata":  # never read by a load (it plans from index.bin): DCP's and Megatron-Core's
        with deadline(20):
            assert torch.equal(ci.load(request, str(d))["w"], w)
        return
    with deadline(20), pytest.raises(CheckpointingException, match="not a regular file|is a directory"):
        ci.load(request, str(d))


def test_zarr_chunk_files_are_contained(tmp_path):
    d = tmp_path / "z"
    w = _full(8)
    ci.save({"w": ShardedTensor.from_rank_offsets("w", w.clone())}, str(d), sharded_strategy="zarr")
    chunk = next(os.path.join(r, f) for r, _, fs in os.walk(d / "w" / "c") for f in fs)
    outside = tmp_path / "elsewhere"
    shutil.move(chunk, outside)
    os.symlink(outside, chunk)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link leading outside"):
        ci.load_plain_tensors(str(d))
    os.remove(chunk)
    os.mkfifo(chunk)
    with deadline(20), pytest.raises(CorruptCheckpointError, match="not a regular file"):
        ci.load_plain_tensors(str(d))


# =========================================================================== hostile metadata
@pytest.mark.parametrize("name", ["metadata.json", "manifest.json"])
def test_deeply_nested_json_is_corruption(tmp_path, name):
    d = tmp_path / "c"
    _save(d)
    (d / name).write_text("[" * 200000 + "]" * 200000)
    with pytest.raises(CorruptCheckpointError, match="nested too deeply"):
        ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS))}, str(d))


def test_deeply_nested_save_marker_is_not_ours(tmp_path):
    """The marker is parsed only by saves: a hostile one makes the directory foreign (refused)."""
    d = tmp_path / "c"
    d.mkdir()
    (d / "ckpt_integration.json").write_text("[" * 200000 + "]" * 200000)
    (d / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(SaveConflictError, match="did not write"):
        _save(d)
    assert sorted(os.listdir(d)) == ["__0_0.distcp", "ckpt_integration.json"]


def test_deeply_nested_zarr_index_is_corruption(tmp_path):
    d = tmp_path / "z"
    ci.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, str(d), sharded_strategy="zarr")
    write_zarr_index(d, '{"tensors": ' + "[" * 200000 + "]" * 200000 + "}")  # (recorded: the parse itself must refuse it)
    with pytest.raises(CorruptCheckpointError):
        ci.load_plain_tensors(str(d))


def _forge_dtype(md):
    md.state_dict_metadata["w"].properties.dtype = torch.int32  # same width as float32: sizes all agree


def _forge_shape(md):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    meta = md.state_dict_metadata["w"]
    meta.size = torch.Size([COLS, ROWS])  # the same elements, transposed
    meta.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([COLS, ROWS]))]
    md.storage_data = {type(k)(k.fqn, torch.Size([0, 0]) if k.offset is not None else None): v
                       for k, v in md.storage_data.items()}


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("forge", ["dtype", "shape"])
def test_forged_dtype_or_shape_is_refused_on_load(tmp_path, forge, verify):
    """A .metadata forged to another dtype of the same width (or the same elements in another
    shape), with the manifest updated to match, is refused by load - which compares it with the
    dtype and shape that each data archive's own data.pkl records - not reinterpreted; also
    with checksums off."""
    d = tmp_path / "c"
    _save(d)
    _rewrite_metadata(d, _forge_dtype if forge == "dtype" else _forge_shape)
    rows, cols = (ROWS, COLS) if forge == "dtype" else (COLS, ROWS)
    dtype = torch.int32 if forge == "dtype" else torch.float32
    said = "torch.float32 (the archive's data.pkl) but" if forge == "dtype" else f"shape {(ROWS, COLS)}"
    loads = [lambda: ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(rows, cols, dtype=dtype))}, str(d),
                             verify_checksums=verify),
             lambda: ci.load({"w": ShardedTensor.from_global_offsets("w", torch.zeros(rows // 2, cols, dtype=dtype),
                                                                     (rows, cols), (rows // 2, 0))}, str(d),
                             verify_checksums=verify, validate_access_integrity=False)]
    if verify:
        loads.append(lambda: ci.load_plain_tensors(str(d)))
    for load in loads:
        with pytest.raises(CorruptCheckpointError, match=rf"__0_0\.distcp: chunk .* of 'w' is stored .*{re.escape(said)}"):
            load()


def test_declared_shape_larger_than_the_chunks_is_refused_before_allocating(tmp_path):
    d = tmp_path / "c"
    _save(d)

    def edit(md):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        meta = md.state_dict_metadata["w"]
        meta.size = torch.Size([10**6, 10**6])  # 10^12 elements: 4 TB
        meta.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([10**6, 10**6]))]

    _rewrite_metadata(d, edit)
    with pytest.raises(CorruptCheckpointError, match="elements"):
        ci.load_plain_tensors(str(d))
    # zarr: the declared shape must match the recorded chunk files
    z = tmp_path / "z"
    ci.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(64))}, str(z), sharded_strategy="zarr")
    index = json.loads((z / "zarr_index.json").read_text())
    index["tensors"]["w"]["shape"] = [10**12]
    write_zarr_index(z, index)
    with pytest.raises(CorruptCheckpointError, match="chunk files"):
        ci.load_plain_tensors(str(z))


# =========================================================================== save-time refusals
def test_tensor_key_equal_to_an_object_storage_key_is_refused(tmp_path):
    d = tmp_path / "c"
    sd = {"t": ShardedTensor.from_rank_offsets("x/shard_0_1", torch.ones(3)), "o": ShardedObject("x", {"a": 1}, (1,), (0,))}
    with pytest.raises(ShardingIntegrityError, match="x/shard_0_1"):
        ci.save(sd, str(d))
    assert not d.exists() or os.listdir(d) == []


def test_meta_device_tensor_is_refused_before_anything_is_written(tmp_path):
    d = tmp_path / "c"
    with pytest.raises(CheckpointingException, match="'meta_w'.*meta device"):
        ci.save({"w": ShardedTensor.from_rank_offsets("meta_w", torch.empty(4, 4, device="meta"))}, str(d))
    assert not d.exists()


def test_files_the_library_did_not_write_are_never_adopted(tmp_path):
    # a first save into a directory with foreign files
    d = tmp_path / "new"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    with pytest.raises(SaveConflictError, match="notes.txt"):
        _save(d)
    assert os.listdir(d) == ["notes.txt"]
    # overwrite=True of a checkpoint that holds foreign files: refused, nothing deleted
    c = tmp_path / "c"
    want = _save(c, seed=9)
    (c / "notes.txt").write_text("mine")
    (c / "nested").mkdir()
    with pytest.raises(SaveConflictError, match="notes.txt.*nested|nested.*notes.txt"):
        _save(c, seed=10, overwrite=True)
    assert (c / "notes.txt").read_text() == "mine" and (c / "nested").is_dir()
    assert torch.equal(ci.load_plain_tensors(str(c))["w"], want)
    # a plain DCP checkpoint (no marker, our file names) is not adopted either
    import torch.distributed.checkpoint as dcp

    p = tmp_path / "dcp"
    with pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(p))
    with pytest.raises(SaveConflictError, match="did not write"):
        _save(p)
    assert torch.equal(ci.load_plain_tensors(str(p))["w"], torch.ones(3))


HOLDER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {root!r})
    import torch
    import ckpt_integration as ci
    from ckpt_integration.execution import save as save_mod
    path, ready, go = sys.argv[1:4]
    real = save_mod.write_data_files
    def paused(*a, **k):
        open(ready, "w").close()
        while not os.path.exists(go):
            time.sleep(0.05)
        return real(*a, **k)
    save_mod.write_data_files = paused
    ci.save({{"w": ci.ShardedTensor.from_rank_offsets("w", torch.full((8, 8), 1.0))}}, path)
    print("committed")
    """
)


def test_two_jobs_saving_into_one_directory(tmp_path):
    """Job A is writing into a new directory; job B saving there at the same time fails and
    touches nothing; A commits its own checkpoint. On object stores (no locks) the second
    claim of a new prefix fails too."""
    d, ready, go = tmp_path / "c", tmp_path / "ready", tmp_path / "go"
    script = tmp_path / "holder.py"
    script.write_text(HOLDER.format(root=ROOT))
    proc = subprocess.Popen([sys.executable, str(script), str(d), str(ready), str(go)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not ready.exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.05)
        for overwrite in (False, True):
            with pytest.raises(SaveConflictError, match="another save"):
                ci.save({"w": ShardedTensor.from_rank_offsets("w", torch.full((8, 8), 2.0))}, str(d), overwrite=overwrite)
        go.touch()
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "committed" in out, err
    finally:
        if proc.poll() is None:
            proc.kill()
    assert torch.equal(ci.load_plain_tensors(str(d))["w"], torch.full((8, 8), 1.0))
    # memory://: the marker is created with a conditional write, so of two saves that both saw
    # the new prefix empty, the second to claim it fails
    from ckpt_integration.storage import claim

    url = f"memory://faults-{os.getpid()}-{time.time_ns()}/c"
    first = claim.claim_new(locate(url), "job-a")
    real = claim.classify_entries
    claim.classify_entries = lambda directory: ([], [])  # job B listed the prefix before A's marker appeared
    try:
        with pytest.raises(SaveConflictError, match="at the same time"):
            claim.claim_new(locate(url), "job-b")
    finally:
        claim.classify_entries = real
    assert first.owned()


ENOSPC_CHILD = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    sys.path.insert(0, {root!r})
    import torch
    import ckpt_integration as ci
    root, how = sys.argv[1], sys.argv[2]
    if sys.argv[3:] == ["streamed"]:  # the write path of large CUDA tensors (pinned chunks), on host tensors
        from ckpt_integration.storage import torch_dist as td
        td.STREAM_DEVICES = ("cpu",)
        td.host_chunks = lambda t, chunk=None: (
            lambda raw: (raw[i : i + 999_999] for i in range(0, len(raw), 999_999)))(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    small = {{"w": ci.ShardedTensor.from_rank_offsets("w", torch.arange(1000.0)), "step": 1}}
    ci.save(small, os.path.join(root, "first"))
    if how == "fsize":  # no private mount: the per-process file size limit stands in for a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    big = {{"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(4 << 20)), "step": 2}}
    out = {{}}
    for name, kw in (("second", {{}}), ("first", {{"overwrite": True}})):
        try:
            ci.save(big, os.path.join(root, name), **kw)
            out[name] = ["saved", ""]
        except Exception as e:
            out[name] = [type(e).__name__, str(e)]
    first = ci.load({{"w": ci.ShardedTensor.from_rank_offsets("w", torch.zeros(1000))}}, os.path.join(root, "first"))
    out["first_intact"] = bool(torch.equal(first["w"], torch.arange(1000.0)) and first["step"] == 1)
    out["second_committed"] = os.path.exists(os.path.join(root, "second", "metadata.json"))
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("write", ["whole", "streamed"])
def test_disk_full_during_save(tmp_path, write):
    """A full filesystem (a 6 MiB tmpfs in a private mount namespace; else RLIMIT_FSIZE):
    CheckpointWriteError 'no space left on device while writing <file>', nothing committed,
    the earlier checkpoint intact (also after a failed overwrite=True). ``streamed``: the tensor's
    bytes written in chunks, as a large CUDA tensor's are."""
    script = tmp_path / "child.py"
    script.write_text(ENOSPC_CHILD.format(root=ROOT))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = f"mount -t tmpfs -o size=6m tmpfs {mnt} && exec {sys.executable} {script} {mnt} tmpfs {write}"
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, cwd=ROOT, timeout=180) \
        if shutil.which("unshare") else None
    if proc is None or (proc.returncode != 0 and "mount" in proc.stderr):
        proc = subprocess.run([sys.executable, str(script), str(mnt), "fsize", write], capture_output=True, text=True,
                              cwd=ROOT, timeout=180)
        reason = "file too large"
    else:
        reason = "no space left on device"
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("second", "first"):
        typ, msg = res[name]
        assert typ == CheckpointWriteError.__name__ and f"{reason} while writing" in msg and str(mnt) in msg, (name, typ, msg)
    assert res["first_intact"] and not res["second_committed"]


def test_strategy_version_is_compared(tmp_path):
    d = tmp_path / "c"
    _save(d)
    with pytest.raises(UnsupportedCheckpointError, match="version 1.*version 2"):
        ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS))}, str(d), sharded_strategy=("torch_dist", 2))
    out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS))}, str(d), sharded_strategy=("torch_dist", 1))
    assert out["step"] == 0


# =========================================================================== every load strategy, every damage
STRATEGIES = ("local", "auto", "read_once", "fully_parallel", "two_stage")


def _damage(path: str, how: str, offset: int) -> None:
    if how == "flipped":
        flip_byte(path, offset)
    elif how == "missing":
        os.remove(path)
    elif how == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    elif how == "emptied":
        os.truncate(path, 0)


def _every_strategy_worker(rank, world, root):
    """A row split saved, damaged four ways in four copies, loaded by columns (every rank needs
    both saved chunks) with every strategy, also as if every rank were its own node: every load
    fails on every rank with a library error naming the damaged file, nothing is returned. A
    copy whose .metadata was forged to another dtype of the same width is refused the same way."""
    from ckpt_integration.storage import torch_dist

    torch_dist.BLOCK_SIZE = 16 << 10
    full = _full(11)
    half = ROWS // world
    src = os.path.join(root, "src")
    ci.save({"w": ShardedTensor.from_rank_offsets("w", full[rank * half:(rank + 1) * half].clone(), (0, rank, world))}, src)
    torch.distributed.barrier()
    damages = ("flipped", "missing", "truncated", "emptied")
    if rank == 0:
        offset = _w_item_of(src, (half, 0)).offset + 2048 + 5 * COLS * 4
        for how in damages:
            shutil.copytree(src, os.path.join(root, how))
            _damage(os.path.join(root, how, "__1_0.distcp"), how, offset)
        shutil.copytree(src, os.path.join(root, "forged"))  # .metadata says int32, manifest updated to match
        _rewrite_metadata(os.path.join(root, "forged"), _forge_dtype)
    torch.distributed.barrier()
    cols = COLS // world
    sentinel = torch.full((ROWS, cols), -7.0)
    for lws in (None, "1"):
        if lws:
            os.environ["LOCAL_WORLD_SIZE"] = lws  # every rank its own node: slices sent, not mapped
        for how in damages:
            for strategy in STRATEGIES:
                out = sentinel.clone()
                with pytest.raises(CheckpointingException) as ei:
                    ci.load({"w": ShardedTensor.from_rank_offsets("w", out, (1, rank, world))}, os.path.join(root, how),
                            load_strategy=strategy)
                text = str(ei.value)
                why = {"flipped": "checksum mismatch", "missing": "is missing", "truncated": "is truncated",
                       "emptied": "is truncated"}[how]
                assert why in text and "__1_0.distcp" in text, (how, strategy, lws, text)
                assert type(ei.value).__name__ in ("CorruptCheckpointError", "DistributedCheckpointingError"), type(ei.value)
        # a consistently forged dtype is refused by every strategy too (read once included): each
        # item's own archive says float32
        for strategy in STRATEGIES:
            with pytest.raises(CorruptCheckpointError, match=r"is stored as torch.float32 \(the archive's data.pkl\)"):
                ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, cols, dtype=torch.int32), (1, rank, world))},
                        os.path.join(root, "forged"), load_strategy=strategy)
        # the undamaged checkpoint loads exactly with every strategy
        for strategy in STRATEGIES:
            out = sentinel.clone()
            ci.load({"w": ShardedTensor.from_rank_offsets("w", out, (1, rank, world))}, src, load_strategy=strategy)
            assert torch.equal(out, full[:, rank * cols:(rank + 1) * cols]), (strategy, lws)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    # zarr: fully_parallel / two_stage plan its arrays in bands of stored chunks, read by one rank each
    # through the checked reader and sent to the other; the second rank's chunk file damaged four
    # ways: every strategy refuses it on every rank, naming the file
    zsrc = os.path.join(root, "zarr")
    ci.save({"w": ShardedTensor.from_rank_offsets("w", full[rank * half:(rank + 1) * half].clone(), (0, rank, world))},
            zsrc, sharded_strategy="zarr")
    torch.distributed.barrier()
    if rank == 0:
        for how in damages:
            shutil.copytree(zsrc, zsrc + how)
            _damage(os.path.join(zsrc + how, "w", "c", "1", "0"), how, 100)
    torch.distributed.barrier()
    for how in damages:
        for strategy in STRATEGIES:
            out = sentinel.clone()
            with pytest.raises(CheckpointingException) as ei:
                ci.load({"w": ShardedTensor.from_rank_offsets("w", out, (1, rank, world))}, zsrc + how, load_strategy=strategy)
            assert os.path.join("w", "c", "1", "0") in str(ei.value), (how, strategy, str(ei.value))
    for strategy in STRATEGIES:
        out = sentinel.clone()
        ci.load({"w": ShardedTensor.from_rank_offsets("w", out, (1, rank, world))}, zsrc, load_strategy=strategy)
        assert torch.equal(out, full[:, rank * cols:(rank + 1) * cols]), ("zarr", strategy)
    # many small replicated tensors (norms, biases: read in runs by each rank under fully_parallel /
    # two_stage and auto), one of them flipped or cut short: every strategy refuses it, naming its file
    small = os.path.join(root, "small")
    values = {f"s{i:02d}": torch.arange(64, dtype=torch.float32) + 100 * i for i in range(24)}
    ci.save({k: ShardedTensor.from_rank_offsets(k, v.clone(), replica_id=rank) for k, v in values.items()}, small)
    torch.distributed.barrier()
    item = _w_item_of(small, (0,), key="s13")
    if rank == 0:
        for how in ("flipped", "truncated"):
            shutil.copytree(small, small + how)
            path = os.path.join(small + how, item.relative_path)
            if how == "flipped":
                flip_byte(path, item.offset + item.length // 2)
            else:
                os.truncate(path, item.offset + item.length // 2)
    torch.distributed.barrier()
    for strategy in STRATEGIES:
        for how in ("flipped", "truncated"):
            with pytest.raises(CheckpointingException) as ei:
                ci.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(64), replica_id=rank) for k in values},
                        small + how, load_strategy=strategy)
            assert item.relative_path in str(ei.value), (strategy, how, str(ei.value))
            assert type(ei.value).__name__ in ("CorruptCheckpointError", "DistributedCheckpointingError"), type(ei.value)
        out = ci.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(64), replica_id=rank) for k in values}, small,
                      load_strategy=strategy)
        assert all(torch.equal(out[k], v) for k, v in values.items()), strategy


def _w_item_of(d, offsets, key="w"):
    with open(os.path.join(d, ".metadata"), "rb") as f:
        md = pickle.load(f)
    return next(v for k, v in md.storage_data.items() if k.fqn == key and tuple(k.offset) == offsets)


@pytest.mark.slow
def test_damaged_files_fail_every_load_strategy_on_every_rank(tmp_path):
    run_distributed(_every_strategy_worker, 2, str(tmp_path), timeout=240)




def _different_arguments(rank, world, root):
    def state(fill=True):
        a = torch.arange(64.0).view(8, 8)[rank * 4:(rank + 1) * 4].clone() if fill else torch.zeros(4, 8)
        return {"a": ShardedTensor.from_rank_offsets("a", a, (0, rank, world)), "step": 7}

    # options that decide which collectives follow, different on the two ranks: every rank raises at
    # once, naming its own value, and nothing is committed (before: the ranks waited in different
    # collectives until the job was killed)
    with pytest.raises(ci.errors.MismatchError, match=f"validate_access_integrity={rank == 0}"):
        ci.save(state(), f"{root}/c", validate_access_integrity=rank == 0)
    with pytest.raises(ci.errors.MismatchError, match="backend="):
        ci.save(state(), f"{root}/c", sharded_strategy="zarr" if rank else "torch_dist")
    with pytest.raises(ci.errors.MismatchError, match=f"async_sharded_save={rank == 0}"):
        ci.save(state(), f"{root}/c", async_sharded_save=rank == 0)
    # a directory per rank (a timestamp in the name, taken on each rank): the coordinator's got every
    # rank's data, silently; now refused, naming this rank's directory
    with pytest.raises(ci.errors.MismatchError, match=f"checkpoint_dir='{root}/d{rank}'"):
        ci.save(state(), f"{root}/d{rank}")
    assert not os.path.exists(f"{root}/c/metadata.json") and not os.path.exists(f"{root}/d0/metadata.json")
    ci.save(state(), f"{root}/c")
    ci.save(state(), f"{root}/c2")
    # loading two checkpoints: a rank read its files against the coordinator's manifest and called
    # them damaged (CorruptCheckpointError), or, unverified, returned another checkpoint's data
    for verify in (True, False):
        with pytest.raises(ci.errors.MismatchError, match="checkpoint_dir="):
            ci.load(state(False), f"{root}/c" if rank == 0 else f"{root}/c2", verify_checksums=verify)
        # without the request check: the rank given another directory says so before reading it, and
        # every rank raises it (the coordinator names that rank)
        with pytest.raises(CheckpointingException, match="every rank of the group must pass the same directory"):
            ci.load(state(False), f"{root}/c" if rank == 0 else f"{root}/c2", verify_checksums=verify,
                    validate_access_integrity=False)
    strategy = "read_once" if rank == 0 else "fully_parallel"
    with pytest.raises(ci.errors.MismatchError, match=f"load_strategy={strategy}"):
        ci.load(state(False), f"{root}/c", load_strategy=strategy)
    with pytest.raises(ci.errors.MismatchError, match=f"verify_state={rank == 1}"):
        ci.load(state(False), f"{root}/c", verify_state=rank == 1)
    # the request check on one rank only: gloo aborted the process (collectives of other sizes); without
    # the request check on every rank, other strategies: the ranks waited in different collectives
    with pytest.raises(ci.errors.MismatchError, match=f"validate_access_integrity={rank == 1}"):
        ci.load(state(False), f"{root}/c", validate_access_integrity=rank == 1)
    with pytest.raises(ci.errors.MismatchError, match=f"load_strategy={strategy}"):
        ci.load(state(False), f"{root}/c", load_strategy=strategy, validate_access_integrity=False)
    out = ci.load(state(False), f"{root}/c", load_strategy="fully_parallel")
    assert torch.equal(out["a"], state()["a"].data) and out["step"] == 7


def test_ranks_passing_different_options_fail_at_once_instead_of_hanging(tmp_path):
    run_distributed(_different_arguments, 2, str(tmp_path), timeout=60)
