"""A bad-input test for every error: each asserts the exception type and that the
message names what is wrong (file, key, rank).

Single-process cases come first; the multi-rank cases (sharding integrity, a save
failing on one rank, overwrite/partial-save handling) run in ONE 3-rank launch
whose worker records every scenario's outcome, asserted by one test per scenario.
"""

from __future__ import annotations

import json
import logging
import os
import pickle

import pytest
import torch
import torch.distributed as dist

import ckpt_integration as ci
from ckpt_integration import (
    CheckpointingException,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ShardedObject,
    ShardedTensor,
    StrictHandling,
)
from ckpt_integration.errors import (
    MismatchError,
    SaveConflictError,
    ShardingIntegrityError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from tests.dist_utils import run_distributed

ST = ShardedTensor
A = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) / 3
B = torch.linspace(-4, 4, 8).to(torch.bfloat16)


class Benign:
    """A harmless custom class (not on the allow-list)."""

    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Benign) and other.v == self.v


class RunsCode:
    """Unpickling this runs ``os.system`` (creates ``marker``)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class RunsCodeViaEval:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({self.marker!r}, 'w').close()",))


def _state() -> dict:
    return {
        "a": ST.from_rank_offsets("a", A.clone()),
        "b": ST.from_rank_offsets("b", B.clone()),
        "obj": ShardedObject("obj", {"k": 1}, (1,), (0,)),
        "iteration": 3,
    }


def _request() -> dict:
    return {"a": ST.from_rank_offsets("a", torch.empty(64, 32)), "b": ST.from_rank_offsets("b", torch.empty(8, dtype=torch.bfloat16))}


@pytest.fixture
def ckpt(tmp_path) -> str:
    d = str(tmp_path / "ckpt")
    ci.save(_state(), d, thread_count=1)  # one data file: __0_0.distcp
    return d


@pytest.fixture
def ckpt5(tmp_path, monkeypatch) -> str:
    """A format-5 checkpoint: ``chunk_index.bin`` beside ``.metadata``, which loads read where the
    index is missing (format 6 keeps every item's digests in ``index.bin`` and never falls back:
    tests/test_checkpoint_index.py)."""
    from ckpt_integration.storage import checkpoint_dir as ckdir

    monkeypatch.setattr(ckdir, "SAVE_MANIFEST_VERSION", 5)
    d = str(tmp_path / "ckpt")
    ci.save(_state(), d, thread_count=1)
    return d


def _storage_of(d: str, key: str):
    with open(os.path.join(d, ".metadata"), "rb") as f:
        md = pickle.load(f)  # our own, freshly written checkpoint
    return next(v for k, v in md.storage_data.items() if k.fqn == key)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _make_foreign(d: str) -> None:
    """Strip our manifest, marker and index: the checkpoint now looks like Megatron-Core's (no checksums)."""
    for name in ("manifest.json", "ckpt_integration.json", "index.bin", "chunk_index.bin"):
        if os.path.exists(os.path.join(d, name)):
            os.remove(os.path.join(d, name))


def _write_config(d: str, **fields) -> None:
    cfg = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}
    cfg.update(fields)
    with open(os.path.join(d, "metadata.json"), "w") as f:
        json.dump(cfg, f)


# =========================================================================== not a checkpoint
ENTRY_POINTS = {
    "load": lambda d: ci.load(_request(), d),
    "load_common_state_dict": ci.load_common_state_dict,
    "load_tensors_metadata": ci.load_tensors_metadata,
    "load_plain_tensors": ci.load_plain_tensors,
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_path_does_not_exist(tmp_path, entry):
    missing = str(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as ei:
        ENTRY_POINTS[entry](missing)
    assert missing in str(ei.value)
    assert isinstance(ei.value, FileNotFoundError)  # also catchable as the builtin


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, f)
    with pytest.raises(CheckpointNotFoundError, match="is a file") as ei:
        ci.load(_request(), str(f))
    assert str(f) in str(ei.value)


def test_empty_directory_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="is not a distributed checkpoint.*metadata.json"):
        ci.load(_request(), str(tmp_path))


def test_data_files_without_commit_marker_is_incomplete(ckpt):
    os.remove(os.path.join(ckpt, "metadata.json"))
    for entry in ENTRY_POINTS.values():
        with pytest.raises(IncompleteCheckpointError, match="incomplete") as ei:
            entry(ckpt)
        assert ckpt in str(ei.value) and "metadata.json" in str(ei.value)


# =========================================================================== metadata.json
def test_unknown_backend(ckpt):
    _write_config(ckpt, sharded_backend="tensorflow")
    with pytest.raises(UnsupportedCheckpointError, match="metadata.json: unknown sharded backend 'tensorflow'"):
        ci.load(_request(), ckpt)  # (names the file: a flipped byte that leaves valid JSON reads so too)


def test_unsupported_backend_version(ckpt):
    _write_config(ckpt, sharded_backend_version=99)
    with pytest.raises(UnsupportedCheckpointError, match="metadata.json: .*version 99"):
        ci.load(_request(), ckpt)


def test_unsupported_common_backend(ckpt):
    _write_config(ckpt, common_backend="yaml")
    with pytest.raises(UnsupportedCheckpointError, match="common backend 'yaml'"):
        ci.load_common_state_dict(ckpt)


def test_unknown_fields_in_metadata_json(ckpt):
    _write_config(ckpt, written_by="the future")
    with pytest.raises(UnsupportedCheckpointError, match="written_by"):
        ci.load(_request(), ckpt)


@pytest.mark.parametrize(
    "content, pattern",
    [
        ("{not json", "not valid JSON"),
        ("", "not valid JSON"),
        ("[1, 2]", "does not describe a checkpoint"),
        ('{"common_backend": "torch"}', "does not describe a checkpoint"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
    ],
)
def test_malformed_metadata_json(ckpt, content, pattern):
    path = os.path.join(ckpt, "metadata.json")
    with open(path, "wb") as f:
        f.write(content.encode() if isinstance(content, str) else content)
    with pytest.raises(CorruptCheckpointError, match=pattern) as ei:
        ci.load(_request(), ckpt)
    assert "metadata.json" in str(ei.value)


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"sharded_backend": ["torch_dist"]}, "sharded_backend"),
        ({"sharded_backend": None}, "sharded_backend"),
        ({"common_backend": {"a": 1}}, "common_backend"),
        ({"sharded_backend_version": [1]}, "sharded_backend_version"),
    ],
)
def test_metadata_json_with_wrong_field_types(ckpt, fields, name):
    _write_config(ckpt, **fields)
    with pytest.raises(CorruptCheckpointError, match=f"metadata.json: field '{name}'"):
        ci.load(_request(), ckpt)


