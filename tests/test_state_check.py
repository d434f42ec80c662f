"""Verified resume (issue 35): the state a load returns equals what was saved, position by position.

Placement bugs injected into real loads through hooks (two rows of a resharded slice swapped, a
read-once slice sent to the wrong rank, a factory part read into another part's destination, a
data-parallel replica that loaded a stale copy) pass the block digests and the delivery ledger,
and are caught by the fingerprint check on every rank, with the key named. Also: the
fingerprint's own properties (every split of a tensor sums to the same value; damage of any kind
changes it), old checkpoints (no fingerprints) load with a note, DCP still reads ours.
"""

from __future__ import annotations

import os

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import ShardedTensor
from ckpt_integration.storage.fingerprint import add, fingerprint, fingerprints
from tests.damage import write_manifest
from tests.dist_utils import run_distributed
from tests.layouts import expected_fused, fused_qkv_factory, global_tensor
from ckpt_integration.storage.filesystem import locate

R, C = 64, 2048  # float32: a row is 8 KiB


def _save(rank, world, d):
    full = global_tensor("w", (R, C))
    half = global_tensor("h", (32, 16), torch.bfloat16)
    ci.save({
        "w": ShardedTensor.from_rank_offsets("w", full[rank * R // world:(rank + 1) * R // world].clone(), (0, rank, world)),
        "h": ShardedTensor.from_rank_offsets("h", half.clone(), replica_id=rank),
        "fused": fused_qkv_factory("fused", 32, rank, world),
    }, d)


def _request(rank, world):
    cols = C // world
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(R, cols), (1, rank, world)),  # rows saved, columns loaded
        "h": ShardedTensor.from_rank_offsets("h", torch.zeros(32, 16), replica_id=rank),  # bf16 saved, fp32 loaded
        "fused": fused_qkv_factory("fused", 32, rank, world),
    }


def _expect(got, rank, world):
    cols = C // world
    assert torch.equal(got["w"], global_tensor("w", (R, C))[:, rank * cols:(rank + 1) * cols])
    assert torch.equal(got["h"], global_tensor("h", (32, 16), torch.bfloat16).float())
    assert torch.equal(got["fused"], expected_fused("fused", 32, rank, world))


def _injected(rank, world, d):
    from ckpt_integration.execution import load as load_mod
    from ckpt_integration.execution import read_once as ro_mod

    _save(rank, world, d)
    for strategy in ("local", "auto", "read_once", "fully_parallel", "two_stage"):  # the check on, nothing injected
        _expect(ci.load(_request(rank, world), d, load_strategy=strategy, verify_state=True), rank, world)

    def caught(name, key, strategy, lws=None):
        if lws:
            os.environ["LOCAL_WORLD_SIZE"] = lws
        try:
            with pytest.raises(ci.CheckpointingException) as info:
                ci.load(_request(rank, world), d, load_strategy=strategy, verify_state=True)
        finally:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        text = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
        assert f"{key!r}" in text and "fingerprint differs" in text, (name, text)
        return text

    # 1. two rows of a resharded slice swapped (read once, node-local copies on rank 0)
    real_copy = ro_mod.copy_parts

    def swap_rows(tasks, regions, parts, src):
        real_copy(tasks, regions, parts, src)
        if rank == 0 and not swap_rows.done and tasks[0].key == "w":
            out = tasks[0].out
            out[[3, 4]] = out[[4, 3]]
            swap_rows.done = True
    swap_rows.done = False
    ro_mod.copy_parts = swap_rows
    try:
        text = caught("rows swapped", "w", "read_once")
    finally:
        ro_mod.copy_parts = real_copy
    assert "rank 0" in text, text

    # 2. a read-once slice sent to the wrong rank: every rank its own node, the reader of a unit
    # sends the receiver the slice of its own request (same shape) instead of the receiver's
    real_decode = ro_mod._decode_replies

    def misroute(inbox, chunks):
        real_decode(inbox, chunks)
        for c in chunks.values():
            for unit, remote in c.remote.items():
                c.remote[unit] = [(r, c.regions) for r, _ in remote]
    ro_mod._decode_replies = misroute
    try:
        caught("slice to the wrong rank", "w", "read_once", lws="1")
    finally:
        ro_mod._decode_replies = real_decode

    # 3. a factory part read into another part's destination (q and k swapped on rank 1)
    real_prepare = load_mod._prepare_reads

    def swap_parts(*a, **k):
        job = real_prepare(*a, **k)
        if rank == 1:
            q = next(t for t in job.tasks if t.key == "fused.q")
            kk = next(t for t in job.tasks if t.key == "fused.k")
            q.out, kk.out = kk.out, q.out
        return job
    load_mod._prepare_reads = swap_parts
    try:
        text = caught("factory parts", "fused.q", "local")
    finally:
        load_mod._prepare_reads = real_prepare
    assert "'fused.k'" in text and "rank 1" in text, text

    # 4. a data-parallel replica that loaded a stale copy (rank 1's copy of "h", not its main)
    from ckpt_integration.storage import small_reads as sr_mod

    real_read = sr_mod.read_task

    def stale(reader, t):
        real_read(reader, t)
        if rank == 1 and t.key == "h":
            t.out.add_(1)
    sr_mod.read_task = stale
    try:
        text = caught("stale replica", "h", "local")
    finally:
        sr_mod.read_task = real_read
    assert "rank 1" in text and "replica" in text, text

    # nothing left behind: the same loads pass again
    _expect(ci.load(_request(rank, world), d, load_strategy="read_once", verify_state=True), rank, world)


