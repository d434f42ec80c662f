"""``MemoryCheckpoints``: frequent snapshots in host shared memory, copied to peer nodes.

A snapshot is taken like an async save (:mod:`ckpt_integration.execution.async_save`): the caller is blocked
only while the structure is staged (:class:`StateDictStager`, whose buffers here are slices of files in the
node's shared memory, :mod:`.slots`); large tensors are copied by a background thread while training goes on
(:class:`Snapshot`: the next ``torch.optim`` step waits for it, an early in-place change fails the snapshot).
A worker thread (:class:`AsyncCallsQueue`) then computes the block digests, commits the rank's record, sends
the slot to the ranks that keep its copies and receives the copies it keeps (:mod:`.transfer`), and agrees
with every rank on the outcome, all on a private gloo group; the caller never enters a collective for it (a
failure is raised on every rank by ``wait()`` or the next ``save()``).

Restores (:mod:`.restore`) read the rank's own files when its node still has them and otherwise fetch a
peer's copy; every byte is checked against the block digests first."""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Type, Union

import torch

from ..checkpoints import save_base
from ..errors import CheckpointingException, MemoryCheckpointError, MemoryLayoutError, MemorySpaceError, MismatchError
from ..execution import dist
from ..execution.async_save import DEFAULT_COPY_NOW_BYTES, AsyncCallsQueue, AsyncRequest
from ..execution.preprocess import check_group, dtype_name, split_state_dict
from ..execution.dist import Group, describe_error as _describe
from ..execution.failure import Failure
from ..execution.state_check import default_verify_state
from ..execution.save import finalize_save, prepare_save, save_options, write_local
from ..execution.snapshot import Snapshot
from ..execution.staging import StateDictStager
from ..dict_utils import nested_values
from ..mapping import ShardedObject, ShardedTensor
from ..storage.checksum import save_block_hash
from ..storage.filesystem import storage_for
from ..storage.fingerprint import shard_fingerprints
from ..storage.safe_pickle import torch_dumps
from . import elastic, slots
from . import restore as rs
from .restore import RestoreReport
from .plan import group_ranks_per_node, memory_clashes, replication_plan, space_problem
from .transfer import Outgoing, exchange

logger = logging.getLogger(__name__)

__all__ = ["MemoryCheckpoints", "RestoreReport"]


@dataclass
class _Job:
    step: int
    slot: int
    values: List[Any]  # ShardedTensors (with data) / ShardedObjects, in save order
    staged: Any = None
    failure: Failure = field(default_factory=Failure)  # this rank's, agreed in the background


