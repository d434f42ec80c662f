"""A rank killed in the middle of a save or a load: the survivors' error is the library's.

The library's collectives raised torch's bare ``RuntimeError`` (gloo's "Connection reset by peer")
on the surviving ranks, naming neither the checkpoint nor what happened; now a
:class:`~ckpt_integration.errors.PeerLostError` (a ``DistributedCheckpointingError``) says a peer is
gone, also where it dies in the middle of the point-to-point transfers of a shared read (an async save
killed in its background part still gives ``AsyncSaveAbandonedError`` naming the path:
``tests/test_exit.py``).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank_main(cfg: dict) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import ckpt_integration as ci
    from ckpt_integration.execution import dist as cdist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    sd = {"w": ci.ShardedTensor.from_rank_offsets("w", torch.full((4, 4), float(rank)), (0, rank, 2))}
    ci.save(sd, cfg["base"] + "/ok")
    transfer = cfg["what"].startswith("transfer")
    # dies in its next collective of the library, or (a transfer) when it sends or receives a
    # shared read's bytes, after every exchange of the plan
    names = ("isend", "irecv", "broadcast_tensor") if transfer else (
        "_c_all_gather", "_c_broadcast", "_c_all_reduce", "_c_all_to_all", "_c_gather")
    if rank == 1:
        for name in names:
            setattr(cdist, name, lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))
        if transfer:  # (torch's own too: whichever a transfer calls)
            dist.broadcast = dist.isend = dist.irecv = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    out = {}
    try:
        if transfer:  # each rank needs the other's rows: columns (read_once), the whole (fully_parallel)
            os.environ["LOCAL_WORLD_SIZE"] = "1"  # (each rank a node of its own: read_once sends)
            strategy = cfg["what"].split("-")[1]
            want = (ci.ShardedTensor.from_rank_offsets("w", torch.zeros(8, 2), (1, rank, 2)) if strategy == "read_once"
                    else ci.ShardedTensor.from_rank_offsets("w", torch.zeros(8, 4), replica_id=rank))
            ci.load({"w": want}, cfg["base"] + "/ok", load_strategy=strategy)
        elif cfg["what"] == "load":
            ci.load(sd, cfg["base"] + "/ok")
        elif cfg["what"] == "save":
            ci.save(sd, cfg["base"] + "/new")
        else:
            ci.save(sd, cfg["base"] + "/new", async_sharded_save=True).wait()
        out["error"] = None
    except Exception as e:  # noqa: BLE001
        out["error"] = [type(e).__name__, [c.__name__ for c in type(e).__mro__], str(e)[:600]]
    with open(f"{cfg['out']}-rank{rank}.json", "w") as f:
        json.dump(out, f)
    os._exit(0)


@pytest.mark.parametrize("what, kind", [("load", "PeerLostError"), ("save", "PeerLostError"),
                                        ("async", "PeerLostError"),  # (killed in the async save's planning)
                                        ("transfer-read_once", "PeerLostError"),
                                        ("transfer-fully_parallel", "PeerLostError")])
def test_a_killed_peer_fails_the_survivors_with_the_librarys_error(tmp_path, what, kind):
    from tests.proc_launch import launch, tails

    rcs, outs, logs = launch(__file__, str(tmp_path), what, {"base": str(tmp_path), "what": what}, 2, victim=1,
                             timeout=120, survivor_grace=60)
    assert rcs[1] == -signal.SIGKILL, f"{rcs}\n{tails(logs)}"
    err = outs[0].get("error")
    assert err and err[0] == kind and "CheckpointingException" in err[1], f"{outs}\n{tails(logs)}"
    if kind == "PeerLostError":
        assert "one of them exited, was killed or cannot be reached" in err[2], err


if __name__ == "__main__":  # one rank of a launch: python test_peer_lost.py '<json cfg>'
    sys.path.insert(0, ROOT)
    _rank_main(json.loads(sys.argv[1]))
