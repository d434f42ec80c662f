"""``index.bin`` (manifest format 6): one row per stored item, the only record of the items' places and
digests, from which loads derive the item table, the chunk index and the fingerprints (issue 37, item 1)."""

from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np
import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import ShardedObject, ShardedTensor
from ckpt_integration.errors import CorruptCheckpointError
from ckpt_integration.storage import checkpoint_dir as ckdir
from ckpt_integration.storage.checkpoint_index import INDEX_FILE, CheckpointIndex, encode_index
from ckpt_integration.storage.checksum import crc32
from ckpt_integration.storage.filesystem import locate
from ckpt_integration.storage.opened import OpenedCheckpoint
from ckpt_integration.tools.verify import verify_checkpoint
from tests.damage import write_manifest


def _state(fill: bool = True) -> dict:
    def t(shape, dtype=torch.float32, base=0):
        n = int(np.prod(shape))
        return (torch.arange(n, dtype=torch.float64) + base).reshape(shape).to(dtype) if fill else torch.zeros(shape, dtype=dtype)

    sd = {
        "w": ShardedTensor.from_rank_offsets("w", t((6, 4))),
        "b": ShardedTensor.from_rank_offsets("b", t((5,), torch.int64, 3)),
        "h": ShardedTensor.from_rank_offsets("h", t((2, 3), torch.bfloat16, 7)),
        "big": ShardedTensor.from_rank_offsets("big", t((300, 1024), base=1)),  # (above 1 MiB: several blocks)
        "opt.m": ShardedTensor.from_rank_offsets("opt.m", t((6, 4), base=2)),
        "o": ShardedObject("o", {"x": [1, 2]} if fill else None, (1,), (0,), replica_id=0),
    }
    if fill:
        sd["step"] = 9
    return sd


def _save(path, version=None, monkeypatch=None) -> str:
    if version is not None:
        monkeypatch.setattr(ckdir, "SAVE_MANIFEST_VERSION", version)
    ci.save(_state(), str(path))
    return str(path)


def _load(path) -> dict:
    return ci.load(_state(fill=False), str(path))


def _check(out: dict) -> None:
    want = _state()
    for k in ("w", "b", "h", "big", "opt.m"):
        assert out[k].dtype == want[k].data.dtype and torch.equal(out[k], want[k].data), k
    assert out["o"] == {"x": [1, 2]} and out["step"] == 9


def test_format_6_keeps_every_item_in_one_index_and_its_views_equal_format_5s_records(tmp_path, monkeypatch):
    p6 = _save(tmp_path / "v6")
    names = sorted(os.listdir(p6))
    assert INDEX_FILE in names and "chunk_index.bin" not in names, names
    raw = json.loads(open(os.path.join(p6, "manifest.json")).read())
    assert raw["version"] == ckdir.MANIFEST_VERSION >= 6 and "tables" not in raw and "fingerprints" not in raw, raw
    assert raw["files"][INDEX_FILE]["crc32"] == crc32(open(os.path.join(p6, INDEX_FILE), "rb").read())
    _check(_load(p6))
    p5 = _save(tmp_path / "v5", 5, monkeypatch)
    with OpenedCheckpoint(p6) as a, OpenedCheckpoint(p5) as b:
        # the same save in both formats: the data files are the same bytes, so every derived record is
        ta, tb = a.manifest.item_table(), b.manifest.item_table()
        assert ta.files == tb.files
        for col in ("file", "offset", "nblocks", "data_offset", "data_length", "block_size", "block_digests"):
            assert np.array_equal(getattr(ta, col), getattr(tb, col)), col
        # (format 6 stores no XXH3-64 item digest its block digests determine: derived, they are the recorded ones)
        assert np.array_equal(ta.digests(), tb.digest) and not ta.digest[ta.nblocks >= 0].any()
        ca, cb = a.chunk_index(), b.chunk_index()
        assert ca.full().state_dict_metadata == cb.full().state_dict_metadata
        assert ca.full().storage_data == cb.full().storage_data
        fa, fb = a.manifest.recorded_fingerprints(), b.manifest.recorded_fingerprints()
        for key in ("w", "b", "h", "big", "opt.m"):
            assert fa.chunks(key) == fb.chunks(key) and fa.total(key) is not None, key
        assert "o" not in fa and "o" not in fb
        rows = a.manifest.index().layout.written
        assert len(rows) == 6 and sorted(a.manifest.index().layout.tensor_keys) == ["b", "big", "h", "opt.m", "w"]
    report = verify_checkpoint(p6, state=True)
    assert report.ok and report.state_checked == 5, report.problems


