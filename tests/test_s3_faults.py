"""Object stores that fail: saves and loads through s3fs against moto behind a fault-injecting proxy.

The client's own retries are switched off here (s3fs ``retries=1``, botocore ``max_attempts=1``),
so what is tested is the library's layer (``ckpt_integration/storage/readers.py``'s ``retried``): bounded,
backed-off retries of transient failures with a deadline per attempt, then an error naming the
object; a failed save commits nothing and leaves the previous checkpoint loadable; a multipart
upload cut short is aborted; a listing that lags behind writes hides no commit.
"""

from __future__ import annotations

import logging
import os
import uuid

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration.storage import readers as retry
from tests.dist_utils import run_distributed
from tests.s3_faults import Rule, apply_client_retries, s3_fixture

BUCKET = "faults"
MiB = 2**20
# the client does not retry by itself: every retry seen is the library's
proxy = s3_fixture(bucket=BUCKET, with_proxy=True, retries=1, default_block_size=5 * MiB,
                   config_kwargs={"retries": {"total_max_attempts": 1}})


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setenv(retry.BACKOFF_ENV, "0.05")
    monkeypatch.setenv(retry.TIMEOUT_ENV, "4")
    monkeypatch.setenv(retry.ATTEMPTS_ENV, "4")


@pytest.fixture
def url(proxy):
    proxy.clear()
    yield f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    proxy.clear()


def _state(value: float, n: int = 1000):
    return {"a": ci.ShardedTensor.from_rank_offsets("a", torch.full((n,), value)),
            "b": ci.ShardedTensor.from_rank_offsets("b", torch.arange(10.0) + value), "step": int(value)}


def _load(path, n: int = 1000):
    out = ci.load({"a": ci.ShardedTensor.from_rank_offsets("a", torch.zeros(n)),
                   "b": ci.ShardedTensor.from_rank_offsets("b", torch.zeros(10))}, path)
    return out["a"], out["b"], out["step"]


def _check(path, value: float, n: int = 1000):
    a, b, step = _load(path, n)
    assert torch.equal(a, torch.full((n,), value)) and torch.equal(b, torch.arange(10.0) + value) and step == int(value)


def _keys(path):
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.find(path))


def test_transient_faults_are_retried(proxy, url, caplog):
    """500, 503 SlowDown, reset connections on writes, reads, stats and listings: the save and
    the load succeed with exact data; each fault was met once and retried."""
    rules = [
        Rule(op="PutObject", key=r"__0_0\.distcp$", status=503, times=2),  # SlowDown
        Rule(op="PutObject", key=r"manifest\.json$", status=500),  # InternalError
        Rule(op="PutObject", key=r"/metadata\.json$", action="reset"),
        Rule(op="PutObject", key=r"\.metadata$", status=503, code="ServiceUnavailable"),
        Rule(op="ListObjects", status=503),
        Rule(op="GetObject", key=r"__0_1\.distcp$", action="reset"),
        Rule(op="GetObject", key=r"common\.pt$", status=500),
        Rule(op="HeadObject", key=r"distcp$", status=503),
    ]
    proxy.add(*rules)
    with caplog.at_level(logging.WARNING, logger="ckpt_integration"):
        ci.save(_state(3.0), url)
        _check(url, 3.0)
    assert [r.fired for r in rules] == [2, 1, 1, 1, 1, 1, 1, 1]
    retried = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    # every error answer was retried by the library (a reset connection may instead be retried
    # by the HTTP client itself, which repeats an idempotent request on a reused connection once)
    assert len(retried) >= 7 and any("__0_0.distcp" in m and "reduce your request rate" in m for m in retried)
    for name in ("__0_0.distcp", "manifest.json", ".metadata", "common.pt"):
        assert any(f"/{name} failed (attempt 1 of 4)" in m for m in retried), name


def test_zarr_requests_get_the_same_retries(proxy, url, caplog):
    """zarr's fsspec store made one attempt: one 503 on a chunk or zarr.json failed the save, and on a
    load it was reported as damage (``CorruptCheckpointError``); a request that never ends waited for the
    client's own timeout. Now the same retries and deadline as every other object; a fault that
    persists is a ``CheckpointReadError`` naming the object, not damage."""
    rules = [
        Rule(op="PutObject", key=r"/a/c/0$", status=503, times=2),
        Rule(op="PutObject", key=r"/b/zarr\.json$", status=500),
        Rule(op="GetObject", key=r"/a/c/0$", status=503),
        Rule(op="GetObject", key=r"/b/zarr\.json$", action="reset"),
    ]
    proxy.add(*rules)
    with caplog.at_level(logging.WARNING, logger="ckpt_integration"):
        ci.save(_state(5.0), url, sharded_strategy="zarr")
        _check(url, 5.0)
    assert [r.fired for r in rules] == [2, 1, 1, 1]
    retried = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert any(f"{url}/a/c/0 failed (attempt 1 of 4)" in m for m in retried), retried
    proxy.clear()
    proxy.add(Rule(op="GetObject", key=r"/a/c/0$", status=503, times=100))
    with pytest.raises(ci.errors.CheckpointReadError, match=r"/a/c/0 failed after 4 attempt"):
        _load(url)


