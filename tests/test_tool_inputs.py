"""Damaged or unusual inputs of the command-line tools: they must fail (exit 2, naming the file/key),
not report success, skip silently or write wrong output.

The CLI runs in-process via ``main([...])``; every checkpoint is tiny and saved in this process.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
import zipfile

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration.cli import main
from ckpt_integration.errors import CorruptCheckpointError
from ckpt_integration.modules import module_sharded_state_dict
from ckpt_integration.optimizer import optimizer_sharded_state_dict
from ckpt_integration.tools import diff_checkpoints, export_checkpoint, export_recipe_object
from ckpt_integration.tools import writers


def run_cli(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _flip(path, at=None):
    """Flip one bit of ``path`` (in the middle unless ``at``)."""
    at = os.path.getsize(path) // 2 if at is None else at
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


# --------------------------------------------------------------------------- export: the common state
def _lightning_two_optimizers(path):
    """A Lightning-style checkpoint (marker in the common state) with two optimizers."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt0 = torch.optim.Adam(model.parameters())
    opt1 = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for o in (opt0, opt1):
        model(torch.randn(2, 4)).sum().backward()
        o.step()
        o.zero_grad()
    model_sd = module_sharded_state_dict(model, "")
    state = {"state_dict": model_sd,
             "optimizer": optimizer_sharded_state_dict(opt0, model_sd, prefix="optimizer"),
             "optimizer_1": optimizer_sharded_state_dict(opt1, model_sd, prefix="optimizer_1"),
             "epoch": 3, "global_step": 10, "hyper_parameters": {"hidden": 4},
             "pytorch-lightning_version": "2.4.0", "loops": {}, "export_recipe": export_recipe_object(model_sd)}
    marker = {"lightning": 1, "world_size": 1, "num_optimizers": 2, "has_optimizer_states": True,
              "layout": {"tp": 1, "pp": 1, "dp": 1}}
    ci.save(state, path, content_metadata=marker, durable=False)
    return path


@pytest.mark.parametrize("damage", ["flipped", "truncated", "emptied", "missing"])
def test_export_fails_on_damaged_common_state(tmp_path, capsys, damage):
    src = _lightning_two_optimizers(str(tmp_path / "ckpt"))
    code, _, _ = run_cli(capsys, "export", src, tmp_path / "ok", "--to", "hf")
    assert code == 0
    with open(tmp_path / "ok" / "model.safetensors.index.json") as f:
        assert sorted(json.load(f)["weight_map"]) == ["bias", "weight"]
    common = os.path.join(src, "common.pt")
    if damage == "flipped":
        _flip(common)
    elif damage == "truncated":
        os.truncate(common, os.path.getsize(common) // 2)
    elif damage == "emptied":
        os.truncate(common, 0)
    else:
        os.remove(common)
    for to, out in (("hf", tmp_path / "hf"), ("lightning", tmp_path / "x.ckpt")):
        code, stdout, err = run_cli(capsys, "export", src, out, "--to", to)
        assert code == 2, (to, code, stdout)
        assert "common.pt" in err, err
        assert not os.path.exists(out)  # nothing written (no optimizer state as model weights)


class Opaque:
    """A class outside the restricted unpickler's allow-list."""

    def __init__(self, x=1):
        self.x = x


def test_export_untrusted_common_state_stays_a_note(tmp_path, capsys):
    src = str(tmp_path / "ckpt")
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), "thing": Opaque()}, src, durable=False)
    code, out, _ = run_cli(capsys, "export", src, tmp_path / "hf", "--to", "hf")
    assert code == 0
    assert "not exported: the common state" in out


def test_export_lightning_aborts_writer_on_failure(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    src = str(tmp_path / "ckpt")
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, src, durable=False)
    aborted = []
    real_abort = writers.TorchSaveWriter.abort

    def abort(self):
        aborted.append(self.path)
        real_abort(self)

    def broken_write(self, block):
        raise OSError("disk full")

    monkeypatch.setattr(writers.TorchSaveWriter, "abort", abort)
    monkeypatch.setattr(writers.TorchSaveWriter, "write", broken_write)
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(src, str(tmp_path / "x.ckpt"), "lightning")
    assert len(aborted) == 1
    assert not os.path.exists(tmp_path / "x.ckpt")


