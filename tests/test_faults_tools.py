"""Fault injection at the tools level: ``verify``, ``inspect``, ``convert`` and ``diff`` on
damaged, malicious and foreign checkpoints (issue 11, items 2-5 and the "not a checkpoint" /
plain DCP cases).

The tools run in-process through ``ckpt_integration.cli.main``. ``verify`` must report every
damage a load would refuse (exit 1, ``DAMAGED``, naming the file), including ``common.pt``, the
block checksums and ``.metadata`` records that disagree with the data; every tool must refuse
names and links leading outside the checkpoint and special files (never a hang: a deadline
fails the test instead), and ``verify`` tells "not a checkpoint" (exit 2) from damage (exit 1).
Checkpoints are one 48 KiB tensor with the checksum block size lowered to 16 KiB.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import zlib

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import CheckpointingException, ShardedObject, ShardedTensor
from ckpt_integration.cli import main
from ckpt_integration.storage import checkpoint_dir as ckdir
from ckpt_integration.storage import checksum
from ckpt_integration.storage import torch_dist as td
from tests.damage import reindex, deadline, flip_byte, write_manifest
from ckpt_integration.storage.filesystem import locate

ROWS, COLS = 128, 96  # 48 KiB of float32: 3 checksum blocks of 16 KiB
DATA = "__0_0.distcp"


def _full(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def _save(d, seed: int, **kw) -> None:
    sd = {"w": ShardedTensor.from_rank_offsets("w", _full(seed)), "o": ShardedObject("o", {"seed": seed}, (1,), (0,)),
          "step": seed}
    ci.save(sd, str(d), thread_count=1, durable=False, **kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two checkpoints of the same layout (``good``, ``other``) and a zarr one, written once."""
    base = tmp_path_factory.mktemp("tools_faults")
    old, old_hash = td.BLOCK_SIZE, checksum.SAVE_BLOCK_HASH
    td.BLOCK_SIZE = 16 << 10
    try:
        _save(base / "good", seed=1)
        _save(base / "other", seed=2)
        _save(base / "zarr", seed=3, sharded_strategy="zarr")
        checksum.SAVE_BLOCK_HASH = "crc32"  # CRC32 block digests
        _save(base / "good_crc32", seed=1)
    finally:
        td.BLOCK_SIZE, checksum.SAVE_BLOCK_HASH = old, old_hash
    return base


@pytest.fixture(params=["good", "good_crc32"])
def ckpt(saved, tmp_path, request):
    """A fresh copy of the good checkpoint, to damage: XXH3-64 block digests and CRC32 ones."""
    d = tmp_path / "c"
    shutil.copytree(saved / request.param, d)
    return d


def run_cli(*args, capsys):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _append(path, data: bytes = b"garbage") -> None:
    with open(path, "ab") as f:
        f.write(data)


def _metadata(d):
    with open(os.path.join(str(d), ".metadata"), "rb") as f:
        return pickle.load(f)  # our own, freshly written checkpoint


def _w_item(d):
    return next(v for k, v in _metadata(d).storage_data.items() if k.fqn == "w")


def _manifest(d) -> dict:
    return json.loads((d / "manifest.json").read_text())


def _write_manifest(d, man: dict) -> None:
    write_manifest(d / "manifest.json", man)


def _rewrite_metadata(d, edit) -> None:
    """Edit ``.metadata`` and record its new bytes in the manifest: a consistently crafted checkpoint."""
    md = _metadata(d)
    edit(md)
    data = pickle.dumps(md)
    (d / ".metadata").write_bytes(data)
    man = _manifest(d)
    man["files"][".metadata"] = {"size": len(data), "crc32": zlib.crc32(data)}
    _write_manifest(d, man)
    reindex(d)  # (format 6: loads read index.bin, made to say what the edited .metadata says)


def _to_format_1(d) -> None:
    """The manifest as written before block checksums (whole-item CRC32s only), from a CRC32 one."""
    from ckpt_integration.storage.checkpoint_dir import read_manifest

    man = _manifest(d)
    assert man["block_hash"] == "crc32", "format 1 is made from a CRC32 checkpoint"
    items = {f"{f}@{o}": v for (f, o), v in read_manifest(locate(d)).checksums().items()}
    man = {k: man[k] for k in ("format", "created", "world_size", "files", "library_version")}
    man.update(version=1, items=items)
    _write_manifest(d, man)


