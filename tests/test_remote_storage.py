"""Checkpoints on fsspec URLs: memory:// and an S3 endpoint started locally (moto)."""

from __future__ import annotations

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import ShardedObject, ShardedTensor
from tests.dist_utils import run_distributed
from tests.layouts import expected_grid, global_tensor, grid_shard
from tests.s3_faults import s3_fixture


def _state(rank, world):
    return {
        "w": grid_shard("w", (8, 6), rank, (world, 1)),
        "b": ShardedTensor.from_rank_offsets("b", global_tensor("b", (5,), torch.bfloat16), replica_id=rank),
        "obj": ShardedObject("obj", {"rank": rank}, (world,), (rank,)),
        "step": 11,
    }


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_memory_url_roundtrip_and_reshard(backend):
    url = f"memory://ckpt-tests/roundtrip-{backend}"
    ci.save(_state(0, 1), url, sharded_strategy=backend)
    req = {"w": ShardedTensor.from_global_offsets("w", torch.zeros(3, 6), (8, 6), (2, 0))}
    out = ci.load(req, url, validate_access_integrity=False)
    assert torch.equal(out["w"], global_tensor("w", (8, 6))[2:5]) and out["step"] == 11
    assert set(ci.load_tensors_metadata(url)) == {"w", "b"}
    assert torch.equal(ci.load_plain_tensors(url)["b"], global_tensor("b", (5,), torch.bfloat16))
    with pytest.raises(ci.CheckpointingException, match="overwrite=True is not supported"):
        ci.save(_state(0, 1), url, overwrite=True)
    with pytest.raises(ci.CheckpointingException, match="already holds a committed checkpoint"):
        ci.save(_state(0, 1), url)


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_glob_characters_in_urls_and_keys_are_taken_literally(backend):
    """fsspec's rm / copy read "[", "*", "?" as a pattern: removing ``run/v[1]`` (Lightning's top-k
    deletion) removed ``run/v1`` and left itself; a failed save's cleanup in ``exp[AB]`` emptied the
    other run ``expB``; an incremental save in ``exp[AB]`` copied ``expA``'s file; zarr keys ``emb0``
    and ``emb[0]`` in one save deleted ``emb0``."""
    from ckpt_integration.lightning import DistCkptIO
    from ckpt_integration.storage.filesystem import storage_for

    root = f"memory://ckpt-tests/glob-{backend}"
    for name in ("v1", "v[1]", "v*"):
        ci.save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(len(name))))}, f"{root}/{name}",
                sharded_strategy=backend)
    DistCkptIO._remove_now(f"{root}/v[1]")  # (the plugin's removal of a replaced checkpoint)
    storage, _ = storage_for(root)
    assert not storage.exists(f"{root}/v[1]")
    for name in ("v1", "v*"):  # untouched, whole
        got = ci.load_plain_tensors(f"{root}/{name}")["w"]
        assert torch.equal(got, torch.full((4,), float(len(name)))), name
    storage.rmtree(f"{root}/v*")
    assert torch.equal(ci.load_plain_tensors(f"{root}/v1")["w"], torch.full((4,), 2.0))
    keys = {"emb0": torch.zeros(3), "emb[0]": torch.ones(3), "e?": torch.full((2,), 2.0)}
    ci.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in keys.items()}, f"{root}/keys[0]",
            sharded_strategy=backend)
    got = ci.load_plain_tensors(f"{root}/keys[0]")
    assert all(torch.equal(got[k], v) for k, v in keys.items()), got
    if backend == "torch_dist":  # an incremental save's server-side copy names its source literally
        ci.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, f"{root}/expA/it1")
        ci.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, f"{root}/exp[AB]/it1")
        ci.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, f"{root}/exp[AB]/it2",
                base=f"{root}/exp[AB]/it1")
        assert torch.equal(ci.load_plain_tensors(f"{root}/exp[AB]/it2")["w"], torch.arange(4.0))
        names = [n.split("/exp[AB]/it2/", 1)[1] for n in storage.fs.find(f"{root}/exp[AB]/it2")]
        assert names and all("/" not in n for n in names), names  # (no other run's file copied into one of its own)


