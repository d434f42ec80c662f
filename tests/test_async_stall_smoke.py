"""Smoke test of benchmarks/async_stall.py: a tiny run completes and reports every method."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests import forked  # the script's own process forked with torch imported
from tests.dist_utils import scaled_timeout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # ~10-20 s (the memory probes, one process each, are left out)
def test_async_stall_quick_runs(tmp_path):
    out = tmp_path / "stall.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "async_stall.py"), "--quick", "--dir", str(tmp_path),
           "--json", str(out), "--skip-memory"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = forked.run(cmd, timeout=scaled_timeout(180), cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    names = ["none", "ours sync", "ours async (caller snapshot)", "ours async", "DCP async", "DCP async (async staging)"]
    assert list(rows) == names
    for n in names[1:]:
        assert n in proc.stdout
        assert rows[n]["blocking_s"] > 0
    assert rows["ours async"]["step_wait_s"] is not None
    assert not [p for p in os.listdir(tmp_path) if p.startswith("async_stall")]  # cleaned up