# --------------------------------------------------------------------------- diff: exact integers, damaged objects
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint64])
def test_diff_integers_exact(tmp_path, capsys, dtype):
    from safetensors.torch import save_file

    vals = [2**53, 1234567890123456789, 2**62] if dtype == torch.uint64 else [2**53, 1234567890123456789, -(2**62)]
    a = torch.tensor(vals, dtype=torch.int64).to(dtype)
    b = (torch.tensor(vals, dtype=torch.int64) + 1).to(dtype)
    save_file({"ids": a}, str(tmp_path / "a.safetensors"))
    save_file({"ids": b}, str(tmp_path / "b.safetensors"))
    code, out, _ = run_cli(capsys, "diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert code == 1, out
    assert out.strip().endswith("different")
    rep = diff_checkpoints(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"))
    assert rep.max_abs_diff["ids"] >= 1
    code, out, _ = run_cli(capsys, "diff", tmp_path / "a.safetensors", tmp_path / "a.safetensors")
    assert code == 0 and out.strip().endswith("identical")


def _with_object(path):
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.arange(4.0)),
             "o": ci.ShardedObject("o", {"step": 7, "blob": list(range(50))}, (1,), (0,)), "epoch": 3},
            path, durable=False)
    return path


def test_diff_damaged_common_state_is_an_error(tmp_path, capsys):
    a, b = _with_object(str(tmp_path / "a")), _with_object(str(tmp_path / "b"))
    assert run_cli(capsys, "diff", a, b)[0] == 0
    _flip(os.path.join(a, "common.pt"))
    code, out, err = run_cli(capsys, "diff", a, b)
    assert code == 2, out
    assert "common.pt" in err


def test_diff_damaged_object_is_an_error(tmp_path, capsys):
    import pickle

    a, b = _with_object(str(tmp_path / "a")), _with_object(str(tmp_path / "b"))
    with open(os.path.join(a, ".metadata"), "rb") as f:
        md = pickle.load(f)
    info = next(v for k, v in md.storage_data.items() if k.fqn.startswith("o/"))
    _flip(os.path.join(a, info.relative_path), info.offset + info.length // 2)
    code, out, err = run_cli(capsys, "diff", a, b)
    assert code == 2, out
    assert "o/shard_0_1" in err


def test_diff_untrusted_common_state_stays_a_note(tmp_path, capsys):
    a = str(tmp_path / "a")
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), "thing": Opaque()}, a, durable=False)
    code, out, _ = run_cli(capsys, "diff", a, a)
    assert code == 1 and "common state and objects not compared" in out


# --------------------------------------------------------------------------- safetensors inputs: the header is checked
def _st_file(path, edit=None, truncate=0):
    """A safetensors file with tensors ``a`` (1000 float32) and ``b``; ``edit(header)`` rewrites its header."""
    from safetensors.torch import save_file

    save_file({"a": torch.arange(1000, dtype=torch.float32), "b": torch.arange(1000, 2000, dtype=torch.float32)}, path)
    with open(path, "rb") as f:
        raw = f.read()
    if edit is not None:
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        edit(header)
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        raw = struct.pack("<Q", len(h)) + h + raw[8 + n:]
    with open(path, "wb") as f:
        f.write(raw[:len(raw) - truncate])
    return path


def _set(key, field, value):
    def edit(header):
        if value is None:
            del header[key][field]
        else:
            header[key][field] = value
    return edit


def _overlap(header):
    header["b"]["data_offsets"] = [2000, 6000]  # 'b' starts inside 'a'