@pytest.mark.parametrize(
    "manifest",
    [{"items": {"__0_0.distcp@0": "abc"}}, {"items": {"no-offset": 1}}, {"items": [1, 2]}, {"items": {}, "files": 3}, 5],
)
def test_manifest_with_wrong_content(ckpt, manifest):
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CorruptCheckpointError, match="manifest.json is damaged"):
        ci.load(_request(), ckpt)


def test_wrong_backend_requested(ckpt):
    with pytest.raises(CheckpointingException, match="torch_dist"):
        ci.load(_request(), ckpt, sharded_strategy="zarr")


# =========================================================================== damaged files
def test_truncated_data_file(ckpt):
    info = _storage_of(ckpt, "a")
    path = os.path.join(ckpt, info.relative_path)
    os.truncate(path, info.offset + info.length // 2)
    with pytest.raises(CorruptCheckpointError, match="truncated") as ei:
        ci.load(_request(), ckpt)
    assert info.relative_path in str(ei.value) and "'a'" in str(ei.value)


def test_flipped_byte_in_tensor_data_fails_checksum(ckpt):
    info = _storage_of(ckpt, "a")
    path = os.path.join(ckpt, info.relative_path)
    _flip(path, info.offset + info.length // 2)  # inside the 8 KiB of raw tensor bytes
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as ei:
        ci.load(_request(), ckpt)
    assert path in str(ei.value) and "'a'" in str(ei.value)
    # the other tensor of the same file is intact and still loads
    out = ci.load({"b": ST.from_rank_offsets("b", torch.empty(8, dtype=torch.bfloat16))}, ckpt)
    assert torch.equal(out["b"], B)
    # with verification off the damage goes unnoticed (documented escape hatch; the state check,
    # on when CKPT_INTEGRATION_VERIFY_STATE=1, would see it too)
    out = ci.load(_request(), ckpt, verify_checksums=False, verify_state=False)
    assert not torch.equal(out["a"], A)
    from ckpt_integration.errors import StateVerificationError

    with pytest.raises(StateVerificationError, match="'a'.*fingerprint differs"):
        ci.load(_request(), ckpt, verify_checksums=False, verify_state=True)


@pytest.mark.parametrize("where", [0, 5, 40, -10])
def test_flipped_byte_in_archive_header_or_footer(ckpt, where):
    """Zip signature (0), header fields (5, 40) and central directory (-10) of the record."""
    info = _storage_of(ckpt, "a")
    path = os.path.join(ckpt, info.relative_path)
    _flip(path, info.offset + (where if where >= 0 else info.length + where))
    with pytest.raises(CorruptCheckpointError) as ei:
        ci.load(_request(), ckpt)
    assert path in str(ei.value)


@pytest.mark.parametrize("where", [0, 5, 40, 60, 97, 99, 169, -60, -54, -48, -10])
def test_damaged_archive_without_checksums_is_still_a_clean_error(ckpt, where):
    """Checkpoints from Megatron/DCP have no checksums: damaged archives must still raise
    CorruptCheckpointError (not TypeError/MemoryError/OSError/... from the decoders)."""
    _make_foreign(ckpt)
    info = _storage_of(ckpt, "a")
    path = os.path.join(ckpt, info.relative_path)
    _flip(path, info.offset + (where if where >= 0 else info.length + where))
    try:
        out = ci.load(_request(), ckpt)
    except (CorruptCheckpointError, UnsafeCheckpointError) as e:
        assert path in str(e)
    else:  # a byte the decoder does not depend on (e.g. a timestamp or CRC field): the data is intact
        assert torch.equal(out["a"], A) and torch.equal(out["b"], B)


def test_damaged_common_pt(ckpt):
    path = os.path.join(ckpt, "common.pt")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CorruptCheckpointError) as ei:
        ci.load_common_state_dict(ckpt)
    assert path in str(ei.value)


def test_garbage_common_pt_is_corrupt_not_unsafe(ckpt):
    """Damaged pickle opcodes inside an intact archive are corruption, not an unsafe global."""
    import io
    import zipfile

    path = os.path.join(ckpt, "common.pt")
    src = zipfile.ZipFile(path)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("data.pkl"):
                data = b"\x80\x02\x8e" + data[3:]  # opcode 0x8e: not a pickle opcode
            dst.writestr(item, data)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    with pytest.raises(CorruptCheckpointError, match="common.pt"):
        ci.load_common_state_dict(ckpt)


def test_deleted_data_file(ckpt):
    info = _storage_of(ckpt, "a")
    os.remove(os.path.join(ckpt, info.relative_path))
    with pytest.raises(CorruptCheckpointError, match="missing") as ei:
        ci.load(_request(), ckpt)
    assert info.relative_path in str(ei.value)


def test_missing_dcp_metadata(ckpt5):
    """Our readers (loads and the metadata helpers) read the chunk index (``chunk_index.bin``) and
    never ``.metadata``, which DCP and Megatron-Core read and ``verify`` checks; without either the
    load says what is missing."""
    ckpt = ckpt5
    os.remove(os.path.join(ckpt, ".metadata"))
    out = ci.load(_request(), ckpt)
    assert torch.equal(out["a"], A) and torch.equal(out["b"], B)
    assert ci.load_tensors_metadata(ckpt)["a"].global_shape == tuple(A.shape)
    os.remove(os.path.join(ckpt, "chunk_index.bin"))  # neither: the load says what is missing
    for call in (lambda: ci.load(_request(), ckpt), lambda: ci.load_tensors_metadata(ckpt)):
        with pytest.raises(CorruptCheckpointError, match=r"\.metadata is missing"):
            call()


def test_damaged_dcp_metadata(ckpt5):
    ckpt = ckpt5
    os.remove(os.path.join(ckpt, "chunk_index.bin"))  # (as written before the index: .metadata is read)
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        f.write(b"\x80\x04not a pickle at all")
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata"):
        ci.load_tensors_metadata(ckpt)


def test_missing_common_pt(ckpt):
    os.remove(os.path.join(ckpt, "common.pt"))
    with pytest.raises(CorruptCheckpointError, match="common.pt is missing"):
        ci.load(_request(), ckpt)


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_a_checkpoint_that_lost_its_manifest_and_its_marker_is_not_loaded_unchecked(tmp_path, backend):
    """Our checkpoint with manifest.json and ckpt_integration.json both gone (probe): it loaded as a
    foreign checkpoint, without checksums. The index only our saves write says whose it is."""
    d = str(tmp_path / "c")
    ci.save(_state(), d, sharded_strategy=backend)
    os.remove(os.path.join(d, "manifest.json"))
    os.remove(os.path.join(d, "ckpt_integration.json"))
    with pytest.raises(CorruptCheckpointError, match="manifest.json is missing"):
        ci.load(_request(), d)
    from ckpt_integration.cli import main

    assert main(["verify", d]) == 1


def test_damaged_manifest(ckpt):
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        f.write("{broken")
    with pytest.raises(CorruptCheckpointError, match="manifest.json"):
        ci.load(_request(), ckpt)


# =========================================================================== code in pickles
@pytest.mark.parametrize("payload", [RunsCode, RunsCodeViaEval])
def test_dcp_metadata_that_would_run_code_is_refused(ckpt5, tmp_path, payload):
    ckpt = ckpt5
    marker = tmp_path / "pwned"
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        md = pickle.load(f)
    md.planner_data = {"a": payload(str(marker))}  # hidden deep inside a valid Metadata
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    # our readers read the chunk index, never .metadata: nothing of it is unpickled
    ci.load(_request(), ckpt)
    ci.load_tensors_metadata(ckpt)
    assert not marker.exists()
    # without the index: the tampering is caught by the checksum, before any unpickling
    os.remove(os.path.join(ckpt, "chunk_index.bin"))
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata is damaged"):
        ci.load(_request(), ckpt)
    assert not marker.exists()
    _make_foreign(ckpt)  # a foreign checkpoint (no manifest, no marker): the unpickler must refuse
    for call in (
        lambda: ci.load(_request(), ckpt),
        lambda: ci.load_tensors_metadata(ckpt),
        lambda: ci.load_sharded_metadata(ckpt),
        lambda: ci.load_plain_tensors(ckpt),
    ):
        with pytest.raises(UnsafeCheckpointError) as ei:
            call()
        assert ("system" in str(ei.value)) or ("eval" in str(ei.value)), str(ei.value)
        assert "trusted=True" in str(ei.value)
        assert not marker.exists(), "unpickling .metadata executed code"


@pytest.mark.parametrize("payload", [RunsCode, RunsCodeViaEval])
def test_common_state_that_would_run_code_is_refused(ckpt, tmp_path, payload):
    marker = tmp_path / "pwned"
    torch.save({"iteration": 3, "x": payload(str(marker))}, os.path.join(ckpt, "common.pt"))
    with pytest.raises(CorruptCheckpointError, match="common.pt is damaged"):
        ci.load_common_state_dict(ckpt)
    assert not marker.exists()
    _make_foreign(ckpt)
    for call in (lambda: ci.load(_request(), ckpt), lambda: ci.load_common_state_dict(ckpt), lambda: ci.load_content_metadata(ckpt)):
        with pytest.raises(UnsafeCheckpointError) as ei:
            call()
        msg = str(ei.value)
        assert "common.pt" in msg and ("system" in msg or "eval" in msg), msg
        assert not marker.exists(), "unpickling common.pt executed code"


def test_sharded_object_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    d = str(tmp_path / "ckpt")
    ci.save({"evil": ShardedObject("evil", RunsCode(str(marker)), (1,), (0,))}, d)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match="ShardedObject 'evil/shard_0_1'.*system"):
        ci.load({"evil": ShardedObject("evil", None, (1,), (0,))}, d)
    assert not marker.exists(), "unpickling a ShardedObject executed code"


