"""S3 requests per save and per load: ours against PyTorch DCP's fsspec reader/writer, same state.

A local moto S3 server behind the counting proxy of ``tests/s3_faults.py`` (no faults injected):
every HTTP request s3fs makes is counted by S3 operation. One process; the state is ``--tensors``
tensors of ``--mib`` MiB each plus a few objects (a model's weights and optimizer state in small).

    python benchmarks/s3_requests.py [--tensors 16 --mib 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import ckpt_integration as ci  # noqa: E402
from tests.s3_faults import S3FaultProxy, restore, start_moto, use_endpoint  # noqa: E402


def _state(n: int, mib: float):
    numel = int(mib * 2**20) // 4
    return {f"layer{i}.weight": torch.randn(numel) for i in range(n)}


def _count(proxy, fn):
    proxy.reset_counts()
    fn()
    with proxy.state.lock:  # bytes the server sent (GET bodies, listings): what a load fetched
        sent = proxy.state.bytes_out
    counts = proxy.reset_counts()
    return {"total": sum(counts.values()), **dict(sorted(counts.items())), "MiB sent": round(sent / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--mib", type=float, default=1.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    server, endpoint = start_moto()
    proxy = S3FaultProxy(endpoint).start()
    old = use_endpoint(proxy.endpoint)
    try:
        import fsspec

        fsspec.filesystem("s3").mkdir("bench")
        plain = _state(args.tensors, args.mib)
        ours = {k: ci.ShardedTensor.from_rank_offsets(k, v) for k, v in plain.items()}
        ours["step"] = 1
        url = f"s3://bench/{uuid.uuid4().hex[:8]}"
        rows = {}
        rows["ours save"] = _count(proxy, lambda: ci.save(ours, url + "/ours"))
        req = {k: ci.ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in plain.items()}
        rows["ours load"] = _count(proxy, lambda: ci.load(req, url + "/ours"))
        try:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

            sd = dict(plain)
            rows["DCP save (FsspecWriter)"] = _count(proxy, lambda: dcp.save(sd, storage_writer=FsspecWriter(url + "/dcp")))
            out = {k: torch.empty_like(v) for k, v in plain.items()}
            rows["DCP load (FsspecReader)"] = _count(proxy, lambda: dcp.load(out, storage_reader=FsspecReader(url + "/dcp")))
        except Exception as e:  # noqa: BLE001 - report what we have
            rows["DCP"] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        restore(old)
        proxy.stop()
        server.stop()
    total_mib = args.tensors * args.mib
    print(f"S3 requests, {args.tensors} tensors x {args.mib} MiB ({total_mib:.0f} MiB), 1 process")
    for name, c in rows.items():
        print(f"  {name:26s} {json.dumps(c)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": args.tensors, "mib": args.mib, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