@pytest.mark.parametrize("name, edit, truncate, key", [
    ("truncated", None, 100, "b"),
    ("short_range", _set("a", "data_offsets", [0, 2000]), 0, "a"),
    ("big_shape", _set("a", "shape", [2000]), 0, "a"),
    ("no_dtype", _set("a", "dtype", None), 0, "a"),
    ("no_shape", _set("b", "shape", None), 0, "b"),
    ("negative_dim", _set("b", "shape", [-1000]), 0, "b"),
    ("bad_offsets", _set("b", "data_offsets", [4000]), 0, "b"),
    ("reversed_offsets", _set("b", "data_offsets", [8000, 4000]), 0, "b"),
    ("entry_not_object", lambda h: h.__setitem__("b", [1, 2]), 0, "b"),
    ("overlap", _overlap, 0, "b"),
])
def test_safetensors_header_checked(tmp_path, capsys, name, edit, truncate, key):
    path = _st_file(str(tmp_path / f"{name}.safetensors"), edit, truncate)
    good = _st_file(str(tmp_path / "good.safetensors"))
    for args in (("inspect", path), ("convert", path, tmp_path / "out.pt", "--to", "torch"),
                 ("convert", path, tmp_path / "out_td", "--to", "torch_dist"), ("diff", path, good)):
        code, out, err = run_cli(capsys, *args)
        assert code == 2, (args[0], code, out, err)
        assert path in err and repr(key) in err, err
    assert not os.path.exists(tmp_path / "out.pt") and not os.path.exists(tmp_path / "out_td")
    from ckpt_integration.tools.sources import SafetensorsSource

    with pytest.raises(CorruptCheckpointError):
        SafetensorsSource(path)


def test_safetensors_truncated_shard_of_a_folder(tmp_path, capsys):
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"a": torch.arange(10.0)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.arange(1000.0)}, str(folder / "model-00002-of-00002.safetensors"))
    with open(folder / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                  "b": "model-00002-of-00002.safetensors"}}, f)
    assert run_cli(capsys, "inspect", folder)[0] == 0
    shard = folder / "model-00002-of-00002.safetensors"
    os.truncate(shard, os.path.getsize(shard) - 1000)
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "out.pt", "--to", "torch")
    assert code == 2 and str(shard) in err and "'b'" in err


