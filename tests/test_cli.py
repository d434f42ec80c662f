"""The ``ckpt-integration`` command line (inspect / verify / convert / diff) on real checkpoints.

Checkpoints are written with ckpt_integration.save by one process and by 2 gloo ranks
(multi-shard layout). The CLI runs in-process via ``main([...])`` and in a subprocess via
``python -m ckpt_integration.cli``; one conversion runs under an address-space cap smaller
than the checkpoint.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import resource
import subprocess
import sys

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import tools
from ckpt_integration.cli import main

from . import forked
from .dist_utils import run_distributed, scaled_timeout
from ckpt_integration.storage.filesystem import locate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- fixtures
def _expected_two_rank():
    g = torch.Generator().manual_seed(1234)
    return {
        "decoder.layers.0.tp_row.weight": torch.randn(8, 6, generator=g),
        "decoder.layers.0.tp_col.weight": torch.randn(4, 10, generator=g),
        "embedding.weight": torch.randn(7, 3, generator=g),
        "decoder.final_norm.weight": torch.randn(5, generator=g),
        "decoder.final_norm.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "step": torch.tensor(11, dtype=torch.int64),
    }


def _save_two_ranks(rank, world, path):
    full = _expected_two_rank()
    ST = ci.ShardedTensor
    sd = {
        "row": ST.from_rank_offsets("decoder.layers.0.tp_row.weight",
                                    full["decoder.layers.0.tp_row.weight"][rank * 4:(rank + 1) * 4].clone(), (0, rank, 2)),
        "col": ST.from_rank_offsets("decoder.layers.0.tp_col.weight",
                                    full["decoder.layers.0.tp_col.weight"][:, rank * 5:(rank + 1) * 5].clone(), (1, rank, 2)),
        # uneven: rows 0..5 on rank 0, 5..7 on rank 1
        "emb": ST.from_global_offsets("embedding.weight", full["embedding.weight"][[slice(0, 5), slice(5, 7)][rank]].clone(),
                                      (7, 3), ((0, 5)[rank], 0)),
        "norm_w": ST.from_rank_offsets("decoder.final_norm.weight", full["decoder.final_norm.weight"].clone(), replica_id=rank),
        "norm_b": ST.from_rank_offsets("decoder.final_norm.bias", full["decoder.final_norm.bias"].clone(), replica_id=rank),
        "step": ST.from_rank_offsets("step", full["step"].clone(), replica_id=rank),
        "rng": ci.ShardedObject("rng_state", {"rank": rank}, (2,), (rank,)),
        "iteration": 42,
        "config": {"lr": 0.001, "name": "tiny"},
    }
    ci.save(sd, path, durable=False)


@pytest.fixture(scope="module")
def two_rank_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli2") / "ckpt")
    run_distributed(_save_two_ranks, 2, path)
    return path


def _expected_single():
    g = torch.Generator().manual_seed(7)
    return {
        "model.encoder.weight": torch.randn(16, 8, generator=g),
        "model.encoder.bias": torch.randn(8, generator=g).half(),
        "model.head.weight": torch.randn(3, 4, 5, generator=g).to(torch.bfloat16),
        "model.counter": torch.arange(6, dtype=torch.int32),
        "model.mask": torch.tensor([True, False, True]),
        "model.scale": torch.tensor(0.5),
    }


def _save_single(path, tensors=None, common=None):
    tensors = _expected_single() if tensors is None else tensors
    sd = {k: ci.ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}
    sd.update(common if common is not None else {"epoch": 3, "hparams": {"dropout": 0.1}})
    ci.save(sd, path, durable=False)
    return tensors


@pytest.fixture
def single_ckpt(tmp_path):
    path = str(tmp_path / "single")
    _save_single(path)
    return path


def run_cli(*args, capsys):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def run_module(*args, env=None, preexec_fn=None, timeout=120):
    """``python -m ckpt_integration.cli ARGS``; ``timeout``: seconds on an idle machine (scaled to the load).

    Forked with the package imported (tests/forked.py), or a new interpreter where ``preexec_fn``
    shapes the process itself (a memory limit must not count the test's imports).
    """
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    cmd = [sys.executable, "-m", "ckpt_integration.cli", *map(str, args)]
    if preexec_fn is None:
        return forked.run(cmd, env=e, timeout=scaled_timeout(timeout), cwd=REPO)
    return subprocess.run(cmd, capture_output=True, text=True, env=e, preexec_fn=preexec_fn,
                          timeout=scaled_timeout(timeout), cwd=REPO)


def _assert_same(loaded, expected):
    assert sorted(loaded) == sorted(expected)
    for k, v in expected.items():
        assert loaded[k].dtype == v.dtype, k
        assert torch.equal(loaded[k], v), k


# --------------------------------------------------------------------------- inspect
def test_inspect_text_tree(two_rank_ckpt, capsys):
    code, out, _ = run_cli("inspect", two_rank_ckpt, capsys=capsys)
    assert code == 0
    assert "backend: torch_dist (version 1)" in out
    assert "on 2 rank(s)" in out
    # tree split on '.'
    assert re.search(r"^  decoder$", out, re.M)
    assert re.search(r"^    layers$", out, re.M)
    assert re.search(r"^\s+weight: \[8, 6\] float32 192 B\s+\[2 shards, split along axis 0, each \[4, 6\]\]", out, re.M)
    assert "2 shards, split along axis 1, each [4, 5]" in out
    assert "uneven: [2, 3], [5, 3]" in out
    assert re.search(r"bias: \[5\] bfloat16 10 B\s+\[1 shard \(whole tensor\)\]", out)
    assert "sharded objects: 2" in out and "rng_state/shard_0_2" in out and "rng_state/shard_1_2" in out
    assert "iteration: int = 42" in out and "config.lr: float = 0.001" in out


def test_inspect_json(two_rank_ckpt, capsys):
    code, out, _ = run_cli("inspect", two_rank_ckpt, "--json", capsys=capsys)
    assert code == 0
    info = json.loads(out)
    t = info["tensors"]["decoder.layers.0.tp_row.weight"]
    assert t["shape"] == [8, 6] and t["dtype"] == "float32" and t["nbytes"] == 192
    assert [s["offsets"] for s in t["shards"]] == [[0, 0], [4, 0]]
    assert all(s["file"].endswith(".distcp") and s["length"] > 0 for s in t["shards"])
    assert info["manifest"]["world_size"] == 2
    assert sorted(o["key"] for o in info["objects"]) == ["rng_state/shard_0_2", "rng_state/shard_1_2"]
    assert info["common_state"]["keys"]["iteration"] == "int = 42"
    assert info["total_bytes"] == sum(v.numel() * v.element_size() for v in _expected_two_rank().values())


@dataclasses.dataclass
class _Custom:
    value: int = 1


def test_inspect_unsafe_common_state_is_reported_not_run(tmp_path, capsys):
    path = str(tmp_path / "unsafe")
    _save_single(path, common={"custom": _Custom(5), "epoch": 1})
    code, out, _ = run_cli("inspect", path, capsys=capsys)
    assert code == 0
    assert "common state: not shown" in out and "refusing to load" in out and "_Custom" in out
    assert "--trusted" in out
    assert "model.encoder.weight" not in out  # tree shown as leaves under model/encoder
    assert re.search(r"^\s+weight: \[16, 8\] float32", out, re.M)
    code, out, _ = run_cli("inspect", path, "--trusted", capsys=capsys)
    assert code == 0 and "custom: _Custom" in out and "epoch: int = 1" in out


# --------------------------------------------------------------------------- verify
def test_verify_good(two_rank_ckpt, capsys):
    code, out, _ = run_cli("verify", two_rank_ckpt, capsys=capsys)
    assert code == 0, out
    assert "OK: checksums of" in out
    code, out, _ = run_cli("verify", two_rank_ckpt, "--json", capsys=capsys)
    rep = json.loads(out)
    assert rep["ok"] and rep["checksums_available"] and rep["items_checked"] >= 8


def _file_holding(path, key):
    info = tools.inspect_checkpoint(path)
    shard = info["tensors"][key]["shards"][0]
    return shard["file"], shard["file_offset"], shard["length"]


def test_verify_flipped_bytes(single_ckpt, capsys):
    name, offset, length = _file_holding(single_ckpt, "model.encoder.weight")
    file = os.path.join(single_ckpt, name)
    with open(file, "r+b") as f:  # flip bytes in the middle of the tensor's data
        f.seek(offset + length - 200)
        b = f.read(4)
        f.seek(offset + length - 200)
        f.write(bytes(x ^ 0xFF for x in b))
    code, out, _ = run_cli("verify", single_ckpt, capsys=capsys)
    assert code == 1
    assert "DAMAGED" in out and "checksum mismatch" in out
    assert name in out and "model.encoder.weight" in out
    # the same through the module entry point
    r = run_module("verify", single_ckpt, "--json")
    assert r.returncode == 1
    rep = json.loads(r.stdout)
    assert not rep["ok"] and rep["problems"][0]["file"] == name
    assert "model.encoder.weight[0, 0]" in rep["problems"][0]["keys"]


def test_verify_truncated_file(two_rank_ckpt, tmp_path, capsys):
    import shutil

    path = str(tmp_path / "trunc")
    shutil.copytree(two_rank_ckpt, path)
    name, offset, length = _file_holding(path, "decoder.layers.0.tp_row.weight")
    file = os.path.join(path, name)
    os.truncate(file, offset + length // 2)
    code, out, _ = run_cli("verify", path, capsys=capsys)
    assert code == 1
    assert "is truncated" in out and name in out
    assert "decoder.layers.0.tp_row.weight" in out


def test_verify_missing_file_and_commit_marker(single_ckpt, capsys):
    name, _, _ = _file_holding(single_ckpt, "model.encoder.weight")
    os.remove(os.path.join(single_ckpt, name))
    os.remove(os.path.join(single_ckpt, "metadata.json"))
    code, out, _ = run_cli("verify", single_ckpt, capsys=capsys)
    assert code == 1
    assert "incomplete checkpoint" in out
    assert f"{name} is missing" in out and "model.encoder.weight" in out


def test_verify_foreign_checkpoint_without_manifest(single_ckpt, capsys):
    # a foreign writer (Megatron-Core, DCP) writes neither the manifest nor our marker nor our index
    for name in ("manifest.json", "ckpt_integration.json", "index.bin"):
        os.remove(os.path.join(single_ckpt, name))
    code, out, _ = run_cli("verify", single_ckpt, capsys=capsys)
    assert code == 0
    assert "no checksums of ours" in out and "OK: structure and record CRC32s of" in out


def test_verify_deleted_manifest_is_damage(single_ckpt, capsys):
    os.remove(os.path.join(single_ckpt, "manifest.json"))
    code, out, _ = run_cli("verify", single_ckpt, capsys=capsys)
    assert code == 1
    assert f"{os.path.join(single_ckpt, 'manifest.json')} is missing" in out
    assert "checksums are unavailable" not in out


# --------------------------------------------------------------------------- convert
def test_convert_to_safetensors_sharded(two_rank_ckpt, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file

    out_dir = tmp_path / "st"
    code, out, err = run_cli("convert", two_rank_ckpt, out_dir, "--to", "safetensors", "--max-shard-size", "100B",
                             capsys=capsys)
    assert code == 0, err
    assert "skipped 2 ShardedObject(s)" in out
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    expected = _expected_two_rank()
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in expected.values())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f) for f in files)
    loaded = {}
    for f in files:
        part = load_file(str(out_dir / f))
        assert all(index["weight_map"][k] == f for k in part)
        with safe_open(str(out_dir / f), "pt") as h:
            assert h.metadata() == {"format": "pt"}
        data_bytes = sum(v.numel() * v.element_size() for v in part.values())
        assert data_bytes <= 100 or len(part) == 1  # bounded, or one tensor larger than the bound
        loaded.update(part)
    _assert_same(loaded, expected)
    # refuses to overwrite
    code, _, err = run_cli("convert", two_rank_ckpt, out_dir, "--to", "safetensors", capsys=capsys)
    assert code == 2 and "already exists" in err


def test_convert_in_row_blocks_with_tiny_budget(two_rank_ckpt, tmp_path, capsys):
    """A budget smaller than one row forces sub-row blocks read with read_region."""
    from safetensors.torch import load_file

    out_dir = tmp_path / "st"
    code, _, err = run_cli("convert", two_rank_ckpt, out_dir, "--to", "safetensors", "--memory-budget", "8",
                           capsys=capsys)
    assert code == 0, err
    assert os.listdir(out_dir) == ["model.safetensors", "model.safetensors.index.json"] or \
        sorted(os.listdir(out_dir)) == ["model.safetensors", "model.safetensors.index.json"]
    _assert_same(load_file(str(out_dir / "model.safetensors")), _expected_two_rank())


def test_plan_blocks_cover_tensor_in_order():
    for shape, budget in [((8, 6), 4 * 6 * 3), ((8, 6), 8), ((3, 4, 5), 2 * 5 * 2), ((7,), 4), ((), 1), ((0, 3), 4)]:
        t = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float32)[: torch.Size(shape).numel()].reshape(shape)
        pieces = []
        for box in tools.plan_blocks(shape, torch.float32, budget):
            block = t[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
            assert block.numel() * 4 <= max(budget, 4) or block.numel() == 0
            pieces.append(block.reshape(-1))
        assert torch.equal(torch.cat(pieces), t.reshape(-1))


def test_convert_to_torch(two_rank_ckpt, tmp_path, capsys):
    out_file = tmp_path / "model.pt"
    code, out, err = run_cli("convert", two_rank_ckpt, out_file, "--to", "torch", "--memory-budget", "16",
                             capsys=capsys)
    assert code == 0, err
    expected = _expected_two_rank()
    common = {"iteration": 42, "config": {"lr": 0.001, "name": "tiny"}}  # kept at their own keys
    for loaded in (torch.load(out_file, weights_only=True), torch.load(out_file, weights_only=True, mmap=True)):
        assert {k: loaded.pop(k) for k in common} == common
        _assert_same(loaded, expected)
    # nested on '.'
    nested_file = tmp_path / "nested.pt"
    assert run_cli("convert", two_rank_ckpt, nested_file, "--to", "torch", "--nested", capsys=capsys)[0] == 0
    nested = torch.load(nested_file, weights_only=True)
    assert nested["iteration"] == 42 and nested["config"] == common["config"]
    assert torch.equal(nested["decoder"]["layers"]["0"]["tp_col"]["weight"], expected["decoder.layers.0.tp_col.weight"])


def test_convert_torch_dist_copy_keeps_objects_and_common(two_rank_ckpt, tmp_path, capsys):
    out_dir = tmp_path / "copy"
    code, _, err = run_cli("convert", two_rank_ckpt, out_dir, "--to", "torch_dist", "--memory-budget", "32",
                           capsys=capsys)
    assert code == 0, err
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".ckpt-convert-spill")]
    _assert_same(ci.load_plain_tensors(out_dir), _expected_two_rank())
    common = ci.load_common_state_dict(out_dir)
    assert common["iteration"] == 42 and common["config"] == {"lr": 0.001, "name": "tiny"}
    req = {"rng": ci.ShardedObject("rng_state", None, (2,), (1,))}
    assert ci.load(req, out_dir)["rng"] == {"rank": 1}
    assert run_cli("verify", out_dir, capsys=capsys)[0] == 0
    code, out, _ = run_cli("diff", two_rank_ckpt, out_dir, capsys=capsys)
    assert code == 0, out


@pytest.mark.parametrize("to", ["torch_dist", "zarr"])
def test_convert_keeps_a_common_entry_named_as_a_tensor(tmp_path, capsys, to):
    """The common state and the tensors' keys are separate namespaces: a common ``cfg`` beside a tensor
    ``cfg`` (and an object ``sharded``) was dropped by a copy without a word, and ``diff`` told them apart."""
    src, out_dir = tmp_path / "src", tmp_path / "out"
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(2)), "cfg": {"lr": 0.1}, "sharded": 3,
             "x": {"t": ci.ShardedTensor.from_rank_offsets("cfg", torch.arange(3.0))},
             "o": ci.ShardedObject("sharded", {"a": 1}, (1,), (0,))}, str(src))
    code, _, err = run_cli("convert", src, out_dir, "--to", to, capsys=capsys)
    assert code == 0, err
    assert ci.load_common_state_dict(str(out_dir)) == {"cfg": {"lr": 0.1}, "sharded": 3}
    got = ci.load({"t": ci.ShardedTensor.from_rank_offsets("cfg", torch.empty(3)),
                   "o": ci.ShardedObject("sharded", None, (1,), (0,))}, str(out_dir))
    assert torch.equal(got["t"], torch.arange(3.0)) and got["o"] == {"a": 1}
    assert run_cli("diff", src, out_dir, capsys=capsys)[0] == 0


def test_convert_keeps_the_recorded_step(tmp_path, capsys):
    """A step given to save (not in the common state) survives a copy to either backend: commit
    order and ``ckpt_path="last"`` read it from the manifest."""
    from ckpt_integration.storage import checkpoint_dir as ckdir

    src = tmp_path / "src"
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}, str(src), step=7)
    for to in ("torch_dist", "zarr"):
        code, _, err = run_cli("convert", src, tmp_path / to, "--to", to, capsys=capsys)
        assert code == 0, err
        assert ckdir.read_manifest(locate(tmp_path / to)).step == 7, to


def test_import_torch_save_file(tmp_path, capsys):
    expected = _expected_single()
    nested = {"state_dict": {"encoder": {"weight": expected["model.encoder.weight"], "bias": expected["model.encoder.bias"]},
                             "head": [expected["model.head.weight"]]},
              "epoch": 5, "name": "run-1"}
    src = tmp_path / "lightning.ckpt"
    torch.save(nested, src)
    out_dir = tmp_path / "imported"
    r = run_module("convert", src, out_dir, "--to", "torch_dist")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # no progress bar without a TTY
    request = {"state_dict": {
        "encoder": {"weight": ci.ShardedTensor.from_rank_offsets("state_dict.encoder.weight", torch.empty(16, 8)),
                    "bias": ci.ShardedTensor.from_rank_offsets("state_dict.encoder.bias", torch.empty(8, dtype=torch.half))},
        "head": [ci.ShardedTensor.from_rank_offsets("state_dict.head.0", torch.empty(3, 4, 5, dtype=torch.bfloat16))]}}
    loaded = ci.load(request, out_dir)
    assert torch.equal(loaded["state_dict"]["encoder"]["weight"], expected["model.encoder.weight"])
    assert torch.equal(loaded["state_dict"]["encoder"]["bias"], expected["model.encoder.bias"])
    assert torch.equal(loaded["state_dict"]["head"][0], expected["model.head.weight"])
    assert loaded["epoch"] == 5 and loaded["name"] == "run-1"
    code, out, _ = run_cli("diff", src, out_dir, capsys=capsys)
    assert code == 0, out


def test_import_safetensors_folder(tmp_path, capsys):
    from safetensors.torch import save_file

    expected = _expected_single()
    folder = tmp_path / "hf"
    folder.mkdir()
    keys = sorted(expected)
    save_file({k: expected[k] for k in keys[:3]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: expected[k] for k in keys[3:]}, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": 0},
        "weight_map": {k: f"model-0000{1 if i < 3 else 2}-of-00002.safetensors" for i, k in enumerate(keys)}}))
    out_dir = tmp_path / "imported"
    code, _, err = run_cli("convert", folder, out_dir, "--to", "torch_dist", capsys=capsys)
    assert code == 0, err
    request = {k: ci.ShardedTensor.from_rank_offsets(k, torch.empty(v.shape, dtype=v.dtype)) for k, v in expected.items()}
    _assert_same(ci.load(request, out_dir), expected)
    # a single safetensors file too, and the round trip back
    single = tmp_path / "one.safetensors"
    save_file(expected, str(single))
    assert run_cli("convert", single, tmp_path / "imp2", "--to", "torch_dist", capsys=capsys)[0] == 0
    assert run_cli("diff", tmp_path / "imp2", out_dir, capsys=capsys)[0] == 0


# --------------------------------------------------------------------------- diff
def test_diff_identical_and_different(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    base = _save_single(a)
    code, out, _ = run_cli("diff", a, a, capsys=capsys)
    assert code == 0 and out.strip().endswith("identical")
    changed = dict(base)
    changed["model.encoder.weight"] = base["model.encoder.weight"].clone()
    changed["model.encoder.weight"][3, 2] += 0.25
    changed["model.counter"] = base["model.counter"].long()  # dtype change
    changed["model.mask"] = torch.tensor([True, False])  # shape change
    del changed["model.scale"]
    changed["model.extra"] = torch.zeros(2)
    _save_single(b, changed)
    code, out, _ = run_cli("diff", a, b, "--memory-budget", "16", capsys=capsys)
    assert code == 1
    assert "only in A (1):\n  model.scale" in out
    assert "only in B (1):\n  model.extra" in out
    assert "model.mask: [3] vs [2]" in out
    assert "model.counter: int32 vs int64" in out
    assert re.search(r"model.encoder.weight: max abs diff 0.25", out)
    assert out.strip().endswith("different")
    r = run_module("diff", a, b, "--json")
    assert r.returncode == 1
    rep = json.loads(r.stdout)
    assert not rep["identical"] and rep["max_abs_diff"]["model.encoder.weight"] == pytest.approx(0.25)
    assert rep["max_abs_diff"]["model.counter"] == 0  # same values, different dtype


def test_diff_compares_common_state_and_objects(tmp_path, capsys):
    """Same tensors; the common state differs in a value, a type, keys only on one side; an object's value."""
    w = ci.ShardedTensor.from_rank_offsets("w", torch.ones(4))

    def save(path, common, step):
        ci.save({"w": w, "rng": ci.ShardedObject("rng", {"step": step}, (1,), (0,)), **common}, path)

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    save(a, {"iteration": 3, "config": {"lr": 0.1, "name": "x", "old": 1}, "sched": [1, 2]}, 1)
    save(b, {"iteration": 3.0, "config": {"lr": 0.2, "name": "x", "new": None}, "sched": [1, 2]}, 2)
    code, out, _ = run_cli("diff", a, a, capsys=capsys)
    assert code == 0 and out.strip().endswith("identical")
    code, out, _ = run_cli("diff", a, b, capsys=capsys)
    assert code == 1 and out.strip().endswith("different")
    assert "common state only in A (1):\n  config/old" in out
    assert "common state only in B (1):\n  config/new" in out
    assert "common state differs (2):" in out
    assert "  config/lr: float 0.1 vs float 0.2" in out and "  iteration: int 3 vs float 3.0" in out
    assert "objects differ (1):\n  rng/shard_0_1: dict {'step': 1} vs dict {'step': 2}" in out
    assert "values differ" not in out  # the tensors are the same
    r = run_module("diff", a, b, "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 1 and rep["common_only_in_a"] == ["config/old"] and sorted(rep["common_differ"]) == [
        "config/lr", "iteration"]


def test_errors_and_usage(tmp_path, capsys):
    code, _, err = run_cli("inspect", tmp_path / "nope", capsys=capsys)
    assert code == 2 and "does not exist" in err
    code, _, err = run_cli("convert", "x", "y", "--to", "zarr", capsys=capsys)
    assert code == 2
    assert tools.parse_size("5GB") == 5 * 10**9 and tools.parse_size("500MB") == 500 * 10**6
    assert tools.parse_size("64MiB") == 64 * 2**20 and tools.parse_size("4096") == 4096
    with pytest.raises(ValueError):
        tools.parse_size("lots")


# --------------------------------------------------------------------------- memory bound
_PROBE = (
    "import ckpt_integration.cli, ckpt_integration.tools\n"
    "for line in open('/proc/self/status'):\n"
    "    if line.startswith('VmPeak'): print(line.split()[1])\n"
)


def test_convert_larger_than_memory_cap(tmp_path):
    """Convert a ~150 MiB checkpoint while the process may map only baseline + 64 MiB."""
    from safetensors import safe_open

    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs /proc to measure the baseline")
    path = str(tmp_path / "big")
    g = torch.Generator().manual_seed(3)
    tensors = {f"layers.{i}.weight": torch.randn(2500, 4000, generator=g) for i in range(4)}  # 4 x 40 MB
    ci.save({k: ci.ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, path, durable=False)
    ckpt_bytes = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, check=True)
    baseline = int(probe.stdout.strip()) * 1024
    margin = 64 * 2**20
    assert margin < ckpt_bytes / 2
    cap = baseline + margin

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    # control: loading every tensor at once does not fit under the cap
    control = subprocess.run([sys.executable, "-c", f"import ckpt_integration as c; c.load_plain_tensors({path!r})"],
                             capture_output=True, text=True, env=env, preexec_fn=limit, timeout=scaled_timeout(120))
    assert control.returncode != 0, "the memory cap is not effective"
    out_dir = tmp_path / "st"
    r = run_module("convert", path, out_dir, "--to", "safetensors", "--max-shard-size", "100MB",
                   "--memory-budget", "8MB", env=env, preexec_fn=limit)
    assert r.returncode == 0, r.stderr[-3000:]
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    for key, file in index["weight_map"].items():
        with safe_open(str(out_dir / file), "pt") as h:
            assert torch.equal(h.get_tensor(key), tensors[key]), key


def test_zarr_checkpoint_inspect_verify_convert_roundtrip(tmp_path):
    """zarr checkpoints are a source and a target like torch_dist ones."""
    import ckpt_integration as ci
    from ckpt_integration.cli import main

    w, b = torch.randn(6, 4), torch.randn(5).bfloat16()
    src = str(tmp_path / "z")
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", w), "b": ci.ShardedTensor.from_rank_offsets("dec.b", b)}, src, sharded_strategy="zarr")
    assert main(["inspect", src, "-q"]) == 0
    assert main(["verify", src, "-q"]) == 0
    assert main(["convert", src, "--to", "torch_dist", str(tmp_path / "t"), "-q"]) == 0
    assert main(["convert", str(tmp_path / "t"), "--to", "zarr", str(tmp_path / "z2"), "-q"]) == 0
    assert main(["diff", src, str(tmp_path / "z2"), "-q"]) == 0
    plain = ci.load_plain_tensors(str(tmp_path / "z2"))
    assert torch.equal(plain["w"], w) and torch.equal(plain["dec.b"], b)
    # damage: remove a chunk file of an array -> zarr fills zeros silently, but a missing array is reported
    import shutil

    shutil.rmtree(tmp_path / "z2" / "w")
    assert main(["verify", str(tmp_path / "z2"), "-q"]) == 1


# --------------------------------------------------------------------------- first contact: what the CLI prints
def test_help_names_both_backends_and_every_argument(capsys):
    code, out, _ = run_cli("--help", capsys=capsys)
    assert code == 0 and "zarr" in out and "torch_dist" in out
    code, out, _ = run_cli("convert", "--help", capsys=capsys)
    assert code == 0 and "zarr" in out
    code, out, _ = run_cli("inspect", "--help", capsys=capsys)
    assert code == 0 and "zarr" in out and "--all" in out
    code, out, _ = run_cli("diff", "--help", capsys=capsys)
    assert code == 0
    # each positional argument has a help text on its line
    assert re.search(r"^\s+A\s+\S", out, re.M) and re.search(r"^\s+B\s+\S", out, re.M), out


def test_convert_prints_a_summary_not_every_file(two_rank_ckpt, tmp_path, capsys):
    """zarr writes one file per chunk: the summary counts them instead of listing them on one line."""
    out_dir = tmp_path / "z"
    code, out, err = run_cli("convert", two_rank_ckpt, out_dir, "--to", "zarr", capsys=capsys)
    assert code == 0, err
    files = [os.path.join(r, n) for r, _, names in os.walk(out_dir) for n in names]
    size = sum(os.path.getsize(f) for f in files)
    first = out.splitlines()[0]
    assert first == (f"wrote 6 tensors ({tools.format_size(474)}) as zarr to {out_dir}: "
                     f"{len(files)} file(s), {tools.format_size(size)}")
    assert len(files) > 10 and "zarr_index.json" not in out and "metadata.json" not in out
    code, out, _ = run_cli("convert", two_rank_ckpt, tmp_path / "st", "--to", "safetensors", "--json", capsys=capsys)
    result = json.loads(out)
    assert result["file_count"] == 2 and result["files"] == ["model.safetensors", "model.safetensors.index.json"]
    assert result["file_bytes"] == sum(os.path.getsize(tmp_path / "st" / n) for n in result["files"])


def test_convert_summary_shortens_long_skipped_lists(tmp_path, capsys):
    src = str(tmp_path / "objs")
    objects = {f"opt.{i}": ci.ShardedObject(f"optimizer.param_state.layer{i}", {"step": i}, (1,), (0,)) for i in range(12)}
    _save_single(src, common={**objects, **{f"meta{i}": i for i in range(6)}})
    code, out, err = run_cli("convert", src, tmp_path / "st", "--to", "safetensors", capsys=capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1] == ("skipped 12 ShardedObject(s) (safetensors holds tensors only): optimizer.param_state.layer0/shard_0_1, "
                        "optimizer.param_state.layer1/shard_0_1, optimizer.param_state.layer10/shard_0_1 "
                        "and 9 more (--json lists all)")
    assert lines[2] == ("skipped common state (safetensors holds tensors only): 'meta0', 'meta1', 'meta2' "
                        "and 3 more (--json lists all)")
    code, out, _ = run_cli("convert", src, tmp_path / "st2", "--to", "safetensors", "--json", capsys=capsys)
    assert len(json.loads(out)["skipped"]) == 12 and len(json.loads(out)["skipped_common"]) == 6


def _lightning_like_common():
    """The shape of Lightning's checkpoint dict: a deep ``loops`` tree beside a few plain keys."""
    progress = {"total": {"ready": 60, "completed": 60}, "current": {"ready": 15, "completed": 15}}
    loops = {name: {"state_dict": {}, "batch_progress": progress, "epoch_progress": progress}
             for name in ("fit_loop", "validate_loop", "test_loop", "predict_loop")}
    return {"epoch": 3, "global_step": 60, "loops": loops, "hyper_parameters": {"lr": 0.003, "d_model": 32}}


def test_inspect_folds_large_common_state_groups(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    objects = {f"o{i}": ci.ShardedObject(f"optimizer.param_state.layer{i}", {"step": i}, (1,), (0,)) for i in range(12)}
    objects["rng"] = ci.ShardedObject("lightning.rng_states", {"seed": 1}, (1,), (0,))
    _save_single(path, common={**_lightning_like_common(), **objects})
    code, out, _ = run_cli("inspect", path, capsys=capsys)
    assert code == 0
    assert "loops." not in out
    assert re.search(r"^  loops: 36 keys under fit_loop, validate_loop, test_loop, predict_loop$", out, re.M), out
    assert "common state: 40 key(s); 1 group(s) of more than 8 keys folded (--all lists every key)" in out
    assert "  epoch: int = 3" in out and "  hyper_parameters.lr: float = 0.003" in out  # small groups stay
    assert re.search(r"^  optimizer\.\*: 12 shards \(.+ in \d+ file\(s\); --all lists them\)$", out, re.M), out
    assert "  lightning.rng_states/shard_0_1 (" in out and "param_state.layer3" not in out
    code, full, _ = run_cli("inspect", path, "--all", capsys=capsys)
    assert code == 0 and "folded" not in full
    assert "  loops.fit_loop.batch_progress.total.ready: int = 60" in full
    assert full.count("  loops.") == 36 and full.count("  optimizer.param_state.layer") == 12
    code, js, _ = run_cli("inspect", path, "--json", capsys=capsys)  # JSON is never folded
    assert sum(k.startswith("loops.") for k in json.loads(js)["common_state"]["keys"]) == 36


def test_inspect_of_a_file_that_is_not_a_checkpoint(tmp_path, capsys):
    """``inspect README.md`` said 'not a safetensors file (header length 7592915522956763171)'."""
    for path in (os.path.join(REPO, "README.md"), tmp_path):
        (tmp_path / "notes.txt").write_text("not a checkpoint\n")
        code, out, err = run_cli("inspect", path, capsys=capsys)
        assert code == 2 and out == ""
        assert f"{path} is not a checkpoint" in err and "header length" not in err, err
    code, _, err = run_cli("diff", os.path.join(REPO, "README.md"), tmp_path, capsys=capsys)
    assert code == 2 and "README.md is not a checkpoint" in err
    # files are recognised by content, whatever their names
    torch.save({"w": torch.ones(2)}, tmp_path / "weights.data")
    code, out, _ = run_cli("inspect", tmp_path / "weights.data", capsys=capsys)
    assert code == 0 and "kind: torch" in out


class _TTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_bars_use_binary_units(tmp_path, capsys, monkeypatch):
    """Bars (on a terminal) count bytes in KiB/MiB like the summaries, not tqdm's kB/MB."""
    path = str(tmp_path / "ckpt")
    _save_single(path, tensors={"w": torch.zeros(3 * 2**18)})  # 3 MiB
    for args in (["verify", path], ["convert", path, tmp_path / "o.pt", "--to", "torch"], ["diff", path, path]):
        err = _TTY()
        monkeypatch.setattr(sys, "stderr", err)
        assert main([str(a) for a in args]) == 0
        monkeypatch.undo()
        bar = err.getvalue()
        assert "/3.0 MiB [" in bar, (args, bar)
        assert not re.search(r"\d[kMG]B\b", bar), (args, bar)
    capsys.readouterr()


def test_verify_passes_a_checkpoint_holding_empty_tensors(tmp_path, capsys):
    """An empty tensor has no data to place: verify called the manifest of a fresh checkpoint damaged
    (its block record puts an empty tensor's data somewhere else than the archive does)."""
    d = str(tmp_path / "c")
    shapes = {"e0": (0,), "e1": (3, 0), "e2": (0, 5), "w": (2, 3)}
    ci.save({k: ci.ShardedTensor.from_rank_offsets(k, torch.ones(s)) for k, s in shapes.items()}, d)
    code, out, err = run_cli("verify", d, capsys=capsys)
    assert code == 0 and "OK" in out, out + err


@pytest.mark.parametrize("tool", [("export", "--to", "hf"), ("convert", "--to", "safetensors")])
def test_a_tensor_named_like_the_safetensors_header_is_refused(tmp_path, capsys, tool):
    """A tensor keyed ``__metadata__`` was written into the header's metadata slot: the tools exited 0
    with a file no safetensors reader opens."""
    src = str(tmp_path / "ck")
    ci.save({"a": ci.ShardedTensor.from_rank_offsets("__metadata__", torch.ones(1)),
             "b": ci.ShardedTensor.from_rank_offsets("w", torch.ones(1))}, src)
    code, _, err = run_cli(tool[0], src, tmp_path / "out", *tool[1:], capsys=capsys)
    assert code == 2 and "'__metadata__' cannot be stored in safetensors" in err, err
    assert not (tmp_path / "out").exists()


def test_diff_and_convert_take_file_urls_as_the_other_tools_do(tmp_path, capsys):
    """save, load, verify, inspect and export took ``file://`` URLs; diff and convert said
    "file:///... does not exist"."""
    d = str(tmp_path / "c")
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.arange(3.0)), "step": 4}, "file://" + d)
    code, out, err = run_cli("diff", "file://" + d, d, capsys=capsys)
    assert code == 0, out + err
    code, out, err = run_cli("convert", "file://" + d, tmp_path / "out", "--to", "torch_dist", capsys=capsys)
    assert code == 0, out + err
    assert torch.equal(ci.load_plain_tensors(str(tmp_path / "out"))["w"], torch.arange(3.0))


