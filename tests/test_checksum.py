"""Block digests: XXH3-64 (new saves) and CRC32 as docs/format.md defines them in the manifest's
item table, unknown algorithms refused, and the hashes running without the GIL.

The format tests recompute every recorded digest independently (``zlib``, ``xxhash`` and the
file's bytes), so they pin the on-disk definition, not just a round trip through our code.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
import time
import zlib

import numpy as np
import pytest
import torch
import xxhash

import ckpt_integration as ci
from ckpt_integration import ShardedObject, ShardedTensor
from ckpt_integration.cli import main
from ckpt_integration.storage import checkpoint_dir as ckdir
from ckpt_integration.storage import checksum
from ckpt_integration.storage import torch_dist as td
from tests.damage import flip_byte, write_manifest

ROWS, COLS = 64, 96  # 24 KiB of float32: 3 data blocks of 8 KiB

# the keys of a format-5 manifest
FORMAT_5_KEYS = {"format", "version", "created", "step", "commit_seq", "commit_id", "world_size", "block_hash", "files",
                 "library_version", "save", "fingerprints", "tables"}


def _save(d, block_hash: str, monkeypatch, seed: int = 0) -> torch.Tensor:
    monkeypatch.setattr(checksum, "SAVE_BLOCK_HASH", block_hash)
    monkeypatch.setattr(td, "BLOCK_SIZE", 8 << 10)
    w = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))
    ci.save({"w": ShardedTensor.from_rank_offsets("w", w.clone()), "o": ShardedObject("o", {"s": seed}, (1,), (0,))},
            str(d), thread_count=1, durable=False)
    return w


def _load(d) -> dict:
    return ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS)),
                    "o": ShardedObject("o", None, (1,), (0,))}, str(d))


def _items(d):
    """``{(file, offset): (length, key)}`` from ``.metadata``."""
    import pickle

    md = pickle.loads((d / ".metadata").read_bytes())
    return {(v.relative_path, v.offset): (v.length, k.fqn) for k, v in md.storage_data.items()}


# =========================================================================== the algorithms
@pytest.mark.parametrize("name", checksum.BLOCK_HASHES)
def test_running_digest_equals_one_call_and_the_reference(name):
    h = checksum.block_hash(name)
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    ref = zlib.crc32 if name == "crc32" else xxhash.xxh3_64_intdigest
    assert h.digest(data) == h.digest(memoryview(data)) == ref(data)
    run = h.hasher()
    for a, b in ((0, 1), (1, 70000), (70000, 70000), (70000, 2 << 20), (2 << 20, len(data))):
        run.update(memoryview(data)[a:b])
    assert run.intdigest() == ref(data)
    assert list(h.unpack(h.pack([0, 1, (1 << 8 * h.width) - 1]))) == [0, 1, (1 << 8 * h.width) - 1]


def test_item_digest_definitions():
    """CRC32: the CRC32 of the item's bytes (combined from the blocks); XXH3-64: XXH3-64 of the
    block digests as little-endian uint64, concatenated (docs/format.md)."""
    data = np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    parts = [data[:700], data[700:3000], data[3000:]]
    crc = checksum.block_hash("crc32")
    assert crc.item_digest([zlib.crc32(p) for p in parts], [len(p) for p in parts]) == zlib.crc32(data)
    xx = checksum.block_hash("xxh3_64")
    ds = [xxhash.xxh3_64_intdigest(p) for p in parts]
    assert xx.item_digest(ds, [len(p) for p in parts]) == xxhash.xxh3_64_intdigest(struct.pack("<3Q", *ds))


@pytest.mark.parametrize("name", checksum.BLOCK_HASHES)
@pytest.mark.parametrize("running", [False, True])
def test_hashing_a_large_buffer_releases_the_gil(name, running):
    """Loads checksum from several threads: while one thread hashes a large buffer, another runs."""
    h = checksum.block_hash(name)
    buf = np.ones(256 << 20, dtype=np.uint8)
    stamps, stop = [], threading.Event()

    def other() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    t = threading.Thread(target=other)
    t.start()
    time.sleep(0.01)
    try:
        t0 = time.perf_counter()
        if running:
            r = h.hasher()
            r.update(buf)
            r.intdigest()
        else:
            h.digest(buf)
        t1 = time.perf_counter()
    finally:
        stop.set()
        t.join()
    # with the GIL held for the whole call the other thread could not run in its middle part
    assert any(t0 + 0.3 * (t1 - t0) < s < t0 + 0.7 * (t1 - t0) for s in stamps), (t1 - t0, len(stamps))


# =========================================================================== manifest formats
def _tables_of_format_4(text: str, width_: int = 8):
    """``items`` and ``blocks`` as formats 2 and 3 spelled them, decoded by hand from a format-4
    ``tables`` field as docs/format.md describes it (not through the library's reader)."""
    from ckpt_integration.planning.records import decode_array

    raw = base64.b64decode(text)
    magic, version, width, n, nb, nmsg = struct.unpack_from("<4sIIQQQ", raw, 0)
    assert (magic, version) == (b"CKIT", 1) and width == width_
    files, ints = decode_array(raw[36 : 36 + nmsg])
    file, off, nblocks, d, ln, b = ints.reshape(6, n).tolist()
    fmt = "Q" if width == 8 else "I"
    digests = struct.unpack_from(f"<{n + nb}{fmt}", raw, 36 + nmsg)
    assert len(raw) == 36 + nmsg + width * (n + nb)
    keys = [f"{files[f]}@{o}" for f, o in zip(file, off)]
    assert keys == sorted(keys, key=lambda k: (k.rpartition("@")[0], int(k.rpartition("@")[2])))
    items, blocks, pos = {}, {}, n
    for i, k in enumerate(keys):
        items[k] = digests[i]
        if nblocks[i] >= 0:
            packed = base64.b64encode(struct.pack(f"<{nblocks[i]}{fmt}", *digests[pos : pos + nblocks[i]])).decode()
            blocks[k] = [d[i], ln[i], b[i], packed]
            pos += nblocks[i]
    assert pos == n + nb
    return items, blocks


def _tables_of_format_6(raw: bytes, width_: int = 8):
    """``items`` and ``blocks`` as :func:`_tables_of_format_4` gives them, decoded by hand from a
    format-6 ``index.bin`` as docs/format.md describes it (its rows' data file, offset and block
    record; the keys and boxes are checked against the data in test_checkpoint_index.py)."""
    from ckpt_integration.planning.records import decode_array, difference_ints

    magic, version, width, flags, n, nb, nmsg, _, _ = struct.unpack_from("<4sIIIQQQqq", raw, 0)
    assert (magic, version) == (b"CKIX", 1) and width == width_ and flags in (0, 1, 2, 3)
    msg = bytearray(zlib.decompress(raw[56 : 56 + nmsg]))
    difference_ints(msg, undo=True)  # (stored as first differences)
    strings, ints = decode_array(bytes(msg))
    nfiles = int(ints[0])
    key, nd, has_sizes, file, off, length, d, ln, b, nblocks, has_fp = ints[2 : 2 + 11 * n].reshape(11, n).tolist()
    fmt = "Q" if width == 8 else "I"
    # flag 2 (XXH3-64): item digests only of the rows without block digests, the others are XXH3-64
    # of their block digests
    stored = sum(1 for k in nblocks if k < 0) if flags & 2 else n
    assert (flags & 2 != 0) == (width == 8)
    digests = struct.unpack_from(f"<{stored + nb}{fmt}", raw, 56 + nmsg)
    assert len(raw) == 56 + nmsg + width * (stored + nb) + (8 * n if flags & 1 else 0)
    assert all(0 <= f < nfiles for f in file)
    keys = [f"{strings[f]}@{o}" for f, o in zip(file, off)]
    assert keys == sorted(keys, key=lambda k: (k.rpartition("@")[0], int(k.rpartition("@")[2])))
    items, blocks, pos, given = {}, {}, stored, iter(digests[:stored])
    for i, k in enumerate(keys):
        if nblocks[i] >= 0:
            own = digests[pos : pos + nblocks[i]]
            blocks[k] = [d[i], ln[i], b[i], base64.b64encode(struct.pack(f"<{nblocks[i]}{fmt}", *own)).decode()]
            items[k] = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(own)}Q", *own)) if flags & 2 else next(given)
            pos += nblocks[i]
        else:
            items[k] = next(given)
    assert pos == stored + nb
    return items, blocks


