"""Audit fixes of the ``ckpt-integration`` command line.

* ``convert --overwrite`` never deletes its own source and keeps the old OUT until the new one is complete;
* ``verify`` reports a deleted ``manifest.json`` of a checkpoint saved with checksums;
* ``inspect`` describes zarr checkpoints (files, sizes, checksummed items, backend);
* a closed stdout pipe (``| head -1``) ends the command quietly;
* ``convert --to torch`` keeps the common state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import tools
from ckpt_integration.cli import EXIT_BROKEN_PIPE, main
from tests.dist_utils import scaled_timeout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _save(path, common=None, **kwargs):
    g = torch.Generator().manual_seed(5)
    tensors = {"model.w": torch.randn(6, 4, generator=g), "model.b": torch.randn(4, generator=g)}
    # state-dict paths differ from the ShardedTensor keys, so common state may reuse a tensor key
    sd = {f"t/{k}": ci.ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}
    sd.update({"epoch": 3, "hparams": {"lr": 0.1}} if common is None else common)
    ci.save(sd, str(path), durable=False, **kwargs)
    return tensors


def run_cli(*args, capsys):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


# --------------------------------------------------------------------------- convert: source safety
@pytest.mark.parametrize("to", ["torch_dist", "zarr", "safetensors"])
def test_convert_onto_its_own_source_is_refused(tmp_path, capsys, to):
    src = tmp_path / "ckpt"
    tensors = _save(src)
    code, _, err = run_cli("convert", src, src, "--to", to, "--overwrite", capsys=capsys)
    assert code == 2 and str(src) in err and "source" in err
    # a parent directory of the source, and a path inside the source
    code, _, err = run_cli("convert", src, tmp_path, "--to", to, "--overwrite", capsys=capsys)
    assert code == 2 and "source" in err
    code, _, err = run_cli("convert", src, src / "inner", "--to", to, "--overwrite", capsys=capsys)
    assert code == 2 and "source" in err
    # the same directory spelled differently (trailing '/.', a symlink)
    os.symlink(src, tmp_path / "link")
    code, _, err = run_cli("convert", f"{src}/.", tmp_path / "link", "--to", to, "--overwrite", capsys=capsys)
    assert code == 2
    plain = ci.load_plain_tensors(str(src))
    assert all(torch.equal(plain[k], v) for k, v in tensors.items())
    assert run_cli("verify", src, capsys=capsys)[0] == 0


def test_convert_torch_file_onto_itself_is_refused(tmp_path, capsys):
    src = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3)}, src)
    code, _, err = run_cli("convert", src, src, "--to", "torch", "--overwrite", capsys=capsys)
    assert code == 2 and str(src) in err
    assert torch.equal(torch.load(src, weights_only=True)["w"], torch.ones(3))


def test_an_output_inside_another_checkpoint_is_refused(tmp_path, capsys):
    """``convert ck/s1 ck/s2/model.pt`` put a file inside another checkpoint without a word; every later
    ``overwrite=True`` save of ``ck/s2`` (Lightning's last.ckpt rewrite) then refused the foreign file."""
    _save(tmp_path / "s1")
    _save(tmp_path / "s2")
    for to, out in (("torch", tmp_path / "s2" / "model.pt"), ("safetensors", tmp_path / "s2" / "sub" / "st")):
        code, _, err = run_cli("convert", tmp_path / "s1", out, "--to", to, capsys=capsys)
        assert code == 2 and f"lies inside the checkpoint {tmp_path / 's2'}" in err, err
    assert sorted(os.listdir(tmp_path / "s2")) == sorted(os.listdir(tmp_path / "s1"))
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, str(tmp_path / "s2"), overwrite=True)


def _fail_after_first_block(monkeypatch):
    """Make every source raise while the conversion is under way."""
    def boom(self, key, budget):
        raise OSError(5, "Input/output error (simulated)", self.path)
        yield  # pragma: no cover

    monkeypatch.setattr(tools.TensorSource, "iter_blocks", boom)


