"""Launch the ranks of a test job as processes of their own, where a dead rank is part of the test.

``launch(script, tmp, name, cfg, world)`` runs ``python script '<cfg json>'`` once per rank (forked
with its heavy imports done: ``tests.forked.start_script``; ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*`` set; the rank's own session, output in
``<tmp>/<name>-rank<r>.log``) and returns ``(return codes, outputs, logs)``, where ``outputs[r]`` is
the JSON the rank wrote to ``<cfg['out']>-rank<r>.json`` (``{}`` if none). With ``victim`` set, the
others get ``survivor_grace`` seconds once it has exited. ``on_poll(procs)``, if given, is called
every 0.1 s while ranks run (to signal them from outside, as a scheduler does). Deadlines scale with the load measured
at launch (:func:`tests.dist_utils.slowdown`); everything left is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(script, tmp, name, cfg, world, victim=None, timeout=120.0, survivor_grace=30.0, ranks_per_node=None,
           extra_path=(), on_poll=None):
    from tests.dist_utils import free_port, slowdown
    from tests.forked import kill, start_script

    cfg = {**cfg, "out": os.path.join(tmp, name), "victim": victim}
    rpn = ranks_per_node or world
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "NODE_RANK": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, *extra_path, os.environ.get("PYTHONPATH", "")])}
    procs, logs = [], []
    try:
        for r in range(world):
            log = os.path.join(tmp, f"{name}-rank{r}.log")
            logs.append(log)
            open(log, "w").close()
            procs.append(start_script(script, [json.dumps(cfg)], {**env, "RANK": str(r), "LOCAL_RANK": str(r % rpn)},
                                      log, ROOT))
        factor = slowdown()
        deadline = time.monotonic() + timeout * factor
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if victim is not None and procs[victim].poll() is not None:
                deadline = min(deadline, time.monotonic() + survivor_grace * factor)
            if on_poll is not None:
                on_poll(procs)
            time.sleep(0.1 if on_poll is not None else 0.2)
        if on_poll is not None:  # once more: ranks that ended since the last call (all may end in one interval)
            on_poll(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                kill(p)  # the rank and anything it started
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
                pass
    outs = []
    for r in range(world):
        try:
            with open(f"{cfg['out']}-rank{r}.json") as f:
                outs.append(json.load(f))
        except FileNotFoundError:
            outs.append({})
    return [p.returncode for p in procs], outs, logs


def tails(logs, n=3000):
    parts = []
    for log in logs:
        with open(log, errors="replace") as f:
            parts.append(f"--- {os.path.basename(log)} ---\n{f.read()[-n:]}")
    return "\n".join(parts)