def _tamper_block_crc(d) -> None:
    """One block digest of ``w`` wrong, its item digest right (and the index's own CRC32 updated):
    loads of that block fail."""
    man = _manifest(d)
    # index.bin (format 6): the first tensor item's block digests follow the item digests
    from ckpt_integration.storage.checkpoint_index import CheckpointIndex
    from ckpt_integration.storage.checksum import block_hash

    raw = bytearray((d / "index.bin").read_bytes())
    _, _, width, flags, n, _, nmsg, _, _ = struct.unpack_from("<4sIIIQQQqq", raw, 0)
    nblocks = CheckpointIndex(bytes(raw), block_hash(man["block_hash"]), "index.bin").layout.written.nblocks
    stored = int((nblocks < 0).sum()) if flags & 2 else n  # (flag 2: item digests of rows without block digests only)
    raw[56 + nmsg + width * stored + 16] ^= 1  # in a data block's digest (CRC32: the fifth, XXH3-64: the third)
    (d / "index.bin").write_bytes(bytes(raw))
    man["files"]["index.bin"] = {"size": len(raw), "crc32": zlib.crc32(bytes(raw))}
    _write_manifest(d, man)


def _expect_damaged(d, capsys, *needles):
    code, out, err = run_cli("verify", d, capsys=capsys)
    assert code == 1 and "DAMAGED" in out, (code, out, err)
    for n in needles:
        assert n in out, (n, out)
    return out


# =========================================================================== verify: every recorded file and block
DAMAGES = {
    # name: (damage(d, other), words the report must contain); loads refuse all but LOADS_READ_AROUND:
    # "data_appended" (bytes after the last item are never read, but the file differs from the one
    # saved) and damage to .metadata (loads plan from index.bin, which describes the same; index.bin
    # itself has no stand-in: it holds every item's digests)
    "common_flipped": (lambda d, o: flip_byte(d / "common.pt", (d / "common.pt").stat().st_size // 2), ["common.pt"]),
    "common_swapped": (lambda d, o: shutil.copy(o / "common.pt", d / "common.pt"), ["common.pt"]),
    "common_appended": (lambda d, o: _append(d / "common.pt"), ["common.pt"]),
    "common_missing": (lambda d, o: os.remove(d / "common.pt"), ["common.pt is missing"]),
    "metadata_flipped": (lambda d, o: flip_byte(d / ".metadata", 40), [".metadata"]),
    "metadata_appended": (lambda d, o: _append(d / ".metadata"), [".metadata"]),
    "index_flipped": (lambda d, o: flip_byte(d / "index.bin", 20), ["index.bin"]),
    "index_missing": (lambda d, o: os.remove(d / "index.bin"), ["index.bin is missing"]),
    "data_flipped_header": (lambda d, o: flip_byte(d / DATA, _w_item(d).offset + 100), [DATA, "checksum mismatch"]),
    "data_flipped_block": (lambda d, o: flip_byte(d / DATA, _w_item(d).offset + 20000), [DATA, "checksum mismatch", "w[0, 0]"]),
    "data_flipped_trailer": (lambda d, o: flip_byte(d / DATA, _w_item(d).offset + _w_item(d).length - 50), [DATA, "checksum mismatch"]),
    "data_truncated": (lambda d, o: os.truncate(d / DATA, _w_item(d).offset + 1000), [DATA, "truncated"]),
    "data_appended": (lambda d, o: _append(d / DATA), [DATA, "manifest.json says"]),
    "data_swapped": (lambda d, o: shutil.copy(o / DATA, d / DATA), [DATA, "checksum mismatch"]),
    # (XXH3-64: the item digest is derived from the block digests, so the data no longer matches the
    # tampered one: a checksum mismatch at that block's bytes; CRC32: the two recorded digests disagree)
    "block_checksum": (lambda d, o: _tamper_block_crc(d), [DATA, "checksum"]),
}


LOADS_READ_AROUND = {"data_appended", "metadata_flipped", "metadata_appended"}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_verify_reports_what_loads_refuse(saved, ckpt, capsys, damage):
    fn, needles = DAMAGES[damage]
    fn(ckpt, saved / "other")
    _expect_damaged(ckpt, capsys, *needles)
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS))}
    if damage in LOADS_READ_AROUND:
        good = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS))}, str(saved / "good"))
        assert torch.equal(ci.load(request, str(ckpt))["w"], good["w"])
        return
    with pytest.raises(CheckpointingException):  # verify agrees with the loaders
        ci.load(request, str(ckpt))