@pytest.mark.parametrize("block_hash,version", [("xxh3_64", 6), ("crc32", 6), ("xxh3_64", 5), ("xxh3_64", 4),
                                                ("crc32", 5)])
def test_recorded_digests_are_those_of_the_stored_bytes(tmp_path, monkeypatch, block_hash, version):
    """Every block and item digest, recomputed from the data file: format 6 (XXH3-64, 8 bytes per
    block, in index.bin) for new saves, formats 5 (one binary table in the manifest) and 4 (the
    same without fingerprints) through the switch, and CRC32 (4 bytes) in the same formats."""
    d = tmp_path / "c"
    monkeypatch.setattr(ckdir, "SAVE_MANIFEST_VERSION", version)
    want = _save(d, block_hash, monkeypatch)
    man = json.loads((d / "manifest.json").read_text())
    assert man["version"] == version and man["block_hash"] == block_hash
    assert set(man) == FORMAT_5_KEYS - ({"fingerprints"} if version == 4 else
                                        {"fingerprints", "tables"} if version == 6 else set())
    if block_hash == "xxh3_64":
        ref, width = xxhash.xxh3_64_intdigest, 8
    else:
        ref, width = zlib.crc32, 4
    if version == 6:
        man["items"], man["blocks"] = _tables_of_format_6((d / "index.bin").read_bytes(), width)
    else:
        man["items"], man["blocks"] = _tables_of_format_4(man["tables"], width)
    items = _items(d)
    assert len(man["blocks"]) == 1 and len(man["items"]) == 2
    for key, recorded in man["items"].items():
        name, _, off = key.rpartition("@")
        length, fqn = items[(name, int(off))]
        item = (d / name).read_bytes()[int(off): int(off) + length]
        if key not in man["blocks"]:  # the object: the digest of its bytes
            assert recorded == ref(item), fqn
            continue
        data_offset, data_length, block_size, packed = man["blocks"][key]
        assert (data_length, block_size) == (ROWS * COLS * 4, 8 << 10)
        assert item[data_offset:data_offset + data_length] == want.numpy().tobytes()
        bounds = [0, *range(data_offset, data_offset + data_length, block_size), data_offset + data_length, length]
        parts = [item[a:b] for a, b in zip(bounds, bounds[1:])]
        raw = base64.b64decode(packed)
        assert len(raw) == width * len(parts) == width * 5
        digests = list(struct.unpack(f"<{len(parts)}{'Q' if width == 8 else 'I'}", raw))
        assert digests == [ref(p) for p in parts]
        whole = ref(struct.pack(f"<{len(parts)}Q", *digests)) if width == 8 else zlib.crc32(item)
        assert recorded == whole
    assert torch.equal(_load(d)["w"], want)