def test_tensors_whose_values_are_not_their_memory_are_refused_by_name(tmp_path, capsys):
    """A ``torch.save`` file holding a sparse or a quantized tensor: ``convert --to torch`` / ``--to safetensors``
    died with a bare NotImplementedError traceback (sparse), or wrote the quantized tensor's integers without its
    scale and zero point and exited 0 (it loaded, unusable), and ``diff`` crashed on it. Refused now, naming the
    tensor, with nothing written; ``inspect`` still lists them. A file holding no dict is refused too."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (quantized tensors are deprecated in torch)
        q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    torch.save({"a": torch.ones(2).to_sparse(), "b": torch.ones(3)}, f"{tmp_path}/sparse.pt")
    torch.save({"q": q, "b": torch.ones(3)}, f"{tmp_path}/quant.pt")
    torch.save(5, f"{tmp_path}/int.pt")
    for src, key, what in (("sparse", "a", "sparse_coo"), ("quant", "q", "quantized")):
        for to in ("torch", "safetensors", "torch_dist", "zarr"):
            code, _, err = run_cli("convert", f"{tmp_path}/{src}.pt", f"{tmp_path}/out", "--to", to, capsys=capsys)
            assert code == 2 and repr(key) in err and (what in err or "qint8" in err) and "Traceback" not in err, (to, err)
            assert not os.path.exists(f"{tmp_path}/out"), to
        code, _, err = run_cli("diff", f"{tmp_path}/{src}.pt", f"{tmp_path}/{src}.pt", capsys=capsys)
        assert code == 2 and repr(key) in err, err
        code, out, _ = run_cli("inspect", f"{tmp_path}/{src}.pt", capsys=capsys)
        assert code == 0 and f"{key}: [" in out, out
    for to in ("torch", "safetensors"):
        code, _, err = run_cli("convert", f"{tmp_path}/int.pt", f"{tmp_path}/out", "--to", to, capsys=capsys)
        assert code == 2 and "holds an object of type int, not a dict of tensors" in err and not os.path.exists(f"{tmp_path}/out"), err


def test_diff_of_complex32_tensors(tmp_path, capsys):
    """``diff`` of two ``torch.complex32`` tensors died with a NotImplementedError traceback (torch has no
    ``equal`` for that dtype)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (complex32 is experimental in torch)
        one, other = torch.ones(3, dtype=torch.complex32), torch.zeros(3, dtype=torch.complex32)
    torch.save({"c": one}, f"{tmp_path}/a.pt")
    torch.save({"c": other}, f"{tmp_path}/b.pt")
    code, out, err = run_cli("diff", f"{tmp_path}/a.pt", f"{tmp_path}/b.pt", capsys=capsys)
    assert code == 1 and "c: max abs diff 1" in out, (out, err)
    code, out, err = run_cli("diff", f"{tmp_path}/a.pt", f"{tmp_path}/a.pt", capsys=capsys)
    assert code == 0 and "identical" in out, (out, err)