def test_verify_names_the_damaged_blocks(ckpt, capsys):
    """Two flipped data blocks of one item: the report gives the byte range of each block."""
    item = _w_item(ckpt)
    rec = ckdir.read_manifest(locate(ckpt)).block_records()[(DATA, item.offset)]
    data_offset, block = rec.data_offset, rec.block_size
    starts = [item.offset + data_offset + k * block for k in (0, 2)]
    for s in starts:
        flip_byte(ckpt / DATA, s + 5)
    _expect_damaged(ckpt, capsys, *(f"[{s}, {s + block})" for s in starts))


def test_verify_good_checkpoints(saved, tmp_path, capsys):
    for name, block_hash in (("good", "xxh3_64"), ("good_crc32", "crc32")):
        code, out, _ = run_cli("verify", saved / name, capsys=capsys)
        assert code == 0 and "OK: checksums of" in out, out
        rep = json.loads(run_cli("verify", saved / name, "--json", capsys=capsys)[1])
        assert rep["ok"] and rep["checksums_available"] and rep["blocks_checked"] >= 3
        assert rep["block_hash"] == block_hash
    old = tmp_path / "old"
    shutil.copytree(saved / "good_crc32", old)
    _to_format_1(old)  # an older format: reported as not verified (not as damage), naming the command
    code, out, _ = run_cli("verify", old, capsys=capsys)
    assert code == 1 and "NOT VERIFIED: 1 problem(s) (not damage" in out and "DAMAGED" not in out, out
    assert "manifest format 1" in out and "ckpt-integration convert" in out, out
    rep = json.loads(run_cli("verify", old, "--json", capsys=capsys)[1])
    assert [(p["file"], p["kind"]) for p in rep["problems"]] == [("manifest.json", "unsupported")]
    assert run_cli("convert", old, tmp_path / "new", "--to", "torch_dist", capsys=capsys)[0] == 0
    assert run_cli("verify", tmp_path / "new", capsys=capsys)[0] == 0
    flip_byte(old / DATA, _w_item(old).offset + 20000)
    assert run_cli("convert", old, tmp_path / "new2", "--to", "torch_dist", capsys=capsys)[0] != 0


# =========================================================================== verify: .metadata vs the data
def _set_dtype(dtype):
    def edit(md):
        md.state_dict_metadata["w"].properties.dtype = dtype
    return edit