@pytest.mark.parametrize("block_hash", ["xxh3_64", "crc32"])
def test_a_flipped_byte_is_found_by_loads_and_verify(tmp_path, monkeypatch, capsys, block_hash):
    d = tmp_path / "c"
    _save(d, block_hash, monkeypatch)
    assert main(["verify", str(d)]) == 0
    (length, _), where = next(((v, k) for k, v in _items(d).items() if v[1] == "w"))
    flip_byte(d / where[0], where[1] + length // 2)
    with pytest.raises(ci.CorruptCheckpointError, match="checksum mismatch") as ei:
        _load(d)
    label = "XXH3-64" if block_hash == "xxh3_64" else "CRC32"
    assert where[0] in str(ei.value) and label in str(ei.value), str(ei.value)
    capsys.readouterr()
    assert main(["verify", str(d)]) == 1
    assert "checksum mismatch" in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
@pytest.mark.parametrize("where", ["step", "world_size", "save", "version_7_to_6", "version_6_to_7"])
def test_a_manifest_changed_by_one_bit_is_refused_by_its_own_checksum(tmp_path, monkeypatch, capsys, backend, where):
    """Before format 7 nothing checked ``manifest.json`` itself: one flipped bit turned a recorded step 30
    into 20 (so ``"last"`` and ``base="auto"`` picked an older checkpoint) or the world size into 0, and
    loads and ``verify`` said nothing. Now its head and its whole text carry CRC32s; a format-6 manifest
    (no seal) that claims 7 is refused too, and a sealed one that claims 6 is still checked."""
    d = tmp_path / "c"
    if where == "version_6_to_7":
        monkeypatch.setattr(ckdir, "SAVE_MANIFEST_VERSION", 6)
        if backend == "zarr":
            monkeypatch.setattr(ckdir, "ZARR_MANIFEST_VERSION", 5)
    w = torch.arange(12.0).reshape(3, 4)
    ci.save({"w": ShardedTensor.from_rank_offsets("w", w.clone())}, str(d), backend, durable=False, step=30)
    path = d / "manifest.json"
    data = bytearray(path.read_bytes())
    pattern = {"step": b'"step": 3', "world_size": b'"world_size": 1', "save": b'"save": "',
               "version_7_to_6": b'"version": 7', "version_6_to_7": b'"version": '}[where]
    at = data.index(pattern) + len(pattern) - (0 if where in ("save", "version_6_to_7") else 1)
    data[at] ^= ord("7") ^ data[at] if where == "version_6_to_7" else 0x01  # (one bit: 6 -> 7, zarr's 5 -> 7)
    path.write_bytes(bytes(data))
    json.loads(bytes(data))  # (still valid JSON: a change only a checksum can see)
    with pytest.raises(ci.CorruptCheckpointError, match=r"manifest\.json is damaged: .*(own checksum|CRC32)"):
        ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}, str(d))
    if where in ("world_size", "save"):  # (listings read the sealed head only; the load above refuses the rest)
        assert ci.checkpoints.newest_checkpoint(str(tmp_path)) == str(d)
    else:
        with pytest.raises(ci.CorruptCheckpointError, match=r"manifest\.json is damaged"):
            ci.checkpoints.newest_checkpoint(str(tmp_path))
    capsys.readouterr()
    assert main(["verify", str(d)]) == 1
    assert "manifest.json is damaged" in capsys.readouterr().out


