#!/usr/bin/env python
"""The memory tier against durable checkpoints and NVRx local checkpointing, one run, same state.

2 gloo ranks, each its own simulated node (``/dev/shm/.../node<r>``, ``replicas=2``: every
rank's snapshot also lives in the other node's memory), ``--gib-per-rank`` of fp32 state per
rank (``--tensors`` tensors sharded along dim 0). Measured, in this order (each phase frees
what it used, the machine has 24 GiB):

1. **blocking per save**: how long the call blocks training, best of ``--repeats`` (after one
   warm-up call that allocates buffers): our async durable save (``ci.save(...,
   async_sharded_save=True)``, to disk), PyTorch DCP ``async_save`` (to disk), a memory
   snapshot (``MemoryCheckpoints.save``); and how long the whole save takes until committed
   (background included);
2. **restores into the live tensors** (zeroed first, checked afterwards), best of
   ``--repeats``: from own memory (``tier.load``, every byte checked against its block digest),
   from a peer (rank 1's node directory moved away: its snapshot comes from rank 0's node), from the durable
   checkpoint on tmpfs and on disk read cold, an **elastic** restore (the same step into another
   layout, every tensor split by columns instead of rows: resharded from both nodes' memory)
   against the durable resharded load of the same request from tmpfs (``sync; echo 3 > /proc/sys/vm/drop_caches`` first,
   needs root; otherwise ``posix_fadvise(DONTNEED)`` per file), and the plain limits of the same
   bytes: ``read()`` of the snapshot files into the tensors (tmpfs to process memory) and
   ``memcpy`` from host memory;
3. **memory**: shared memory per node for the tier's files, anonymous process memory
   (``RssAnon``) the snapshots added;
4. **NVRx** (``nvidia-resiliency-ext``) ``LocalCheckpointManager`` with
   ``CliqueReplicationStrategy.from_replication_params(replication_jump=1, replication_factor=2)``
   on ``/dev/shm``, with a
   CPU ``TensorAwareStateDict`` (its ``BasicTensorAwareStateDict`` accepts CUDA tensors only):
   synchronous save (its async save calls ``torch.cuda.synchronize()``; the error is recorded),
   ``find_latest`` + ``load``.

Usage::

    python benchmarks/memory_tier.py                      # 1 GiB per rank
    python benchmarks/memory_tier.py --gib-per-rank 0.05 --repeats 1   # smoke run
    python benchmarks/memory_tier.py --json out.json
    python benchmarks/memory_tier.py --s3                 # also the durable tier on a local S3 server
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any, Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench import _drop_cache, _free_port, _status_kib  # noqa: E402
from bench_util import all_gather  # noqa: E402

GiB = 1 << 30


def _drop_all_caches(dirs: List[str], system_wide: bool = True) -> str:
    """Evict the page cache: the kernel's drop_caches as root, else (or when not ``system_wide``)
    per-file fadvise."""
    try:
        if not system_wide:
            raise OSError("per-file eviction asked for")
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for d in dirs:
            _drop_cache(d)
        return "fadvise"


class Rank:
    def __init__(self, rank: int, world: int, args: argparse.Namespace):
        import torch

        self.rank, self.world, self.args = rank, world, args
        per_tensor = int(args.gib_per_rank * GiB) // args.tensors
        self.cols = 1024
        self.rows = max(1, per_tensor // (self.cols * 4))
        g = torch.Generator().manual_seed(100 + rank)
        self.tensors = [torch.rand(self.rows, self.cols, generator=g) for _ in range(args.tensors)]
        self.bytes = sum(t.numel() * 4 for t in self.tensors)
        self.crcs = [zlib.crc32(t.numpy()) for t in self.tensors]
        self.results: Dict[str, Any] = {}

    def sharded(self) -> Dict[str, Any]:
        import ckpt_integration as ci

        sd = {f"t{i}": ci.ShardedTensor.from_rank_offsets(f"t{i}", t, (0, self.rank, self.world))
              for i, t in enumerate(self.tensors)}
        sd["step"] = 0
        return sd

    def columns(self) -> Dict[str, Any]:
        """Another layout of the same state: every tensor split by columns instead of rows (the
        elastic restore's request; its destinations are allocated once, as the live tensors are)."""
        import torch

        import ckpt_integration as ci

        if not hasattr(self, "col_tensors"):
            self.col_tensors = [torch.empty(self.rows * self.world, self.cols // self.world) for _ in self.tensors]
        return {f"t{i}": ci.ShardedTensor.from_rank_offsets(f"t{i}", t, (1, self.rank, self.world))
                for i, t in enumerate(self.col_tensors)}

    def zero(self) -> None:
        for t in self.tensors:
            t.zero_()

    def zero_columns(self) -> None:
        for t in self.col_tensors:
            t.zero_()

    def check(self, what: str) -> None:
        for i, t in enumerate(self.tensors):
            if zlib.crc32(t.numpy()) != self.crcs[i]:
                raise AssertionError(f"rank {self.rank}: {what} restored wrong data in t{i}")

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def timed(self, fn: Callable[[], Any], setup: Optional[Callable[[], Any]] = None) -> List[float]:
        """``fn`` between barriers, ``repeats`` times; the slowest rank's time of each."""
        import torch
        import torch.distributed as dist

        out = []
        for _ in range(self.args.repeats):
            if setup is not None:
                setup()
            self.barrier()
            t0 = time.perf_counter()
            fn()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            out.append(float(dt))
        return out

    def worst(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)


# --------------------------------------------------------------------------- phases
def durable_saves(r: Rank, disk: str) -> str:
    """Blocking per async save: ours and DCP's; leaves our durable checkpoint on disk."""
    import torch.distributed.checkpoint as dcp

    import ckpt_integration as ci
    from ckpt_integration.execution.async_save import AsyncCallsQueue

    ours = os.path.join(disk, "ours")
    q = AsyncCallsQueue()
    blocking, total = [], []
    for k in range(r.args.repeats + 1):  # the first call allocates the staging buffers
        path = f"{ours}_{k}"
        r.barrier()
        t0 = time.perf_counter()
        req = ci.save(r.sharded(), path, async_sharded_save=True, async_queue=q)
        b = time.perf_counter() - t0
        req.wait()
        blocking.append(r.worst(b))
        total.append(r.worst(time.perf_counter() - t0))
        if k:
            r.barrier()
            if r.rank == 0:
                shutil.rmtree(f"{ours}_{k - 1}" if k > 1 else f"{ours}_0", ignore_errors=True)
    q.close()
    keep = f"{ours}_{r.args.repeats}"
    r.results["ours_async_durable"] = {"blocking_s": min(blocking[1:]), "total_s": min(total[1:]),
                                       "first_blocking_s": blocking[0]}
    blocking, total = [], []
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()  # buffers reused across saves, staged in the caller (DCP's default)
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                          use_non_blocking_copy=cuda))
    for k in range(r.args.repeats + 1):
        path = os.path.join(disk, f"dcp_{k}")
        sd = {f"t{i}": t for i, t in enumerate(r.tensors)}
        r.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=path, async_stager=stager)
        b = time.perf_counter() - t0
        (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
        blocking.append(r.worst(b))
        total.append(r.worst(time.perf_counter() - t0))
        r.barrier()
        if r.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    stager.close()
    r.results["dcp_async_save"] = {"blocking_s": min(blocking[1:]), "total_s": min(total[1:]),
                                   "first_blocking_s": blocking[0]}
    return keep


def durable_restores(r: Rank, ckpt_disk: str, shm_base: str) -> None:
    import ckpt_integration as ci

    how = []

    def cold():
        r.barrier()
        if r.rank == 0:
            how.append(_drop_all_caches([ckpt_disk], not r.args.no_drop_caches))
        r.zero()

    t = r.timed(lambda: ci.load(r.sharded(), ckpt_disk), setup=cold)
    r.check("durable load from disk")
    r.results["durable_disk_cold"] = {"seconds": min(t), "cache_drop": how[-1] if how else None}
    ckpt_shm = os.path.join(shm_base, "durable")
    if r.rank == 0:
        shutil.copytree(ckpt_disk, ckpt_shm)
    r.barrier()
    t = r.timed(lambda: ci.load(r.sharded(), ckpt_shm), setup=r.zero)
    r.check("durable load from tmpfs")
    r.results["durable_tmpfs"] = {"seconds": min(t)}
    r.columns()
    t = r.timed(lambda: ci.load(r.columns(), ckpt_shm), setup=r.zero_columns)  # resharded: columns instead of rows
    r.col_crcs = [zlib.crc32(c.numpy()) for c in r.col_tensors]
    r.results["durable_tmpfs_resharded"] = {"seconds": min(t)}
    r.barrier()
    if r.rank == 0:
        shutil.rmtree(ckpt_shm, ignore_errors=True)
    if r.args.s3_url:  # the durable tier on an object store (a local moto server: no network distance)
        ci.save(r.sharded(), r.args.s3_url)
        t = r.timed(lambda: ci.load(r.sharded(), r.args.s3_url), setup=r.zero)
        r.check("durable load from S3")
        r.results["durable_s3"] = {"seconds": min(t)}


def memory_tier(r: Rank, shm_base: str) -> None:
    import torch

    import ckpt_integration as ci

    node = os.path.join(shm_base, f"node{r.rank}")
    tier = ci.MemoryCheckpoints(node, "bench", replicas=2, ranks_per_node=1)
    blocking, total, rss = [], [], []
    for k in range(r.args.repeats + 1):
        r.barrier()
        before = _status_kib("RssAnon") or 0
        t0 = time.perf_counter()
        tier.save(r.sharded(), k)
        b = time.perf_counter() - t0
        tier.wait()
        blocking.append(r.worst(b))
        total.append(r.worst(time.perf_counter() - t0))
        rss.append(((_status_kib("RssAnon") or 0) - before) * 1024)  # the shared-memory files are counted apart
    files = sum(os.path.getsize(os.path.join(dp, n)) for dp, _, ns in os.walk(os.path.join(node, "bench")) for n in ns)
    r.results["memory_snapshot"] = {"blocking_s": min(blocking[1:]), "total_s": min(total[1:]),
                                    "first_blocking_s": blocking[0], "shm_bytes_per_node": r.worst(files),
                                    "extra_anon_bytes": r.worst(max(rss))}
    step = tier.latest()
    t = r.timed(lambda: tier.load(r.sharded(), step), setup=r.zero)
    r.check("own-memory restore")
    assert tier.last_restore.source == "own memory" and tier.last_restore.from_mapping, tier.last_restore
    r.results["restore_own_memory"] = {"seconds": min(t)}

    # the limits: the same bytes read from the snapshot files, and copied from host memory
    recs = [ci.memory.slots.read_record(tier.root, r.rank, s) for s in (0, 1)]
    rec = next(x for x in recs if x is not None and x.step == step)
    regions = rec.regions
    paths = {n: os.path.join(ci.memory.slots.owner_dir(tier.root, r.rank), n) for n in rec.files()}

    def read_files():
        for (name, off, n, _), tt in zip(regions, r.tensors):
            with open(paths[name], "rb", buffering=0) as f:
                f.seek(off)
                f.readinto(memoryview(tt.numpy()).cast("B"))

    t = r.timed(read_files, setup=r.zero)
    r.check("plain read")
    r.results["limit_read_tmpfs"] = {"seconds": min(t)}
    chunk = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)

    def memcpy():
        for tt in r.tensors:
            b = tt.view(-1).view(torch.uint8)
            for o in range(0, b.numel(), chunk.numel()):
                n = min(chunk.numel(), b.numel() - o)
                b[o:o + n].copy_(chunk[:n])

    t = r.timed(memcpy)
    r.results["limit_memcpy"] = {"seconds": min(t)}
    from ckpt_integration.storage.checksum import DEFAULT_BLOCK_SIZE

    digest = rec.block_hash.digest

    def memcpy_digest():  # the restore's floor: the bytes copied once, and each 1 MiB block digested
        memcpy()
        for tt in r.tensors:
            b = tt.view(-1).view(torch.uint8).numpy()
            for o in range(0, len(b), DEFAULT_BLOCK_SIZE):
                digest(b[o:o + DEFAULT_BLOCK_SIZE])

    t = r.timed(memcpy_digest)
    r.results["limit_memcpy_digest"] = {"seconds": min(t)}
    r.zero()

    # own memory after a restart: a new tier (no mappings of the files in this process) reads them
    tier.close()
    tier = ci.MemoryCheckpoints(node, "bench", replicas=2, ranks_per_node=1)
    t = r.timed(lambda: tier.load(r.sharded(), step), setup=r.zero)
    r.check("own-memory restore after a restart")
    assert not tier.last_restore.from_mapping, tier.last_restore
    r.results["restore_own_memory_restarted"] = {"seconds": min(t)}

    # a peer restore: rank 1's node lost its memory (moved away meanwhile)
    hidden = os.path.join(shm_base, "hidden1")

    def lose_node():
        r.barrier()
        if r.rank == 1 and os.path.exists(os.path.join(shm_base, "node1", "bench")):
            os.rename(os.path.join(shm_base, "node1", "bench"), hidden)
        r.barrier()
        r.zero()

    t = r.timed(lambda: tier.load(r.sharded(), step), setup=lose_node)
    r.check("peer restore")
    src = tier.last_restore.source
    r.barrier()
    if r.rank == 1:
        os.rename(hidden, os.path.join(shm_base, "node1", "bench"))

    sources: List[Any] = all_gather(src)
    r.results["restore_peer"] = {"seconds": min(t), "source_rank1": sources[1]}

    # elastic: the same step into another layout (columns), resharded from both nodes' memory
    t = r.timed(lambda: tier.load(r.columns(), step), setup=r.zero_columns)
    if [zlib.crc32(c.numpy()) for c in r.col_tensors] != r.col_crcs:
        raise AssertionError(f"rank {r.rank}: the elastic restore differs from the durable resharded load")
    r.results["restore_elastic"] = {"seconds": min(t), "source": tier.last_restore.source}
    tier.close(remove=True)