def test_sharded_object_with_custom_class(tmp_path):
    d = str(tmp_path / "ckpt")
    ci.save({"cfg": ShardedObject("cfg", Benign(7), (1,), (0,)), "a": ST.from_rank_offsets("a", A.clone())}, d)
    req = lambda: {"cfg": ShardedObject("cfg", None, (1,), (0,))}  # noqa: E731
    with pytest.raises(UnsafeCheckpointError) as ei:
        ci.load(req(), d)
    msg = str(ei.value)
    assert f"{Benign.__module__}.Benign" in msg and "cfg/shard_0_1" in msg
    assert "allowed_globals" in msg and "trusted=True" in msg
    assert ci.load(req(), d, trusted=True)["cfg"] == Benign(7)
    assert ci.load(req(), d, allowed_globals=[Benign])["cfg"] == Benign(7)


def test_common_state_with_custom_class(tmp_path):
    d = str(tmp_path / "ckpt")
    ci.save({"a": ST.from_rank_offsets("a", A.clone()), "cfg": Benign(1)}, d)
    with pytest.raises(UnsafeCheckpointError, match="Benign"):
        ci.load_common_state_dict(d)
    assert ci.load_common_state_dict(d, trusted=True)["cfg"] == Benign(1)
    assert ci.load_common_state_dict(d, allowed_globals=[Benign])["cfg"] == Benign(1)


# =========================================================================== request vs checkpoint
def test_key_not_in_checkpoint(ckpt):
    req = {**_request(), "c": ST.from_rank_offsets("c.weight", torch.empty(2))}
    with pytest.raises(MismatchError, match="'c.weight' is not in the checkpoint"):
        ci.load(req, ckpt)


def test_object_not_in_checkpoint(ckpt):
    with pytest.raises(MismatchError, match="nothere/shard_0_1"):
        ci.load({"o": ShardedObject("nothere", None, (1,), (0,))}, ckpt)