def _two_rank_failed_save(rank, world, url):
    """Rank 1's data object fails on every attempt, sync and async: both ranks raise, nothing is committed."""
    apply_client_retries()
    def state(v):
        t = torch.full((4, 6), v)
        return {"w": ci.ShardedTensor.from_rank_offsets("w", t[rank * 2:(rank + 1) * 2], (0, rank, world)), "step": int(v)}

    def check(path, v):
        req = {"w": ci.ShardedTensor.from_rank_offsets("w", torch.zeros(2, 6), (0, rank, world))}
        out = ci.load(req, path)
        assert torch.equal(out["w"], torch.full((2, 6), v)) and out["step"] == int(v)

    with pytest.raises(ci.CheckpointingException) as info:
        ci.save(state(2.0), url + "/ck2")
    text = str(info.value)
    assert f"{url}/ck2/__1_0.distcp" in text and "after 3 attempt(s)" in text, text
    assert "internal error" in text.lower()
    req = ci.save(state(3.0), url + "/ck3", async_sharded_save=True)
    with pytest.raises(ci.CheckpointingException, match=r"__1_0\.distcp failed after 3 attempt"):
        req.wait()
    check(url + "/ck1", 1.0)  # the previous checkpoint is untouched and loads
    assert [p.rsplit("/", 1)[-1] for p in ci.list_checkpoints(url)] == ["ck1"]


def _two_rank_first_save(rank, world, url):
    apply_client_retries()
    t = torch.full((4, 6), 1.0)
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", t[rank * 2:(rank + 1) * 2], (0, rank, world)), "step": 1},
            url + "/ck1")


def test_failing_object_gives_named_error_and_commits_nothing(proxy, url, monkeypatch):
    monkeypatch.setenv(retry.ATTEMPTS_ENV, "3")
    run_distributed(_two_rank_first_save, 2, url)
    proxy.add(Rule(op="PutObject", key=r"/ck[23]/__1_0\.distcp$", status=500, times=None))
    run_distributed(_two_rank_failed_save, 2, url)
    assert proxy.state.rules[0].fired == 6  # 3 attempts each for the sync and the async save
    # nothing of the failed saves is left: no commit marker, no data objects
    assert _keys(url + "/ck2") == [] and _keys(url + "/ck3") == []


def test_hanging_requests_are_bounded(proxy, url, monkeypatch):
    """A request that never answers is abandoned after the per-attempt deadline and retried;
    one that never answers at all ends in an error naming the object."""
    monkeypatch.setenv(retry.TIMEOUT_ENV, "2")
    proxy.add(Rule(op="PutObject", key=r"/metadata\.json$", action="hang", seconds=600),
              Rule(op="GetObject", key=r"__0_0\.distcp$", action="hang", seconds=600))
    ci.save(_state(4.0), url)
    _check(url, 4.0)
    assert [r.fired for r in proxy.state.rules] == [1, 1]
    monkeypatch.setenv(retry.ATTEMPTS_ENV, "2")
    proxy.add(Rule(op="GetObject", key=r"manifest\.json$", action="hang", seconds=600, times=None))
    with pytest.raises(ci.errors.CheckpointReadError, match=rf"{url}/manifest\.json failed after 2 attempt\(s\).*timed out"):
        _load(url)


def test_interrupted_multipart_upload_is_aborted(proxy, url):
    """A data object larger than the block size (5 MiB here) is a multipart upload; when a part
    or the completion fails for good, the upload is aborted: no object, no open upload, no
    commit, and the previous checkpoint loads."""
    import fsspec

    n = 3 * MiB  # 12 MiB of float32: three parts
    ci.save(_state(1.0, n), url + "/ck1", thread_count=1)
    for rule in (Rule(op="UploadPart", skip=1, action="reset", times=None),
                 Rule(op="CompleteMultipartUpload", status=500, times=None)):
        proxy.clear()
        proxy.add(rule)
        with pytest.raises(ci.errors.CheckpointWriteError, match=rf"{url}/ck2/__0_0\.distcp"):
            ci.save(_state(2.0, n), url + "/ck2", thread_count=1)
        assert rule.fired >= 1 and proxy.counts["CreateMultipartUpload"] == 1
        assert proxy.counts["AbortMultipartUpload"] == 1, repr(proxy.state.log)[-1500:]
        assert _keys(url + "/ck2") == []
        uploads = fsspec.filesystem("s3").call_s3("list_multipart_uploads", Bucket=BUCKET).get("Uploads", [])
        assert [u["Key"] for u in uploads if u["Key"].startswith(url.split("/", 3)[3])] == []
    proxy.clear()
    _check(url + "/ck1", 1.0, n)