def test_diff_of_dtypes_without_arithmetic_and_of_float8(tmp_path, capsys):
    """``bits8``, ``bits16``, ``float4_e2m1fn_x2`` save, load and convert, but ``diff`` died with a
    NotImplementedError traceback and exit code 1 ("different"), also for a checkpoint against itself;
    float8 has no ``torch.equal`` either. They are compared bit for bit."""
    import ckpt_integration as ci

    for dtype in (torch.bits8, torch.bits16, torch.float4_e2m1fn_x2, torch.float8_e4m3fn):
        raw = torch.arange(8, dtype=torch.uint8)
        changed = raw.clone()
        changed[5] ^= 1
        for name, data in (("a", raw), ("b", changed)):
            ci.save({"x": ci.ShardedTensor.from_rank_offsets("x", data.view(dtype))}, f"{tmp_path}/{dtype}{name}")
        code, out, err = run_cli("diff", f"{tmp_path}/{dtype}a", f"{tmp_path}/{dtype}a", capsys=capsys)
        assert code == 0 and "identical" in out, (dtype, out, err)
        code, out, err = run_cli("diff", f"{tmp_path}/{dtype}a", f"{tmp_path}/{dtype}b", capsys=capsys)
        assert code == 1 and "x: max abs diff" in out, (dtype, out, err)


def test_an_internal_error_of_a_tool_exits_2_not_1(tmp_path, capsys, monkeypatch):
    """A bug of ours inside ``diff`` or ``verify`` left Python's exit code 1, which both commands use for
    "different" / "damaged"; it is an error (2), with its traceback."""
    import ckpt_integration as ci
    from ckpt_integration import tools

    ci.save({"x": ci.ShardedTensor.from_rank_offsets("x", torch.ones(2))}, f"{tmp_path}/a")

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(tools, "diff_checkpoints", broken)
    code, out, err = run_cli("diff", f"{tmp_path}/a", f"{tmp_path}/a", capsys=capsys)
    assert code == 2 and "ZeroDivisionError: a bug" in err and "diff: internal error" in err, (out, err)