def _halve_rows(md):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    meta = md.state_dict_metadata["w"]
    meta.size = torch.Size([ROWS // 2, COLS])
    meta.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([ROWS // 2, COLS]))]


EDITS = {"dtype_same_size": _set_dtype(torch.int32), "dtype_larger": _set_dtype(torch.float64), "fewer_elements": _halve_rows}


@pytest.mark.parametrize("block_hash", ["xxh3_64", "crc32"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_verify_finds_metadata_that_disagrees_with_the_archive(saved, tmp_path, capsys, edit, block_hash):
    ckpt = tmp_path / "c"
    shutil.copytree(saved / ("good" if block_hash == "xxh3_64" else "good_crc32"), ckpt)
    _rewrite_metadata(ckpt, EDITS[edit])
    _expect_damaged(ckpt, capsys, DATA, "'w'")


# =========================================================================== containment
@pytest.mark.parametrize("name", ["ABSOLUTE", "../outside.distcp", "sub/__0_0.distcp"])
def test_tools_refuse_data_file_names_outside_the_checkpoint(saved, tmp_path, capsys, name):
    """Names from .metadata that lead outside: verify reports a refusal (exit 1), convert and diff
    refuse (exit 2), inspect warns; nothing outside is opened (it is a FIFO: opening it would hang)."""
    d = tmp_path / "sub" / "c"
    shutil.copytree(saved / "good", d)
    os.mkfifo(tmp_path / "sub" / "outside.distcp")
    target = str(tmp_path / "sub" / "outside.distcp") if name == "ABSOLUTE" else name

    def edit(md):
        for k, v in list(md.storage_data.items()):
            md.storage_data[k] = type(v)(target, v.offset, v.length)

    _rewrite_metadata(d, edit)
    with deadline():
        out = _expect_damaged(d, capsys, "refus", "only name files inside")
        code, _, err = run_cli("convert", d, tmp_path / "o.pt", "--to", "torch", capsys=capsys)
        assert code == 2 and "only name files inside" in err, err
        code, _, err = run_cli("diff", d, saved / "good", capsys=capsys)
        assert code == 2 and "only name files inside" in err, err
        code, out, _ = run_cli("inspect", d, capsys=capsys)
        assert code == 0 and "warning" in out and "only name files inside" in out, out


def test_verify_refuses_manifest_names_outside_the_checkpoint(ckpt, tmp_path, capsys):
    os.mkfifo(tmp_path / "secret")
    man = _manifest(ckpt)
    man["files"]["../secret"] = {"size": 1, "crc32": 0}
    _write_manifest(ckpt, man)
    with deadline():
        _expect_damaged(ckpt, capsys, "refus", "../secret")


@pytest.mark.parametrize("damage", ["common_flipped", "common_swapped", "common_appended", "common_missing"])
def test_convert_refuses_a_damaged_common_state(saved, ckpt, tmp_path, capsys, damage):
    """A damaged or missing common.pt fails the conversion (exit 2, file named, no output): an
    output silently without the common state would be a loss. (An *unsafe* one, refused for
    want of --trusted, is skipped and named in the summary instead: the user's choice.)"""
    DAMAGES[damage][0](ckpt, saved / "other")
    out_path = tmp_path / "o.pt"
    code, _, err = run_cli("convert", ckpt, out_path, "--to", "torch", capsys=capsys)
    assert code == 2 and "common.pt" in err, (code, err)
    assert not out_path.exists()


# format 6: our tools read index.bin and never .metadata (an export for DCP and Megatron-Core), which
# only verify reads (and reports); index.bin has no stand-in


@pytest.mark.parametrize("metadata", ["flipped", "missing"])
def test_verify_reports_damaged_data_beside_a_damaged_metadata(ckpt, capsys, metadata):
    # .metadata (an export for DCP and Megatron-Core) could not be read, and verify then checked no
    # data at all: the damaged data file beside it went unreported, though loads read it through index.bin
    flip_byte(ckpt / DATA, 1000)
    flip_byte(ckpt / ".metadata", 40) if metadata == "flipped" else os.remove(ckpt / ".metadata")
    code, out, err = run_cli("verify", ckpt, capsys=capsys)
    assert code == 1 and ".metadata" in out and f"{DATA}: checksum mismatch" in out, (out, err)
    assert "checked through the index" in out, out
    os.remove(ckpt / "index.bin")  # neither: the report says the data was not checked
    code, out, err = run_cli("verify", ckpt, capsys=capsys)
    assert code == 1 and "the data was not checked" in out, (out, err)


@pytest.mark.parametrize("name", [DATA, "common.pt", ".metadata", "index.bin", "manifest.json", "metadata.json"])
def test_tools_refuse_links_leading_outside(ckpt, tmp_path, capsys, monkeypatch, name):
    store = tmp_path / "dedup"
    store.mkdir()
    shutil.move(str(ckpt / name), str(store / name))
    os.symlink(store / name, ckpt / name)
    _expect_damaged(ckpt, capsys, "symbolic link leading outside", name)
    if name == ".metadata":  # (the tools plan from index.bin: only verify reads it)
        return
    code, _, err = run_cli("convert", ckpt, tmp_path / "o.pt", "--to", "torch", capsys=capsys)
    assert code == 2 and "symbolic link leading outside" in err, err
    code, out, err = run_cli("inspect", ckpt, capsys=capsys)
    assert "symbolic link leading outside" in out + err
    monkeypatch.setenv("CKPT_INTEGRATION_ALLOW_SYMLINKS", "1")  # the documented opt-in
    code, out, _ = run_cli("verify", ckpt, capsys=capsys)
    assert code == 0, out


@pytest.mark.parametrize("name", [DATA, "common.pt", ".metadata", "index.bin", "manifest.json", "metadata.json"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_tools_on_special_files_give_an_error_not_a_hang(ckpt, tmp_path, capsys, name, kind):
    os.remove(ckpt / name)
    os.mkfifo(ckpt / name) if kind == "fifo" else os.mkdir(ckpt / name)
    with deadline():
        _expect_damaged(ckpt, capsys, name, "not a regular file")
        if name == ".metadata":  # (the tools plan from index.bin: only verify reads it)
            return
        if name in (DATA, "index.bin", "common.pt"):
            code, _, err = run_cli("convert", ckpt, tmp_path / "o.pt", "--to", "torch", capsys=capsys)
            assert code == 2 and "not a regular file" in err, err
        if name in (DATA, "index.bin"):  # (diff compares tensors only)
            code, _, err = run_cli("diff", ckpt, ckpt, capsys=capsys)
            assert code == 2 and "not a regular file" in err, err
        code, out, err = run_cli("inspect", ckpt, capsys=capsys)
        if name in ("common.pt", "index.bin", "manifest.json", "metadata.json"):
            assert "not a regular file" in out + err, (out, err)


def test_zarr_chunk_files_fifo_and_links(saved, tmp_path, capsys):
    """A chunk file linked outside and an object file that is a FIFO: both reported (each with
    its key), the rest still checked; convert refuses."""
    from ckpt_integration.storage.zarr_backend import object_file_name

    d = tmp_path / "z"
    shutil.copytree(saved / "zarr", d)
    chunk = next(os.path.join(r, f) for r, _, fs in os.walk(d / "w" / "c") for f in fs)
    shutil.move(chunk, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", chunk)
    obj = d / object_file_name("o/shard_0_1")  # the unique key of ShardedObject "o"
    os.remove(obj)
    os.mkfifo(obj)
    with deadline():
        out = _expect_damaged(d, capsys, "DAMAGED: 2 problem(s)", "symbolic link leading outside", "not a regular file")
        assert "affected: w" in out and "affected: o/shard_0_1" in out, out
        code, _, err = run_cli("convert", d, tmp_path / "o.pt", "--to", "torch", capsys=capsys)
        assert code == 2 and "symbolic link leading outside" in err, err


# =========================================================================== not a checkpoint
def test_verify_on_what_is_not_a_checkpoint_exits_2(saved, tmp_path, capsys):
    for path in (tmp_path / "missing", tmp_path / "empty"):
        if path.name == "empty":
            path.mkdir()
        code, out, err = run_cli("verify", path, capsys=capsys)
        assert code == 2 and "not a checkpoint" in err and "DAMAGED" not in out, (code, out, err)
    runs = tmp_path / "runs"
    runs.mkdir()
    for name in ("iter_1", "iter_2"):
        shutil.copytree(saved / "good", runs / name)
    code, out, err = run_cli("verify", runs, capsys=capsys)
    assert code == 2 and "not a checkpoint" in err, (code, out, err)
    assert str(runs / "iter_1") in err and str(runs / "iter_2") in err, err
    assert run_cli("verify", runs / "iter_1", capsys=capsys)[0] == 0


# =========================================================================== plain PyTorch DCP
def test_a_flipped_bit_in_a_plain_dcp_checkpoint_is_refused_by_verify_convert_and_load(tmp_path, capsys):
    # PyTorch DCP writes each tensor as a torch.save zip archive whose records carry CRC32s (torch.load
    # checks none): verify passed the damage, convert wrote the bad value under fresh digests, and a
    # load returned it
    import torch.distributed.checkpoint as dcp

    from ckpt_integration import CorruptCheckpointError, ShardedTensor

    d = tmp_path / "dcp"
    with pytest.warns(UserWarning):
        dcp.save({"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(7)}, checkpoint_id=str(d))
    data = d / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    at = raw.find(struct.pack("<f", 11.0)) + 3
    raw[at] ^= 0x10
    data.write_bytes(bytes(raw))
    code, out, err = run_cli("verify", d, capsys=capsys)
    assert code == 1 and "DAMAGED" in out and "__0_0.distcp" in out and "affected: w[" in out, (out, err)
    code, _, err = run_cli("convert", d, tmp_path / "out", "--to", "torch_dist", capsys=capsys)
    assert code == 2 and "__0_0.distcp" in err and "'w'" in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp"):
        ci.load_plain_tensors(str(d))
    req = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp"):
        ci.load(req, str(d))
    req = {"b": ShardedTensor.from_rank_offsets("b", torch.zeros(7))}  # (its own record is intact)
    assert torch.equal(ci.load(req, str(d))["b"], torch.arange(7))


def test_tools_on_a_plain_dcp_checkpoint(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    want = _full(5)
    d = tmp_path / "dcp"
    with pytest.warns(UserWarning):
        dcp.save({"w": want.clone(), "b": torch.arange(7)}, checkpoint_id=str(d))
    code, out, err = run_cli("verify", d, capsys=capsys)
    assert code == 0 and "OK: structure and record CRC32s of" in out and "no checksums of ours" in out, (out, err)
    assert "common.pt" not in out
    code, out, _ = run_cli("inspect", d, capsys=capsys)
    assert code == 0 and "w: [128, 96] float32" in out, out
    code, _, err = run_cli("convert", d, tmp_path / "o.pt", "--to", "torch", capsys=capsys)
    assert code == 0, err
    got = torch.load(tmp_path / "o.pt", weights_only=True)
    assert torch.equal(got["w"], want) and torch.equal(got["b"], torch.arange(7))
    assert run_cli("diff", d, tmp_path / "o.pt", capsys=capsys)[0] == 0
    # damage that needs no checksums to be seen: a truncated data file
    data = next(n for n in os.listdir(d) if n.endswith(".distcp") and os.path.getsize(d / n) > 1000)
    os.truncate(d / data, 1000)
    _expect_damaged(d, capsys, data, "truncated")


# =========================================================================== other inputs of the tools
def test_safetensors_index_names_and_special_input_files(tmp_path, capsys):
    """A safetensors index naming a file outside its folder is refused; a FIFO given as the input
    file is refused instead of waited on."""
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"w": torch.ones(3)}, str(tmp_path / "outside.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    code, _, err = run_cli("inspect", folder, capsys=capsys)
    assert code == 2 and "refusing" in err and "../outside.safetensors" in err, err
    os.mkfifo(tmp_path / "model.pt")
    with deadline():
        for args in (("inspect", tmp_path / "model.pt"), ("diff", tmp_path / "model.pt", tmp_path / "outside.safetensors")):
            code, _, err = run_cli(*args, capsys=capsys)
            assert code == 2 and "not a regular file" in err, err


@pytest.mark.parametrize("what", ["convert:torch", "convert:safetensors", "export:hf"])
def test_a_tool_whose_output_disk_is_full_names_the_output(tmp_path, monkeypatch, what):
    """``convert`` / ``export`` onto a full disk raised a bare ``OSError(28)`` naming no file (the CLI
    printed "[Errno 28] No space left on device"); now a ``CheckpointWriteError`` names the output,
    and nothing is left beside it."""
    import builtins
    import errno
    import io

    from ckpt_integration.errors import CheckpointWriteError
    from ckpt_integration.tools import convert_checkpoint, export_checkpoint

    src = str(tmp_path / "src")
    ci.save({"model.w": ShardedTensor.from_rank_offsets("model.w", torch.ones(64, 64))}, src)

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    real_open = builtins.open

    def full_disk(file, *args, **kwargs):  # (the outputs' partial files only)
        f = real_open(file, *args, **kwargs)
        return Full(f) if str(file).endswith(".partial") else f

    monkeypatch.setattr(builtins, "open", full_disk)
    monkeypatch.setattr(io, "open", full_disk)
    tool, to = what.split(":")
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointWriteError, match=f"no space left on device while writing {out}$"):
        convert_checkpoint(src, to, out) if tool == "convert" else export_checkpoint(src, out, to)
    assert sorted(os.listdir(tmp_path)) == ["src"]