def test_shape_mismatch(ckpt):
    req = {"a": ST.from_rank_offsets("a", torch.empty(64, 33))}
    with pytest.raises(MismatchError) as ei:
        ci.load(req, ckpt)
    msg = str(ei.value)
    assert "'a'" in msg and "(64, 32)" in msg and "(64, 33)" in msg and "allow_shape_mismatch" in msg


def test_ndim_mismatch(ckpt):
    with pytest.raises(MismatchError, match="'a'"):
        ci.load({"a": ST.from_rank_offsets("a", torch.empty(64 * 32))}, ckpt)


def test_dtype_mismatch(ckpt):
    # casts by default (like Megatron-Core, see tests/test_megatron_compat.py); refused with strict_dtype
    req = {"b": ST.from_rank_offsets("b", torch.empty(8, dtype=torch.float32))}
    with pytest.raises(MismatchError) as ei:
        ci.load(req, ckpt, strict_dtype=True)
    msg = str(ei.value)
    assert "'b'" in msg and "bfloat16" in msg and "float32" in msg


def test_tensor_requested_for_object_key(ckpt):
    with pytest.raises(MismatchError, match="object"):
        ci.load({"x": ST.from_rank_offsets("obj/shard_0_1", torch.empty(1))}, ckpt)


def test_allow_shape_mismatch_zero_fills_the_rest(ckpt):
    # larger than saved (padded vocabulary): overlap loaded, the rest zero
    big = ST.from_rank_offsets("a", torch.full((70, 40), -1.0), allow_shape_mismatch=True)
    out = ci.load({"a": big}, ckpt)["a"]
    assert torch.equal(out[:64, :32], A)
    assert torch.count_nonzero(out[64:]) == 0 and torch.count_nonzero(out[:, 32:]) == 0
    # a row shard of the larger tensor that lies partly outside the saved one
    part = ST.from_rank_offsets("a", torch.full((35, 40), -1.0), (0, 1, 2), allow_shape_mismatch=True)
    out = ci.load({"a": part}, ckpt, validate_access_integrity=False)["a"]
    assert torch.equal(out[:29, :32], A[35:64])
    assert torch.count_nonzero(out[29:]) == 0 and torch.count_nonzero(out[:, 32:]) == 0
    # smaller than saved: the overlapping corner
    small = ST.from_rank_offsets("a", torch.full((10, 8), -1.0), allow_shape_mismatch=True)
    assert torch.equal(ci.load({"a": small}, ckpt)["a"], A[:10, :8])


# =========================================================================== StrictHandling
def _strict_request() -> dict:
    # 'a' is in the checkpoint, 'c.weight' is not (unexpected); 'b' and the object are not requested (missing)
    return {"a": ST.from_rank_offsets("a", torch.empty(64, 32)), "c": ST.from_rank_offsets("c.weight", torch.empty(2))}


MISSING = {"b", "obj"}  # a ShardedObject under its key, as Megatron-Core reports it
UNEXPECTED = {"c.weight"}


def test_strict_raise_unexpected(ckpt):
    with pytest.raises(MismatchError) as ei:
        ci.load(_strict_request(), ckpt, strict=StrictHandling.RAISE_UNEXPECTED)
    msg = str(ei.value)
    assert "c.weight" in msg and "unexpected" in msg and "'b'" not in msg
    # only missing keys: fine in this mode
    out = ci.load({"a": ST.from_rank_offsets("a", torch.empty(64, 32))}, ckpt, strict="raise_unexpected")
    assert torch.equal(out["a"], A)


def test_strict_raise_all(ckpt):
    with pytest.raises(MismatchError) as ei:
        ci.load(_strict_request(), ckpt, strict=StrictHandling.RAISE_ALL)
    msg = str(ei.value)
    assert "c.weight" in msg and "'b'" in msg and "'obj'" in msg and "shard_" not in msg
    with pytest.raises(MismatchError, match=r"(?s)missing.*'b'"):
        ci.load({"a": ST.from_rank_offsets("a", torch.empty(64, 32))}, ckpt, strict="raise_all")
    # nothing missing, nothing unexpected
    full = {**_request(), "o": ShardedObject("obj", None, (1,), (0,))}
    out = ci.load(full, ckpt, strict=StrictHandling.RAISE_ALL)
    assert out["o"] == {"k": 1} and torch.equal(out["b"], B)


def test_strict_return_all_directions(ckpt):
    sd, missing, unexpected = ci.load(_strict_request(), ckpt, strict=StrictHandling.RETURN_ALL)
    assert unexpected == UNEXPECTED  # requested but not in the checkpoint
    assert missing == MISSING  # in the checkpoint but not requested
    assert torch.equal(sd["a"], A) and "c" not in sd
    assert sd["iteration"] == 3


def test_strict_modes_compare_a_tensor_named_like_an_object_shard_by_its_own_key(tmp_path):
    """A tensor whose key ends like an object shard's (``a/shard_0_1``) was compared as the object
    ``a``: a tensor ``a`` requested by nobody was not reported missing (nor raised by RAISE_ALL), and
    an unrequested ``u/shard_0_1`` was reported as ``u``. Only objects go by their object's key."""
    d = str(tmp_path / "c")
    t = lambda k, v=1.0: ShardedTensor.from_rank_offsets(k, torch.full((2,), v))  # noqa: E731
    ci.save({"a": t("a"), "b": t("a/shard_0_1", 2.0), "u": t("u/shard_0_1"),
             "o": ShardedObject("obj", {"k": 1}, (2,), (0,)), "p": ShardedObject("obj", {"k": 2}, (2,), (1,))}, d)
    out, missing, unexpected = ci.load({"b": t("a/shard_0_1", 0.0), "o": ShardedObject("obj", None, (2,), (1,))}, d,
                                       strict=StrictHandling.RETURN_ALL)
    assert missing == {"a", "u/shard_0_1"} and unexpected == set()
    assert torch.equal(out["b"], torch.full((2,), 2.0)) and out["o"] == {"k": 2}
    with pytest.raises(MismatchError, match=r"Missing keys \(for all ranks\): \{'a'\}"):
        ci.load({"b": t("a/shard_0_1", 0.0), "u": t("u/shard_0_1", 0.0), "o": ShardedObject("obj", None, (2,), (0,))}, d,
                strict=StrictHandling.RAISE_ALL)
    _, missing, unexpected = ci.load({"x": t("x/shard_0_1"), "y": ShardedObject("y", None, (1,), (0,))}, d,
                                     strict=StrictHandling.RETURN_ALL)
    assert unexpected == {"x/shard_0_1", "y"} and missing == {"a", "a/shard_0_1", "u/shard_0_1", "obj"}