@pytest.mark.parametrize("to", ["torch", "safetensors", "torch_dist"])
def test_failed_overwrite_keeps_the_old_output(tmp_path, capsys, monkeypatch, to):
    src = tmp_path / "ckpt"
    _save(src)
    out = tmp_path / ("old.pt" if to == "torch" else "old")
    assert run_cli("convert", src, out, "--to", to, capsys=capsys)[0] == 0
    before = sorted(os.listdir(out)) if out.is_dir() else out.read_bytes()
    _fail_after_first_block(monkeypatch)
    code, _, err = run_cli("convert", src, out, "--to", to, "--overwrite", capsys=capsys)
    assert code == 2 and "simulated" in err
    assert (sorted(os.listdir(out)) if out.is_dir() else out.read_bytes()) == before
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", out.name]), "temporary output left behind"


@pytest.mark.parametrize("to", ["torch", "safetensors", "torch_dist"])
def test_overwrite_replaces_the_old_output(tmp_path, capsys, to):
    src = tmp_path / "ckpt"
    tensors = _save(src)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    code, _, err = run_cli("convert", src, out, "--to", to, capsys=capsys)
    assert code == 2 and "--overwrite" in err and (out / "stale.txt").exists()
    assert run_cli("convert", src, out, "--to", to, "--overwrite", capsys=capsys)[0] == 0
    assert not (out / "stale.txt").exists() if out.is_dir() else out.is_file()
    code, report, _ = run_cli("diff", src, out, capsys=capsys)
    assert code == 0, report
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "out"]


# --------------------------------------------------------------------------- verify: deleted manifest
def test_verify_reports_deleted_manifest(tmp_path, capsys):
    path = tmp_path / "ckpt"
    _save(path)
    assert run_cli("verify", path, capsys=capsys)[0] == 0
    os.remove(path / "manifest.json")
    code, out, _ = run_cli("verify", path, capsys=capsys)
    assert code == 1 and "manifest.json" in out and "DAMAGED" in out
    code, out, _ = run_cli("verify", path, "--json", capsys=capsys)
    assert code == 1 and any(p["file"] == "manifest.json" for p in json.loads(out)["problems"])
    # metadata.json stays exactly what Megatron-Core reads
    with open(path / "metadata.json") as f:
        assert set(json.load(f)) == {"sharded_backend", "sharded_backend_version", "common_backend",
                                     "common_backend_version"}


def test_verify_reports_deleted_manifest_of_zarr_checkpoint(tmp_path, capsys):
    path = tmp_path / "z"
    _save(path, sharded_strategy="zarr")
    assert run_cli("verify", path, capsys=capsys)[0] == 0
    os.remove(path / "manifest.json")
    code, out, _ = run_cli("verify", path, capsys=capsys)
    assert code == 1 and "manifest.json" in out


def test_verify_foreign_checkpoint_still_passes(tmp_path, capsys):
    """A checkpoint without manifest.json, our marker and our index is a foreign (Megatron/DCP) one."""
    from ckpt_integration.storage import checkpoint_dir as ckdir

    path = tmp_path / "ckpt"
    _save(path)
    os.remove(path / ckdir.MANIFEST_FILE)
    os.remove(path / ckdir.WRITER_FILE)
    os.remove(path / "index.bin")
    code, out, _ = run_cli("verify", path, capsys=capsys)
    assert code == 0 and "no checksums of ours" in out


