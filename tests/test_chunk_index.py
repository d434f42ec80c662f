"""``chunk_index.bin``: what a load reads instead of unpickling ``.metadata`` (issue 19, per-tensor cost)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import ShardedObject, ShardedTensor
from ckpt_integration.storage import checkpoint_dir as ckdir
from ckpt_integration.storage import chunk_index as cx
from ckpt_integration.storage import torch_dist
from ckpt_integration.storage.checksum import crc32
from ckpt_integration.storage.torch_dist import read_dcp_metadata
from ckpt_integration.storage.filesystem import locate
from tests.damage import write_manifest


@pytest.fixture(autouse=True)
def _format_5(monkeypatch):
    """``chunk_index.bin`` is what formats 4 and 5 write (format 6 derives the same records from
    ``index.bin``: tests/test_checkpoint_index.py); these tests save format 5, which loads forever."""
    monkeypatch.setattr(ckdir, "SAVE_MANIFEST_VERSION", 5)


def assert_index_matches_metadata(path: str) -> None:
    """The index the save wrote decodes to exactly what ``.metadata`` holds (keys, dtypes, shapes,
    chunks and where each is stored)."""
    manifest = ckdir.read_manifest(locate(path))
    index = cx.read_chunk_index(locate(path), manifest, lambda: pytest.fail("the index was not used"))
    md = read_dcp_metadata(locate(path))
    assert (index.metadata_size, index.metadata_crc32) == (manifest.files[".metadata"]["size"],
                                                          manifest.files[".metadata"]["crc32"])
    got = index.full()
    assert got.state_dict_metadata.keys() == md.state_dict_metadata.keys()
    for key, meta in md.state_dict_metadata.items():
        mine = got.state_dict_metadata[key]
        assert type(mine) is type(meta), key
        if hasattr(meta, "chunks"):
            assert (mine.properties.dtype, mine.size) == (meta.properties.dtype, meta.size), key
            assert sorted(map(str, mine.chunks)) == sorted(map(str, meta.chunks)), key
    assert got.storage_data == md.storage_data


def _state(scale: float = 1.0) -> dict:
    stacked = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5) * scale
    out = {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(48.0).reshape(8, 6) * scale),
        "scalar": ShardedTensor.from_rank_offsets("scalar", torch.tensor(3.5 * scale)),
        "half": ShardedTensor.from_rank_offsets("half", torch.ones(7, dtype=torch.bfloat16) * scale),
        "obj": ShardedObject("obj", {"k": scale}, (1,), (0,)),
        "step": 3,
    }
    # one rank holding several chunks of one key (layers of a stacked tensor): a multi-chunk key
    out["stack"] = [ShardedTensor.from_rank_offsets("stack", stacked[i : i + 1].clone(), (0, i, 4)) for i in range(4)]
    return out


def _request() -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6)),
        "scalar": ShardedTensor.from_rank_offsets("scalar", torch.tensor(0.0)),
        "half": ShardedTensor.from_rank_offsets("half", torch.zeros(7, dtype=torch.bfloat16)),
        "obj": ShardedObject("obj", None, (1,), (0,)),
        # the stacked tensor in another layout: split along its second axis, across its chunks
        "stack": ShardedTensor.from_rank_offsets("stack", torch.zeros(4, 3, 5), (1, 1, 2)),
    }


def _load(path) -> dict:  # (the request reads half of the stacked tensor: not a whole-tensor layout)
    return ci.load(_request(), path, validate_access_integrity=False)


def _check(out: dict, scale: float = 1.0) -> None:
    stacked = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5) * scale
    assert torch.equal(out["w"], torch.arange(48.0).reshape(8, 6) * scale)
    assert torch.equal(out["scalar"], torch.tensor(3.5 * scale))
    assert torch.equal(out["half"], torch.ones(7, dtype=torch.bfloat16) * scale)
    assert out["obj"] == {"k": scale}
    assert torch.equal(out["stack"], stacked[:, 3:6])


def test_index_describes_the_metadata_and_loads_never_unpickle_it(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    ci.save(_state(), path)
    assert "chunk_index.bin" in ckdir.read_manifest(locate(path)).files
    assert_index_matches_metadata(path)

    def refuse(*a, **k):
        raise AssertionError("a load unpickled .metadata")

    monkeypatch.setattr(torch_dist, "load_dcp_metadata", refuse)
    _check(_load(path))
    with ci.open_checkpoint(path) as ck:
        _check(_load(ck))


def _rewrite(path: str, name: str, data: bytes) -> None:
    """Replace a recorded file and its manifest entry (size, CRC32): its checksum still passes."""
    with open(os.path.join(path, name), "wb") as f:
        f.write(data)
    man = json.load(open(os.path.join(path, "manifest.json")))
    man["files"][name] = {"size": len(data), "crc32": crc32(data)}
    write_manifest(os.path.join(path, "manifest.json"), man)


def test_an_index_of_another_metadata_is_not_used(tmp_path, caplog):
    """An index whose recorded ``.metadata`` is not the checkpoint's (its checksum passing) is
    ignored with a warning; the load plans from ``.metadata`` and returns exactly the saved state."""
    path, other = str(tmp_path / "c"), str(tmp_path / "other")
    ci.save(_state(), path)
    ci.save({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6))}, other)  # w in one other file
    _rewrite(path, "chunk_index.bin", open(os.path.join(other, "chunk_index.bin"), "rb").read())
    with caplog.at_level(logging.WARNING, logger="ckpt_integration.storage.chunk_index"):
        _check(_load(path))
    assert "describes another .metadata" in caplog.text


def test_remove_sharded_tensors_drops_the_index(tmp_path):
    path = str(tmp_path / "c")
    ci.save(_state(), path)
    ci.remove_sharded_tensors(path, "half")
    assert not os.path.exists(os.path.join(path, "chunk_index.bin"))
    assert "chunk_index.bin" not in ckdir.read_manifest(locate(path)).files
    request = _request()
    del request["half"]
    out = ci.load(request, path, validate_access_integrity=False)
    assert "half" not in ci.load_tensors_metadata(path)
    out["half"] = torch.ones(7, dtype=torch.bfloat16)
    _check(out)


def test_a_damaged_index_falls_back_to_metadata(tmp_path, caplog):
    path = str(tmp_path / "c")
    ci.save(_state(2.0), path)
    with open(os.path.join(path, "chunk_index.bin"), "r+b") as f:
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="ckpt_integration.storage.chunk_index"):
        _check(_load(path), 2.0)
    assert "chunk_index.bin is not used" in caplog.text and "damaged" in caplog.text
    # a copy without the index (as an older version wrote): the same load from .metadata
    old = str(tmp_path / "old")
    shutil.copytree(path, old)
    os.remove(os.path.join(old, "chunk_index.bin"))
    man = json.load(open(os.path.join(old, "manifest.json")))
    del man["files"]["chunk_index.bin"]
    write_manifest(os.path.join(old, "manifest.json"), man)
    _check(_load(old), 2.0)


def test_a_malformed_index_with_a_valid_checksum_is_damage_not_a_crash():
    import zlib

    from ckpt_integration.errors import CorruptCheckpointError
    from ckpt_integration.planning.records import encode

    for raw in (b"not zlib", zlib.compress(b"not a message"), zlib.compress(encode(["x"], [1, 5, 5, 3, 0, 0])),
                zlib.compress(encode([], [2, 0, 0]))):
        with pytest.raises(CorruptCheckpointError, match="idx is damaged"):
            cx.parse_index(raw, "idx").metadata_for(["x"])


def test_verify_checks_the_index_against_metadata(tmp_path):
    """``verify`` compares the index loads plan from with ``.metadata`` (what DCP and Megatron-Core
    read): an index that, its checksum passing, places a chunk elsewhere or describes another
    ``.metadata`` is reported, naming the file and the key."""
    from ckpt_integration.tools import verify_checkpoint

    path = str(tmp_path / "c")
    ci.save(_state(), path)
    assert verify_checkpoint(path).ok
    md = read_dcp_metadata(locate(path))
    entry = ckdir.read_manifest(locate(path)).files[".metadata"]
    for index_key, info in md.storage_data.items():
        if index_key.fqn == "w":
            md.storage_data[index_key] = type(info)(info.relative_path, info.offset + 8, info.length)
    _rewrite(path, "chunk_index.bin", cx.compact_of_metadata(md, entry).raw)
    report = verify_checkpoint(path)
    assert not report.ok and "chunk_index.bin does not describe .metadata as saved: 'w'" in str(report.problems), report.problems
    _rewrite(path, "chunk_index.bin", cx.compact_of_metadata(md, {"size": 1, "crc32": 2}).raw)
    report = verify_checkpoint(path)
    assert not report.ok and "describes another .metadata" in str(report.problems), report.problems


def _box(key: str, data: torch.Tensor, row: int, col: int) -> ShardedTensor:
    """An uneven block of a 24 x 36 tensor at (row, col)."""
    return ShardedTensor(key, data, data.dtype, tuple(data.shape), (24, 36), (row, col), None)


def test_keys_of_many_chunks_are_found_by_search(tmp_path):
    """Keys of more than 8 chunks (searched, not scanned): saved as 12 column blocks and as a 3 x 4
    grid of uneven blocks, loaded by rows, by an unaligned window and whole."""
    full = torch.arange(24 * 36, dtype=torch.float32).reshape(24, 36)
    cols = [ShardedTensor.from_rank_offsets("cols", full[:, 3 * j : 3 * j + 3].clone(), (1, j, 12)) for j in range(12)]
    rows_at, cols_at = [0, 5, 16, 24], [0, 7, 8, 20, 36]
    grid = [_box("grid", full[r0:r1, c0:c1].clone(), r0, c0) for r0, r1 in zip(rows_at, rows_at[1:])
            for c0, c1 in zip(cols_at, cols_at[1:])]
    path = str(tmp_path / "c")
    ci.save({"cols": cols, "grid": grid}, path)
    assert_index_matches_metadata(path)
    for box in ((slice(0, 24), slice(0, 36)), (slice(6, 12), slice(0, 36)), (slice(3, 20), slice(5, 31))):
        rows, cs = box
        req = {k: _box(k, torch.zeros(rows.stop - rows.start, cs.stop - cs.start), rows.start, cs.start)
               for k in ("cols", "grid")}
        out = ci.load(req, path, validate_access_integrity=False)
        assert torch.equal(out["cols"], full[box]) and torch.equal(out["grid"], full[box]), box


def test_a_request_that_is_one_saved_chunk_is_planned_in_one_step(tmp_path, monkeypatch):
    """A same-layout request (exactly one saved chunk) is found by ``CompactChunks.whole_chunk``
    (scanned for a few chunks, searched for more than 8) with the record ``chunk_reads`` gives it;
    anything else is None and goes to the general plan, which loads it (or refuses it) as before."""
    from ckpt_integration.execution import load as load_mod
    from ckpt_integration.planning.boxes import Box

    full = torch.arange(24 * 36, dtype=torch.float32).reshape(24, 36)
    rows_at, cols_at = [0, 5, 16, 24], [0, 7, 8, 20, 36]
    blocks = [(r0, c0, full[r0:r1, c0:c1].clone()) for r0, r1 in zip(rows_at, rows_at[1:])
              for c0, c1 in zip(cols_at, cols_at[1:])]
    path = str(tmp_path / "c")
    ci.save({"grid": [_box("grid", b, r, c) for r, c, b in blocks],
             "one": ShardedTensor.from_rank_offsets("one", torch.arange(6.0))}, path)
    index = cx.read_chunk_index(locate(path), ckdir.read_manifest(locate(path)), lambda: pytest.fail("the index was not used"))
    compact = cx.compact_chunks_of(index.metadata_for(["grid", "one"]))
    for key, r, c, b in [("grid", r, c, b) for r, c, b in blocks] + [("one", None, None, torch.arange(6.0))]:
        box = Box((0,), (6,)) if r is None else Box((r, c), tuple(b.shape))
        info = compact.whole_chunk(key, box, path)
        (read,) = compact.chunk_reads(key, box, path)
        assert info is not None and info.box == box and info.storage == read.source.storage, (key, box)
    assert compact.whole_chunk("grid", Box((0, 0), (5, 8)), path) is None  # two chunks
    assert compact.whole_chunk("grid", Box((0, 0), (4, 7)), path) is None  # inside one
    assert compact.whole_chunk("grid", Box((0,), (5,)), path) is None  # another number of dims
    assert compact.whole_chunk("nope", Box((0,), (6,)), path) is None
    fast = []
    real = load_mod._whole_chunk_task
    monkeypatch.setattr(load_mod, "_whole_chunk_task", lambda *a: fast.append(real(*a)) or fast[-1])
    # every block as saved (one step each), a window over several (the general plan), a Parameter
    req = {"grid": [_box("grid", torch.zeros_like(b), r, c) for r, c, b in blocks],
           "win": _box("grid", torch.zeros(10, 20), 3, 5),
           "one": ShardedTensor.from_rank_offsets("one", torch.nn.Parameter(torch.zeros(6)))}
    out = ci.load(req, path, validate_access_integrity=False)
    assert all(torch.equal(o, b) for o, (_r, _c, b) in zip(out["grid"], blocks))
    assert torch.equal(out["win"], full[3:13, 5:25])
    assert isinstance(out["one"], torch.nn.Parameter) and torch.equal(out["one"].detach(), torch.arange(6.0))
    assert [t is not None for t in fast] == [True] * len(blocks) + [False, True]


def test_a_loads_metadata_lists_the_requested_keys_and_names_all(tmp_path):
    """A load's metadata decodes only the keys it requests (each other key of the index is stepped
    over: a rank no longer decodes every key of the job); ``checkpoint_keys`` still names every
    key, objects included, and strict handling sees them all: a load of one tensor reports every
    other key missing, and a requested key the checkpoint lacks as unexpected."""
    from ckpt_integration.execution import shared_metadata as sm
    from ckpt_integration.storage.chunk_index import checkpoint_keys

    path = str(tmp_path / "c")
    ci.save(_state(), path)
    shared = sm.read_local(path)
    everything = sorted(shared.metadata_for().state_dict_metadata)
    assert everything == ["half", "obj/shard_0_1", "scalar", "stack", "w"]
    md = shared.metadata_for(["w", "obj/shard_0_1", "nope"])
    assert sorted(md.state_dict_metadata) == ["obj/shard_0_1", "w"]
    assert checkpoint_keys(md) == everything == checkpoint_keys(shared.metadata_for())
    assert tuple(md.state_dict_metadata["w"].size) == (8, 6)
    out, missing, unexpected = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6)),
                                        "nope": ShardedTensor.from_rank_offsets("nope", torch.zeros(2))},
                                       path, strict="return_all")
    assert torch.equal(out["w"], torch.arange(48.0).reshape(8, 6))
    assert sorted(missing) == ["half", "obj", "scalar", "stack"] and sorted(unexpected) == ["nope"]  # (objects by key)


@pytest.mark.parametrize("compress", [True, False])
def test_the_load_broadcast_carries_the_same_metadata_compressed_or_not(tmp_path, compress):
    """The coordinator's broadcast (manifest text, commit marker, the manifest's item table, the
    index as stored) decodes to the same manifest and index whether head and table are compressed
    (a job on several nodes) or not (one node, ``LOCAL_WORLD_SIZE`` covering the group: no zlib on
    megabytes of tables for 20,000 small tensors); the frame says which. The item table travels
    as its binary columns (not as the manifest's base64), in formats 4 and 5."""
    import dataclasses

    from ckpt_integration.execution import shared_metadata as sm

    for version in (5, 4):
        ckdir.SAVE_MANIFEST_VERSION, was = version, ckdir.SAVE_MANIFEST_VERSION
        try:
            ci.save(_state(), tmp_path / f"c{version}")
        finally:
            ckdir.SAVE_MANIFEST_VERSION = was
        shared = sm.read_local(str(tmp_path / f"c{version}"))
        assert shared.manifest.version == version
        payload = sm.encode_shared(shared, compress=compress)
        assert payload[4] & 1 == (1 if compress else 0)
        manifest_json = ckdir.manifest_text(shared.manifest)
        table = shared.manifest.item_table()
        assert manifest_json.encode() not in payload  # (the base64 does not travel)
        assert ckdir.manifest_json(dataclasses.replace(shared.manifest, tables="")).encode() in payload or compress
        assert (table.raw in payload) is not compress
        got = sm.decode_shared(payload)
        assert got.backend == shared.backend and got.config == shared.config
        assert {**ckdir.manifest_fields(got.manifest), "tables": ""} == {**ckdir.manifest_fields(shared.manifest), "tables": ""}
        assert got.compact.raw == shared.compact.raw
        assert dict(got.manifest.checksums()) == dict(shared.manifest.checksums())
        got_b, want_b = got.manifest.block_records(), shared.manifest.block_records()
        assert sorted(got_b) == sorted(want_b) and len(want_b) > 0
        for rid in want_b:
            a, b = got_b[rid], want_b[rid]
            assert (a.data_offset, a.data_length, a.block_size, a.digests.tolist()) == \
                (b.data_offset, b.data_length, b.block_size, b.digests.tolist())
    # format 6: index.bin travels as stored (compressed already), in place of the table and chunk index
    ckdir.SAVE_MANIFEST_VERSION, was = 6, ckdir.SAVE_MANIFEST_VERSION
    try:
        ci.save(_state(), tmp_path / "c6")
    finally:
        ckdir.SAVE_MANIFEST_VERSION = was
    shared = sm.read_local(str(tmp_path / "c6"))
    payload = sm.encode_shared(shared, compress=compress)
    index = shared.manifest.index()
    assert payload[4] == (4 | (1 if compress else 0)) and payload.endswith(index.raw)
    got = sm.decode_shared(payload)
    assert ckdir.manifest_fields(got.manifest) == ckdir.manifest_fields(shared.manifest)
    assert got.manifest.index().raw == index.raw and got.compact.full() == shared.compact.full()
    assert dict(got.manifest.checksums()) == dict(shared.manifest.checksums()) and len(index) == 8  # (4 stack layers)
    assert got.manifest.recorded_fingerprints().chunks("w") == shared.manifest.recorded_fingerprints().chunks("w")


def test_the_broadcast_between_nodes_sends_the_item_table_in_its_wire_form(tmp_path, monkeypatch):
    """Compressed (a job on several nodes), the broadcast's item table travels in its wire form:
    zeros in place of the XXH3-64 item digests of items with block digests (random bytes that
    nothing compresses: 1.6 of 9.5 MiB at 65,536 ranks) and its integer columns as first
    differences. The receiving ranks get every column as recorded, derive every such digest as it
    was recorded, and a table re-encoded from them is the recorded one byte for byte; a received
    table sent on keeps all of it. CRC32 tables, whose item digests need each block's length,
    travel as they are, and a wire-form table of CRC32 digests is refused."""
    import zlib

    from ckpt_integration.errors import CorruptCheckpointError
    from ckpt_integration.execution import shared_metadata as sm
    from ckpt_integration.storage import checksum
    from ckpt_integration.storage.item_table import ItemTable

    state = _state()
    state["big"] = ShardedTensor.from_rank_offsets("big", torch.arange(3 * 2**18, dtype=torch.float32))  # 3 MiB: 3 blocks
    for i in range(200):  # (offsets in a run: what the differences are for)
        state[f"small.{i}"] = ShardedTensor.from_rank_offsets(f"small.{i}", torch.full((16,), float(i)))
    ci.save(state, tmp_path / "x")
    shared = sm.read_local(str(tmp_path / "x"))
    table = shared.manifest.item_table()
    recorded = table.digest.tolist()
    wire, is_wire = table.for_wire()
    assert is_wire and len(wire) == len(table.raw) and len(zlib.compress(wire, 1)) < len(zlib.compress(table.raw, 1))
    payload = sm.encode_shared(shared, compress=True)
    assert payload[4] == 3  # compressed, a table in wire form
    got = sm.decode_shared(payload).manifest.item_table()
    has_blocks = got.nblocks >= 0
    assert got.wire and 0 < int(has_blocks.sum()) < len(got) and int(got.nblocks.max()) >= 5
    assert got.files == table.files
    for column in ("file", "offset", "nblocks", "data_offset", "data_length", "block_size", "block_digests"):
        assert getattr(got, column).tolist() == getattr(table, column).tolist(), column
    assert not got.digest[has_blocks].any() and got.digest[~has_blocks].tolist() == table.digest[~has_blocks].tolist()
    assert [got.item_digest(i) for i in range(len(got))] == recorded
    assert got.digests().tolist() == recorded and got.without_files([]) == table.raw
    assert sm.decode_shared(sm.encode_shared(shared, compress=False)).manifest.item_table().raw == table.raw
    again = sm.decode_shared(payload)  # (a received table sent on: in wire form, compressed or not)
    for compress in (True, False):
        sent_on = sm.decode_shared(sm.encode_shared(again, compress)).manifest.item_table()
        assert sent_on.digests().tolist() == recorded and sent_on.offset.tolist() == table.offset.tolist()

    monkeypatch.setattr(checksum, "SAVE_BLOCK_HASH", checksum.CRC32)
    ci.save(state, tmp_path / "c")
    shared = sm.read_local(str(tmp_path / "c"))
    payload = sm.encode_shared(shared, compress=True)
    assert shared.manifest.hash.name == "crc32" and payload[4] == 1
    assert sm.decode_shared(payload).manifest.item_table().raw == shared.manifest.item_table().raw
    with pytest.raises(CorruptCheckpointError, match="must have XXH3-64 digests, not CRC32"):
        ItemTable(shared.manifest.item_table().raw, shared.manifest.hash, "x", wire=True)


def _one_node_load(rank, world, root):
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # as torchrun says for one node: uncompressed broadcast
    from ckpt_integration.execution import shared_metadata as sm

    assert sm.one_node()
    w = torch.arange(64.0).reshape(16, 4)
    import torch.distributed as tdist

    # format 6: index.bin broadcast as stored; cut short, every rank raises the coordinator's error
    ci.save({"w": ShardedTensor.from_rank_offsets("w", w.chunk(world)[rank].clone(), (0, rank, world))}, root + "6")
    got = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(16, 4 // world), (1, rank, world))}, root + "6")
    assert torch.equal(got["w"], w.chunk(world, dim=1)[rank])
    if rank == 0:
        index = os.path.join(root + "6", "index.bin")
        raw = open(index, "rb").read()
        open(index, "wb").write(raw[:-8])
    tdist.barrier()
    with pytest.raises(ci.CorruptCheckpointError, match=r"index\.bin is damaged"):
        ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(16, 4 // world), (1, rank, world))}, root + "6")
    ckdir.SAVE_MANIFEST_VERSION = 5  # (this process only)
    ci.save({"w": ShardedTensor.from_rank_offsets("w", w.chunk(world)[rank].clone(), (0, rank, world))}, root)
    got = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(16, 4 // world), (1, rank, world))}, root)
    assert torch.equal(got["w"], w.chunk(world, dim=1)[rank])
    # the format-4 item table cut short: the coordinator refuses the manifest and every rank
    # raises the same error (none waits for a broadcast that does not come)
    import base64
    import json

    if rank == 0:
        with open(os.path.join(root, "manifest.json")) as f:
            man = json.load(f)
        man["tables"] = base64.b64encode(base64.b64decode(man["tables"])[:-8]).decode()
        with open(os.path.join(root, "manifest.json"), "w") as f:
            json.dump(man, f)
    tdist.barrier()
    with pytest.raises(ci.CorruptCheckpointError, match=r"manifest\.json is damaged: its item table"):
        ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(16, 4 // world), (1, rank, world))}, root)


def test_a_load_on_one_node_resharded_exactly(tmp_path):
    from tests.dist_utils import run_distributed

    run_distributed(_one_node_load, 2, str(tmp_path / "c"))