def test_strict_return_unexpected(ckpt):
    sd, missing, unexpected = ci.load(_strict_request(), ckpt, strict=StrictHandling.RETURN_UNEXPECTED)
    assert unexpected == UNEXPECTED and missing == set()
    assert torch.equal(sd["a"], A) and "c" not in sd


@pytest.mark.parametrize("mode, logs_missing", [(StrictHandling.LOG_UNEXPECTED, False), (StrictHandling.LOG_ALL, True)])
def test_strict_log_modes(ckpt, caplog, mode, logs_missing):
    with caplog.at_level(logging.WARNING, logger="ckpt_integration"):
        sd = ci.load(_strict_request(), ckpt, strict=mode)
    assert torch.equal(sd["a"], A) and "c" not in sd
    text = caplog.text
    assert "c.weight" in text
    assert ("'b'" in text) == logs_missing


def test_strict_ignore_all(ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="ckpt_integration"):
        sd = ci.load(_strict_request(), ckpt, strict=StrictHandling.IGNORE_ALL)
    assert torch.equal(sd["a"], A) and "c" not in sd
    assert "c.weight" not in caplog.text


def test_strict_default_fails_on_unexpected_key_naming_it(ckpt):
    with pytest.raises(MismatchError, match="c.weight"):
        ci.load(_strict_request(), ckpt)  # ASSUME_OK_UNEXPECTED


def test_strict_unknown_mode(ckpt):
    with pytest.raises(ValueError, match="unknown strict mode 'very_strict'.*raise_all"):
        ci.load(_request(), ckpt, strict="very_strict")


# =========================================================================== save-side, one process
def test_save_over_committed_checkpoint_needs_overwrite(ckpt):
    new = {"a": ST.from_rank_offsets("a", A.clone() + 1), "iteration": 4}
    with pytest.raises(CheckpointingException, match="already holds a committed checkpoint.*overwrite=True") as ei:
        ci.save(new, ckpt)
    assert ckpt in str(ei.value)
    out = ci.load(_request(), ckpt)  # untouched
    assert torch.equal(out["a"], A) and out["iteration"] == 3
    ci.save(new, ckpt, overwrite=True)
    out = ci.load({"a": ST.from_rank_offsets("a", torch.empty(64, 32))}, ckpt, strict=StrictHandling.RAISE_ALL)
    assert torch.equal(out["a"], A + 1) and out["iteration"] == 4
    assert "b" not in ci.load_tensors_metadata(ckpt)  # fully replaced, not merged
    parent = os.path.dirname(ckpt)
    assert sorted(os.listdir(parent)) == ["ckpt"], "staging/old directories left behind"


def _dead_save_marker(d) -> None:
    """The marker every save writes first; no process holds its lock: the save was killed."""
    with open(os.path.join(str(d), "ckpt_integration.json"), "w") as f:
        json.dump({"format": "ckpt_integration", "save": "killed-save", "started": 0}, f)