def test_injected_placement_bugs_are_caught_on_every_rank(tmp_path):
    run_distributed(_injected, 2, str(tmp_path / "ckpt"), timeout=180)


def test_fingerprint_is_the_same_for_every_split_and_sees_every_change():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.complex64, torch.float16):
        width = 70000 // torch.empty(0, dtype=dtype).element_size()  # rows of more than one 64 KiB segment
        full = torch.rand(9, width) > 0.5 if dtype is torch.bool else torch.randn(9, width).to(dtype)
        whole = fingerprint(full)
        c = width // 3
        parts = [(full[:4], (0, 0)), (full[4:, :c], (4, 0)), (full[4:, c:], (4, c))]
        assert add(*(fingerprint(t, o) for t, o in parts)) == whole, dtype
        assert add(*fingerprints(parts)) == whole, dtype
        changed = full.clone()
        changed[[1, 2]] = changed[[2, 1]]  # two rows swapped
        assert fingerprint(changed) != whole, dtype
        if dtype is not torch.bool:
            changed = full.clone()
            changed[5, [7, 8]] = changed[5, [8, 7]]  # two elements of a row swapped
            assert fingerprint(changed) != whole or torch.equal(changed, full), dtype
    x = torch.randn(4, 5, 6)
    assert add(fingerprint(x[:, :2], (0, 0, 0)), fingerprint(x[:, 2:, :3], (0, 2, 0)),
               fingerprint(x[:, 2:, 3:], (0, 2, 3))) == fingerprint(x)
    assert fingerprint(x.transpose(0, 1).contiguous().transpose(0, 1)) == fingerprint(x)  # strides do not matter
    assert fingerprint(x[:, :, 1:], (0, 0, 1)) != fingerprint(x[:, :, 1:], (0, 0, 0))  # places do
    vec = torch.arange(10.0)
    assert add(fingerprint(vec[:4]), fingerprint(vec[4:], (4,))) == fingerprint(vec)
    assert fingerprints([(torch.tensor(2.0), ()), (vec, (0,))]) == [fingerprint(torch.tensor(2.0)), fingerprint(vec)]
    one = torch.zeros(100)
    other = one.clone()
    other[17] = 1e-30  # one element, one bit pattern
    assert fingerprint(one) != fingerprint(other)