# --------------------------------------------------------------------------- torch.save inputs: zip CRC32s are checked
def _flip_in_record(path, suffix, at=8):
    """Flip a bit of the data of the zip record whose name ends with ``suffix``."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:  # the local header's lengths (its extra field may differ from the central one)
        f.seek(info.header_offset + 26)
        n_name, n_extra = struct.unpack("<HH", f.read(4))
    _flip(path, info.header_offset + 30 + n_name + n_extra + at)
    return info.filename


def test_torch_file_input_crc_checked(tmp_path, capsys):
    from ckpt_integration.tools.sources import TorchFileSource

    path = str(tmp_path / "model.pt")
    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, path)
    assert run_cli(capsys, "inspect", path)[0] == 0
    record = _flip_in_record(path, "data/0", 4000)
    code, out, err = run_cli(capsys, "convert", path, tmp_path / "ck", "--to", "torch_dist")
    assert code == 2, (out, err)
    assert path in err and record in err, err
    assert not os.path.exists(tmp_path / "ck")
    with pytest.raises(CorruptCheckpointError, match="CRC32"):
        TorchFileSource(path)


def _stock_ckpt(path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    torch.save({"state_dict": model.state_dict(), "epoch": 1, "global_step": 3, "pytorch-lightning_version": "2.4.0",
                "loops": {}, "callbacks": {}, "lr_schedulers": [], "optimizer_states": []}, path)
    return path


def test_lightning_ckpt_input_crc_checked(tmp_path, capsys):
    path = _stock_ckpt(str(tmp_path / "stock.ckpt"))
    assert run_cli(capsys, "convert", path, tmp_path / "ok", "--to", "torch_dist")[0] == 0
    record = _flip_in_record(path, "data/0")
    code, out, err = run_cli(capsys, "convert", path, tmp_path / "bad", "--to", "torch_dist")
    assert code == 2, (out, err)
    assert path in err and record in err, err
    assert not os.path.exists(tmp_path / "bad")


@pytest.mark.parametrize("damage", ["emptied", "truncated", "garbage"])
def test_lightning_dcp_damaged_meta_is_corrupt(tmp_path, capsys, damage):
    import torch.distributed.checkpoint as dcp

    from ckpt_integration.tools import lightning_import

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    d = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (single process, no process group: intended)
        dcp.save({"state_dict": dict(model.state_dict())}, checkpoint_id=d, no_dist=True)
    meta = os.path.join(d, "meta.pt")
    torch.save({"epoch": 1, "global_step": 3, "pytorch-lightning_version": "2.4.0", "loops": {}}, meta)
    assert run_cli(capsys, "convert", d, tmp_path / "ok", "--to", "torch_dist")[0] == 0
    if damage == "emptied":
        os.truncate(meta, 0)
    elif damage == "truncated":
        os.truncate(meta, os.path.getsize(meta) // 2)
    else:
        with open(meta, "wb") as f:
            f.write(b"not a torch file at all" * 10)
    code, out, err = run_cli(capsys, "convert", d, tmp_path / "bad", "--to", "torch_dist")
    assert code == 2, (out, err)
    assert "meta.pt" in err
    with pytest.raises(CorruptCheckpointError, match="meta.pt"):
        lightning_import.import_lightning_checkpoint(d, str(tmp_path / "bad2"))


# --------------------------------------------------------------------------- key collisions
@pytest.mark.parametrize("to", ["safetensors", "torch", "torch_dist"])
def test_torch_input_whose_joined_keys_collide_is_refused(tmp_path, capsys, to):
    """``{"model.weight": t, "model": {"weight": u}}``: flattened, one tensor silently replaced the other
    (safetensors and torch outputs held 1 of the 2, and ``diff`` called them identical)."""
    src = tmp_path / "in.pt"
    torch.save({"model.weight": torch.ones(3), "model": {"weight": torch.zeros(3)}}, src)
    code, out, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", to)
    assert code == 2 and "'model.weight'" in err and "rename one" in err, (code, out, err)
    assert not os.path.exists(tmp_path / "out")


def test_nested_torch_output_of_a_key_and_its_child_is_refused_before_writing(tmp_path, capsys):
    """``--nested`` with tensors ``emb`` and ``emb.scale``: a raw TypeError after every tensor was streamed."""
    ck = tmp_path / "ck"
    ci.save({"a": ci.ShardedTensor.from_rank_offsets("emb", torch.ones(3)),
             "b": ci.ShardedTensor.from_rank_offsets("emb.scale", torch.zeros(1))}, str(ck), durable=False)
    code, out, err = run_cli(capsys, "convert", ck, tmp_path / "o.pt", "--to", "torch", "--nested")
    assert code == 2 and "'emb' and 'emb.scale'" in err, (code, out, err)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    code, out, err = run_cli(capsys, "convert", ck, tmp_path / "o.pt", "--to", "torch")  # (flat keys: fine)
    assert code == 0, err
    assert torch.equal(torch.load(tmp_path / "o.pt", weights_only=True)["emb.scale"], torch.zeros(1))


@pytest.mark.parametrize("to", ["torch_dist", "lightning"])
def test_spill_file_has_no_name_while_it_is_written(tmp_path, monkeypatch, to):
    """A conversion killed while streaming into its spill file left it beside OUT (up to the size of
    every tensor): the file is now unlinked before anything is written to it."""
    from ckpt_integration.tools import sources

    ck = tmp_path / "ck"
    ci.save({"a": ci.ShardedTensor.from_rank_offsets("a", torch.arange(6.0))}, str(ck), durable=False)
    if to == "lightning":  # (a stock Lightning DCP directory goes through the import's spill)
        pytest.importorskip("lightning")
    seen = []
    real = sources.DistCheckpointSource.iter_blocks

    def watching(self, key, budget):
        seen.append(sorted(n for n in os.listdir(tmp_path) if "spill" in n))
        yield from real(self, key, budget)

    monkeypatch.setattr(sources.DistCheckpointSource, "iter_blocks", watching)
    if to == "torch_dist":
        out = ci.tools.convert_checkpoint(str(ck), "torch_dist", str(tmp_path / "out"))
        assert out.tensors == 1 and torch.equal(ci.load_plain_tensors(str(tmp_path / "out"))["a"], torch.arange(6.0))
        assert seen and all(s == [] for s in seen), seen
    else:
        tensors = sources.spill_tensors(sources.DistCheckpointSource(str(ck)), ["a"], str(tmp_path), 1 << 20,
                                        lambda **kw: _NoBar(), "import")
        assert torch.equal(tensors["a"], torch.arange(6.0)) and seen == [[]], seen


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("to", ["torch_dist", "zarr"])
def test_a_dcp_checkpoint_with_non_tensor_values_converts(tmp_path, capsys, to):
    """A ``dcp.save`` of a state with non-tensor values (every ``get_state_dict`` optimizer: its param groups;
    a step) keeps each under its own key as a byte item; ``convert`` took each for one of our sharded
    objects and failed ("'optim.param_groups.0.lr' is not a ShardedObject storage key"). They become the
    common state (what ``load_common_state_dict`` returns), exactly."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optim": {"param_groups": [{"lr": 0.1}]}, "step": 7,
                  "data/shard_info": 3,  # (a key with "/shard_" that is not a ShardedObject storage name)
                  "lrs": [0.01]},  # (a one-element list: a scheduler's _last_lr; it became 0.01)
                 checkpoint_id=str(src), no_dist=True)
    code, out, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", to)
    assert code == 0, (out, err)
    common = ci.load_common_state_dict(str(tmp_path / "out"))
    assert common == {"optim.param_groups.0.lr": 0.1, "step": 7, "data/shard_info": 3, "lrs": [0.01]}, common
    assert isinstance(common["lrs"], list)
    assert torch.equal(ci.load_plain_tensors(str(tmp_path / "out"))["model.w"], torch.arange(6.0).reshape(2, 3))