try:  # NVRx's interface for a state dict with tensors (pickled by its manager: module level)
    from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict as _NVRxBase
except Exception:  # noqa: BLE001 - not installed: the NVRx part reports it
    _NVRxBase = object


class CPUStateDict(_NVRxBase):
    """NVRx's interface for CPU tensors: a snapshot is a clone (its basic class moves CUDA tensors to host)."""

    def __init__(self, tensors):
        self.state = {"tensors": list(tensors)}
        self._hollow = False

    def pop_tensors(self):
        out, self.state["tensors"] = self.state["tensors"], [(t.shape, t.dtype) for t in self.state["tensors"]]
        self._hollow = True
        return out

    @property
    def tensors(self):
        return iter(self.state["tensors"])

    @property
    def is_hollow(self):
        return self._hollow

    def insert_tensors(self, tensor_data):
        self.state["tensors"] = list(tensor_data)
        self._hollow = False

    def init_tensors(self):
        import torch

        self.state["tensors"] = [torch.empty(s, dtype=d) for s, d in self.state["tensors"]]
        self._hollow = False

    def copy_tensors_to_cpu(self, non_blocking=False):
        self.state["tensors"] = [t.clone() for t in self.state["tensors"]]

    def restore_tensor_device(self, non_blocking=True):
        pass


