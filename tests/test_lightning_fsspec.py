"""Lightning checkpoints on fsspec URLs (``memory://`` and S3 on the local moto server): top-k
deletions, resume, incomplete saves."""

import os
import sys
import uuid

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

CHARS, BLOCK, GBS = 2000, 32, 8


from tests.s3_faults import s3_fixture  # noqa: E402

s3_endpoint = s3_fixture()  # the moto server, as in tests/test_remote_storage.py


@pytest.fixture(params=["memory", "s3"])
def mem_url(request):
    """A fresh directory on ``memory://`` or on S3 (moto), removed afterwards."""
    fsspec = pytest.importorskip("fsspec")
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        url, fs = f"s3://ckpt-bucket/lt-{uuid.uuid4().hex[:8]}", fsspec.filesystem("s3", endpoint_url=endpoint)
    else:
        url, fs = f"memory://ckpt-{uuid.uuid4().hex[:8]}", fsspec.filesystem("memory")
    yield url
    if fs.exists(url):
        fs.rm(url, recursive=True)


def _pipe(url, data):
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    fs.pipe_file(path, data)


def _names(url):
    from ckpt_integration.storage.filesystem import storage_for

    storage, p = storage_for(url)
    return storage.listdir(p)


def _fit(url, epochs, ckpt_path=None, save_last=False, top_k=1, filename=None):
    import lightning as L

    import gpt
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint, DistCkptSingleDeviceStrategy

    L.seed_everything(0, verbose=False)
    m = gpt.GPTModule(vocab_size=gpt.vocab_size(CHARS), corpus_chars=CHARS, n_layers=1)
    cb = DistCkptModelCheckpoint(dirpath=url, save_top_k=top_k, monitor="train_loss", save_last=save_last,
                                 every_n_epochs=1, filename=filename)
    t = L.Trainer(accelerator="cpu", devices=1, strategy=DistCkptSingleDeviceStrategy(), plugins=[DistCkptIO()],
                  max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[cb], limit_train_batches=2, num_sanity_val_steps=0, limit_val_batches=0)
    t.fit(m, gpt.make_dataloader(BLOCK, GBS, 1, CHARS), ckpt_path=ckpt_path)
    return m, t


def test_topk_deletes_and_resume_on_fsspec_url(mem_url):
    from ckpt_integration.lightning import (is_complete_checkpoint, latest_complete_checkpoint,
                                            resolve_checkpoint_path)

    _, t = _fit(mem_url, 3)
    # save_top_k=1: the two older checkpoint directories were deleted through fsspec
    assert len(_names(mem_url)) == 1, _names(mem_url)
    best = f"{mem_url}/{_names(mem_url)[0]}"
    assert is_complete_checkpoint(best) and not is_complete_checkpoint(f"{mem_url}/nope.ckpt")
    assert latest_complete_checkpoint(mem_url) == best
    assert resolve_checkpoint_path(best) == best

    # an interrupted last.ckpt (data written, no metadata.json) resolves to the newest complete one
    _pipe(f"{mem_url}/last.ckpt/__0_0.distcp", b"partial")
    assert not is_complete_checkpoint(f"{mem_url}/last.ckpt")
    assert resolve_checkpoint_path(f"{mem_url}/last.ckpt") == best
    import ckpt_integration as ci

    _pipe(f"{mem_url}/partial.ckpt/__0_0.distcp", b"partial")
    with pytest.raises(ci.IncompleteCheckpointError, match="not a complete checkpoint"):
        resolve_checkpoint_path(f"{mem_url}/partial.ckpt")

    # without save_last, ckpt_path="last" resumes from the newest complete checkpoint
    m, t = _fit(mem_url, 4, ckpt_path="last")
    assert min(dict(m.step_losses)) == 6 and t.global_step == 8


def test_save_last_refused_on_object_store(mem_url):
    with pytest.raises(ValueError, match="save_last=True.*save_last=False"):
        _fit(mem_url, 1, save_last=True)


def test_resume_last_finds_the_checkpoints_a_file_name_with_a_slash_nests(tmp_path):
    """A metric name with ``/`` in the file name (``"{epoch}-{train/loss:.2f}"``) puts each checkpoint
    one directory down: ``ckpt_path="last"`` found none there and trained again from epoch 0, with a
    warning only. It looks as deep as the file name nests."""
    from ckpt_integration.checkpoints import ordered_checkpoints

    _fit(str(tmp_path), 3, filename="{epoch}/{step}")
    assert [os.path.relpath(c.path, tmp_path) for c in ordered_checkpoints(str(tmp_path), depth=1)] == ["epoch=2/step=6.ckpt"]
    m, t = _fit(str(tmp_path), 4, ckpt_path="last", filename="{epoch}/{step}")
    assert min(dict(m.step_losses)) == 6 and t.global_step == 8