def test_memory_url_uncommitted_save_is_invisible(monkeypatch):
    import fsspec

    import ckpt_integration.execution.save as save_mod

    url = "memory://ckpt-tests/crash"
    monkeypatch.setattr(save_mod.ckdir, "write_config", lambda *a, **k: (_ for _ in ()).throw(OSError("crash before commit")))
    with pytest.raises(OSError, match="crash before commit"):
        ci.save(_state(0, 1), url)
    monkeypatch.undo()
    fs = fsspec.filesystem("memory")
    assert not fs.exists(url + "/metadata.json")
    with pytest.raises((ci.IncompleteCheckpointError, ci.CheckpointNotFoundError)):
        ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6))}, url)
    # a new save into the same location works and becomes visible
    ci.save(_state(0, 1), url)
    assert fs.exists(url + "/metadata.json")


# --------------------------------------------------------------------------- S3 (moto server)
s3_endpoint = s3_fixture()


def _s3_save(rank, world, url, fail_rank):
    import ckpt_integration.execution.save as save_mod

    ci.save(_state(rank, world), url + "/good")
    ci.save(_state(rank, world), url + "/good_zarr", sharded_strategy="zarr")
    if rank == fail_rank:
        real = save_mod.write_data_files

        def broken(*a, **k):
            raise OSError("disk full (simulated)")

        save_mod.write_data_files = broken
    # the failing rank re-raises its own error; the others raise DistributedCheckpointingError
    with pytest.raises(OSError if rank == fail_rank else ci.errors.DistributedCheckpointingError):
        ci.save(_state(rank, world), url + "/interrupted")
    if rank == fail_rank:
        save_mod.write_data_files = real


def test_s3_save_resharded_load_and_interrupted_save(s3_endpoint):
    url = "s3://ckpt-bucket/run1"
    run_distributed(_s3_save, 2, url, 1)
    # resharded load of the 2-rank checkpoint in one process
    out = ci.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6)),
         "b": ShardedTensor.from_rank_offsets("b", torch.zeros(5, dtype=torch.bfloat16)),
         "obj": [ShardedObject("obj", None, (2,), (r,)) for r in range(2)]},
        url + "/good",
    )
    assert torch.equal(out["w"], global_tensor("w", (8, 6)))
    assert torch.equal(out["b"], global_tensor("b", (5,), torch.bfloat16))
    assert [o["rank"] for o in out["obj"]] == [0, 1] and out["step"] == 11
    # the save that failed on rank 1 never became visible
    with pytest.raises((ci.IncompleteCheckpointError, ci.CheckpointNotFoundError)):
        ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6))}, url + "/interrupted")
    import fsspec

    assert not fsspec.filesystem("s3").exists(url + "/interrupted/metadata.json")
    # column split on 2 ranks straight from S3, from both backends
    run_distributed(_s3_load_columns, 2, url + "/good")
    run_distributed(_s3_load_columns, 2, url + "/good_zarr")


def _s3_load_columns(rank, world, url):
    req = {"w": grid_shard("w", (8, 6), rank, (1, world))}
    req["w"].data.zero_()
    out = ci.load(req, url)
    assert torch.equal(out["w"], expected_grid("w", (8, 6), rank, (1, world)))