def test_fingerprint_matches_the_documented_definition():
    """A direct, element-by-element transcription of docs/format.md's definition (slow, small)."""
    import numpy as np

    def fmix(z):
        z ^= z >> 30
        z = (z * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        z ^= z >> 27
        z = (z * 0x94D049BB133111EB) & (2**64 - 1)
        return z ^ (z >> 31)

    def ref(t, offsets):
        b = t.element_size()
        raw = t.contiguous().view(torch.uint8).numpy().reshape(-1, t.shape[-1] * b)
        rows = np.ndindex(*t.shape[:-1]) if t.dim() > 1 else [()]
        total = 0
        for ri, lead in enumerate(rows):
            h = 0x0C0FFEE5
            for d, c in enumerate(lead):
                h = fmix(h ^ (((c + offsets[d]) * 0x9E3779B97F4A7C15 + d + 1) & (2**64 - 1)))
            lanes = {}
            for col in range(t.shape[-1]):
                for k in range(b):
                    p = (col + offsets[-1]) * b + k
                    s, q = p // 65536, p % 65536
                    byte = int(raw[ri, col * b + k])
                    byte = byte - 256 if byte > 127 else byte
                    for j in range(8):
                        w = fmix((8 * q + j) ^ 0x5EED0FB17E5EED) & 0xFF
                        w = w - 256 if w > 127 else w
                        lanes[(s, j)] = lanes.get((s, j), 0) + byte * w
            for (s, j), y in lanes.items():
                hh = fmix(fmix(h ^ (((s + 1) * 0xD1B54A32D192ED03) & (2**64 - 1))) ^ (((j + 1) * 0xA0761D6478BD642F) & (2**64 - 1))) | 1
                total = (total + y * hh) % 2**64
        return total

    x = torch.randn(3, 5)
    assert fingerprint(x, (7, 2)) == ref(x, (7, 2))
    y = torch.randn(2, 16390).to(torch.bfloat16)  # crosses a segment boundary
    assert fingerprint(y[:, 3:], (1, 16380)) == ref(y[:, 3:].contiguous(), (1, 16380))


# ------------------------------------------------------------------ the memory tier
def _memory(rank, world, root):
    """2 ranks, each its own node (replicas=2: each node also keeps the other's copy). Injected:
    (a) rank 0 served rank 1's copy as its own (the two hold a tensor under the same id whose values
    diverged), (b) two same-shaped tensors' places swapped in rank 0's own record. Each is refused
    by the fingerprints, named with its key, and the intact copy on the other node is used."""
    from ckpt_integration.memory import restore as rs
    from ckpt_integration.memory import slots

    node = os.path.join(root, f"node{rank}")
    tier = ci.MemoryCheckpoints(node, "fp", replicas=2, ranks_per_node=1)

    def state(sign=1.0):
        return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 8), sign * (rank + 1)), (0, rank, world)),
                "u": ShardedTensor.from_rank_offsets("u", torch.arange(32.0).view(4, 8) * sign + rank, (0, rank, world)),
                "diverged": ShardedTensor.from_rank_offsets("diverged", torch.full((3,), float(rank)), replica_id=rank)}

    tier.save(state(), 1)
    tier.wait()

    def restore(**kw):
        req = state(0.0)
        got = tier.load(req, 1, **kw)
        want = state()
        for k in want:
            assert torch.equal(got[k], want[k].data), (rank, k)
        return tier.last_restore

    assert restore(verify_state=True).source == "own memory"
    real_own, real_read = rs._own, slots.read_record

    # (a) rank 1's copy (kept on rank 0's node) served to rank 0 as its own
    def other_owner(inv, r, key, root_, nd):
        if r != 0:
            return real_own(inv, r, key, root_, nd)
        slot = inv.slot_of(0, 1, key)
        rec = rs.read_own(root_, 1, slot, key)
        return rs.Obtained(rec, slots.open_files(root_, 1, rec.files()), "own memory", nd)
    rs._own = other_owner
    try:
        rep = restore()  # the ownership digest is checked on every restore, verify_state or not
    finally:
        rs._own = real_own
    if rank == 0:
        assert rep.source == "peer rank 1" and any("not the snapshot rank 0 saved" in x and "'diverged'" in x
                                                   for x in rep.refused), rep

    # (b) in rank 0's own record, "w" and "u" (same shape) point at each other's bytes
    def swapped(root_, owner, slot):
        rec = real_read(root_, owner, slot)
        if rec is not None and rank == 0 and owner == 0:
            shards = {s.get("key"): s for s in rec.header["shards"]}
            shards["w"]["region"], shards["u"]["region"] = shards["u"]["region"], shards["w"]["region"]
        return rec
    slots.read_record = swapped
    try:
        rep = restore(verify_state=True)
    finally:
        slots.read_record = real_read
    if rank == 0:
        assert rep.source == "peer rank 1" and any("'w'" in x and "fingerprint differs" in x for x in rep.refused), rep
    tier.close(remove=True)