def test_diff_compares_bytesio_values_by_their_bytes(tmp_path, capsys):
    """A ``BytesIO`` object (DCP's way to store raw bytes) compared by identity: a checkpoint differed from itself."""
    import io

    for name, payload in (("a", b"same"), ("b", b"same"), ("c", b"other")):
        ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(2)),
                 "blob": ci.ShardedObject("blob", io.BytesIO(payload), (1,), (0,)), "meta": {"buf": io.BytesIO(payload)}},
                str(tmp_path / name))
    code, out, _ = run_cli(capsys, "diff", tmp_path / "a", tmp_path / "b", "--trusted")
    assert code == 0, out
    code, out, _ = run_cli(capsys, "diff", tmp_path / "a", tmp_path / "c", "--trusted")
    assert code == 1 and "blob/shard_0_1: bytes b'same' vs bytes b'other'" in out and "meta/buf" in out, out


def test_diff_counts_nan_in_the_common_state_and_objects_equal_to_itself(tmp_path, capsys):
    """A checkpoint compared with itself was "different" when its common state (Lightning's
    ``best_model_score`` of a diverged run) or an object held NaN; tensors already compared NaN equal."""
    for name, last in (("a", 1.0), ("b", 1.0), ("c", 2.0)):
        ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.tensor([float("nan"), 1.0])),
                 "callbacks": {"best": torch.tensor([float("nan"), last]), "f": float("nan")},
                 "o": ci.ShardedObject("o", {"loss": float("nan")}, (1,), (0,))}, str(tmp_path / name))
    assert run_cli(capsys, "diff", tmp_path / "a", tmp_path / "a")[0] == 0
    code, out, _ = run_cli(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert code == 0, out
    code, out, _ = run_cli(capsys, "diff", tmp_path / "a", tmp_path / "c")
    assert code == 1 and "callbacks/best: Tensor tensor([nan, 1.]) vs Tensor tensor([nan, 2.])" in out, out
    assert "callbacks/f" not in out and "o/shard" not in out, out
