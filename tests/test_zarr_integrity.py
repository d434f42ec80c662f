"""zarr backend integrity: chunk and object files carry size + CRC32 records in zarr_index.json.

Damage (a deleted, truncated or bit-flipped chunk file) must fail the load with a
CorruptCheckpointError naming the key and the file, instead of reading zeros or
garbage; loads that do not touch the damaged chunk still work; ``verify`` reports
every bad file. Checkpoints written before the records existed still load.
"""

from __future__ import annotations

import json
import zlib
import os
import re
import shutil

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import CorruptCheckpointError, ShardedObject, ShardedTensor
from ckpt_integration.cli import main
from tests.damage import write_zarr_index
from tests.dist_utils import run_distributed
from tests.layouts import global_tensor, grid_shard
from ckpt_integration.storage.filesystem import locate

pytest.importorskip("zarr")

SHAPE = (8, 6)  # saved as a 2x2 grid of shards -> chunks (4, 3): files w/c/{0,1}/{0,1}
W = global_tensor("w", SHAPE)
B = global_tensor("b", (5,), torch.bfloat16)  # stored as int16 in zarr
Z = torch.zeros(4, 4)  # all zeros: zarr would skip such a chunk unless told to write it


def _state():
    state = {
        f"w{r}{c}": ShardedTensor.from_global_offsets("w", W[4 * r : 4 * r + 4, 3 * c : 3 * c + 3], SHAPE, (4 * r, 3 * c))
        for r in range(2)
        for c in range(2)
    }
    state.update(
        b=ShardedTensor.from_rank_offsets("b", B),
        z=ShardedTensor.from_rank_offsets("z", Z),
        obj=ShardedObject("obj", {"step": 7}, (1,), (0,)),
        step=7,
    )
    return state


def _request(rows=(0, 8), cols=(0, 6)):
    """The whole checkpoint, or only rows x cols of ``w`` (a resharded read)."""
    (r0, r1), (c0, c1) = rows, cols
    req = {"w": ShardedTensor.from_global_offsets("w", torch.full((r1 - r0, c1 - c0), -1.0), SHAPE, (r0, c0))}
    if (rows, cols) == ((0, 8), (0, 6)):
        req.update(
            b=ShardedTensor.from_rank_offsets("b", torch.zeros(5, dtype=torch.bfloat16)),
            z=ShardedTensor.from_rank_offsets("z", torch.ones(4, 4)),
            obj=ShardedObject("obj", None, (1,), (0,)),
        )
    return req


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("zarr") / "good")
    ci.save(_state(), path, sharded_strategy="zarr")
    return path


@pytest.fixture
def ckpt(saved, tmp_path):
    """A fresh copy of the good checkpoint, free to damage."""
    path = str(tmp_path / "ckpt")
    shutil.copytree(saved, path)
    return path


def _damage(path: str, how: str) -> None:
    if how == "delete":
        os.remove(path)
    elif how == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    elif how == "flip":
        with open(path, "r+b") as f:
            f.seek(5)
            byte = f.read(1)
            f.seek(5)
            f.write(bytes([byte[0] ^ 0x10]))
    else:
        raise ValueError(how)


EXPECTED_ERROR = {"delete": "is missing", "truncate": "is truncated", "flip": "is damaged: CRC32"}


# --------------------------------------------------------------------------- good checkpoint
def test_good_checkpoint_loads_exactly(saved):
    out = ci.load(_request(), saved)
    assert torch.equal(out["w"], W)
    assert out["b"].dtype == torch.bfloat16 and torch.equal(out["b"], B)
    assert torch.equal(out["z"], Z)
    assert out["obj"] == {"step": 7} and out["step"] == 7
    plain = ci.load_plain_tensors(saved)
    assert torch.equal(plain["w"], W) and torch.equal(plain["b"], B)


def test_index_records_every_chunk_and_object_file(saved):
    with open(os.path.join(saved, "zarr_index.json")) as f:
        index = json.load(f)
    assert index["format"] == 3
    files = index["files"]
    chunks = {"w/c/0/0", "w/c/0/1", "w/c/1/0", "w/c/1/1", "b/c/0", "z/c/0/0", "obj/shard_0_1.pt"}
    assert set(files) == chunks | {"w/zarr.json", "b/zarr.json", "z/zarr.json"}
    assert index["tensors"]["w"] == {"dtype": "float32", "stored_dtype": "float32", "shape": [8, 6], "chunks": [4, 3]}
    for name, rec in files.items():
        assert os.path.getsize(os.path.join(saved, name)) == rec["size"], name
    assert files["w/c/0/0"] == {"key": "w", "size": 4 * 3 * 4, "crc32": files["w/c/0/0"]["crc32"]}
    assert files["z/c/0/0"]["key"] == "z"  # the all-zero chunk was written, not skipped


