"""Records as arrays: the save's exchange, rank 0's commit records and ``.metadata`` written from
arrays give what the per-record reference code gives, with Python work that does not grow with
the number of records (counted in function calls, not timed)."""

from __future__ import annotations

import io
import json
import pickle
import random
import re

import numpy as np
import pytest
import torch

from ckpt_integration.planning import exchange as ex
from ckpt_integration.planning.integrity import validate_key
from ckpt_integration.planning.records import MessageWriter, TableBatch, decode, put_table
from ckpt_integration.planning.shards import ShardMeta
from ckpt_integration.planning.written import WrittenTable, commit_layout, encode_finalize, gather_finalize
from ckpt_integration.storage import checkpoint_dir as ckdir
from ckpt_integration.storage.checksum import block_hash
from ckpt_integration.storage.dcp_pickle import dumps_commit_layout, supported
from ckpt_integration.storage.safe_pickle import load_dcp_metadata
from ckpt_integration.storage.torch_dist import WrittenItem, make_dcp_metadata
from tests.test_planning import _calls, _per_rank, meta, simulate


# --------------------------------------------------------------------------- exchange vs reference
def _random_layout(rng: random.Random, key: str, world: int):
    """Shards of one key in one of several layouts, some valid and some broken."""
    kind = rng.choice(["rows", "cols", "grid", "flat", "scalar", "replicated"])
    rows, cols = rng.randint(2, 12), rng.randint(1, 6)
    out = []
    if kind == "rows":  # row split, maybe uneven, DP replicas
        cuts = sorted({0, rows, *rng.sample(range(1, rows), min(rows - 1, rng.randint(0, 3)))})
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            for rep in range(rng.randint(1, 2)):
                out.append(meta(key, (i + rep * 3) % world, (a, 0), (b - a, cols), (rows, cols), (rep,)))
    elif kind == "cols":  # column blocks, each cut in row ranges (ZeRO pieces of a column-parallel weight)
        for c in range(2):
            cuts = sorted({0, rows, rng.randint(1, rows - 1)})
            for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
                out.append(meta(key, (c * 2 + i) % world, (a, c * cols), (b - a, cols), (rows, 2 * cols)))
    elif kind == "grid":  # 2-D grid: valid, but no flat ranges (the reference path)
        for r in range(2):
            for c in range(2):
                out.append(meta(key, (2 * r + c) % world, (r * rows, c * cols), (rows, cols), (2 * rows, 2 * cols)))
    elif kind == "flat":  # 3-D, whole-row pieces of the flattened tensor
        n = rng.randint(2, 5)
        for i in range(n):
            out.append(meta(key, i % world, (i, 0, 0), (1, rows, cols), (n, rows, cols)))
    elif kind == "scalar":
        out.append(meta(key, rng.randrange(world), (), (), ()))
        out += [meta(key, r, (), (), (), (1,)) for r in range(world) if rng.random() < 0.3]
    else:  # replicated everywhere, one main
        out = [meta(key, r, (0,), (rows,), (rows,), (r,)) for r in range(world)]
    damage = rng.random()
    if damage < 0.15 and len(out) > 1:  # a gap
        out.pop(rng.randrange(len(out)))
    elif damage < 0.3 and out:  # an overlap: a main copy shifted by one row
        m = out[0]
        if m.offsets:
            o = (m.offsets[0] + 1,) + m.offsets[1:]
            out.append(ShardMeta(m.key, m.kind, (m.rank + 1) % world, m.dtype, m.global_shape, o, m.sizes, (0,), m.nbytes))
    elif damage < 0.4 and out:  # another dtype on one rank
        m = out[-1]
        out[-1] = ShardMeta(m.key, m.kind, m.rank, "bfloat16", m.global_shape, m.offsets, m.sizes, m.replica_id, m.nbytes)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_exchange_on_random_layouts_matches_the_reference_validation(seed):
    rng = random.Random(seed)
    world = rng.choice([3, 5, 8])
    shards = []
    for k in range(40):
        shards += _random_layout(rng, f"k{k}", world)
    # the reference over every record of a key, in the order the key owner sees them (by rank)
    by_rank = sorted(shards, key=lambda s: (s.rank, s.offsets))
    expected = sorted(p for k in sorted({s.key for s in shards}) for p in validate_key(k, [s for s in by_rank if s.key == k]))
    problems, summaries, writes = simulate(_per_rank(shards, world))
    assert sorted(problems) == expected
    if not expected:  # valid: every chunk written exactly once, summaries agree with the commit check
        written = [m.chunk_id for ws in writes for m in ws]
        assert sorted(written) == sorted({s.chunk_id for s in shards})
        tables = []
        for r, ws in enumerate(writes):
            t = WrittenTable()
            for m in ws:
                t.append(m.storage_key, m.offsets, m.sizes, f"__{r}_0.distcp", len(t) * 10, 10, 1)
            tables.append(encode_finalize(None, t, [s for s in summaries if ex.owner_of_key(s.key, world) == r]))
        _, cols, summ = gather_finalize(tables)
        layout = commit_layout(cols, summ)
        assert set(layout.tensors) == {s.key for s in shards}