def _rewrite_index(path: str, data: bytes) -> None:
    """Replace index.bin and record the new bytes in the manifest (damage the CRC32 cannot see)."""
    with open(os.path.join(path, INDEX_FILE), "wb") as f:
        f.write(data)
    man = json.loads(open(os.path.join(path, "manifest.json")).read())
    man["files"][INDEX_FILE] = {"size": len(data), "crc32": crc32(data)}
    write_manifest(os.path.join(path, "manifest.json"), man)


def _edited(raw: bytes, edit) -> bytes:
    """The same index with its column message changed by ``edit(strings, columns, ints)`` (``columns``:
    the eleven row columns, writable views of ``ints``), consistently: damage its CRC32 cannot see."""
    head = struct.Struct("<4sIIIQQQqq")
    fields = list(head.unpack_from(raw, 0))
    n, nmsg = fields[4], fields[6]
    from ckpt_integration.planning.records import decode_array, difference_ints, encode_array

    msg = bytearray(zlib.decompress(raw[head.size : head.size + nmsg]))
    difference_ints(msg, undo=True)
    strings, ints = decode_array(bytes(msg))
    ints = ints.copy()
    edit(strings, ints[2 : 2 + 11 * n].reshape(11, n), ints)
    out = bytearray(encode_array(strings, ints))
    difference_ints(out)
    z = zlib.compress(bytes(out), 1)
    fields[6] = len(z)
    return head.pack(*fields) + z + raw[head.size + nmsg :]


def _rows_swapped(strings, cols, ints) -> None:
    """Two rows' offsets exchanged (rows out of order)."""
    files, offsets = cols[3], cols[4]
    i = int(np.flatnonzero(files[1:] == files[:-1])[0])  # (two rows of one data file)
    offsets[[i, i + 1]] = offsets[[i + 1, i]]


def _blocked_row(cols) -> int:
    return int(np.flatnonzero(cols[9] >= 0)[0])  # (a row with block digests)


def _set(column: int, value, row=_blocked_row):
    def edit(strings, cols, ints):
        cols[column][row(cols)] = value(cols) if callable(value) else value
    return edit


def _renamed(old: str, new: str):
    def edit(strings, cols, ints):
        strings[strings.index(old)] = new
    return edit


def _case(edit, said):
    return (lambda p, raw: _rewrite_index(p, _edited(raw, edit)), said)