# --------------------------------------------------------------------------- damaged chunks
@pytest.mark.parametrize("how", ["delete", "truncate", "flip"])
def test_damaged_chunk_fails_the_load_naming_key_and_file(ckpt, how):
    _damage(os.path.join(ckpt, "w", "c", "1", "1"), how)
    with pytest.raises(CorruptCheckpointError, match=EXPECTED_ERROR[how]) as e:
        ci.load(_request(), ckpt)
    assert os.path.join(ckpt, "w", "c", "1", "1") in str(e.value) and "'w'" in str(e.value)


def test_deleted_all_zero_chunk_is_not_read_as_zeros(ckpt):
    _damage(os.path.join(ckpt, "z", "c", "0", "0"), "delete")
    with pytest.raises(CorruptCheckpointError, match=r"z/c/0/0 of 'z' is missing"):
        ci.load(_request(), ckpt)


@pytest.mark.parametrize("how", ["delete", "truncate", "flip"])
def test_resharded_load_reads_only_the_chunks_it_needs(ckpt, how):
    _damage(os.path.join(ckpt, "w", "c", "1", "1"), how)  # rows 4:8, columns 3:6
    for rows, cols in [((0, 4), (0, 6)), ((0, 8), (0, 3)), ((2, 7), (1, 3))]:
        out = ci.load(_request(rows, cols), ckpt, validate_access_integrity=False)
        assert torch.equal(out["w"], W[rows[0] : rows[1], cols[0] : cols[1]]), (rows, cols)
    with pytest.raises(CorruptCheckpointError, match=r"w/c/1/1 of 'w'"):
        ci.load(_request((5, 6), (4, 5)), ckpt, validate_access_integrity=False)


def test_damaged_object_file_fails_the_load(ckpt):
    _damage(os.path.join(ckpt, "obj", "shard_0_1.pt"), "flip")
    with pytest.raises(CorruptCheckpointError, match=r"object file .*shard_0_1\.pt of 'obj/shard_0_1' is damaged"):
        ci.load(_request(), ckpt)


def test_reader_without_checksum_verification_still_checks_presence_and_size(ckpt):
    from ckpt_integration.planning.boxes import Box
    from ckpt_integration.storage.zarr_backend import ZarrReader

    _damage(os.path.join(ckpt, "w", "c", "0", "0"), "flip")
    _damage(os.path.join(ckpt, "w", "c", "1", "1"), "truncate")

    def read(reader, rows):
        box = Box((rows[0], 0), (rows[1] - rows[0], 6))
        out = torch.empty(box.sizes)
        reader.read_region("w", reader.chunks["w"][0], box, out, torch.float32)
        return out

    with ZarrReader(locate(ckpt), verify_checksums=False) as reader:
        assert not torch.equal(read(reader, (0, 4)), W[:4])  # flipped bit read unchecked, as asked
        with pytest.raises(CorruptCheckpointError, match="is truncated"):
            read(reader, (4, 8))
    with ZarrReader(locate(ckpt)) as reader, pytest.raises(CorruptCheckpointError, match="is damaged: CRC32"):
        read(reader, (0, 4))