def test_key_owner_python_work_does_not_grow_with_its_chunks():
    """A key owner checking 8x the chunks of its keys (row splits over 8 and 64 ranks, ZeRO-1
    style flat pieces) makes about as many Python calls: the records are checked as arrays."""

    def inbox(ranks):
        shards = [meta(f"k{k}", r, (2 * r, 0), (2, 4), (2 * ranks, 4)) for k in range(50) for r in range(ranks)]
        mail = [msg for rt in [ex.route_shards(m, r, 1) for r, m in enumerate(_per_rank(shards, ranks))]
                for msg in rt.messages.values()]
        return list(ex.chunk_owner_step(mail, 1)[0].values())

    small, big = inbox(8), inbox(64)
    n_small, (p1, s1) = _calls(lambda: ex.key_owner_step(small))
    n_big, (p2, s2) = _calls(lambda: ex.key_owner_step(big))
    assert p1 == p2 == [] and [s.chunks for s in s1] == [8] * 50 and [s.chunks for s in s2] == [64] * 50
    assert n_big <= n_small + 100, (n_small, n_big)


def test_commit_records_python_work_per_item_is_constant():
    def messages(n):
        t = WrittenTable()
        for i in range(n):
            t.append(f"k{i % 50}", (i // 50, 0), (1, 4), "__0_0.distcp", 100 * i, 100, i, (64, 16, 1 << 20, [i, i + 1, i + 2]))
        return [encode_finalize(None, t, [])]

    small, big = messages(500), messages(4000)
    n_small, (_, cols, _) = _calls(lambda: gather_finalize(small))
    n_big, (_, cols_big, _) = _calls(lambda: gather_finalize(big))
    assert len(cols_big) == 4000 and n_big <= n_small + 200, (n_small, n_big)
    assert cols_big.items()[123].blocks == (64, 16, 1 << 20, [123, 124, 125])


# --------------------------------------------------------------------------- .metadata and manifest
def _layout_case(bits=32, long_key=True):
    rng = random.Random(7)
    t = WrittenTable()
    summaries = []
    from ckpt_integration.planning.key_owner import KeySummary, chunk_digest

    def add(key, dtype, shape, boxes, big=False):
        for j, (o, s) in enumerate(boxes):
            start = (1 << 33) + j if big else rng.randrange(1 << 20)
            t.append(key, o, s, f"__{j % 3}_{j % 2}.distcp", start, 64 + rng.randrange(1 << 12), rng.getrandbits(bits),
                     (16, 48, 1 << 20, [rng.getrandbits(bits) for _ in range(rng.randint(1, 4))]))
        summaries.append(KeySummary(key, "tensor", dtype, shape, len(boxes), sum(chunk_digest(key, o) for o, _ in boxes) % (1 << 64)))

    add("w", "float32", (4, 6), [((2, 0), (2, 6)), ((0, 0), (2, 6))])
    add("scalar", "int64", (), [((), ())])
    add("é/ünicode key", "bfloat16", (300,), [((i * 3,), (3,)) for i in range(100)])
    if long_key:  # (a key of 300 bytes: the memo's string table one by one; without: built by numpy)
        add("x" * 300, "float16", (2, 2, 2, 2, 2), [((0, 0, 0, 0, 0), (2, 2, 2, 2, 2))], big=True)
    add("huge", "uint8", (1 << 40,), [((0,), (1 << 39,)), ((1 << 39,), (1 << 39,))])
    for k in range(300):  # memo slots past 255
        add(f"many.{k}", "float32", (4,), [((0,), (4,))])
    for name in ("obj/shard_0_1", "obj/shard_1_2"):
        t.append(name, None, None, "__1_0.distcp", rng.randrange(1000), 17, rng.getrandbits(32))
    summaries.append(KeySummary("obj", "object", "object", (2,), 2, (chunk_digest("obj/shard_0_1", None) + chunk_digest("obj/shard_1_2", None)) % (1 << 64)))
    _, cols, summ = gather_finalize([encode_finalize(None, t, summaries)])
    return t, commit_layout(cols, summ)


@pytest.mark.parametrize("long_key", [True, False])
def test_metadata_from_arrays_unpickles_to_the_objects_dcp_builds(long_key):
    assert supported()
    t, layout = _layout_case(long_key=long_key)
    data = dumps_commit_layout(layout)
    tensors = {k: (getattr(torch, dt), shape, chunks) for k, (dt, shape, chunks) in layout.tensors.items()}
    written = [WrittenItem(k, o, f, s, n, d) for k, o, f, s, n, d in zip(t.keys, t.offsets, t.files, t.starts, t.lengths, t.digests)]
    expected = make_dcp_metadata(tensors, layout.objects, written)
    assert pickle.loads(data) == expected  # what DCP's and Megatron-Core's readers get
    assert load_dcp_metadata(io.BytesIO(data)) == expected  # our restricted unpickler takes it too
    assert list(pickle.loads(data).state_dict_metadata) == list(expected.state_dict_metadata)


@pytest.mark.parametrize("hash_name", ["crc32", "xxh3_64"])
def test_the_item_table_holds_what_the_old_json_tables_held(hash_name):
    """A commit's item table (made from its arrays) answers every lookup as the JSON tables of
    formats 2/3 with the same content did, once ``convert`` has read those (item_table.upgrade):
    item digests, block records, the batched lookup of many small items (with items that are not
    there), iteration; dropping the items of a data file (what ``remove_sharded_tensors`` does)
    drops exactly those; ``file_sizes`` ends each file at its last item."""
    from ckpt_integration.storage.item_table import ItemTable, TableItemDigests, decode_text, file_sizes, table_of_written
    from ckpt_integration.storage.item_table import upgrade

    h = block_hash(hash_name)
    t, layout = _layout_case(bits=8 * h.width)
    items = {f"{f}@{s}": d for f, s, d in zip(t.files, t.starts, t.digests)}
    blocks = {f"{f}@{s}": [b[0], b[1], b[2], h.pack(b[3])] for f, s, b in zip(t.files, t.starts, t.blocks) if b}
    raw = {"version": 2, "items": items, "blocks": blocks} if hash_name == "crc32" else \
        {"version": 3, "block_hash": hash_name, "items": items, "blocks": blocks}
    old = ckdir.Manifest(**upgrade(raw, 5))  # (format 5: the last whose item table is in the manifest)
    text = json.loads(table_of_written(layout.written, h))
    new = ckdir.Manifest(version=5, block_hash=hash_name, tables=text)
    assert old.tables == new.tables  # the same content: the same bytes
    want = {item_id: d for item_id, d in zip(zip(t.files, t.starts), t.digests)}
    assert dict(new.checksums()) == want and len(new.checksums()) == len(t)
    nb = new.block_records()
    assert len(nb) == sum(1 for b in t.blocks if b)
    for f, s, b in zip(t.files, t.starts, t.blocks):
        if b:
            rec = nb[(f, s)]
            assert (rec.data_offset, rec.data_length, rec.block_size, rec.digests.tolist()) == (b[0], b[1], b[2], list(b[3]))
            assert nb.digests_of((f, s)) == (b[0], b[1], b[2], tuple(b[3])) and (f, s) in nb
    objects = [rid for rid in want if rid not in nb]
    rids = list(nb)[::-1] + objects + [("nope.distcp", 0), ("__0_0.distcp", 3), ("__0_0.distcp", -1)]
    assert nb.digests_many(rids) == [nb.digests_of(r) if r in nb else None for r in rids]
    assert nb.digests_of(("nope.distcp", 0)) is None and ("nope.distcp", 0) not in new.checksums()
    with pytest.raises(KeyError):
        nb[objects[0]]
    table = decode_text(text, h)
    kept = ItemTable(table.without_files(["__1_0.distcp"]), h)
    assert dict(TableItemDigests(kept)) == {k: v for k, v in want.items() if k[0] != "__1_0.distcp"}
    ends = {}
    for f, s, n in zip(t.files, t.starts, t.lengths):
        ends[f] = max(ends.get(f, 0), s + n)
    assert file_sizes(layout.written) == {f: {"size": e} for f, e in ends.items()}


def test_a_damaged_binary_item_table_is_named_never_misread():
    """Every structural problem of a format-4 table raises CorruptCheckpointError naming the
    file and the problem: not base64, truncated or padded, bad magic, a newer table version,
    digests of another width, items out of order or listed twice, block counts that do not add up."""
    import base64
    import struct

    from ckpt_integration.errors import CorruptCheckpointError
    from ckpt_integration.storage.item_table import ItemTable, decode_text, encode_table

    h = block_hash("xxh3_64")
    files = ["__0_0.distcp", "__1_0.distcp"]

    def table(file, offset, nblocks=(3, -1, 3), digests=6):
        n = len(file)
        nbk = np.asarray(nblocks[:n], dtype=np.int64)
        pos = np.cumsum(np.maximum(nbk, 0)) - np.maximum(nbk, 0)
        return encode_table(files, np.asarray(file), np.asarray(offset), np.arange(n, dtype=np.uint64), nbk,
                            np.full(n, 8), np.full(n, 16), np.full(n, 1 << 20), pos,
                            np.arange(digests, dtype=np.uint64), h)

    good = table([0, 0, 1], [0, 100, 0])
    assert len(ItemTable(good, h)) == 3

    def bad(raw, needle, where="x/manifest.json"):
        with pytest.raises(CorruptCheckpointError, match=needle) as e:
            ItemTable(raw, h, where)
        assert where in str(e.value)

    bad(good[:-1], "bytes where its header describes")
    bad(good + b"\0", "bytes where its header describes")
    bad(good[:10], "shorter than its header")
    bad(b"XKIT" + good[4:], "bad magic")
    bad(good[:4] + struct.pack("<I", 2) + good[8:], "table version 2")
    with pytest.raises(CorruptCheckpointError, match="8-byte digests, but CRC32 digests have 4 bytes"):
        ItemTable(good, block_hash("crc32"))
    bad(table([0, 0, 1], [0, 0, 5]), "listed twice")
    # (encode_table sorts; out of order rows are made by swapping two offsets in the bytes)
    raw = bytearray(good)
    nmsg = struct.unpack_from("<Q", raw, 28)[0]
    from ckpt_integration.planning.records import decode_array, encode_array

    fl, ints = decode_array(bytes(raw[36 : 36 + nmsg]))
    ints = ints.copy()
    ints[3], ints[4] = ints[4], ints[3]
    msg = encode_array(fl, ints)
    bad(bytes(raw[:28]) + struct.pack("<Q", len(msg)) + msg + bytes(raw[36 + nmsg :]), "not sorted")
    ints = ints.copy()
    ints[3], ints[4] = ints[4], ints[3]
    ints[6 + 1] = 4  # the object (no block record) claims 4 digests
    msg = encode_array(fl, ints)
    bad(bytes(raw[:28]) + struct.pack("<Q", len(msg)) + msg + bytes(raw[36 + nmsg :]), "block digests")
    ints[6 + 1] = -1
    ints[0] = 7  # a file the table does not list
    msg = encode_array(fl, ints)
    bad(bytes(raw[:28]) + struct.pack("<Q", len(msg)) + msg + bytes(raw[36 + nmsg :]), "names a file")
    with pytest.raises(CorruptCheckpointError, match="not valid base64"):
        decode_text("not base64!", h, "x/manifest.json")
    with pytest.raises(CorruptCheckpointError, match="must be a string"):
        decode_text(12, h, "x/manifest.json")
    assert len(decode_text("", h)) == 0 and decode_text(base64.b64encode(good).decode(), h).raw == good


def test_table_batch_reads_many_messages_like_one_by_one():
    msgs = []
    for k in range(20):
        w = MessageWriter()
        w.add(k)
        put_table(w, 3, 1, [w.sids([f"s{k % 3}", "é"]), np.asarray([k, (1 << 40) if k == 7 else -k])])
        msgs.append(w.tobytes())
    batch = TableBatch(msgs, {3: lambda nd: 2}, prefix=lambda i, ints, p: p + 1)
    msg, rows = batch.rows(3, 1, 2)
    names = [batch.strings[j] for j in batch.global_ids(msg, rows[0]).tolist()]
    one_by_one = []
    for m in msgs:
        strings, ints = decode(m)
        one_by_one += [(strings[ints[4]], ints[6]), (strings[ints[5]], ints[7])]
    assert list(zip(names, rows[1].tolist())) == one_by_one
    with pytest.raises(ValueError):
        TableBatch([msgs[0][:-4]], {3: lambda nd: 2})


def test_table_batch_reads_thousands_of_messages_in_bulk_and_names_damage():
    """Rank 0 reads every rank's finalize message at once (strings interned in one pass, the k-th
    table of every message in the k-th numpy pass): messages with several tables each, of
    different kinds, repeated kinds and messages without strings or tables come out in message
    order as one by one; a message whose tables do not add up (a table header cut, a count that
    runs past the end, an unknown tag, a negative count, a string table longer than its bytes)
    raises ValueError saying which, among thousands of good ones."""
    import struct

    msgs = []
    for k in range(3000):
        w = MessageWriter()
        if k % 7:
            put_table(w, 3, 1, [w.sids([f"file{k}", "key"]), np.asarray([k, -k])])
        if k % 5 == 0:
            put_table(w, 4, 2, [np.asarray([k]), np.asarray([k + 1]), np.asarray([k + 2])])
        if k % 11 == 0:
            put_table(w, 3, 1, [w.sids(["again"]), np.asarray([7 * k])])
        msgs.append(w.tobytes())
    widths = {3: lambda nd: 2, 4: lambda nd: 1 + nd}
    batch = TableBatch(msgs, widths)
    want3, want4 = [], []
    for k in range(3000):
        if k % 7:
            want3 += [(f"file{k}", k), ("key", -k)]
        if k % 5 == 0:
            want4.append((k, k + 1, k + 2))
        if k % 11 == 0:
            want3.append(("again", 7 * k))
    msg, rows = batch.rows(3, 1, 2)
    got3 = list(zip([batch.strings[j] for j in batch.global_ids(msg, rows[0]).tolist()], rows[1].tolist()))
    assert got3 == want3
    assert [tuple(r) for r in batch.rows(4, 2, 3)[1].T.tolist()] == want4
    assert len(batch.strings) == len(set(batch.strings)) == len(set(s for s, _ in want3))

    def damaged(m: bytes, ints: list) -> bytes:
        """``m`` with its integers replaced (same header otherwise)."""
        magic, width, nstr, nblob, _ = struct.unpack_from("<4sBIII", m, 0)
        head = struct.pack("<4sBIII", magic, 8, nstr, nblob, len(ints))
        return head + m[17:17 + nblob] + struct.pack(f"<{len(ints)}q", *ints)

    good = msgs[1]
    _, ints = decode(good)
    cases = {
        "ends inside a table header": damaged(good, ints + [3, 1]),
        "ends inside a table": damaged(good, ints[:-1]),
        "unknown table (tag 9, nd 1, count 0)": damaged(good, ints + [9, 1, 0]),
        "unknown table (tag 3, nd 1, count -2)": damaged(good, ints + [3, 1, -2]),
        "inconsistent": good[:17] + struct.pack("<I", 99) + good[21:],
    }
    for words, bad in cases.items():
        with pytest.raises(ValueError, match=re.escape(words)):
            TableBatch(msgs[:1000] + [bad] + msgs[1000:2000], widths)


def test_finalize_digests_of_32_and_64_bits_survive_the_trip():
    """Block digests go as one 32-bit word each when they fit (CRC32), as two words otherwise
    (64-bit digests); messages of both kinds gathered together keep every value."""
    a, b = WrittenTable(), WrittenTable()
    a.append("k", (0,), (4,), "f", 0, 10, (1 << 32) - 1, (1, 2, 3, [(1 << 32) - 1, 5, 1 << 31]))
    b.append("k2", (0,), (4,), "g", 1 << 40, 10, (1 << 64) - 1, (1, 2, 3, [1 << 40, (1 << 64) - 1]))
    _, cols, _ = gather_finalize([encode_finalize(None, a, []), encode_finalize(None, b, []), encode_finalize(None, a, [])])
    assert cols.items() == a.items() + b.items() + a.items()


def test_memo_string_table_and_row_groups_equal_the_one_by_one_forms():
    """The vectorized pieces of the commit: the memo's string table (``.metadata``) is the bytes of
    ``_str + _put + POP`` per string, and ``group_rows`` the groups ``np.unique(axis=0)`` and a
    mask per group give, also for values too wide for one integer per row."""
    from ckpt_integration.planning.records import group_rows
    from ckpt_integration.storage.dcp_pickle import POP, _memo_strings, _put, _str

    for base in (5, 300, 1 << 20):
        for strs in (["a", "ключ", "x" * 255, ""], [f"layers.{i}.w" for i in range(2000)], ["y" * 300, "z"], []):
            assert _memo_strings(strs, base) == b"".join(_str(x) + _put(base + i) + POP for i, x in enumerate(strs))
    rng = np.random.default_rng(0)
    for rows in (rng.integers(-1, 4, size=(500, 3)), np.asarray([[1 << 40, -(1 << 40)], [0, 0], [1 << 40, -(1 << 40)]]),
                 np.zeros((0, 2), dtype=np.int64)):
        want = [(u, np.flatnonzero(np.all(rows == np.asarray(u), axis=1))) for u in np.unique(rows, axis=0).tolist()]
        got = group_rows(rows)
        assert [g[0] for g in got] == [w[0] for w in want]
        assert all(np.array_equal(g[1], w[1]) for g, w in zip(got, want))


def test_first_differences_of_a_message_are_undone_exactly_in_either_width():
    """``records.difference_ints`` (the item table's wire form): differences wrap in the message's
    integer width, so extreme values (where a difference overflows the width) come back exact;
    strings are untouched; a buffer that is not a message is refused."""
    from ckpt_integration.planning.records import decode_array, difference_ints, encode_array

    lo32, hi32 = -(2**31), 2**31 - 1
    for ints in ([], [7], [hi32, lo32, -1, 0, hi32, 5, 5, 5], [2**62, -(2**62), 3, -1, 2**40]):
        msg = bytearray(encode_array(["__0_0.distcp", "a"], np.asarray(ints, dtype=np.int64)))
        before = bytes(msg)
        difference_ints(msg)
        assert len(msg) == len(before) and (msg != before or len(ints) < 2)
        difference_ints(msg, undo=True)
        assert bytes(msg) == before
        strings, got = decode_array(bytes(msg))
        assert strings == ["__0_0.distcp", "a"] and got.tolist() == ints
    with pytest.raises(ValueError, match="not a metadata message"):
        difference_ints(bytearray(b"XXXX" + bytes(20)))