def test_memory_tier_refuses_copies_that_are_not_what_was_saved(tmp_path):
    run_distributed(_memory, 2, str(tmp_path), timeout=120)


def test_checkpoints_without_fingerprints_load_with_a_note(tmp_path, monkeypatch, caplog):
    """A checkpoint saved before manifest format 5 (or by another tool) loads with verify_state=True,
    exactly, with a one-line note that its state was not checkable; verify --state says so too."""
    import logging

    from ckpt_integration.storage import checkpoint_dir as ckdir
    from ckpt_integration.tools import verify_checkpoint

    w = torch.randn(6, 5)
    monkeypatch.setattr(ckdir, "SAVE_MANIFEST_VERSION", 4)
    ci.save({"w": ShardedTensor.from_rank_offsets("w", w)}, str(tmp_path / "old"))
    monkeypatch.undo()
    assert ckdir.read_manifest(locate(tmp_path / "old")).version == 4
    with caplog.at_level(logging.WARNING):
        out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(6, 5))}, str(tmp_path / "old"), verify_state=True)
    assert torch.equal(out["w"], w)
    notes = [r.getMessage() for r in caplog.records if "not checkable" in r.getMessage()]
    assert len(notes) == 1 and "records no fingerprints" in notes[0], notes
    report = verify_checkpoint(str(tmp_path / "old"), state=True)
    assert report.ok and report.state_checked == 0 and any("records no fingerprints" in n for n in report.notes)


def test_verify_state_reads_back_across_chunks_and_names_a_tensor_that_differs(tmp_path):
    """verify --state: a checkpoint saved by 2 ranks (row halves) read back in column blocks is the
    saved state; a manifest whose recorded fingerprint does not describe the data is reported."""
    import json

    import numpy as np

    from ckpt_integration.storage.fingerprint import MASK64
    from ckpt_integration.tools import verify_checkpoint

    d = tmp_path / "c"
    run_distributed(_save, 2, str(d), timeout=60)
    report = verify_checkpoint(str(d), state=True, memory_budget=64 << 10)  # blocks far smaller than a chunk
    assert report.ok and report.state_checked == 5, report.format()  # w, h, fused.q/k/v
    man = json.loads((d / "manifest.json").read_text())
    # format 6: the fingerprints are a column of index.bin; one chunk of "h" misdescribed there (and
    # the index's recorded CRC32 updated: damage no checksum sees)
    from ckpt_integration.storage.checkpoint_index import CheckpointIndex, encode_index
    from ckpt_integration.storage.checksum import block_hash, crc32

    h = block_hash(man["block_hash"], "manifest.json")
    index = CheckpointIndex((d / "index.bin").read_bytes(), h, "index.bin")
    w = index.layout.written
    first_h = int(np.flatnonzero(w.key == w.strings.index("h"))[0])
    assert w.has_fingerprint[first_h]
    w.fingerprint[first_h] = (int(w.fingerprint[first_h]) + 1) & MASK64
    raw = encode_index(index.layout, h, {"size": index.metadata_size, "crc32": index.metadata_crc32})
    (d / "index.bin").write_bytes(raw)
    man["files"]["index.bin"] = {"size": len(raw), "crc32": crc32(raw)}
    write_manifest(d / "manifest.json", man)
    report = verify_checkpoint(str(d), state=True)
    assert not report.ok and ["h"] == [k for p in report.problems for k in p["keys"]], report.format()
    assert "'h'" in report.format() and "not the state that was saved" in report.format()