# --------------------------------------------------------------------------- verify
def test_verify_cli_reports_every_damaged_file(saved, ckpt, capsys):
    assert main(["verify", saved]) == 0
    assert "OK: checksums of 7 items" in capsys.readouterr().out
    _damage(os.path.join(ckpt, "w", "c", "0", "1"), "delete")
    _damage(os.path.join(ckpt, "w", "c", "1", "0"), "flip")
    _damage(os.path.join(ckpt, "b", "c", "0"), "truncate")
    _damage(os.path.join(ckpt, "obj", "shard_0_1.pt"), "flip")
    assert main(["verify", ckpt]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED: 4 problem(s)" in out
    for name, key, what in [
        ("w/c/0/1", "w", "is missing"),
        ("w/c/1/0", "w", "is damaged: CRC32"),
        ("b/c/0", "b", "is truncated: 5 bytes, expected 10"),
        ("obj/shard_0_1.pt", "obj/shard_0_1", "is damaged: CRC32"),
    ]:
        assert f"{os.path.join(ckpt, name)} of {key!r} {what}" in out, (name, out)


def test_verify_json_names_file_and_key(ckpt, capsys):
    _damage(os.path.join(ckpt, "z", "c", "0", "0"), "truncate")
    assert main(["verify", ckpt, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["checksums_available"] is True
    assert [(p["file"], p["keys"]) for p in report["problems"]] == [("z/c/0/0", ["z"])]


@pytest.mark.parametrize("how", ["flip_key", "truncate", "empty"])
def test_a_damaged_index_fails_the_load_naming_it(ckpt, capsys, how):
    """``zarr_index.json`` is recorded in the manifest (size and CRC32) like every small file. Before,
    it was not: a bit flipped in a key's name made the load say the key was not in the checkpoint
    (``KeyNotInCheckpointError``), and one flipped in a file record's name went unnoticed."""
    from ckpt_integration.storage.zarr_backend import INDEX_FILE

    manifest = json.loads(open(os.path.join(ckpt, "manifest.json")).read())
    raw = open(os.path.join(ckpt, INDEX_FILE), "rb").read()
    assert manifest["files"][INDEX_FILE] == {"size": len(raw), "crc32": zlib.crc32(raw)}
    if how == "flip_key":
        i = raw.index(b'"b": {"dtype"') + 1
        raw = raw[:i] + b"c" + raw[i + 1 :]  # the tensor "b" is now called "c"
    else:
        raw = raw[: len(raw) // 2] if how == "truncate" else b""
    with open(os.path.join(ckpt, INDEX_FILE), "wb") as f:
        f.write(raw)
    with pytest.raises(CorruptCheckpointError, match=f"{INDEX_FILE} is damaged"):
        ci.load(_request(), ckpt)
    assert main(["verify", ckpt, "-q"]) == 1
    assert INDEX_FILE in capsys.readouterr().out


def test_removing_keys_records_the_rewritten_index(ckpt):
    ci.remove_sharded_tensors(ckpt, "z")
    req = _request()
    del req["z"]
    out = ci.load(req, ckpt)
    assert torch.equal(out["w"], W) and torch.equal(out["b"], B) and out["obj"] == {"step": 7}
    assert main(["verify", ckpt, "-q"]) == 0


# --------------------------------------------------------------------------- older checkpoints
def test_checkpoint_without_records_still_loads_and_verifies(ckpt, capsys):
    index_path = os.path.join(ckpt, "zarr_index.json")
    with open(index_path) as f:
        index = json.load(f)
    del index["files"]
    index["format"] = 1  # as written before records existed
    write_zarr_index(ckpt, index, recorded=False)
    out = ci.load(_request(), ckpt)
    assert torch.equal(out["w"], W) and torch.equal(out["b"], B) and out["obj"] == {"step": 7}
    assert main(["verify", ckpt]) == 0
    assert "before chunk checksums were recorded" in capsys.readouterr().out
    # integrity unknown, not corrupt: a missing chunk reads as fill value, as it always did there
    _damage(os.path.join(ckpt, "w", "c", "0", "0"), "delete")
    out = ci.load(_request((0, 4), (0, 3)), ckpt, validate_access_integrity=False, verify_state=False)
    assert torch.equal(out["w"], torch.zeros(4, 3))
    # (the manifest of this checkpoint, written now, records fingerprints: the state check sees it)
    with pytest.raises(ci.CorruptCheckpointError, match="'w'.*fingerprint differs"):
        ci.load(_request((0, 4), (0, 3)), ckpt, validate_access_integrity=False, verify_state=True)


def test_commit_refuses_a_chunk_no_rank_wrote(ckpt, tmp_path):
    """A chunk no rank wrote would read as zeros: the commit refuses it, naming the key and saying what
    to do (it said "internal error" to a save whose shards, unchecked, did not cover a tensor)."""
    from ckpt_integration.storage.zarr_backend import commit_file_records, read_index

    before = read_index(locate(ckpt))
    with pytest.raises(ci.errors.ShardingIntegrityError, match="was saved by no rank"):
        commit_file_records(locate(ckpt), [])
    assert read_index(locate(ckpt)) == before
    half = {"w": ci.ShardedTensor.from_global_offsets("w", torch.ones(2, 16), (8, 16), (0, 0))}
    with pytest.raises(ci.errors.ShardingIntegrityError, match=r"part of 'w' was saved by no rank .*cover the whole tensor"):
        ci.save(half, str(tmp_path / "half"), sharded_strategy="zarr", validate_access_integrity=False)
    assert not (tmp_path / "half" / "metadata.json").exists()


# --------------------------------------------------------------------------- fsspec URLs
def test_memory_url_damage_is_detected():
    import fsspec

    fs = fsspec.filesystem("memory")
    url = "memory://ckpt-tests/zarr-integrity"
    ci.save(_state(), url, sharded_strategy="zarr")
    assert torch.equal(ci.load(_request(), url)["w"], W)
    assert main(["verify", url, "-q"]) == 0
    fs.rm(url + "/w/c/1/1")
    fs.pipe_file(url + "/w/c/0/0", fs.cat_file(url + "/w/c/0/0")[:-4])
    with pytest.raises(CorruptCheckpointError, match=r"w/c/1/1 of 'w' is missing"):
        ci.load(_request((4, 8), (3, 6)), url, validate_access_integrity=False)
    with pytest.raises(CorruptCheckpointError, match=r"w/c/0/0 of 'w' is truncated"):
        ci.load(_request((0, 4), (0, 3)), url, validate_access_integrity=False)
    out = ci.load(_request((0, 4), (3, 6)), url, validate_access_integrity=False)
    assert torch.equal(out["w"], W[:4, 3:])
    assert main(["verify", url, "-q"]) == 1


# --------------------------------------------------------------------------- 2 ranks
def _save_two_ranks(rank, world, path):
    state = {
        "w": grid_shard("w", SHAPE, rank, (world, 1)),
        "b": ShardedTensor.from_rank_offsets("b", B, replica_id=rank),
        "obj": ShardedObject("obj", {"rank": rank}, (world,), (rank,)),
    }
    ci.save(state, path, sharded_strategy="zarr")


def test_two_rank_save_records_both_ranks_files(tmp_path):
    path = str(tmp_path / "two")
    run_distributed(_save_two_ranks, 2, path)
    with open(os.path.join(path, "zarr_index.json")) as f:
        files = json.load(f)["files"]
    assert set(files) == {"w/c/0/0", "w/c/1/0", "b/c/0", "obj/shard_0_2.pt", "obj/shard_1_2.pt", "w/zarr.json", "b/zarr.json"}
    out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(SHAPE))}, path)
    assert torch.equal(out["w"], W)
    _damage(os.path.join(path, "w", "c", "1", "0"), "flip")  # written by rank 1
    with pytest.raises(CorruptCheckpointError, match=r"w/c/1/0 of 'w' is damaged"):
        ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(SHAPE))}, path)
    assert main(["verify", path, "-q"]) == 1