def nvrx(r: Rank, shm_base: str) -> None:
    try:
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy
    except Exception as e:  # noqa: BLE001
        r.results["nvrx"] = {"error": f"not importable: {type(e).__name__}: {e}"}
        return
    root = os.path.join(shm_base, "nvrx")
    out: Dict[str, Any] = {}
    try:
        repl = CliqueReplicationStrategy.from_replication_params(replication_jump=1, replication_factor=2)
        mgr = LocalCheckpointManager(root, session_id="bench", repl_strategy=repl)
        times = []
        for k in range(1, r.args.repeats + 2):
            r.barrier()
            t0 = time.perf_counter()
            mgr.save(CPUStateDict(r.tensors), k, is_async=False)
            times.append(r.worst(time.perf_counter() - t0))
        out["save_sync_s"] = min(times[1:])
        files = sum(os.path.getsize(os.path.join(dp, n)) for dp, _, ns in os.walk(root) for n in ns)
        out["shm_bytes_total"] = r.worst(files)
        loads = []
        for _ in range(r.args.repeats):
            r.barrier()
            mgr.latest_iteration = -1
            t0 = time.perf_counter()
            mgr.find_latest()
            sd, _ = mgr.load()
            for dst, src in zip(r.tensors, sd.state["tensors"]):
                dst.copy_(src)
            loads.append(r.worst(time.perf_counter() - t0))
        r.check("NVRx restore")
        out["restore_s"] = min(loads)
        try:
            r.barrier()
            mgr.save(CPUStateDict(r.tensors), 100, is_async=True)
            out["async"] = "ran"
        except BaseException as e:  # noqa: BLE001 - expected on CPU
            out["async"] = f"{type(e).__name__}: {e}"
    except BaseException as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    r.barrier()
    if r.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    r.results["nvrx"] = out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import ckpt_integration.memory.slots  # noqa: F401  (ci.memory.slots below)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))
    try:
        r = Rank(rank, world, args)
        shm_base, disk = args.shm, args.disk
        ckpt = durable_saves(r, disk)
        durable_restores(r, ckpt, shm_base)
        r.barrier()
        if rank == 0:
            shutil.rmtree(ckpt, ignore_errors=True)
        memory_tier(r, shm_base)
        if not args.no_nvrx:
            nvrx(r, shm_base)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"bytes_per_rank": r.bytes, "world": world, **r.results}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def format_table(res: Dict[str, Any]) -> str:
    gib = res["bytes_per_rank"] / GiB
    own = res["restore_own_memory"]["seconds"]
    rows = [
        ("blocking per save: memory snapshot", res["memory_snapshot"]["blocking_s"]),
        ("blocking per save: ours async durable (disk)", res["ours_async_durable"]["blocking_s"]),
        ("blocking per save: DCP async_save (disk)", res["dcp_async_save"]["blocking_s"]),
        ("whole save: memory snapshot (2 copies committed)", res["memory_snapshot"]["total_s"]),
        ("whole save: ours async durable (disk)", res["ours_async_durable"]["total_s"]),
        ("whole save: DCP async_save (disk)", res["dcp_async_save"]["total_s"]),
        ("restore: own memory (verified; the process that saved)", own),
        ("restore: own memory (verified; a restarted process)", res["restore_own_memory_restarted"]["seconds"]),
        ("restore: peer copy (verified)", res["restore_peer"]["seconds"]),
        ("restore: durable on tmpfs", res["durable_tmpfs"]["seconds"]),
        ("elastic restore: memory, another layout (verified, resharded)", res["restore_elastic"]["seconds"]),
        ("elastic restore: durable on tmpfs, the same resharding", res["durable_tmpfs_resharded"]["seconds"]),
        ("restore: durable on disk, cold", res["durable_disk_cold"]["seconds"]),
    ] + ([("restore: durable on a local S3 server (moto)", res["durable_s3"]["seconds"])] if "durable_s3" in res else []) + [
        ("limit: read() of the snapshot files", res["limit_read_tmpfs"]["seconds"]),
        ("limit: memcpy from host memory", res["limit_memcpy"]["seconds"]),
        ("limit: memcpy + digest pass (XXH3-64 per 1 MiB block)", res["limit_memcpy_digest"]["seconds"]),
    ]
    nv = res.get("nvrx", {})
    if "save_sync_s" in nv:
        rows += [("NVRx local ckpt: save (sync, 2 copies)", nv["save_sync_s"]),
                 ("NVRx local ckpt: find_latest + load", nv["restore_s"])]
    lines = [f"state: {gib:.2f} GiB per rank x {res['world']} ranks", "", "| what | seconds | GiB/s per rank |",
             "|---|---:|---:|"]
    for name, s in rows:
        lines.append(f"| {name} | {s:.3f} | {gib / s:.2f} |")
    ms = res["memory_snapshot"]
    lines += [
        "",
        f"own-memory restore vs durable on disk (cold): {res['durable_disk_cold']['seconds'] / own:.1f}x faster",
        f"own-memory restore vs read() limit: {res['limit_read_tmpfs']['seconds'] / own:.2f}x; "
        f"vs memcpy limit: {res['limit_memcpy']['seconds'] / own:.2f}x; "
        f"vs memcpy + digest: {res['limit_memcpy_digest']['seconds'] / own:.2f}x (restarted: "
        f"{res['limit_memcpy_digest']['seconds'] / res['restore_own_memory_restarted']['seconds']:.2f}x); "
        f"vs durable on tmpfs: {res['durable_tmpfs']['seconds'] / own:.2f}x (restarted: "
        f"{res['durable_tmpfs']['seconds'] / res['restore_own_memory_restarted']['seconds']:.2f}x)",
        f"blocking: memory snapshot / ours async durable: {ms['blocking_s'] / res['ours_async_durable']['blocking_s']:.2f}",
        f"shared memory per node: {ms['shm_bytes_per_node'] / GiB:.2f} GiB "
        f"({ms['shm_bytes_per_node'] / res['bytes_per_rank']:.2f}x the rank's state); "
        f"process memory (anonymous) added by the snapshots: {ms['extra_anon_bytes'] / GiB:.3f} GiB",
        f"peer restore source (rank 1): {res['restore_peer'].get('source_rank1')}",
        f"elastic restore from memory vs the durable resharded load from tmpfs: "
        f"{res['durable_tmpfs_resharded']['seconds'] / res['restore_elastic']['seconds']:.2f}x "
        f"(rank 0: {res['restore_elastic']['source']})",
    ]
    if nv:
        lines.append(f"NVRx: {json.dumps({k: v for k, v in nv.items() if k not in ('save_sync_s', 'restore_s')})}")
    return "\n".join(lines)


