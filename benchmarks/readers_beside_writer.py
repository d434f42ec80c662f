"""An evaluation job reading checkpoints while the training job writes them (issue 22).

A writer (this process) saves step checkpoints, replaces ``last.ckpt`` after each and keeps the
newest two step checkpoints (the older ones are un-committed, then deleted, as the library's
top-k deletion does). A reader process loads ``last.ckpt`` and the newest step checkpoint in a
loop, through ``ci.open_checkpoint`` (``--mode opened``) or by path (``--mode path``), and sorts
every load into:

* ``ok``: every value equals the step the checkpoint records (one commit);
* ``replaced`` / ``gone``: ``CheckpointReplacedError``, or the checkpoint was removed or not
  committed yet when it was opened (``CheckpointNotFoundError`` / ``IncompleteCheckpointError``);
* ``corrupt``: ``CorruptCheckpointError`` although nothing was damaged (must be 0);
* ``mixed``: values of two commits returned (must be 0);
* ``other``: any other exception (must be 0).

Run: ``python benchmarks/readers_beside_writer.py --saves 300 --mode opened path``
(``tests/test_open_checkpoint.py`` runs a short form). Prints one JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_READER = """
import json, os, sys, torch, ckpt_integration as ci
from ckpt_integration.errors import (CheckpointNotFoundError, CheckpointReplacedError, CorruptCheckpointError,
                                     IncompleteCheckpointError)
root, mode = sys.argv[1], sys.argv[2]
counts = {"ok": 0, "replaced": 0, "gone": 0, "corrupt": 0, "mixed": 0, "other": 0}
examples = []
req = lambda: {"w": ci.ShardedTensor.from_rank_offsets("w", torch.empty(64, 16)),
               "b": ci.ShardedTensor.from_rank_offsets("b", torch.empty(8))}

def load(path):
    if mode == "path":
        return ci.load(req(), path)
    with ci.open_checkpoint(path) as ck:
        return ci.load(req(), ck)

open(os.path.join(root, "reader-ready"), "w").close()
rounds = 0
while True:
    finished = os.path.exists(os.path.join(root, "done"))  # then one last round, nothing written
    for path in [os.path.join(root, "last.ckpt")] + ci.list_checkpoints(root)[-1:]:
        try:
            out = load(path)
        except CheckpointReplacedError:
            counts["replaced"] += 1
            continue
        except (CheckpointNotFoundError, IncompleteCheckpointError):
            counts["gone"] += 1
            continue
        except CorruptCheckpointError as e:
            counts["corrupt"] += 1
            examples.append(f"corrupt: {e}")
            continue
        except Exception as e:
            counts["other"] += 1
            examples.append(f"{type(e).__name__}: {e}")
            continue
        s = out["step"]
        if torch.equal(out["w"], torch.full((64, 16), float(s))) and torch.equal(out["b"], torch.arange(8.0) + s):
            counts["ok"] += 1
        else:
            counts["mixed"] += 1
            examples.append(f"mixed: {path} step {s}")
    rounds += 1
    if rounds == 3:
        open(os.path.join(root, "reader-busy"), "w").close()
    if finished:
        break
print(json.dumps({"counts": counts, "examples": examples[:5]}))
"""


def _state(step: int):
    import torch

    import ckpt_integration as ci

    return {"w": ci.ShardedTensor.from_rank_offsets("w", torch.full((64, 16), float(step))),
            "b": ci.ShardedTensor.from_rank_offsets("b", torch.arange(8.0) + step),
            "step": step}


def run(root: str, saves: int, mode: str, timeout: float = 600.0) -> dict:
    """One writer (this process) and one reader process on ``root``; the reader's counts."""
    import ckpt_integration as ci

    os.makedirs(root, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    reader = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_READER), root, mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_for(name: str) -> None:  # a handshake with the reader (bounded)
        for _ in range(int(timeout / 0.05)):
            if os.path.exists(os.path.join(root, name)) or reader.poll() is not None:
                return
            time.sleep(0.05)

    started = time.perf_counter()
    try:
        wait_for("reader-ready")
        for step in range(1, saves + 1):
            if step == 3:
                wait_for("reader-busy")  # the reader is in its loop while the rest is written
            ci.save(_state(step), os.path.join(root, f"step={step:05d}.ckpt"))
            ci.save(_state(step), os.path.join(root, "last.ckpt"), overwrite=True)
            if step > 2:
                old = os.path.join(root, f"step={step - 2:05d}.ckpt")
                os.remove(os.path.join(old, "metadata.json"))  # un-commit first, as the library deletes
                shutil.rmtree(old)
        open(os.path.join(root, "done"), "w").close()
        out, err = reader.communicate(timeout=timeout)
    finally:
        if reader.poll() is None:
            reader.kill()
    if reader.returncode != 0:
        raise RuntimeError(f"the reader failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result.update(mode=mode, saves=saves, seconds=round(time.perf_counter() - started, 1),
                  loads=sum(result["counts"].values()))
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=300)
    ap.add_argument("--mode", nargs="+", choices=("opened", "path"), default=["opened", "path"])
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = ap.parse_args()
    bad = 0
    for mode in args.mode:
        root = tempfile.mkdtemp(prefix=f"readers-{mode}-", dir=args.dir)
        try:
            res = run(root, args.saves, mode)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(json.dumps(res), flush=True)
        c = res["counts"]
        bad += c["corrupt"] + c["mixed"] + c["other"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