# --------------------------------------------------------------------------- edited zarr.json
def _edit_array_metadata(path: str, key: str, edit) -> None:
    meta_path = os.path.join(path, key, "zarr.json")
    with open(meta_path) as f:
        meta = json.load(f)
    edit(meta)
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=2)


def _drop_metadata_records(path: str) -> None:
    """As a format-2 index (before zarr.json records): only the comparison with the index is left."""
    index_path = os.path.join(path, "zarr_index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["format"] = 2
    index["files"] = {k: v for k, v in index["files"].items() if not k.endswith("/zarr.json")}
    write_zarr_index(path, index, recorded=False)


EDITS = {
    "dtype": (lambda m: m.__setitem__("data_type", "int32"), r"data type int32, expected float32"),
    "shape": (lambda m: m.__setitem__("shape", [8, 5]), r"shape \[8, 5\], expected \[8, 6\]"),
    "chunks": (lambda m: m["chunk_grid"]["configuration"].__setitem__("chunk_shape", [2, 3]), r"chunk shape \[2, 3\], expected \[4, 3\]"),
    "endian": (lambda m: m["codecs"][0]["configuration"].__setitem__("endian", "big"), r"byte order"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("records", [True, False], ids=["format3", "format2"])
def test_edited_zarr_json_fails_the_load_naming_key_and_file(ckpt, edit, records):
    change, mismatch = EDITS[edit]
    _edit_array_metadata(ckpt, "w", change)
    if not records:
        _drop_metadata_records(ckpt)
    # format 3: the CRC32 of zarr.json; format 2: the comparison with zarr_index.json
    expected = r"is damaged: changed after the save" if records else mismatch
    with pytest.raises(CorruptCheckpointError, match=expected) as e:
        ci.load(_request(), ckpt)
    assert os.path.join(ckpt, "w", "zarr.json") in str(e.value) and "'w'" in str(e.value)
    with pytest.raises(CorruptCheckpointError, match=expected):
        ci.load_plain_tensors(ckpt)
    # untouched arrays still load
    out = ci.load({"b": ShardedTensor.from_rank_offsets("b", torch.zeros(5, dtype=torch.bfloat16))}, ckpt)
    assert torch.equal(out["b"], B)


@pytest.mark.parametrize("records", [True, False], ids=["format3", "format2"])
def test_verify_reports_an_edited_zarr_json(ckpt, capsys, records):
    _edit_array_metadata(ckpt, "w", EDITS["dtype"][0])
    if not records:
        _drop_metadata_records(ckpt)
    assert main(["verify", ckpt]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED: 1 problem(s)" in out, out
    assert f"{os.path.join(ckpt, 'w', 'zarr.json')} of 'w'" in out
    assert ("is damaged: changed after the save" if records else "data type int32, expected float32") in out



def test_durable_save_fsyncs_every_file_and_directory_before_the_commit_marker(tmp_path, monkeypatch):
    """zarr's local store writes chunk files (and ``zarr.json``) without fsync: with ``durable=True``
    every one of them, and every directory holding them, must be fsync'ed before ``metadata.json``."""
    synced = []
    real_fsync = os.fsync

    def fsync(fd):  # a file written atomically is fsync'ed under its temporary name (<name>.tmp-<pid>-<thread>)
        synced.append(re.sub(r"\.tmp-\d+-\d+$", "", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = str(tmp_path / "ckpt")
    state = _state()
    state["nested"] = ShardedTensor.from_rank_offsets("model/layer/w", torch.arange(8.0 * 6).reshape(8, 6))
    ci.save(state, path, sharded_strategy="zarr")
    monkeypatch.undo()
    commit = next(i for i, p in enumerate(synced) if os.path.basename(p).startswith("metadata.json"))
    before = set(synced[:commit])
    every = set()
    for root, dirs, files in os.walk(path):
        every.update(os.path.join(root, d) for d in dirs)
        every.update(os.path.join(root, f) for f in files if f != "metadata.json")
    missing = sorted(os.path.relpath(p, path) for p in every - before)
    assert not missing, f"not fsync'ed before the commit marker: {missing}"
    assert any(p.endswith(os.path.join("model", "layer", "w", "c", "0")) for p in before)


def test_a_chunk_write_the_disk_refuses_names_the_chunk_file(tmp_path, monkeypatch):
    """A full disk during a local zarr save named ``/c/0`` (the store's path was looked up under an
    fsspec store's attribute): the error names the chunk's file in the checkpoint."""
    import errno

    from zarr.storage import LocalStore

    from ckpt_integration.errors import CheckpointWriteError

    real = LocalStore.set

    async def full(self, key, value, *args, **kwargs):  # (chunks only: the arrays' metadata is written)
        if "/c/" in key or key.startswith("c/"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real(self, key, value, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "set", full)
    path = tmp_path / "ck"
    with pytest.raises(CheckpointWriteError) as info:
        ci.save({"w": ci.ShardedTensor.from_rank_offsets("layer.w", torch.ones(1024))}, str(path), sharded_strategy="zarr")
    assert info.value.errno == errno.ENOSPC and str(info.value.path).startswith(str(path) + "/"), (info.value, info.value.path)


def test_an_array_the_disk_cannot_create_is_named(tmp_path, monkeypatch):
    """Out of inodes while zarr made an array's folder: a bare ``OSError`` ("[Errno 28] ... '<dir>/t1'")
    came out of the save's preparation; it is a ``CheckpointWriteError`` naming the array's path."""
    import errno

    import zarr

    def no_inodes(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(zarr, "create_array", no_inodes)
    with pytest.raises(ci.CheckpointingException,
                       match=r"CheckpointWriteError: no space left on device while writing .*/ck/t1"):
        ci.save({"t1": ci.ShardedTensor.from_rank_offsets("t1", torch.ones(8))}, str(tmp_path / "ck"),
                sharded_strategy="zarr")


def test_removing_keys_from_a_zarr_checkpoint_leaves_nothing_an_overwrite_refuses(tmp_path):
    """``remove_sharded_tensors`` on zarr deleted a key's files but left their directories (an object's,
    the parents of nested keys) empty and unindexed: a later ``save(overwrite=True)`` refused the checkpoint
    for holding "files this library did not write"."""
    state = {"w": ShardedTensor.from_rank_offsets("model/w", torch.ones(3, 2)),
             "m": ShardedTensor.from_rank_offsets("opt/state/m", torch.full((3, 2), 2.0)),
             "rng": ShardedObject("opt/rng", {"x": 1}, (1,), (0,))}
    ck = str(tmp_path / "ck")
    ci.save(state, ck, "zarr")
    ci.remove_sharded_tensors(ck, "opt/")
    assert not os.path.exists(os.path.join(ck, "opt"))
    assert os.listdir(os.path.join(ck, "model")) == ["w"]
    ci.save(state, ck, "zarr", overwrite=True)
    out = ci.load({"m": ShardedTensor.from_rank_offsets("opt/state/m", torch.empty(3, 2))}, ck)
    assert torch.equal(out["m"], torch.full((3, 2), 2.0))
