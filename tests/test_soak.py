"""Weeks of saves, short form (issue 23 item 4): 40 sync and async saves with top-3 retention on 2
gloo ranks (``benchmarks/soak.py``, whose long mode makes 1,000 and reports slopes).

After a warm-up, the open file descriptors, threads and the library's private process groups are
exactly what they were (nothing accumulates per save), the async queue's staging memory does not
grow, the resident memory stays within 48 MiB of where it was, every retained checkpoint verifies
and nothing else is left in the directory (old checkpoints removed by the library's own top-k
deletion, ``DistCkptIO.remove_checkpoint``).
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.dist_utils import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def _soak(rank, world, directory):
    import soak  # benchmarks/soak.py

    res = soak.soak(rank, world, directory, saves=40, top_k=3, every=5)
    warm = res["samples"][2:]  # from save 10 on: the async queue, its groups and buffers exist
    for key in ("fds", "threads", "groups", "staging"):
        values = [s[key] for s in warm]
        assert values == [values[0]] * len(values), (rank, key, [(s["save"], s[key]) for s in res["samples"]])
    assert len(res["left"]) == 3
    rss = [s["rss_kib"] for s in warm]  # resident memory bounded: no growth per save beyond noise
    assert max(rss) - rss[0] < 48 * 1024, (rank, [(s["save"], s["rss_kib"]) for s in res["samples"]])


@pytest.mark.slow
def test_soak_short(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    run_distributed(_soak, 2, str(d), timeout=300)