class MemoryCheckpoints:
    """Snapshots of a sharded state dict in the node's shared memory and on peer nodes.

    Construct on every rank (collective). ``directory`` is this node's shared memory (a tmpfs
    such as ``/dev/shm/ckpt``); every node passes its own, and a node's snapshots outlive the
    processes that wrote them, so a restarted process finds them. Everything lives under
    ``directory/job_id``: another job's snapshots are never read or removed.

    Args:
        directory: this node's shared-memory directory.
        job_id: name of the training job (stable across restarts of the job); one open tier per
            job and directory (a second one's ranks would overwrite the first one's: refused).
        replicas: copies of each rank's snapshot on distinct nodes, its own included
            (``1``: no peer copies). Nodes form replica groups as in NVRx's clique replication
            (:mod:`ckpt_integration.memory.plan`).
        ranks_per_node: ranks per node (default: from ``LOCAL_WORLD_SIZE``, the group's ranks as
            they sit on the job's nodes; rank ``r`` of the group runs on node ``r // ranks_per_node``).
        process_group: the ranks taking part (default: the world); a private gloo group with
            the same ranks carries the tier's traffic.
        trusted: as for :func:`ckpt_integration.load`, for a snapshot's common state and objects.
        allowed_globals: as for :func:`ckpt_integration.load` (classes the unpickler may build).
        timeout_s: how long the tier's background collectives wait for a peer.

    Example (every rank)::

        tier = ci.MemoryCheckpoints("/dev/shm/ckpt", "run-42", replicas=2)
        step = tier.latest()                       # newest step every rank can restore, or None
        if step is not None:
            state = tier.load(sharded_sd, step)    # verified, from own memory or a peer
        for step in range(step or 0, steps):
            train_step()
            if step % 10 == 0:
                tier.save(sharded_sd, step)        # returns while the copy runs in the background
            if step % 500 == 0:
                tier.persist(step, f"ckpt/iter_{step}")   # an ordinary durable checkpoint
        tier.close(remove=True)                    # the job finished: free the memory
    """

    def __init__(self, directory: Union[str, os.PathLike], job_id: str, replicas: int = 2, ranks_per_node: Optional[int] = None,
                 process_group: Group = None, *, trusted: bool = False, allowed_globals: Optional[Iterable[Any]] = None,
                 timeout_s: float = 600.0, copy_now_bytes: int = DEFAULT_COPY_NOW_BYTES):
        self.directory = os.path.abspath(os.fspath(directory))
        self.job_id = slots.check_job_id(job_id)
        self.root = os.path.join(self.directory, self.job_id)
        check_group(process_group, "MemoryCheckpoint")
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        if ranks_per_node is None:
            env = dist.local_world_size()
            if env is None and self.world_size > 1:
                raise MemoryCheckpointError("MemoryCheckpoints needs ranks_per_node (LOCAL_WORLD_SIZE is not set, "
                                            "or not a positive integer)")
            ranks_per_node = group_ranks_per_node([dist.global_rank(process_group, g) for g in range(self.world_size)], env or 1)
        self.plan = replication_plan(self.world_size, int(ranks_per_node), int(replicas))
        self.trusted = trusted
        self.allowed_globals = list(allowed_globals or [])
        self.copy_now_bytes = int(copy_now_bytes)
        self.last_restore: Optional[RestoreReport] = None
        self.last_complete_step: Optional[int] = None
        self.last_save_blocking_s: Optional[float] = None
        self._check_distinct_memory(process_group)  # (before the tier's own groups exist: nothing to undo)
        self._group = self._new_group(process_group, timeout_s)
        self._persist_group = self._new_group(process_group, timeout_s)
        self.node = slots.node_id(self.root)
        if self.rank % self.plan.ranks_per_node == 0:  # (once per node)
            slots.advise_huge_pages(self.directory)
        if self.plan.replicas < self.plan.asked:
            logger.warning("memory tier: replicas=%d asked, but the job has %d node(s): keeping %d copy(ies) of every "
                           "snapshot", self.plan.asked, self.world_size // self.plan.ranks_per_node, self.plan.replicas)
        inc = dist.broadcast_object((time.time_ns(), uuid.uuid4().hex) if self.rank == 0 else None,
                                    src=dist.coordinator_rank(self._group), group=self._group)
        self.incarnation: Tuple[int, str] = (int(inc[0]), str(inc[1]))
        tag = uuid.uuid4().hex[:8]
        self._arenas = [slots.Arena(self.root, self.rank, s, tag) for s in slots.SLOTS]
        self._held: Dict[Tuple[int, int], slots.Arena] = {}
        self._tag = tag
        self._stagers = [StateDictStager(pin_memory=False, allocator=a.allocate) for a in self._arenas]
        self._queue = AsyncCallsQueue(max_in_flight=1, copy_now_bytes=self.copy_now_bytes)
        self._persist_queue = AsyncCallsQueue(max_in_flight=1)
        self._pinned: Dict[int, int] = {}
        self._pin_cv = threading.Condition()
        self._space_checked = self._closed = False
        # the newest complete step already in memory (a restarted job) must survive the next save
        inv = rs.gather_inventory(self.root, self.job_id, self.node, self._group)
        done = rs.complete_any(inv)  # (also one of another job size: a smaller restart restores it)
        self._protected: Optional[rs.Key] = done[0][0] if done else None
        self._protected_slot: Optional[int] = self._slot_of_key(inv, done[0][0]) if done else None
        self.last_complete_step = done[0][0][0] if done and done[0][1] == self.world_size else None  # (persistable)
        self._worlds: Dict[int, int] = {}  # step -> job size that saved it, as latest() found them
        self.latest_started: Optional[float] = None  # when the run that took latest()'s snapshot started (s)
        self._stale = bool(done) and done[0][1] != self.world_size  # snapshots of another job size to free
        self._ran = False  # (this run completed a snapshot: earlier runs' later steps were dropped then)

    def _check_distinct_memory(self, process_group: Group) -> None:
        """Collective: every copy of a snapshot must sit in other memory than its owner's. Each rank's memory is
        named by its host, boot and the directory's device and inode (what two plan nodes share when
        ``ranks_per_node`` does not match the placement, or two nodes were given one directory); a copy that
        would land in its owner's memory is refused, naming the ranks, before anything is written (it would
        protect nothing, and overwrite records). Each rank's place is locked for the tier's life (``RankLock``)."""
        self._lock = slots.RankLock(self.root, self.rank, self.job_id)
        mine = (slots.memory_identity(self.directory), self.directory, self._lock.problem)
        gathered = dist.all_gather_object(mine, process_group)
        clash = memory_clashes(self.plan, [g[0] for g in gathered], [g[1] for g in gathered])
        if clash is not None or any(g[2] for g in gathered):
            self._lock.release()
            raise MemoryCheckpointError(clash or next(g[2] for g in gathered if g[2]))

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _new_group(process_group: Group, timeout_s: float) -> Optional[dist.PrivateGroup]:
        # The library's own gloo group (fresh random store keys): torch's new_group names a group by
        # its ranks and the groups alive, so a tier made after another was closed could hang on its
        # dead peers' keys; and the caller's destroy_process_group() must not cut work in flight.
        return dist.new_private_group(process_group, datetime.timedelta(seconds=timeout_s))

    @property
    def group(self) -> Optional[dist.PrivateGroup]:
        """The tier's own gloo group (its snapshots and restores talk over it)."""
        return self._group

    def _slot_of_key(self, inv: rs.Inventory, key: rs.Key) -> int:
        return min(e.slot for es in inv.entries for e in es if (e.step, e.incarnation) == key)

    def _check_open(self) -> None:
        if self._closed:
            raise MemoryCheckpointError("MemoryCheckpoints is closed")

    def _held_arena(self, owner: int, slot: int) -> slots.Arena:
        if (owner, slot) not in self._held:
            self._held[(owner, slot)] = slots.Arena(self.root, owner, slot, self._tag)
        return self._held[(owner, slot)]

    def _drain(self) -> None:
        """Wait for the snapshot in flight (its collectives use the tier's group)."""
        self._queue.maybe_finalize_async_calls(blocking=True)

    def _wait_unpinned(self, slot: int) -> None:
        with self._pin_cv:
            while self._pinned.get(slot):
                self._pin_cv.wait()

    # -- save ---------------------------------------------------------------------------------
    def save(self, sharded_state_dict: Dict[str, Any], step: int) -> None:
        """Start a snapshot of ``sharded_state_dict`` as step ``step`` (every rank, same step).

        Returns once the snapshot is under way: small tensors and the rest of the state are copied,
        large tensors are being copied by a background thread (the next ``torch.optim`` step waits for
        that; other in-place changes must call :func:`ckpt_integration.wait_for_snapshot` first). Waits
        for the previous snapshot and raises its failure. The first call checks that every node has
        room for its snapshots and raises :class:`MemorySpaceError` on every rank otherwise."""
        self._check_open()
        t0 = time.perf_counter()
        self._queue._make_room()  # the previous snapshot is complete everywhere (or raises)
        slot = 0 if self._protected_slot is None else 1 - self._protected_slot
        self._wait_unpinned(slot)
        job = _Job(int(step), slot, [])
        common: Any = None
        with job.failure.capture():
            sharded, common, _np, _f, _t = split_state_dict(sharded_state_dict)
            job.values = [v for v in nested_values(sharded) if isinstance(v, ShardedObject)
                          or (isinstance(v, ShardedTensor) and v.data is not None)]
            for v in job.values:
                if isinstance(v, ShardedTensor) and v.data.device.type == "meta":
                    raise CheckpointingException(f"ShardedTensor {v.key!r} is on the meta device: nothing to snapshot")
        common = None if job.failure.failed else common
        if not self._space_checked:
            self._check_space(job)
        snap: Optional[Snapshot] = None
        if not job.failure.failed:
            with job.failure.capture():  # reported on every rank by the background agreement
                slots.invalidate(self.root, self.rank, slot)  # the slot is invalid from here on
                tensors = [v.data for v in job.values if isinstance(v, ShardedTensor)]
                objects = [v.data for v in job.values if isinstance(v, ShardedObject)]
                pending = self._stagers[slot].prepare({"tensors": tensors, "common": common, "objects": objects},
                                                      defer_from_bytes=self.copy_now_bytes)
                job.staged, pending.state = pending.state, None
                if not pending.done.is_set():
                    names = {id(v.data): v.key for v in job.values if isinstance(v, ShardedTensor)}
                    snap = Snapshot(pending, names, f"memory snapshot of step {step}")
        req = AsyncRequest(self._run_save, (job, snap), description=f"memory snapshot of step {step}")
        req.snapshot = snap
        if snap is not None:
            snap.start()
        self._queue._submit(req)
        self.last_save_blocking_s = time.perf_counter() - t0

    def _check_space(self, job: _Job) -> None:
        """First save (collective): does every node have room for 2 slots of what it holds?"""
        est = sum(v.data.numel() * v.data.element_size() for v in job.values if isinstance(v, ShardedTensor))
        sizes = dist.all_gather_object(est + (1 << 20), self._group)
        free = shutil.disk_usage(self.directory).free + slots.node_usage(self.root)
        errors = dist.agree_on_errors(space_problem(self.plan, self.rank, sizes, free, self.directory), self._group)
        if errors:
            raise MemorySpaceError("not enough shared memory for the memory tier:\n  " + "\n  ".join(errors))
        self._space_checked = True

    def _build_record(self, job: _Job) -> Tuple[Dict[str, Any], bytes, List[str]]:
        """The record's header (without ``owner_digests``), its blob and the arena files it keeps.
        Every tensor shard's fingerprint is computed from the staged bytes (what is restored)."""
        arena = self._arenas[job.slot]
        digest = save_block_hash()
        regions: List[List[Any]] = []
        where: Dict[Tuple[str, int], int] = {}
        shards = []
        tensors = iter(job.staged["tensors"])
        objects = 0
        staged_shards = [replace(v, data=t) for v, t in zip((v for v in job.values if isinstance(v, ShardedTensor)),
                                                              job.staged["tensors"])]
        prints = iter(shard_fingerprints(staged_shards))
        for v in job.values:
            head = rs.shard_header(v)
            if isinstance(v, ShardedObject):
                head["index"] = objects
                objects += 1
            else:
                t = next(tensors)
                name, off = arena.locate(t)
                if (name, off) not in where:
                    n = t.untyped_storage().nbytes()
                    where[(name, off)] = len(regions)
                    regions.append([name, off, n, slots.block_digests(arena.maps[name][off:off + n], h=digest)])
                head.update(region=where[(name, off)], elem_offset=t.storage_offset(), size=list(t.shape),
                            stride=list(t.stride()), dtype=dtype_name(t.dtype), fingerprint=next(prints))
            shards.append(head)
        blob = torch_dumps({"common": job.staged["common"], "objects": job.staged["objects"]})
        # (a region's file too: a zero-size tensor's empty region may lie in a buffer of no bytes)
        keep = sorted({r[0] for r in regions} | {arena.locate_ptr(b.data_ptr()) for b in self._stagers[job.slot].buffers if b.nbytes()})
        files = {n: int(arena.maps[n].numel()) for n in keep}
        header = {"job_id": self.job_id, "owner": self.rank, "world_size": self.world_size, "step": job.step,
                  "slot": job.slot, "incarnation": list(self.incarnation), "files": files, "regions": regions,
                  "shards": shards, "block_hash": digest.name}
        return header, blob, keep

    def _run_save(self, job: _Job, snap: Optional[Snapshot]) -> None:
        """Background: checksums, commit, peer copies, agreement (the tier's group, all ranks)."""
        failure, raw = job.failure, None
        files: Dict[str, torch.Tensor] = {}
        built: Optional[Tuple[Dict[str, Any], bytes, List[str]]] = None
        if not failure.failed:
            with failure.capture():
                if snap is not None:
                    e = snap.wait_copied() or snap.seal_in_writer()
                    if e is not None:
                        snap.seal_in_writer()
                        raise e
                built = self._build_record(job)
        # every record of the step lists what every rank's record holds (a digest of its shards and
        # their fingerprints): a restore notices a copy that is not the one its rank saved
        owner_digests = dist.all_gather_object(rs.content_digest(built[0]["shards"]) if built else None, self._group)
        if not failure.failed and built is not None:
            with failure.capture():
                if None in owner_digests:
                    raise MemoryCheckpointError(f"rank(s) {[r for r, d in enumerate(owner_digests) if d is None]} "
                                                "could not build their snapshot record")
                header, blob, keep = built
                header["owner_digests"] = owner_digests
                raw = slots.encode_record(header, blob)
                slots.write_record(self.root, self.rank, job.slot, raw)
                self._arenas[job.slot].retain(keep)
                files = {n: self._arenas[job.slot].maps[n] for n in keep}
            if failure.failed:
                raw = None
        job.staged = None
        recv_err = self._exchange_copies(job, raw, files)
        if not self._ran:  # this run's first snapshot: what earlier runs took of later steps is another timeline
            self._ran = True  # (dropped before the agreement below: no rank then still scans them)
            with failure.capture():
                self._drop_other_runs(job.step + 1)
        errors = dist.agree_on_errors(failure.message or recv_err, self._group)
        if errors:
            dist.raise_if_any_failed(failure.exc, errors, f"memory snapshot of step {job.step} failed: not every copy "
                                     "of it was committed (the previous complete step stays restorable; latest() offers "
                                     f"step {job.step} only where every rank's own record of it survives)")
        self._protected, self._protected_slot = (job.step, self.incarnation), job.slot
        self.last_complete_step = job.step
        if self._stale:  # a step of this job size is complete: free the snapshots of the larger one
            self._stale = False
            for owner in slots.owners(self.root):
                if owner >= self.world_size:
                    slots.remove_owner(self.root, owner)

    def _exchange_copies(self, job: _Job, raw: Optional[bytes], files: Dict[str, torch.Tensor]) -> Optional[str]:
        sends = {h: Outgoing(raw, files) for h in self.plan.holders[self.rank]}
        sources = list(self.plan.held_by(self.rank))
        for owner in sources:
            slots.invalidate(self.root, owner, job.slot)
        try:
            records, errors = exchange(sends, sources, lambda src, rec: self._held_arena(src, job.slot).ensure(rec.files()),
                                       self._group, lambda s: f"copy of rank {s}'s snapshot")
        except Exception as e:  # noqa: BLE001 - a peer died or timed out
            return f"peer transfer failed: {_describe(e)}"
        problems = [f"copy of rank {s}: {e}" for s, e in errors.items()]
        for owner, rec in records.items():
            if rec is None or owner in errors:
                continue
            try:
                h = rec.header
                if (h["owner"], h["step"], h["slot"], tuple(h["incarnation"])) != (owner, job.step, job.slot,
                                                                                  self.incarnation):
                    raise MemoryCheckpointError(f"received a record of rank {h['owner']} step {h['step']}")
                arena = self._held_arena(owner, job.slot)
                for i, (name, off, n, digests) in enumerate(rec.regions):
                    slots.verify_region(arena.maps[name][off:off + n].numpy(), digests,
                                        f"copy of rank {owner}'s step {job.step}, region {i}", rec.block_hash)
                slots.write_record(self.root, owner, job.slot, rec.raw)
            except Exception as e:  # noqa: BLE001
                problems.append(f"copy of rank {owner}: {_describe(e)}")
        return "; ".join(problems) or None

    def wait(self) -> None:
        """Block until the last snapshot is committed on every rank with all its copies; raise its failure."""
        self._drain()

    def discard_newer(self, step: int) -> None:
        """Collective: drop the snapshots earlier runs of this job took of steps after ``step``, where this run
        goes on from (``0``: afresh): a timeline it left (a rollback, a restart from scratch), which :meth:`latest`
        would offer the next restart. A run's first snapshot drops those after its step too."""
        self._check_open()
        self._drain()
        hi, neg_lo = dist.all_reduce_ints([int(step), -int(step)], "max", self._group)  # (ranks that differ keep
        if hi != -neg_lo:  # different slots, and every later snapshot fails naming another rank's step)
            raise MismatchError(f"memory tier: the ranks of job {self.job_id!r} called discard_newer with different steps (from "
                                f"{-neg_lo} to {hi}; this rank: {int(step)}): pass every rank the step the run goes on from")
        self._drop_other_runs(int(step) + 1)
        dist.barrier(self._group)  # (ranks of a node scan each other's slots: none still sees the dropped)

    def _drop_other_runs(self, lowest: int) -> None:
        for slot in slots.SLOTS:  # (a persist reading one finishes first)
            self._wait_unpinned(slot)
        owners = {self.rank, *self.plan.held_by(self.rank), *(o for o in slots.owners(self.root) if o >= self.world_size)}
        dropped = slots.drop_other_runs(self.root, sorted(owners), self.incarnation, lowest)
        if self._protected is not None and self._protected[1] != self.incarnation and self._protected[0] >= lowest:
            # the slot it held is free; the newest step left (the one a restart goes on from) is protected
            e = max((e for e in slots.scan(self.root, self.job_id) if e.owner == self.rank), default=None,
                    key=lambda e: (e.step, e.slot))
            self._protected, self._protected_slot = (None, None) if e is None else ((e.step, e.incarnation), e.slot)
            self.last_complete_step = None
        if dropped:
            logger.info("memory tier: rank %d dropped the snapshots of step(s) %s an earlier run of job %r took (this "
                        "run left that timeline)", self.rank, sorted({s for _, s in dropped}), self.job_id)

    # -- restore ------------------------------------------------------------------------------
    def latest(self) -> Optional[int]:
        """Collective: the newest step whose every saved byte survives in memory (own node or a peer's copy), or
        ``None``. It may have been saved by a job of another size (a restart on fewer nodes): :meth:`load` reshards."""
        self._check_open()
        self._drain()
        inv = rs.gather_inventory(self.root, self.job_id, self.node, self._group)
        done = rs.complete_any(inv)
        self._worlds = {k[0]: w for k, w in reversed(done)}
        self.latest_started = done[0][0][1][0] / 1e9 if done else None
        return done[0][0][0] if done else None

    def saved_world_size(self, step: int) -> Optional[int]:
        """How many ranks saved ``step`` (as the last :meth:`latest` found it; local)."""
        return self._worlds.get(int(step))

    def load(self, sharded_state_dict: Dict[str, Any], step: int, verify_state: Optional[bool] = None) -> Dict[str, Any]:
        """Collective: restore step ``step`` into ``sharded_state_dict``; returns what ``ci.load`` would.

        Each rank reads its own snapshot from its node's memory, or (node replaced, copy damaged)
        fetches a peer's copy; every byte is verified against the block digests, a copy that fails
        (or is not the snapshot its rank saved: the digest of its shards every rank agreed on) is
        refused and the next one tried. ``verify_state``: as :func:`ckpt_integration.load`'s. Raises
        :class:`MemoryLayoutError` when the request is laid out differently and
        :class:`MemoryCheckpointError` when no intact copy of some rank's snapshot is left. Logs
        (and keeps in :attr:`last_restore`) where this rank's state came from.
        """
        self._check_open()
        self._drain()
        inv = rs.gather_inventory(self.root, self.job_id, self.node, self._group)
        found = rs.step_in_memory(inv, int(step))
        if found is None:
            raise MemoryCheckpointError(f"step {step} is not complete in memory for job {self.job_id!r} "
                                        f"(newest complete: {next((k[0] for k, _ in rs.complete_any(inv)), None)})")
        key, saved_world = found
        if saved_world != self.world_size:
            return elastic.load(self, sharded_state_dict, inv, key, saved_world)
        refused: Set[Tuple[int, str]] = set()
        reasons: List[str] = []
        owners = list(range(self.world_size))
        result: Any = None
        source = ""
        while True:
            got, err, missing, chosen = rs.fetch(inv, key, self.root, self._group, refused, owners)
            if missing:
                raise MemoryCheckpointError(
                    f"no intact copy in memory of step {step} for rank(s) {missing}; refused: "
                    + ("; ".join(sorted(set(reasons))) or "none") + ". Load the durable checkpoint instead")
            layout = False
            if self.rank in owners and err is None:
                if got.source == "own memory":  # in the process that took it: read its own mappings of the files
                    rs.use_own_mappings(got, self._arenas)
                try:
                    result = rs.fill_request(sharded_state_dict, got, f"memory snapshot of rank {self.rank} step {step} "
                                             f"({got.source})", self.trusted, self.allowed_globals, rank=self.rank,
                                             verify_state=default_verify_state() if verify_state is None else verify_state)
                    source = got.source
                except MemoryLayoutError as e:
                    err, layout = str(e), True
                except Exception as e:  # noqa: BLE001 - this copy is refused, another one is tried
                    err = _describe(e)
            mine = (err, chosen.get(self.rank, ("", -1)), layout) if self.rank in owners else (None, ("", -1), False)
            outcomes = dist.all_gather_object(mine, self._group)
            if any(o[2] for o in outcomes):  # another layout of the same job size: resharded
                return elastic.load(self, sharded_state_dict, inv, key, self.world_size)
            failed = [r for r, o in enumerate(outcomes) if o[0]]
            for r in failed:
                node, server = outcomes[r][1]
                where = "own memory" if server == r else f"peer rank {server}"
                reasons.append(f"rank {r}'s copy in {where} (node {node[:8]}): {outcomes[r][0]}")
                refused.add((r, node))
                if r == self.rank:
                    logger.warning("memory tier: rank %d refused its copy of step %d in %s: %s", r, step, where,
                                   outcomes[r][0])
            if not failed:
                break
            owners = failed
        self._protected, self._protected_slot = key, self._slot_of_key(inv, key)  # (kept until this run's own)
        mine_refused = [x for x in reasons if x.startswith(f"rank {self.rank}'s ")]
        self.last_restore = RestoreReport(int(step), source, mine_refused, bool(got is not None and got.warm))
        logger.info("memory tier: rank %d restored step %d of job %r from %s", self.rank, step, self.job_id, source)
        return result

    # -- durable tier -------------------------------------------------------------------------
    def persist(self, step: int, checkpoint_dir: Union[str, os.PathLike], **save_kwargs: object) -> AsyncRequest:
        """Collective: write step ``step`` from memory as an ordinary durable checkpoint, in the background.

        The snapshot's bytes are written as they are, each block verified first; the checkpoint loads and
        reshards like any other. ``save_kwargs`` go to the save (``thread_count``, ``durable``, ``overwrite``,
        ``sharded_strategy``; ``balance`` defaults to ``False``: main replicas write; ``step`` to ``step``).
        Returns a request: ``.wait()`` blocks and raises a failure (on every rank); the slot stays pinned."""
        self._check_open()
        self._drain()
        inv = rs.gather_inventory(self.root, self.job_id, self.node, self._group)
        key = rs.key_for_step(inv, self.world_size, int(step))
        if key is None:
            other = rs.step_in_memory(inv, int(step))  # (saved by another job size?)
            raise MemoryCheckpointError(f"cannot persist step {step}: " + ("it is not complete in memory" if other is None
                                        else f"it was saved by {other[1]} rank(s); persist takes steps of this job size"))
        slot = self._slot_of_key(inv, key)
        with self._pin_cv:
            self._pinned[slot] = self._pinned.get(slot, 0) + 1
        path = storage_for(checkpoint_dir)[1]  # (absolute: the persist runs in the background, maybe after a chdir)
        save_kwargs = save_options(save_kwargs, f"persist of step {step} to {path}")
        save_kwargs["base"] = save_base(save_kwargs.get("base"), path)  # ("auto": the newest beside it, as save's)
        held: List[AsyncRequest] = []

        def stop() -> None:  # the write's check before each item: abandon() stops it (nothing is committed)
            held[0]._check_cancelled(path, self.rank)

        req = AsyncRequest(self._run_persist, (inv, key, path, slot, save_kwargs, stop), description=f"persist step {step} to {path}")
        req._cancellable = True
        held.append(req)
        self._persist_queue.schedule_async_request(req)
        return req

    def abandon(self, reason: str, wait_s: float = 2.0) -> bool:
        """Stop the snapshot and the persists in flight (a preemption's grace period is over): a
        persist's write stops before its next item and nothing is committed, a snapshot in flight
        fails (the previous complete step stays). Local; every rank calls it. Returns ``True`` if
        everything ended within ``wait_s``."""
        ok = self._persist_queue.abandon(reason, wait_s)
        return self._queue.abandon(reason, wait_s) and ok

    def _run_persist(self, inv: rs.Inventory, key: rs.Key, checkpoint_dir: str, slot: int, kw: Dict[str, Any],
                     stop: Optional[Any] = None) -> None:
        try:
            if stop is not None:
                stop()
            got, err, missing, _ = rs.fetch(inv, key, self.root, self._persist_group)
            values: List[Any] = []
            common: Any = None
            if err is None and not missing:
                try:
                    rs.verify_all(got, f"memory snapshot of rank {self.rank} step {key[0]} ({got.source})")
                    values, common = rs.as_sharded(got, self.trusted, self.allowed_globals)
                except Exception as e:  # noqa: BLE001
                    err = _describe(e)
            errors = dist.agree_on_errors(err or (f"no copy of rank(s) {missing}" if missing else None),
                                          self._persist_group)
            dist.raise_if_any_failed(None, errors, f"persisting memory step {key[0]} to {checkpoint_dir} failed")
            # the snapshot's step, recorded as a save records it (the commit order and "last" read it;
            # the plan is made before the snapshot's common state is attached below, so it cannot
            # be found there)
            kw = {"balance": False, "step": key[0], **kw}
            plan = prepare_save({"shards": values}, checkpoint_dir, process_group=self._persist_group, **kw)
            plan.stop = stop
            if plan.rank == 0:
                plan.common = common  # the snapshot's common state, exactly as a save of the original writes it
            write_local(plan)
            finalize_save(plan)
        finally:
            with self._pin_cv:
                self._pinned[slot] -= 1
                self._pin_cv.notify_all()

    # -- teardown -----------------------------------------------------------------------------
    def close(self, remove: bool = False) -> None:
        """Wait for snapshots and persists in flight (raising a failure), stop the workers.
        ``remove=True`` (collective: the job is over) deletes this job's snapshots on every node."""
        if self._closed:
            return
        first: Optional[BaseException] = None
        for q in (self._queue, self._persist_queue):
            try:
                q.close()
            except BaseException as e:  # noqa: BLE001
                first = first or e
        self._closed = True
        for a in list(self._arenas) + list(self._held.values()):
            a.close()
        self._stagers = []
        if remove:
            dist.barrier(self._group)  # nobody reads a copy any more
            for owner in (self.rank, *self.plan.held_by(self.rank)):
                slots.remove_owner(self.root, owner)
            self._lock.release(remove=True)
            dist.barrier(self._group)
            slots.remove_job(self.root)
        self._lock.release()
        self._destroy_groups()
        if first is not None:
            raise first

    def _destroy_groups(self) -> None:
        """Shut this tier's own gloo groups down now (their queues are closed): left to interpreter teardown, a
        group whose worker still holds a finished operation's tensors aborts the process when it needs the GIL."""
        for g in filter(None, (self._group, self._persist_group)):  # (a use after close() then fails loudly)
            g.close("the memory tier was closed")

    def __enter__(self) -> "MemoryCheckpoints":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], *rest: object) -> None:
        self.close()
