"""Smoke test of benchmarks/bench.py: a tiny 2-rank run completes and prints the table."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests import forked  # the script's own process forked with torch imported; its ranks spawn as before
from tests.dist_utils import scaled_timeout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # ~10-20 s (two spawned ranks, DCP included)
def test_bench_quick_runs_and_prints_table(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--quick", "--ranks", "2",
        "--total-gib", "0.004", "--tensors", "4", "--cols", "256", "--dir", str(tmp_path), "--json", str(out),
        "--small", "50",
    ]
    proc = forked.run(cmd, timeout=scaled_timeout(180), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for label in ("plain write (limit)", "DCP save", "ours save", "ours load uneven", "ours async blocking",
                  "ours load row->col", "ours load col->row", "ours load ws change", "ours load row->col [local]",
                  "ours load row->col [nodes]", "read MiB", "many small tensors: 50 x 4096 B"):
        assert label in proc.stdout, proc.stdout
    res = json.loads(out.read_text())
    target = res["targets"][str(tmp_path)]
    assert target["ours_async_save"]["staging_allocations"] == 4  # buffers reused on the 2nd save
    assert all(target[k]["gib_s"] > 0 for k in ("ours_save", "ours_load", "dcp_save", "plain_write"))
    # row->col: read once over the job (the stored bytes), twice when every rank reads its own blocks
    stored = res["state_bytes_per_rank"] * 2
    assert target["ours_load_row_to_col"]["load"]["strategy"] == "read_once"
    assert target["ours_load_row_to_col"]["load"]["bytes_read"] == stored
    assert target["ours_load_row_to_col_local"]["load"]["bytes_read"] == 2 * stored
    assert target["ours_load_row_to_col_nodes"]["load"]["bytes_sent"] > 0
    small = res["small"]["targets"][str(tmp_path)]["results"]
    assert small["ours_load"]["us_per_tensor"] > 0 and small["ours_load_first"]["us_per_tensor"] > 0
    assert all(small[f"ours_load_replicas_{s}"]["us_per_tensor"] > 0 for s in ("auto", "fully_parallel", "two_stage"))


@pytest.mark.slow  # ~20-40 s (two configurations)
def test_bench_sweep_prints_summary(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--quick", "--ranks", "2",
        "--total-gib", "0.004", "--tensors", "2,4", "--cols", "256", "--dir", str(tmp_path), "--json", str(out),
        "--skip-dcp",
    ]
    proc = forked.run(cmd, timeout=scaled_timeout(180), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "summary (ratios" in proc.stdout, proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"]["tensors"] for r in runs] == [2, 4]
    assert [r["tensors_per_rank"] for r in runs] == [2, 4]


@pytest.mark.slow  # ~20-30 s (two spawned ranks: durable saves, memory tier, restores)
def test_memory_tier_bench_runs_and_prints_table(tmp_path):
    out = tmp_path / "memtier.json"
    cmd = [
        sys.executable, os.path.join(ROOT, "benchmarks", "memory_tier.py"), "--gib-per-rank", "0.004",
        "--tensors", "4", "--repeats", "1", "--shm", str(tmp_path), "--disk", str(tmp_path), "--no-nvrx",
        "--no-drop-caches", "--json", str(out),
    ]
    proc = forked.run(cmd, timeout=scaled_timeout(180), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for label in ("blocking per save: memory snapshot", "restore: own memory (verified; the process that saved)",
                  "restore: own memory (verified; a restarted process)", "restore: peer copy",
                  "restore: durable on disk, cold", "limit: memcpy from host memory", "limit: memcpy + digest pass"):
        assert label in proc.stdout, proc.stdout
    res = json.loads(out.read_text())
    assert res["restore_peer"]["source_rank1"] == "peer rank 0"
    assert res["memory_snapshot"]["shm_bytes_per_node"] >= 4 * res["bytes_per_rank"]  # 2 slots x 2 copies


@pytest.mark.slow  # ~20-40 s (two spawned ranks; DCP, Megatron-Core and ours on CPU tensors)
def test_gpu_bench_runs_on_cpu_and_prints_table(tmp_path):
    """benchmarks/gpu_bench.py (run for real on a GPU machine only) in its ``--device cpu`` form: every
    method runs, the checks pass and the table has every row; mixed bf16/fp32 state."""
    out = tmp_path / "gpu.json"
    cmd = [
        sys.executable, os.path.join(ROOT, "benchmarks", "gpu_bench.py"), "--device", "cpu", "--gib-per-rank", "0.002",
        "--tensors", "4", "--cols", "256", "--repeats", "1", "--async-saves", "2", "--no-warmup",
        "--dir", str(tmp_path / "t"), "--json", str(out),
    ]
    proc = forked.run(cmd, timeout=scaled_timeout(240), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for label in ("plain write (limit)", "torch.load", "DCP load row->col", "DCP async_save (total)", "MCore save (fully par.)",
                  "MCore load row->col", "ours load row->col", "ours load ws change", "ours async: call blocks",
                  "DCP async: call blocks", "DCP async stager: DefaultStager"):
        assert label in proc.stdout, proc.stdout
    res = json.loads(out.read_text())
    assert "failed" not in res["info"], res["info"]  # no method failed (a failure is reported, not raised)
    assert res["dtypes"] == ["bfloat16", "float32", "bfloat16", "float32"]
    rows = res["targets"][str(tmp_path / "t")]
    for key in ("plain_write", "plain_read", "torch_save", "torch_load", "dcp_save", "dcp_load", "dcp_load_row_to_col",
                "dcp_async_save", "megatron_save", "megatron_load", "megatron_load_row_to_col", "ours_save", "ours_load",
                "ours_load_noverify", "ours_load_row_to_col", "ours_load_ws_change", "ours_async_save"):
        assert rows[key]["gib_s"] > 0 and rows[key]["host_overhead"] is not None, key
    assert rows["ours_load_row_to_col"]["load"]["strategy"] == "read_once"


def test_request_counts_bench_runs_and_counts_remote_fetches():
    """benchmarks/request_counts.py (issue 22's table): runs, and on memory:// counts the reader's
    actual fetches, which the coalescing keeps to one per data file here."""
    cmd = [sys.executable, "benchmarks/request_counts.py", "--tensors", "8"]
    proc = forked.run(cmd, timeout=scaled_timeout(120), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    load = rows[("memory://", "8", "load (path)")]
    assert int(load.split("|")[5]) <= 4, load  # data read requests: one fetch per data file (was one per range)


def _bench_stdout(script, *args):
    """What ``benchmarks/<script> <args>`` printed (a smoke run, which must succeed)."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", script), *map(str, args)]
    proc = forked.run(cmd, timeout=scaled_timeout(120), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow  # ~10-20 s (two spawned ranks, twice)
def test_load_phases_runs_and_prints_every_phase(tmp_path):
    out = _bench_stdout("load_phases.py", "--small", 20, "--repeats", 1, "--dir", tmp_path)
    for label in ("`open_shared`", "`exchange.run`", "`_prepare_reads`", "`load_read_once`", "`read_all`",
                  "total `load()`", "plain read", "the floor with checks"):
        assert label in out, out
    # a resharded load (saved by rows, loaded by columns: read once), its result checked by the script
    out = _bench_stdout("load_phases.py", "--layout", "row_to_col", "--mib", 2, "--tensors", 2, "--cols", 64,
                        "--repeats", 2, "--dir", tmp_path)
    for label in ("stats: read-once decision and plan", "stats: mapping and unmapping units", "stats: copies out"):
        assert label in out, out


def test_page_costs_times_every_method(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import page_costs
    finally:
        sys.path.pop(0)
    res = page_costs.main(["--dir", str(tmp_path), "--mib", "4", "--repeats", "1"])  # (checks the half rows it read)
    assert len(res) == 7 and all(sum(v) > 0 for v in res.values())
    assert not os.listdir(tmp_path)


@pytest.mark.slow  # ~10-20 s (two spawned ranks)
def test_save_phases_runs_and_prints_every_phase(tmp_path):
    out = _bench_stdout("save_phases.py", "--small", 20, "--repeats", 2, "--dir", tmp_path)
    for label in ("`split_state_dict`", "`build_routes`", "`exchange.start`", "`prepare_save`", "`write`",
                  "`commit`", "`finalize_save`", "total `save()`", "first save", "rank 1"):
        assert label in out, out
    assert not os.listdir(tmp_path)  # (its checkpoints removed)


def test_contention_runs_alone_and_together(tmp_path):
    out = _bench_stdout("contention.py", "--small", 20, "--procs", 2, "--repeats", 1, "--dir", tmp_path)
    for label in ("| alone |", "| 2 at once, process 0 |", "| 2 at once, process 1 |", "slowest of 2 at once"):
        assert label in out, out
    assert not os.listdir(tmp_path)


def test_metadata_cost_times_every_loaded_format(tmp_path):
    out = _bench_stdout("metadata_cost.py", "--small", 30, "--repeats", 1, "--dir", tmp_path)
    assert "| 4 |" in out and "| 5 |" in out and "| 6 |" in out, out
    assert not os.listdir(tmp_path)


def test_small_beside_large_runs_every_strategy(tmp_path):
    out = _bench_stdout("small_beside_large.py", "--small", 40, "--rows", 128, "--repeats", 1, "--dir", tmp_path)
    for strategy in ("local", "auto", "read_once", "fully_parallel", "two_stage"):
        assert f"(ran: {strategy})" in out or strategy == "auto", out


@pytest.mark.slow  # ~10-20 s (two spawned ranks)
def test_shared_reads_runs_every_strategy_on_both_backends(tmp_path):
    for backend in ("torch_dist", "zarr"):
        out = _bench_stdout("shared_reads.py", "--gib", 0.002, "--tensors", 2, "--cols", 64, "--repeats", 1,
                            "--backend", backend, "--dir", tmp_path)
        for case in ("replicas", "rows->cols"):
            for strategy in ("local", "auto", "read_once", "fully_parallel", "two_stage"):
                assert f"{case:<11} {strategy:<15}" in out, out
        assert "(ran: fully_parallel)" in out and "(ran: two_stage)" in out, out