def test_unknown_block_hash_is_refused_naming_the_file_and_algorithm(tmp_path, monkeypatch, capsys):
    d = tmp_path / "c"
    _save(d, "xxh3_64", monkeypatch)
    man = json.loads((d / "manifest.json").read_text())
    man["block_hash"] = "blake9"
    write_manifest(d / "manifest.json", man)
    with pytest.raises(ci.errors.UnknownBlockHashError, match=r"manifest\.json.*'blake9'") as ei:
        _load(d)
    assert isinstance(ei.value, ci.errors.UnsupportedCheckpointError) and str(d) in str(ei.value)
    with pytest.raises(ci.errors.UnknownBlockHashError):
        ci.load_common_state_dict(str(d))
    capsys.readouterr()
    assert main(["verify", str(d)]) == 1
    out = capsys.readouterr().out
    assert "'blake9'" in out and "NOT VERIFIED" in out and "DAMAGED" not in out, out  # unverifiable, not damaged
    assert ci.list_checkpoints(str(tmp_path)) == [str(d)]  # listing still works


@pytest.mark.parametrize("change", ["without_name", "crc32_named_xxh3"])
def test_manifest_whose_table_and_algorithm_disagree_is_damaged(tmp_path, monkeypatch, change):
    d = tmp_path / "c"
    _save(d, "xxh3_64" if change == "without_name" else "crc32", monkeypatch)
    man = json.loads((d / "manifest.json").read_text())
    if change == "without_name":
        del man["block_hash"]
    else:
        man["block_hash"] = "xxh3_64"
    write_manifest(d / "manifest.json", man)
    # (format 6 keeps the digests in index.bin, whose width then disagrees with the name)
    with pytest.raises(ci.CorruptCheckpointError, match=r"(manifest\.json|index\.bin) is damaged"):
        _load(d)