def test_a_cast_load_of_nan_values_is_reported_unchecked_not_failed(tmp_path):
    """A cast keeps a NaN a NaN but not its bits (bf16 0x7fff comes back from fp32 as 0x7fc0, a
    signalling NaN turns quiet), so a load with ``verify_state=True`` of NaN values into another
    dtype cannot rebuild the saved bytes: the tensor is reported unchecked, the load does not fail;
    a cast without NaN is checked, and a NaN loaded in its own dtype is checked bit for bit."""
    from ckpt_integration.execution import load as load_mod

    cases = [(torch.bfloat16, torch.int16, 0x7FFF, torch.float32), (torch.float32, torch.int32, 0x7F800001, torch.float64),
             (torch.float8_e5m2, torch.int8, 0x7D, torch.float32)]
    for i, (saved, bits, nan, loaded) in enumerate(cases):
        w = torch.arange(1, 5).to(saved)
        clean = w.clone()
        w.view(bits)[1] = nan
        d = str(tmp_path / f"c{i}")
        ci.save({"w": ShardedTensor.from_rank_offsets("w", w), "v": ShardedTensor.from_rank_offsets("v", clean)}, d)
        out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, dtype=loaded)),
                       "v": ShardedTensor.from_rank_offsets("v", torch.zeros(4, dtype=loaded))}, d, verify_state=True)
        assert torch.equal(out["v"], clean.to(loaded)) and torch.isnan(out["w"][1]) and torch.equal(out["w"][2:], w[2:].to(loaded))
        st = load_mod.last_load_stats
        assert st["state_checked_keys"] == 1 and st["state_unchecked_keys"] == 1, (saved, st)
        same = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, dtype=saved))}, d, verify_state=True)
        assert torch.equal(same["w"].view(bits), w.view(bits)) and load_mod.last_load_stats["state_checked_keys"] == 1


def _cast_kinds(rank, world, root):
    # rank 0 alone requests an integer mask into a bool destination (a pipeline stage's key): the
    # check's cast test raised TypeError (torch.iinfo(bool)) on rank 0 alone, which left rank 1
    # waiting in the check's collective; now it is not checkable there, and both ranks finish
    from ckpt_integration.execution import load as load_mod

    d = os.path.join(root, "c")
    mask = torch.tensor([0, 1, 2, 0], dtype=torch.uint8)
    ci.save({"m": ShardedTensor.from_rank_offsets("mask", mask.clone(), replica_id=rank),
             "w": ShardedTensor.from_rank_offsets("w", torch.full((1, 4), float(rank)), (0, rank, world))}, d)
    req = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(1, 4), (0, rank, world))}
    if rank == 0:
        req["m"] = ShardedTensor.from_rank_offsets("mask", torch.empty(4, dtype=torch.bool))
    out = ci.load(req, d, verify_state=True)
    assert torch.equal(out["w"], torch.full((1, 4), float(rank)))
    if rank == 0:
        assert torch.equal(out["m"], mask.bool()) and load_mod.last_load_stats["state_unchecked_keys"] == 1


def test_a_cast_the_check_cannot_reverse_on_one_rank_leaves_no_rank_waiting(tmp_path):
    run_distributed(_cast_kinds, 2, str(tmp_path), timeout=60)


def test_a_cast_torch_cannot_make_is_refused_naming_both_dtypes(tmp_path):
    from ckpt_integration.errors import MismatchError

    ci.save({"m": ShardedTensor.from_rank_offsets("mask", torch.tensor([0, 1, 2, 0], dtype=torch.uint8))}, str(tmp_path / "c"))
    with pytest.raises(MismatchError, match=r"'mask' is saved as torch.uint8 but requested as torch.bits8 \(torch has no cast"):
        ci.load({"m": ShardedTensor.from_rank_offsets("mask", torch.empty(4, dtype=torch.bits8))}, str(tmp_path / "c"))