DAMAGE = {
    "missing": (lambda p, raw: os.remove(os.path.join(p, INDEX_FILE)), "is missing"),
    "truncated": (lambda p, raw: open(os.path.join(p, INDEX_FILE), "wb").write(raw[:-9]), "is damaged"),
    "emptied": (lambda p, raw: open(os.path.join(p, INDEX_FILE), "wb").write(b""), "is damaged"),
    "flipped": (lambda p, raw: open(os.path.join(p, INDEX_FILE), "wb").write(raw[:70] + bytes([raw[70] ^ 1]) + raw[71:]),
                "is damaged"),
    "cut_short_recorded": (lambda p, raw: _rewrite_index(p, raw[:-8]), "is damaged"),
    "rows_out_of_order": _case(_rows_swapped, "not sorted by file and offset"),
    # the checks a format-5 item table makes, which the index's rows once skipped (a zero block size
    # raised ZeroDivisionError inside a read)
    "block_size_zero": _case(_set(8, 0), "block size that is not positive"),
    "data_beyond_item": _case(_set(7, lambda c: int(c[5][_blocked_row(c)])), "data range exceeds its item"),
    "fingerprint_flag_invalid": _case(_set(10, 2), "invalid fingerprint flag"),
    # two keys of one name (distinct string ids): one tensor's chunks were silently taken for the other's
    "tensor_key_twice": _case(_renamed("big", "b"), "a key is listed twice"),
    "object_key_is_a_tensor_key": _case(_renamed("o/shard_0_1", "w"), "is a tensor key too"),
    # two data files of one name: the items of one would have been looked up in the other's rows
    "file_named_twice": _case(_renamed("__0_1.distcp", "__0_0.distcp"), "a data file name is listed twice"),
    "newer_version": (lambda p, raw: _rewrite_index(p, raw[:4] + struct.pack("<I", 2) + raw[8:]), "index version 2"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_or_missing_index_is_refused_by_load_and_reported_by_verify(tmp_path, case):
    """No fallback to .metadata: without index.bin no byte could be verified."""
    path = _save(tmp_path / "c")
    raw = open(os.path.join(path, INDEX_FILE), "rb").read()
    damage, said = DAMAGE[case]
    damage(path, raw)
    with pytest.raises(CorruptCheckpointError, match=INDEX_FILE) as e:
        _load(path)
    assert said in str(e.value), str(e.value)
    report = verify_checkpoint(path)
    assert not report.ok and any(INDEX_FILE in p for p in map(str, report.problems)), report.problems


def test_an_index_that_does_not_describe_metadata_is_reported_by_verify(tmp_path):
    """DCP and Megatron-Core read .metadata, loads the index: verify says when they disagree."""
    path = _save(tmp_path / "c")
    with OpenedCheckpoint(path) as ck:
        index = ck.manifest.index()
        entry = ck.manifest.files[".metadata"]
        fewer = index.without_keys({"b"}, entry)  # (made with this .metadata, but without one key's row)
        other = encode_index(index.layout, index.hash, {"size": 1, "crc32": 2})
    _rewrite_index(path, fewer)
    report = verify_checkpoint(path)
    assert not report.ok and "does not describe .metadata as saved: 'b'" in str(report.problems), report.problems
    _rewrite_index(path, other)
    report = verify_checkpoint(path)
    assert not report.ok and "was not made with .metadata as it is now" in str(report.problems), report.problems


def test_remove_sharded_tensors_rewrites_the_index(tmp_path):
    path = _save(tmp_path / "c")
    ci.remove_sharded_tensors(path, "opt.")
    with OpenedCheckpoint(path) as ck:
        assert "opt.m" not in ck.manifest.index().layout.tensor_keys
        assert len(ck.manifest.index()) == 5
    sd = _state(fill=False)
    del sd["opt.m"]
    out = ci.load(sd, path)
    want = _state()
    for k in ("w", "b", "h", "big"):
        assert torch.equal(out[k], want[k].data), k
    assert out["o"] == {"x": [1, 2]}
    assert verify_checkpoint(path, state=True).ok


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_remove_sharded_tensors_that_fails_part_way_leaves_the_checkpoint_loading(tmp_path, monkeypatch, backend):
    """The manifest's rewrite failed (a full disk, an object store that gave up) after ``.metadata`` and
    the index were rewritten: every later load refused the checkpoint as damaged (the manifest still
    recorded the old files' sizes and CRC32s)."""
    from ckpt_integration import serialization

    path = str(tmp_path / "c")
    ci.save(_state(), path, sharded_strategy=backend)
    real = ckdir.write_manifest

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(serialization.ckdir, "write_manifest", failing)
    with pytest.raises(OSError, match="No space left"):
        ci.remove_sharded_tensors(path, "opt.")
    monkeypatch.setattr(serialization.ckdir, "write_manifest", real)
    out = ci.load(_state(fill=False), path)  # the old content, opt.m included, verified
    want = _state()
    for k in ("w", "b", "h", "big", "opt.m"):
        assert torch.equal(out[k], want[k].data), k
    assert verify_checkpoint(path, state=True).ok
    ci.remove_sharded_tensors(path, "opt.")  # and the removal works once the cause is gone
    assert "opt.m" not in ci.load_tensors_metadata(path)


def test_an_index_round_trips_exactly(tmp_path):
    path = _save(tmp_path / "c")
    raw = open(os.path.join(path, INDEX_FILE), "rb").read()
    h = ckdir.read_manifest(locate(path)).hash
    index = CheckpointIndex(raw, h, INDEX_FILE)
    assert encode_index(index.layout, h, {"size": index.metadata_size, "crc32": index.metadata_crc32}) == raw


def test_loads_never_unpickle_metadata_and_verify_names_it_when_damaged(tmp_path):
    """``.metadata`` is an export for DCP and Megatron-Core: a load plans from the index, so a
    ``.metadata`` that would run code, or is gone, changes nothing a load does; verify reports it."""
    import pickle

    path = _save(tmp_path / "c")
    marker = tmp_path / "pwned"

    class RunsCode:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    md.planner_data = {"w": RunsCode()}
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    _check(_load(path))
    assert ci.load_tensors_metadata(path)["w"].global_shape == (6, 4)
    report = verify_checkpoint(path)
    assert not marker.exists()
    assert not report.ok and ".metadata is damaged" in str(report.problems), report.problems
    os.remove(os.path.join(path, ".metadata"))
    _check(_load(path))


def test_a_consistently_rewritten_index_loads_the_saved_data_or_is_refused(tmp_path):
    """Fuzz the corpus's format-6 index with its manifest entry kept consistent (the CRC32 sees nothing):
    changed integers in its rows, keys and shapes, swapped integers, flipped digest or fingerprint bits
    and changed header fields. Every load either returns exactly the saved data or raises a
    ``CheckpointingException``: never other data, never a raw error from deep in a read (before,
    a zero block size raised ZeroDivisionError). Seeded: the same 200 cases in every run."""
    import random
    import shutil

    from ckpt_integration.errors import CheckpointingException
    from tests.corpus import CORPUS_DIR, SHAPES, expected_full, expected_object, sharded_state

    src = CORPUS_DIR / "format6" / "torch_dist-sync"
    raw = open(src / INDEX_FILE, "rb").read()
    head = struct.Struct("<4sIIIQQQqq")
    end = head.size + head.unpack_from(raw, 0)[6]
    rng = random.Random(37)

    def mutate() -> bytes:
        kind = rng.choice(["int", "int", "near", "swap", "tail", "head"])
        if kind == "tail":
            i = rng.randrange(end, len(raw))
            return raw[:i] + bytes([raw[i] ^ (1 << rng.randrange(8))]) + raw[i + 1 :]
        if kind == "head":
            fields = list(head.unpack_from(raw, 0))
            j = rng.choice([1, 2, 3, 4, 5])
            fields[j] = rng.choice([0, 1, 2, 3, 8, fields[j] + 1, max(0, fields[j] - 1)])
            return head.pack(*fields) + raw[head.size :]

        def edit(strings, cols, ints):
            a, b = rng.randrange(len(ints)), rng.randrange(len(ints))
            if kind == "swap":
                ints[a], ints[b] = ints[b], ints[a]
            elif kind == "near":
                ints[a] += rng.choice([-8, -2, -1, 1, 2, 8])
            else:
                ints[a] = rng.choice([-1, 0, 1, 2, 10**6, 2**40, -(2**40)])
        return _edited(raw, edit)

    outcomes = {"same": 0, "refused": 0}
    for _ in range(200):
        path = str(tmp_path / "c")
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(src, path)
        _rewrite_index(path, mutate())
        try:
            got = ci.load_plain_tensors(path, verify_state=True)
            assert sorted(got) == sorted(SHAPES)
            for key in SHAPES:
                assert got[key].dtype == expected_full(key).dtype and torch.equal(got[key], expected_full(key)), key
            for r in range(4):  # (each rank's part of the 4-rank save, objects included)
                out = ci.load(sharded_state(r), path, validate_access_integrity=False)
                assert out["rng"] == expected_object(r % 2)
                for k, v in sharded_state(r).items():
                    if k != "rng":
                        assert torch.equal(out[k], v.data), k
            outcomes["same"] += 1
        except CheckpointingException:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100, outcomes  # (most changes matter; the rest touch fields a load does not use)