@pytest.mark.parametrize("change", ["not_base64", "truncated", "no_tables", "json_items_too", "emptied", "v3_with_tables"])
def test_format_4_tables_damaged_or_misplaced_are_refused(tmp_path, monkeypatch, capsys, change):
    """A manifest whose binary table is damaged (not base64, cut short), missing, mixed with format
    3's JSON tables or emptied (it once turned verification off: the load read every item
    unchecked): every load and ``verify`` refuse it as damage naming the manifest; nothing is read
    unverified. A manifest that says format 3 but carries the table is refused by loads as an older
    format and by ``convert`` as damage. The same checkpoint loads once the manifest is restored."""
    from ckpt_integration.tools import convert_checkpoint

    d = tmp_path / "c"
    monkeypatch.setattr(ckdir, "SAVE_MANIFEST_VERSION", 5)  # (format 6 has no 'tables': tests/test_checkpoint_index.py)
    want = _save(d, "xxh3_64", monkeypatch)
    good = (d / "manifest.json").read_text()
    man = json.loads(good)
    assert man["version"] == 5  # format 4 tables, plus fingerprints (format 5)
    if change == "not_base64":
        man["tables"] = "not base64!"
    elif change == "truncated":
        man["tables"] = base64.b64encode(base64.b64decode(man["tables"])[:-8]).decode()
    elif change == "no_tables":
        del man["tables"]
    elif change == "json_items_too":
        man["items"] = {"__0_0.distcp@0": 1}
    elif change == "emptied":
        man["tables"] = ""
    else:
        man["version"] = 3
    write_manifest(d / "manifest.json", man)
    if change == "v3_with_tables":
        with pytest.raises(ci.errors.UnsupportedCheckpointError, match="ckpt-integration convert"):
            _load(d)
        with pytest.raises(ci.CorruptCheckpointError, match=r"manifest\.json is damaged: format 3 has no 'tables'"):
            convert_checkpoint(str(d), "torch_dist", str(tmp_path / "out"))
    else:
        damaged = r"manifest\.json has no checksum for " if change == "emptied" else r"manifest\.json is damaged"
        with pytest.raises(ci.CorruptCheckpointError, match=damaged) as ei:
            _load(d)
        assert str(d) in str(ei.value)
    capsys.readouterr()
    assert main(["verify", str(d)]) == 1
    assert "manifest.json" in capsys.readouterr().out
    (d / "manifest.json").write_text(good)
    assert torch.equal(_load(d)["w"], want)


# =========================================================================== digests between ranks
def test_finalize_messages_carry_64_bit_digests():
    from ckpt_integration.planning import exchange as ex

    big = [0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) + 5, (1 << 64) - 1]
    written = [ex.Written("w", (0, 0), (4, 4), "__0_0.distcp", 0, 1000, (1 << 64) - 2, (64, 512, 256, big)),
               ex.Written("v", (0, 0), (4, 4), "__0_0.distcp", 2000, 9000, 7, (64, 8000, 256, big * 5)),
               ex.Written("o/shard_0_1", None, None, "__0_0.distcp", 1000, 10, 1 << 63, None)]
    _, got, _ = ex.decode_finalize(ex.encode_finalize(None, written, []))
    assert got.items() == written  # (decoded as columns)


# =========================================================================== memory tier records
@pytest.mark.parametrize("name", checksum.BLOCK_HASHES)
def test_memory_snapshot_regions_verify_with_the_recorded_algorithm(name):
    from ckpt_integration.memory import slots

    h = checksum.block_hash(name)
    buf = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    header = {"job_id": "j", "owner": 0, "step": 1, "incarnation": [1, "x"], "files": {"s0-1.bin": buf.numel()},
              "shards": [], "slot": 0, "world_size": 1, "regions": [["s0-1.bin", 0, buf.numel(), slots.block_digests(buf, h=h)]],
              "block_hash": name}
    rec = slots.decode_record(slots.encode_record(header, b""), "r")
    assert rec.block_hash is h
    _, _, _, digests = rec.regions[0]
    slots.verify_region(buf.numpy(), digests, "region 0", rec.block_hash)
    buf[(1 << 20) + 7] ^= 1
    with pytest.raises(ci.CorruptCheckpointError, match=f"{h.label} mismatch in block 1"):
        slots.verify_region(buf.numpy(), digests, "region 0", rec.block_hash)