def test_remote_reads_coalesced_exact_under_threads_and_bounded(monkeypatch):
    """The read-ahead windows of remote readers (storage/filesystem.py): many threads reading
    random and sequential ranges of two objects get exactly the stored bytes, the windows of all
    objects stay within their bound, and a failed fetch is not kept (the next read asks again)."""
    import random
    import threading

    import fsspec

    from ckpt_integration.storage import filesystem as fsm, readers

    fs = fsspec.filesystem("memory")
    rng = random.Random(0)
    blobs = {f"/coalesce/{n}.bin": rng.randbytes(size) for n, size in (("a", 23 << 20), ("b", 9 << 20 | 17))}
    for path, data in blobs.items():
        fs.pipe_file(path, data)
    storage = fsm.Storage(fs)
    fetches = []
    real = readers.FsspecReader._fetch
    monkeypatch.setattr(readers.FsspecReader, "_fetch", lambda self, s, e: fetches.append((self.path, s, e)) or real(self, s, e))
    opened = {p: storage.open_reader(p) for p in blobs}
    errors = []

    def work(seed):
        r = random.Random(seed)
        try:
            for _ in range(60):
                path = r.choice(sorted(blobs))
                size = len(blobs[path])
                off = r.randrange(size)
                n = r.choice([1, 700, 64 << 10, 1 << 20, 9 << 20])
                assert opened[path].read(off, n) == blobs[path][off : off + n]
                windows = readers.FsspecReader._windows
                assert windows.nbytes <= windows.limit + readers.FsspecReader.READ_AHEAD * 2
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    # sequential small reads (headers, data, trailers of consecutive items) cost one request per window
    fetches.clear()
    seq = storage.open_reader("/coalesce/a.bin")
    data, pos = blobs["/coalesce/a.bin"], 0
    while pos < len(data):
        n = min(300_000, len(data) - pos)
        assert seq.read(pos, n) == data[pos : pos + n]
        pos += n
    assert 0 < len(fetches) <= len(data) // readers.FsspecReader.READ_AHEAD + 1, len(fetches)
    # a failed fetch leaves no window behind
    fails = {"n": 1}

    def flaky(self, s, e):
        if fails["n"]:
            fails["n"] -= 1
            raise OSError("injected")
        return real(self, s, e)

    monkeypatch.setattr(readers.FsspecReader, "_fetch", flaky)
    fresh = storage.open_reader("/coalesce/b.bin")
    with pytest.raises(OSError):
        fresh.read(5, 10)
    assert fresh.read(5, 10) == blobs["/coalesce/b.bin"][5:15]
    for r in [*opened.values(), seq, fresh]:
        r.close()
    assert not [w for w in readers.FsspecReader._windows.windows if w.reader in (fresh, seq)]


def test_a_listing_cached_while_a_checkpoint_was_incomplete_does_not_hide_its_files(s3_endpoint):
    """A process that looked at a checkpoint while it was being written (a poller, or a load beside
    a save that was then killed) later loads it after another process committed it. fsspec keeps the
    listing it took then; the load took it for the truth and reported the good checkpoint as damaged
    ("data file ... is missing (listed in .metadata)") for as long as the process lived."""
    import fsspec

    url = "s3://ckpt-bucket/stale/step=2"
    fs = fsspec.filesystem("s3")  # the client this process's loads use (fsspec shares instances)
    fs.pipe(url + "/__0_0.distcp", b"partial")  # a save in progress: one object, no commit marker
    with pytest.raises((ci.IncompleteCheckpointError, ci.CheckpointNotFoundError)):
        ci.load_plain_tensors(url)
    # another process commits the checkpoint: written elsewhere, copied in by a client of its own
    ci.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0)), "step": 2}, "s3://ckpt-bucket/stale/elsewhere")
    fs.ls(url)  # (the listing a poller takes, while the checkpoint is incomplete: cached)
    other = fsspec.filesystem("s3", skip_instance_cache=True)
    names = sorted(other.ls("ckpt-bucket/stale/elsewhere", detail=False), key=lambda n: n.endswith("metadata.json"))
    for name in names:  # (the commit marker last, as a save writes it)
        other.copy(name, "ckpt-bucket/stale/step=2/" + name.rsplit("/", 1)[1])
    assert fs.ls(url, detail=False) and not any(n.endswith("metadata.json") for n in fs.ls(url, detail=False))  # stale
    assert torch.equal(ci.load_plain_tensors(url)["w"], torch.arange(6.0))
    out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, url)
    assert torch.equal(out["w"], torch.arange(6.0)) and out["step"] == 2