def main(argv=None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib-per-rank", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--disk", default=None, help="a directory on disk (default: a temporary one under /var/tmp)")
    p.add_argument("--no-nvrx", action="store_true")
    p.add_argument("--no-drop-caches", action="store_true",
                   help="evict only the checkpoint's files (fadvise) instead of the whole page cache")
    p.add_argument("--s3", action="store_true", help="also restore the durable checkpoint from a local moto S3 server")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    shm = tempfile.mkdtemp(prefix="memtier_bench_", dir=args.shm)
    disk = tempfile.mkdtemp(prefix="memtier_bench_", dir=args.disk or "/var/tmp")
    args.shm, args.disk = shm, disk
    out = os.path.join(disk, "result.json")
    args.s3_url, moto, old_env = None, None, None
    if args.s3:
        from tests.s3_faults import start_moto, use_endpoint

        moto, endpoint = start_moto()
        old_env = use_endpoint(endpoint)  # (through the environment: the spawned ranks use it too)
        import fsspec

        fsspec.filesystem("s3").mkdir("bench")
        args.s3_url = "s3://bench/ckpt"
    try:
        mp.start_processes(_worker, args=(2, _free_port(), args, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            res = json.load(f)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
        if moto is not None:
            from tests.s3_faults import restore

            restore(old_env)
            moto.stop()
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