def test_save_into_directory_of_interrupted_save(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    # leftovers of a crashed save (more ranks than now, garbage content, no commit marker)
    _dead_save_marker(d)
    for name in ("__0_0.distcp", "__7_1.distcp", ".metadata", "common.pt", "manifest.json", "metadata.json.tmp-123"):
        (d / name).write_bytes(b"garbage from a crashed save")
    with pytest.raises(IncompleteCheckpointError):
        ci.load(_request(), str(d))
    ci.save(_state(), str(d))
    out = ci.load(_request(), str(d))
    assert torch.equal(out["a"], A) and torch.equal(out["b"], B)
    assert not (d / "__7_1.distcp").exists() and not (d / "metadata.json.tmp-123").exists()


def test_save_into_interrupted_directory_with_a_user_file_refuses(tmp_path):
    """A user's file beside an interrupted save's leftovers: nothing is deleted, nothing mixed in."""
    d = tmp_path / "ckpt"
    d.mkdir()
    _dead_save_marker(d)
    (d / "__7_1.distcp").write_bytes(b"garbage from a crashed save")
    (d / "notes.txt").write_text("user file")
    with pytest.raises(SaveConflictError, match="notes.txt"):
        ci.save(_state(), str(d))
    assert sorted(os.listdir(d)) == ["__7_1.distcp", "ckpt_integration.json", "notes.txt"]


def test_save_to_a_file_path(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointingException, match="is a file"):
        ci.save(_state(), str(f))
    assert f.read_text() == "x"


def test_save_tensor_without_data(tmp_path):
    st = ST("w", None, torch.float32, (4,), (4,), (0,), (1,))
    with pytest.raises(CheckpointingException, match="'w' has no data"):
        ci.save({"w": st}, str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "c" / "metadata.json")


def test_save_rejects_unknown_backend(tmp_path):
    with pytest.raises(CheckpointingException, match="unknown sharded backend 'hdf5'"):
        ci.save(_state(), str(tmp_path / "c"), sharded_strategy="hdf5")


def test_save_single_process_integrity(tmp_path):
    """Without torch.distributed, two overlapping shards of one key in one state dict."""
    sd = {
        "x": ST.from_global_offsets("x", torch.ones(4), (6,), (0,)),
        "y": ST.from_global_offsets("x", torch.ones(4), (6,), (2,)),
    }
    with pytest.raises(ShardingIntegrityError, match="'x'.*overlap"):
        ci.save(sd, str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "c" / "metadata.json")


# =========================================================================== multi-rank (one launch)
WORLD3 = 3


def _describe_exc(e: BaseException) -> list:
    notes = "\n".join(getattr(e, "__notes__", []))
    return [type(e).__name__, f"{e}\n{notes}"]


def _multi_rank_worker(rank: int, world: int, base: str) -> None:
    import ckpt_integration.execution.save as save_mod
    from ckpt_integration.storage import checkpoint_dir as ckdir

    results: dict = {}
    full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    rows = 6 // world

    def good_state(delta: float = 0.0) -> dict:
        return {
            "w": ST.from_rank_offsets("w", full[rank * rows : (rank + 1) * rows].clone() + delta, (0, rank, world)),
            "r": ST.from_rank_offsets("r", torch.full((3,), 2.0 + delta), replica_id=rank),
            "iteration": int(delta),
        }

    def load_good(path: str) -> dict:
        req = {
            "w": ST.from_rank_offsets("w", torch.empty(rows, 4), (0, rank, world)),
            "r": ST.from_rank_offsets("r", torch.empty(3), replica_id=rank),
        }
        return ci.load(req, path)

    def attempt(name, fn):
        try:
            fn()
            results[name] = ["ok", ""]
        except Exception as e:  # noqa: BLE001 - asserted by the tests
            results[name] = _describe_exc(e)
        dist.barrier()  # no rank may be left behind in a collective

    def committed(path: str) -> bool:
        return os.path.exists(os.path.join(path, "metadata.json"))

    good = os.path.join(base, "good")
    attempt("good_save", lambda: ci.save(good_state(), good))

    # -- sharding integrity ------------------------------------------------------------
    # overlap: rank0 [0:3], rank1 [2:4], rank2 [4:6] of a 6-vector
    ov = {0: (0, 3), 1: (2, 2), 2: (4, 2)}[rank]
    attempt("overlap", lambda: ci.save({"ov": ST.from_global_offsets("ov.w", torch.ones(ov[1]), (6,), (ov[0],))}, os.path.join(base, "overlap")))
    # gap: rank0 [0:2], rank1 [2:3], rank2 [4:6]: [3:4] is saved by nobody
    gp = {0: (0, 2), 1: (2, 1), 2: (4, 2)}[rank]
    attempt("gap", lambda: ci.save({"gp": ST.from_global_offsets("gap.w", torch.ones(gp[1]), (6,), (gp[0],))}, os.path.join(base, "gap")))
    # global shape disagreement: rank 1 says 8 rows
    gshape = (8, 4) if rank == 1 else (6, 4)
    attempt("shape", lambda: ci.save({"s": ST.from_global_offsets("shape.w", torch.ones(2, 4), gshape, (2 * rank, 0))}, os.path.join(base, "shape")))
    # dtype disagreement: rank 2 in bf16
    dt = torch.bfloat16 if rank == 2 else torch.float32
    attempt("dtype", lambda: ci.save({"d": ST.from_rank_offsets("dtype.w", torch.ones(2, 4, dtype=dt), (0, rank, world))}, os.path.join(base, "dtype")))
    # no main replica: replica ids 1, 2, 3
    attempt("no_main", lambda: ci.save({"n": ST.from_rank_offsets("nomain.w", torch.ones(3), replica_id=rank + 1)}, os.path.join(base, "no_main")))

    # -- a save failing on one rank ----------------------------------------------------
    def data_none_state():
        sd = good_state(5.0)
        if rank == 1:
            sd["w"] = ST("w", None, torch.float32, (rows, 4), (6, 4), (rank * rows, 0), (world, 1))
        return sd

    attempt("data_none", lambda: ci.save(data_none_state(), os.path.join(base, "data_none")))
    results["data_none_committed"] = committed(os.path.join(base, "data_none"))

    def write_fail():
        original = save_mod.write_data_files
        if rank == 2:
            def refuse(target, *a, **k):  # (the write directory, as the storage handle)
                raise PermissionError(13, "Permission denied", os.path.join(target.path, "__2_0.distcp"))

            save_mod.write_data_files = refuse
        try:
            ci.save(good_state(6.0), os.path.join(base, "write_fail"))
        finally:
            save_mod.write_data_files = original

    attempt("write_fail", write_fail)
    wf = os.path.join(base, "write_fail")
    results["write_fail_committed"] = committed(wf)
    results["write_fail_leftovers"] = sorted(os.listdir(wf)) if os.path.isdir(wf) else []

    def commit_fail():
        original = ckdir.write_config
        if rank == 0:
            def disk_full(*a, **k):
                raise OSError(28, "No space left on device")

            ckdir.write_config = disk_full
        try:
            ci.save(good_state(7.0), os.path.join(base, "commit_fail"))
        finally:
            ckdir.write_config = original

    attempt("commit_fail", commit_fail)
    results["commit_fail_committed"] = committed(os.path.join(base, "commit_fail"))

    def bad_input_one_rank():
        sd = good_state(8.0) if rank != 2 else ["not", "a", "dict"]
        ci.save(sd, os.path.join(base, "bad_input"))

    attempt("bad_input", bad_input_one_rank)
    # the failed save released its directory: the next save there (same processes) proceeds
    attempt("after_bad_input", lambda: ci.save(good_state(8.5), os.path.join(base, "bad_input")))

    # overwrite=True onto the good checkpoint, failing on rank 1: the old one must survive
    attempt("overwrite_fail", lambda: ci.save(data_none_state(), good, overwrite=True))
    # without overwrite=True onto a committed checkpoint
    attempt("no_overwrite_flag", lambda: ci.save(good_state(9.0), good))

    # -- the earlier checkpoint survived everything ------------------------------------
    def good_still_loads():
        out = load_good(good)
        assert torch.equal(out["w"], full[rank * rows : (rank + 1) * rows]), out["w"]
        assert torch.equal(out["r"], torch.full((3,), 2.0)) and out["iteration"] == 0

    attempt("good_after_failures", good_still_loads)
    results["base_listing"] = sorted(os.listdir(base))

    def failed_dirs_not_loadable():
        for name in ("data_none", "write_fail", "commit_fail", "overlap"):
            try:
                load_good(os.path.join(base, name))
            except CheckpointingException:
                continue
            raise AssertionError(f"{name} loaded although its save failed")

    attempt("failed_dirs_not_loadable", failed_dirs_not_loadable)

    # -- overwrite=True with several ranks; reuse of an interrupted save's directory ---------
    def overwrite_ok():
        ci.save(good_state(10.0), good, overwrite=True)
        out = load_good(good)
        assert torch.equal(out["w"], full[rank * rows : (rank + 1) * rows] + 10) and out["iteration"] == 10

    attempt("overwrite_ok", overwrite_ok)

    partial = os.path.join(base, "partial")
    if rank == 0:
        os.makedirs(partial)
        _dead_save_marker(partial)
        for n in ("__0_0.distcp", "__1_0.distcp", "__5_3.distcp", ".metadata", "common.pt"):
            with open(os.path.join(partial, n), "wb") as f:
                f.write(b"left by a crashed save")
    dist.barrier()

    def partial_dir():
        try:
            load_good(partial)
        except IncompleteCheckpointError:
            pass
        else:
            raise AssertionError("an uncommitted directory loaded")
        dist.barrier()
        ci.save(good_state(11.0), partial)
        out = load_good(partial)
        assert torch.equal(out["w"], full[rank * rows : (rank + 1) * rows] + 11)
        assert not os.path.exists(os.path.join(partial, "__5_3.distcp"))

    attempt("partial_dir", partial_dir)

    with open(os.path.join(base, f"errors_rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def multi_rank(tmp_path_factory):
    base = tmp_path_factory.mktemp("errors3")
    run_distributed(_multi_rank_worker, WORLD3, str(base), timeout=150)
    out = []
    for r in range(WORLD3):
        with open(base / f"errors_rank{r}.json") as f:
            out.append(json.load(f))
    return out


def _outcomes(multi_rank, name):
    return [(r, res[name][0], res[name][1]) for r, res in enumerate(multi_rank)]


def test_multi_rank_good_save(multi_rank):
    assert all(t == "ok" for _, t, _ in _outcomes(multi_rank, "good_save")), _outcomes(multi_rank, "good_save")


@pytest.mark.parametrize(
    "scenario, key, needles",
    [
        ("overlap", "ov.w", ["overlap", "rank 0", "rank 1", "[2:3]"]),
        ("gap", "gap.w", ["cover 5 of 6", "[3:4]"]),
        ("shape", "shape.w", ["global shape", "(8, 4) on ranks 1", "(6, 4) on ranks 0, 2"]),
        ("dtype", "dtype.w", ["dtype", "bfloat16 on ranks 2", "float32 on ranks 0, 1"]),
        ("no_main", "nomain.w", ["no rank holds a main replica", "ranks 0, 1, 2"]),
    ],
)
def test_sharding_integrity_errors_on_all_ranks(multi_rank, tmp_path_factory, scenario, key, needles):
    for rank, typ, msg in _outcomes(multi_rank, scenario):
        assert typ == "ShardingIntegrityError", (rank, typ, msg)
        assert f"'{key}'" in msg, msg
        for n in needles:
            assert n in msg, (n, msg)
        assert "nothing was saved" in msg


def test_sharding_gap_message_names_ranks(multi_rank):
    for rank, typ, msg in _outcomes(multi_rank, "gap"):
        assert "ranks 0, 1, 2" in msg or "rank 2" in msg, msg


def test_save_fails_on_all_ranks_when_one_rank_has_no_data(multi_rank):
    outs = _outcomes(multi_rank, "data_none")
    for rank, typ, msg in outs:
        if rank == 1:
            assert typ == "CheckpointingException", (typ, msg)  # its own error, specific type
        else:
            assert typ == "DistributedCheckpointingError", (rank, typ, msg)
            assert "rank 1" in msg
        assert "'w' has no data to save" in msg, msg
    assert not any(res["data_none_committed"] for res in multi_rank)


def test_save_fails_on_all_ranks_when_one_rank_cannot_write(multi_rank):
    for rank, typ, msg in _outcomes(multi_rank, "write_fail"):
        # a library error on every rank (CheckpointWriteError is also an OSError), naming the file
        assert typ == ("CheckpointWriteError" if rank == 2 else "DistributedCheckpointingError"), (rank, typ, msg)
        assert "permission denied while writing" in msg.lower() and "__2_0.distcp" in msg
        if rank != 2:
            assert "rank 2" in msg
        assert "no checkpoint was committed" in msg
    for res in multi_rank:
        assert not res["write_fail_committed"]
        # the data files ranks 0 and 1 did write were cleaned up
        assert not [n for n in res["write_fail_leftovers"] if n.endswith(".distcp")], res["write_fail_leftovers"]


def test_save_fails_on_all_ranks_when_commit_fails(multi_rank):
    for rank, typ, msg in _outcomes(multi_rank, "commit_fail"):
        assert typ == ("CheckpointWriteError" if rank == 0 else "DistributedCheckpointingError"), (rank, typ, msg)
        assert "no space left on device while writing" in msg
        if rank != 0:  # the failing rank re-raises its own exception; the others name it
            assert "rank 0 (commit)" in msg
    assert not any(res["commit_fail_committed"] for res in multi_rank)


def test_save_fails_on_all_ranks_on_bad_input_on_one_rank(multi_rank):
    for rank, typ, msg in _outcomes(multi_rank, "bad_input"):
        assert typ == ("CheckpointingException" if rank == 2 else "DistributedCheckpointingError"), (rank, typ, msg)
        assert "must be a dict" in msg
        if rank != 2:
            assert "rank 2" in msg


def test_save_after_a_failed_save_into_the_same_directory(multi_rank):
    for rank, typ, msg in _outcomes(multi_rank, "after_bad_input"):
        assert typ == "ok", (rank, typ, msg)


def test_failed_overwrite_keeps_the_old_checkpoint(multi_rank):
    for rank, typ, msg in _outcomes(multi_rank, "overwrite_fail"):
        assert typ in ("CheckpointingException", "DistributedCheckpointingError"), (rank, typ, msg)
        assert "'w' has no data to save" in msg
    for rank, typ, msg in _outcomes(multi_rank, "good_after_failures"):
        assert typ == "ok", (rank, msg)
    listing = multi_rank[0]["base_listing"]
    assert not [n for n in listing if ".tmp-" in n or ".old-" in n], listing


def test_save_over_committed_without_overwrite_multi_rank(multi_rank):
    for rank, typ, msg in _outcomes(multi_rank, "no_overwrite_flag"):
        assert typ == ("CheckpointingException" if rank == 0 else "DistributedCheckpointingError"), (rank, typ, msg)
        assert "already holds a committed checkpoint" in msg


def test_failed_saves_are_not_loadable(multi_rank):
    for rank, typ, msg in _outcomes(multi_rank, "failed_dirs_not_loadable"):
        assert typ == "ok", (rank, msg)


def test_overwrite_multi_rank(multi_rank):
    for rank, typ, msg in _outcomes(multi_rank, "overwrite_ok"):
        assert typ == "ok", (rank, msg)


def test_save_into_interrupted_directory_multi_rank(multi_rank):
    for rank, typ, msg in _outcomes(multi_rank, "partial_dir"):
        assert typ == "ok", (rank, msg)


def test_the_package_root_is_small_and_the_moved_exceptions_still_resolve():
    """The root exports entry points, mapping types, the base exception and the few exceptions
    callers catch; every other exception lives in ckpt_integration.errors and, looked up on the
    root as before, resolves to the same class with a DeprecationWarning."""
    import warnings

    import ckpt_integration as ci
    from ckpt_integration import errors

    exceptions = [n for n in ci.__all__ if isinstance(getattr(ci, n), type) and issubclass(getattr(ci, n), BaseException)]
    assert sorted(exceptions) == ["CheckpointNotFoundError", "CheckpointingException", "CorruptCheckpointError",
                                  "IncompleteCheckpointError"]
    assert len(ci.__all__) <= 36, ci.__all__
    for name in ("MemoryCheckpointError", "SnapshotModifiedError", "UnsupportedCheckpointError"):
        assert name not in ci.__all__
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert getattr(ci, name) is getattr(errors, name)
        assert any(issubclass(w.category, DeprecationWarning) and f"errors.{name}" in str(w.message) for w in caught)
    from ckpt_integration.execution.snapshot import SnapshotModifiedError

    assert SnapshotModifiedError is errors.SnapshotModifiedError
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        ci.no_such_name  # noqa: B018


def test_failure_keeps_the_first_cause_and_lets_interrupts_through():
    """execution.failure.Failure: the first exception of a step is kept (later ones are consequences),
    an interrupt is never swallowed, and agree() raises the kept one with the context as a note."""
    from ckpt_integration.execution.failure import Failure

    failure = Failure()
    failure.agree(None, "nothing failed")  # no failure: no raise
    with failure.capture():
        raise ValueError("first")
    with failure.capture():
        raise KeyError("second")
    assert failure.failed and isinstance(failure.exc, ValueError) and "ValueError: first" in failure.message
    with pytest.raises(KeyboardInterrupt):
        with Failure().capture():
            raise KeyboardInterrupt
    with pytest.raises(ValueError, match="first") as ei:
        failure.agree(None, "step failed")
    assert any("step failed" in n for n in getattr(ei.value, "__notes__", []))


def test_write_and_read_errors_keep_the_paths_they_name():
    """A write error lower-cased the whole system message, paths in it included (``/Run/Ckpt`` shown as
    ``/run/ckpt``, a path that does not exist), and took the failing call's file name even when it lay
    outside the checkpoint (EMFILE while torch imported a module named that module's source file)."""
    import errno

    from ckpt_integration.errors import CheckpointReadError
    from ckpt_integration.storage.filesystem import write_error
    from ckpt_integration.storage.readers import reading

    e = write_error(OSError(errno.EBUSY, "cannot exchange /Run/Ckpt.tmp-1 and /Run/Ckpt: Device or resource busy"),
                    "/Run/Ckpt")
    assert "cannot exchange /Run/Ckpt.tmp-1 and /Run/Ckpt: Device or resource busy while writing /Run/Ckpt" in str(e)
    e = write_error(OSError(errno.EMFILE, "Too many open files", "/usr/lib/python3/site-packages/torch/x.py"),
                    "/Run/Ckpt/__0_0.distcp")
    assert str(e) == "too many open files while writing /Run/Ckpt/__0_0.distcp" and e.path == "/Run/Ckpt/__0_0.distcp"
    e = write_error(OSError(errno.ENOSPC, "No space left on device", "/Run/Ckpt/__1_0.distcp"), "/Run/Ckpt/__0_0.distcp")
    assert e.path == "/Run/Ckpt/__1_0.distcp"  # (a file of the checkpoint: the one that failed)
    with pytest.raises(CheckpointReadError, match="^bad thing at /Run/X while reading /Run/X$"):
        with reading("/Run/X"):
            raise OSError(errno.EIO, "Bad thing at /Run/X")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_common_state_value_that_cannot_be_saved_is_named(tmp_path, mode):
    """A lock (or a lambda, a generator) in the common state raised a bare ``TypeError: cannot pickle
    '_thread.lock' object`` naming neither the key nor the file; the error names the key path."""
    import threading

    sd = {"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(4)), "cfg": {"lr": 0.1, "hook": threading.Lock()}}
    with pytest.raises(ci.CheckpointingException, match=r"'(common\.)?cfg\.hook' \(lock\).*cannot pickle"):
        if mode == "sync":
            ci.save(sd, str(tmp_path / "c"))
        else:
            ci.save(sd, str(tmp_path / "c"), async_sharded_save=True).wait()
    assert not os.path.exists(tmp_path / "c")


def test_an_empty_path_or_a_removed_working_directory_is_refused_clearly(tmp_path, monkeypatch):
    """``save(state, "")`` (a config's empty path) failed with "no such file or directory while writing "
    naming nothing; and once relative paths were resolved at the call, "" meant the working directory
    (an overwrite replaced it). A relative path in a removed working directory raised ``os.getcwd``'s
    bare ``FileNotFoundError``."""
    sd = {"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(4))}
    monkeypatch.chdir(tmp_path)
    for call in (lambda: ci.save(sd, ""), lambda: ci.save(sd, "", overwrite=True), lambda: ci.load(sd, "")):
        with pytest.raises(ci.CheckpointingException, match="no checkpoint path: an empty string was given"):
            call()
    assert os.listdir(tmp_path) == []
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(ci.CheckpointingException, match="ck: a relative path, and the working directory was removed"):
        ci.save(sd, "ck")