# --------------------------------------------------------------------------- inspect: zarr
def test_inspect_zarr_checkpoint(tmp_path, capsys):
    path = tmp_path / "z"
    _save(path, common={"epoch": 3, "rng": ci.ShardedObject("rng", {"seed": 1}, (1,), (0,))},
          sharded_strategy="zarr")
    code, out, _ = run_cli("inspect", path, "--json", capsys=capsys)
    assert code == 0
    info = json.loads(out)
    assert info["kind"] == "zarr" and info["backend"] == "zarr"
    index = json.loads((path / "zarr_index.json").read_text())
    records = index["files"]
    assert info["manifest"]["checksummed_items"] == len(records) > 0
    assert info["files"] == {name: r["size"] for name, r in records.items()}
    shards = info["tensors"]["model.w"]["shards"]
    assert shards and all(s["file"].startswith("model.w/c") and s["length"] > 0 for s in shards)
    assert sum(s["length"] for s in shards) == 6 * 4 * 4
    (obj,) = info["objects"]
    assert obj["file"] == "rng/shard_0_1.pt" and obj["length"] == records["rng/shard_0_1.pt"]["size"]
    code, text, _ = run_cli("inspect", path, capsys=capsys)
    assert code == 0
    assert "backend: zarr" in text and f"{len(records)} checksummed items" in text
    assert f"data files: {len(records)} " in text and "data files: 0" not in text
    assert "in None" not in text and "(0 B" not in text
    assert "epoch: int = 3" in text


# --------------------------------------------------------------------------- broken pipe
def test_closed_stdout_exits_quietly(tmp_path, capsys, monkeypatch):
    path = tmp_path / "ckpt"
    _save(path)

    class ClosedPipe:
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            raise OSError("no file descriptor")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    code = main(["inspect", "--json", str(path)])
    monkeypatch.undo()
    assert code == EXIT_BROKEN_PIPE
    assert capsys.readouterr().err == ""


def test_broken_pipe_while_reading_is_still_an_error(tmp_path, capsys, monkeypatch):
    """Only a closed stdout is quiet: a broken pipe of the input (e.g. remote storage) is reported."""
    def broken(*a, **k):
        raise BrokenPipeError(32, "Broken pipe", "remote://ckpt")

    monkeypatch.setattr(tools, "inspect_checkpoint", broken)
    code, _, err = run_cli("inspect", tmp_path, capsys=capsys)
    assert code == 2 and "Broken pipe" in err


def test_closed_stdout_pipe_in_a_subprocess(tmp_path):
    """``ckpt-integration inspect --json FILE | head -1`` with output (~3 MB) larger than a pipe buffer (up to 1 MiB)."""
    path = tmp_path / "many.pt"
    torch.save({f"layer.{i}.weight": torch.zeros(1) for i in range(20000)}, path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_integration.cli", "inspect", "--json", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=scaled_timeout(120)) == EXIT_BROKEN_PIPE
    assert err == "", err


# --------------------------------------------------------------------------- convert --to torch keeps common state
def test_convert_to_torch_keeps_common_state(tmp_path, capsys):
    src = tmp_path / "ckpt"
    tensors = _save(src, common={"epoch": 3, "hparams": {"lr": 0.1}, "ema": torch.arange(3),
                                 "args": _Args(2), "model.w": 7})
    out = tmp_path / "model.pt"
    code, text, err = run_cli("convert", src, out, "--to", "torch", "--trusted", capsys=capsys)
    assert code == 0, err
    sd = torch.load(out, weights_only=True)
    assert sd["epoch"] == 3 and sd["hparams"] == {"lr": 0.1} and torch.equal(sd["ema"], torch.arange(3))
    assert all(torch.equal(sd[k], v) for k, v in tensors.items())
    # not loadable with weights_only=True, or clashing with a tensor key: skipped and said so
    assert "args" not in sd and "'args'" in text and "'model.w'" in text
    nested = tmp_path / "nested.pt"
    assert run_cli("convert", src, nested, "--to", "torch", "--nested", "--trusted", capsys=capsys)[0] == 0
    sd = torch.load(nested, weights_only=True)
    assert sd["epoch"] == 3 and torch.equal(sd["model"]["w"], tensors["model.w"])


@dataclasses.dataclass
class _Args:
    value: int = 1