# =========================================================================== archives of other layouts
@pytest.mark.parametrize("name", checksum.BLOCK_HASHES)
@pytest.mark.parametrize("layout", ["copied", "interrupted", "short"])
def test_archive_of_an_unexpected_layout_gets_the_digest_of_its_bytes(name, layout):
    """If torch.save ever writes the tensor data other than as one run from the tensor's memory,
    the item has no block record and its digest is the plain digest of all its bytes (what the
    loader then checks the whole item against)."""
    import io

    from ckpt_integration.storage.fs import tensor_buffer
    from ckpt_integration.storage.tensor_record import BlockDigestWriter

    h = checksum.block_hash(name)
    t = torch.randn(50000)
    data = tensor_buffer(t)
    out = io.BytesIO()
    w = BlockDigestWriter(out, t, 64 << 10, h)
    w.write(b"header" * 50)
    if layout == "copied":  # the data from another buffer: not recognised as the tensor's
        w.write(bytes(data))
    elif layout == "interrupted":  # part of the data, something else, the rest
        w.write(data[:100000])
        w.write(b"xyz")
        w.write(data[100000:])
    else:  # fewer bytes than the tensor holds
        w.write(data[:100000])
    if layout != "short":
        w.write(b"trailer" * 30)
    digest, record = w.finish()
    assert record is None and digest == h.digest(out.getvalue())


def test_old_json_block_records_become_the_item_table_or_are_named_as_damage():
    """``convert`` reads the JSON tables of formats 2/3 into the item table (item_table.upgrade):
    records of several lengths (padded base64 too), a key spelled otherwise, items without a record
    come out as ``digests_many`` and ``digests_of`` give them; a malformed record (not base64, another
    form, out of bounds, of no listed item) is named by its key."""
    from ckpt_integration.storage import checkpoint_dir as ckdir
    from ckpt_integration.storage.checksum import block_hash
    from ckpt_integration.storage.item_table import upgrade

    for name in ("xxh3_64", "crc32"):
        h = block_hash(name)
        blocks = {f"f@{i * 100}": [64, 4096 * (i % 3), 4096, h.pack(list(range(i, i + 1 + i % 4)))] for i in range(50)}
        blocks["g@0007"] = [10, 20, 4096, h.pack([5, 6, 7])]  # (not file@offset as the writer spells it)
        items = {k: 9 for k in blocks} | {"f@1": 3, "h@0": 4}
        raw = {"version": 3, "block_hash": name, "items": items, "blocks": blocks} if name == "xxh3_64" else \
            {"version": 2, "items": items, "blocks": blocks}
        recs = ckdir.Manifest(**upgrade(raw, 5)).block_records()  # (format 5: its item table in the manifest)
        rids = [("f", i * 100) for i in range(50)] + [("g", 7), ("f", 1), ("h", 0)]
        got = recs.digests_many(rids)
        assert got == [recs.digests_of(r) for r in rids] and got[-2:] == [None, None]
        assert got[50] == (10, 20, 4096, (5, 6, 7)) and got[3] == (64, 0, 4096, (3, 4, 5, 6))
        for key, wrong in (("f@1200", [64, 0, 4096, "****" * 4]), ("f@1300", [64, -5, 4096, h.pack([1])]),
                           ("f@1300", [64, 0, 0, h.pack([1])]), ("f@1300", ["64", 0, 4096, h.pack([1])]),
                           ("f@1300", [64, 0, 4096]), ("f@1300", "64,0,4096"), ("f@1300", [64, 0, 4096, 7]),
                           ("q@5", [64, 0, 4096, h.pack([1])]), ("f@x", [64, 0, 4096, h.pack([1])])):
            bad = dict(raw, blocks=dict(blocks, **{key: wrong}), items=dict(items, **({} if key == "q@5" else {key: 1})))
            with pytest.raises(ValueError, match=key if key != "f@1200" else ""):
                upgrade(bad, 5)


def test_a_damaged_zip_record_of_another_writer_is_refused_naming_it():
    """Another writer's item (a torch.save zip archive) is checked against its records' CRC32s: a cut
    archive, whose zip directory cannot be read, is damage too (it escaped as a bare BadZipFile)."""
    import io

    from ckpt_integration.errors import CorruptCheckpointError
    from ckpt_integration.storage.checksum import check_zip_bytes

    buf = io.BytesIO()
    torch.save(torch.arange(64.0), buf)
    data = bytearray(buf.getvalue())
    check_zip_bytes(bytes(data), "item")  # intact
    with pytest.raises(CorruptCheckpointError, match="item is damaged: its zip archive cannot be read"):
        check_zip_bytes(bytes(data[:-30]), "item")
    at = data.index(torch.arange(64.0).numpy().tobytes()) + 5
    data[at] ^= 0x10
    with pytest.raises(CorruptCheckpointError, match=r"item is damaged: record '.*data/0' .*fails its CRC32 check"):
        check_zip_bytes(bytes(data), "item")