def test_lagging_listing_hides_no_commit(proxy, url):
    """Listings that lag behind writes (on the store, or cached by the client while a save was
    still running) never make a committed checkpoint look absent or incomplete."""
    import fsspec

    from ckpt_integration.lightning import is_complete_checkpoint

    proxy.lag_listings(600)  # nothing written from now on shows up in listings
    ci.save(_state(5.0), url + "/ck")
    _check(url + "/ck", 5.0)  # found by its commit marker, not by a listing
    assert is_complete_checkpoint(url + "/ck")
    proxy.lag_listings(0)
    # a listing taken while a save was in progress (data, no commit marker yet) ...
    fs = fsspec.filesystem("s3")
    fs.pipe_file(f"{url}/ck2/__0_0.distcp", b"x")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{url}/ck2")) == ["__0_0.distcp"]
    assert not is_complete_checkpoint(url + "/ck2")
    # ... then another client (another process) commits it: this process's cached listing of
    # the directory must not hide the commit marker
    other = fsspec.filesystem("s3", skip_instance_cache=True)
    other.pipe_file(f"{url}/ck2/metadata.json", b'{"sharded_backend": "torch_dist"}')
    assert is_complete_checkpoint(url + "/ck2")


def test_load_requests_are_coalesced(proxy, url):
    """A load asks for few, large ranges: before, every tensor cost three ranged GETs (archive
    header, data, trailer: 54 GETs for 16 tensors of 1 MiB, where PyTorch DCP's reader made 2);
    now consecutive items come in one read-ahead window shared by the reading threads, and no
    byte is fetched twice. A resharded load (a column slice of every tensor) stays exact."""
    n = 16
    plain = {f"t{i}": torch.randn(MiB // 4, generator=torch.Generator().manual_seed(i)) for i in range(n)}
    ci.save({k: ci.ShardedTensor.from_rank_offsets(k, v) for k, v in plain.items()}, url)
    proxy.reset_counts()
    out = ci.load({k: ci.ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in plain.items()}, url)
    with proxy.state.lock:
        sent = proxy.state.bytes_out
    counts = proxy.reset_counts()
    assert all(torch.equal(out[k], v) for k, v in plain.items())
    data = n * MiB
    assert counts["GetObject"] <= 10, counts  # 54 before
    assert sent < data * 1.1, (sent, data)  # read-ahead never fetches a byte twice here
    # 2-D, loaded as a column slice (strided reads of every row): exact, and still few requests
    grid = {f"g{i}": torch.randn(64, 4096, generator=torch.Generator().manual_seed(100 + i)) for i in range(4)}
    ci.save({k: ci.ShardedTensor.from_rank_offsets(k, v) for k, v in grid.items()}, url + "-2d")
    proxy.reset_counts()
    cols = {k: ci.ShardedTensor.from_rank_offsets(k, torch.zeros(64, 1024), (1, 1, 4)) for k in grid}
    got = ci.load(cols, url + "-2d", validate_access_integrity=False)  # one of four column shards
    assert all(torch.equal(got[k], v[:, 1024:2048]) for k, v in grid.items())
    assert proxy.reset_counts()["GetObject"] <= 12


def test_incremental_save_copies_unchanged_objects_server_side(proxy, url):
    """On an object store an unchanged data file is copied by the server (CopyObject), not uploaded
    again; the checkpoint is complete on its own: exact after its base is deleted."""
    import fsspec

    frozen = torch.nn.Parameter(torch.randn(6 * MiB // 4), requires_grad=False)  # multipart-sized

    def state(step):
        return {"frozen": ci.ShardedTensor.from_rank_offsets("frozen", frozen),
                "adapter": ci.ShardedTensor.from_rank_offsets("adapter", torch.full((1000,), float(step))),
                "step": step}

    ci.save(state(1), url + "/c1")
    proxy.reset_counts()
    with proxy.state.lock:
        proxy.state.log.clear()
        uploaded = proxy.state.bytes_in
    ci.save(state(2), url + "/c2", base=url + "/c1")
    with proxy.state.lock:
        log, uploaded = list(proxy.state.log), proxy.state.bytes_in - uploaded
    copies = [key for op, key in log if op == "CopyObject"]
    assert len(copies) == 1 and copies[0].endswith(".distcp"), log
    assert not [op for op, _ in log if op == "UploadPart"] and uploaded < MiB, (uploaded, log)
    fsspec.filesystem("s3").rm(url + "/c1", recursive=True)
    out = ci.load({"frozen": ci.ShardedTensor.from_rank_offsets("frozen", torch.zeros_like(frozen)),
                   "adapter": ci.ShardedTensor.from_rank_offsets("adapter", torch.zeros(1000))}, url + "/c2")
    assert torch.equal(out["frozen"], frozen.detach()) and torch.equal(out["adapter"], torch.full((1000,), 2.0))
    assert out["step"] == 2


def test_a_create_whose_answer_was_lost_is_the_saves_own(proxy, url):
    """The conditional PUT of the commit marker (``metadata.json``) or of the claim marker reached the store,
    and the connection dropped before its answer: the client's retry got 412 Precondition Failed, the save was
    reported as conflicting with another one (it had committed), and its cleanup removed the checkpoint."""
    for i, marker in enumerate((r"metadata\.json", r"ckpt_integration\.json")):
        proxy.clear()
        proxy.add(Rule(op="PutObject", key=rf"/ck{i}/{marker}$", action="drop_after"))
        ci.save(_state(float(i + 1)), f"{url}/ck{i}")
        assert proxy.state.rules[0].fired == 1
        _check(f"{url}/ck{i}", float(i + 1))
    assert [p.rsplit("/", 1)[-1] for p in ci.list_checkpoints(url)] == ["ck0", "ck1"]


def test_a_store_that_does_not_answer_never_reorders_checkpoints(proxy, url, monkeypatch):
    """503s on the newest checkpoint's ``manifest.json`` while checkpoints were ordered: it was taken for a
    checkpoint without a step and ``ckpt_path="last"`` resumed an older one without a word. A listing failing
    while a save numbered its commit: numbered 1, so the new checkpoint was the oldest of those without a step.
    Both now fail, naming the object; the save commits nothing and the others are untouched."""
    from ckpt_integration.lightning import latest_complete_checkpoint
    from ckpt_integration.storage import opened

    monkeypatch.setenv(retry.ATTEMPTS_ENV, "2")
    for s in (1, 2, 3):
        ci.save(_state(float(s)), f"{url}/epoch={s}-step={s * 10}.ckpt", step=s * 10)
    proxy.add(Rule(op="GetObject", key=r"step=30\.ckpt/manifest\.json$", status=503, times=2))
    with pytest.raises(ci.errors.CheckpointReadError, match=r"step=30\.ckpt/manifest\.json failed after 2 attempt"):
        latest_complete_checkpoint(url)
    assert latest_complete_checkpoint(url).endswith("step=30.ckpt")  # (the store answers again)
    for s in (1, 2):
        ci.save(_state(float(s)), f"{url}/plain/ck{s}")
    opened._last_seq.clear()  # (as in a new process)
    import errno

    from ckpt_integration.storage.filesystem import storage_for

    fs, parent = storage_for(url)[0].fs, f"{url}/plain".split("://")[1]
    real_ls = fs.ls

    def ls(path, *args, **kwargs):  # (the parent's listing throttled on every attempt)
        if path.rstrip("/").split("://")[-1] == parent:
            raise OSError(errno.EBUSY, "Please reduce your request rate.")
        return real_ls(path, *args, **kwargs)

    monkeypatch.setattr(fs, "ls", ls)
    with pytest.raises(ci.CheckpointingException, match=r"plain failed after 2 attempt"):
        ci.save(_state(3.0), f"{url}/plain/ck3")
    monkeypatch.setattr(fs, "ls", real_ls)
    assert [p.rsplit("/", 1)[-1] for p in ci.list_checkpoints(f"{url}/plain")] == ["ck1", "ck2"]
    ci.save(_state(3.0), f"{url}/plain/ck3")
    assert [p.rsplit("/", 1)[-1] for p in ci.list_checkpoints(f"{url}/plain")] == ["ck1", "ck2", "ck3"]


def test_verify_says_a_store_that_does_not_answer_is_not_damage(proxy, url, monkeypatch, capsys):
    """Data objects answering 503 on every attempt: ``verify`` said DAMAGED and exited 1 (its code for damage);
    it is NOT VERIFIED, exit 2, problem kind ``unreadable``; once the store answers, OK."""
    import json

    from ckpt_integration.cli import main

    monkeypatch.setenv(retry.ATTEMPTS_ENV, "2")
    ci.save(_state(1.0), url)
    capsys.readouterr()
    proxy.add(Rule(op="GetObject", key=r"\.distcp$", status=503, times=None))
    assert main(["verify", url]) == 2
    assert "problem(s) (not damage: the storage did not answer: try again)" in capsys.readouterr().out
    assert main(["verify", "--json", url]) == 2
    assert {p["kind"] for p in json.loads(capsys.readouterr().out)["problems"]} == {"unreadable"}
    proxy.clear()
    assert main(["verify", url]) == 0
