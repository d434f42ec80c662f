"""Collectives that also work without ``torch.distributed`` (a single process).

Every save/load exchanges only small metadata (compact records, error messages); tensors never go
through these helpers. All of them move **bytes** (objects are pickled here) so that each call knows
exactly what it carries: :data:`traffic` counts the bytes this process sent and received through
them, which tests read to check that the metadata traffic per rank does not grow with the world size.

Counting rule (what lands on this rank from others, as the tensors the backend moves): an all-gather
delivers every other rank's padded buffer plus its size; an all-to-all the messages addressed here
plus one 4-byte size per rank; a gather only to its destination; a broadcast the size and payload to
every other rank; an all-reduce its vector once.

``src``/``dst`` arguments are global ranks, as in ``torch.distributed``.

``group`` is ``None`` (the world), a ``torch.distributed`` group, or a :class:`PrivateGroup`: a gloo
group of this library's own, built directly on the default store and kept out of
``torch.distributed``'s registry, so that ``destroy_process_group()`` does not tear it down under a
save still running in the background (async saves finalize on one; see :func:`new_private_group`).
"""

from __future__ import annotations

import ctypes
import functools
import datetime
import hashlib
import logging
import os
import pickle
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions, AllToAllOptions, BroadcastOptions, GatherOptions

from .objects import dumps

from ..errors import CheckpointingException, DistributedCheckpointingError, PeerLostError
from .settle import python_refs, settle  # (re-exported: every collective helper here calls them)

logger = logging.getLogger(__name__)


class GroupClosedError(RuntimeError):
    """A collective was attempted on a :class:`PrivateGroup` that was closed or aborted."""


class PrivateGroup:
    """A gloo process group owned by this library, outside ``torch.distributed``'s registry.

    ``destroy_process_group()`` shuts down every registered group (``new_group``'s too): an async
    save whose commit still has to talk to the other ranks would be lost although every rank is
    alive. This group lives until :meth:`close` (its owner's, or the library's exit handler's,
    before the interpreter tears down), whatever the caller does with its own groups.

    ``ranks``: the members' global ranks in group order; ``rank``: this process's group rank;
    ``global_rank``: its global rank (kept: ``torch.distributed`` cannot answer once the default
    group is destroyed).
    """

    def __init__(self, pg: dist.ProcessGroup, ranks: Sequence[int], global_rank: int):
        self.pg: Any = pg
        self.ranks = list(ranks)
        self.global_rank = int(global_rank)
        self.rank = self.ranks.index(self.global_rank)
        self.reason = ""  # why it was closed (named by GroupClosedError)

    def size(self) -> int:
        return len(self.ranks)

    def group_rank(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)

    @property
    def closed(self) -> bool:
        return self.pg is None

    def backend(self) -> Any:
        if self.pg is None:
            raise GroupClosedError(f"the library's private process group was closed ({self.reason or 'close()'})")
        return self.pg

    def abort(self, reason: str) -> None:
        """Make collectives that are waiting on this group fail now (used at exit after a deadline)."""
        pg = self.pg
        if pg is not None:
            self.reason = reason
            try:
                pg.abort()
            except Exception as e:  # noqa: BLE001 - best effort; close() follows
                logger.debug("aborting the private process group failed: %s", e)

    def close(self, reason: str = "closed") -> None:
        pg, self.pg = self.pg, None
        if pg is None:
            return
        self.reason = reason
        _private_groups.discard(self)
        try:
            pg.shutdown()
        except Exception as e:  # noqa: BLE001 - best effort: the group is dropped either way
            logger.debug("shutting down the private process group failed: %s", e)

    def __repr__(self) -> str:
        return f"PrivateGroup(ranks={self.ranks}, rank={self.rank}, {'closed' if self.closed else 'open'})"


_private_groups: "weakref.WeakSet[PrivateGroup]" = weakref.WeakSet()


def _default_timeout() -> datetime.timedelta:
    try:
        from torch.distributed.distributed_c10d import _get_default_group

        t = _get_default_group().options._timeout  # type: ignore[attr-defined]
        if isinstance(t, datetime.timedelta):
            return t
    except Exception:  # noqa: BLE001 - older torch: the documented default
        pass
    return dist.default_pg_timeout


#: A process group as the library's collectives take it: torch's (``None``: the default group, or no
#: group at all when ``torch.distributed`` is not initialized) or the library's own.
Group = Optional[Union[dist.ProcessGroup, PrivateGroup]]


def new_private_group(process_group: Group = None, timeout: Optional[datetime.timedelta] = None) -> Optional[PrivateGroup]:
    """A :class:`PrivateGroup` with the members of ``process_group`` (collective over its members).

    Built on the default group's store, under a name no other such group takes: the members'
    ranks and how many groups of these members were made before (a counter in the store, which
    every member increments once). Nothing is sent over ``process_group`` itself, which may
    carry no host tensors (NCCL). ``None`` without ``torch.distributed`` (nothing to talk to).
    """
    if not is_distributed():
        return None
    ranks = list(range(dist.get_world_size())) if process_group is None else list(dist.get_process_group_ranks(process_group))
    me = dist.get_rank()
    from torch.distributed.distributed_c10d import _get_default_store

    base = _get_default_store()
    members = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:20]
    # every member adds 1 per group, in the same program order: group n of these members is named n
    made = (base.add(f"ckpt_integration/private/{members}/joined", 1) - 1) // len(ranks)
    store = dist.PrefixStore(f"ckpt_integration/private/{members}/{made}", base)
    pg = dist.ProcessGroupGloo(store, ranks.index(me), len(ranks), timeout or _default_timeout())
    group = PrivateGroup(pg, ranks, me)
    _private_groups.add(group)
    return group


_host_groups: "weakref.WeakKeyDictionary[Any, PrivateGroup]" = weakref.WeakKeyDictionary()


def takes_host_tensors(group: Group = None) -> bool:
    """Whether ``group``'s backend moves tensors in host memory: gloo does, NCCL does not (its
    groups take CUDA tensors only, and refuse others with "No backend type associated with
    device type cpu"); a ``"cpu:gloo,cuda:nccl"`` group does."""
    if isinstance(group, PrivateGroup) or not is_distributed():
        return True
    pg = group if group is not None else dist.group.WORLD
    types = getattr(pg, "_device_types", None)  # (torch >= 2.2; the backend's name otherwise)
    if types is not None:
        return any(t.type == "cpu" for t in types)
    return "nccl" not in str(dist.get_backend(pg)).lower()


def host_group(group: Group = None) -> Group:
    """``group`` itself when :func:`takes_host_tensors`, else a :class:`PrivateGroup` of its members
    in its order (gloo), made the first time (collective over them) and kept while ``group`` lives:
    what a load sends of the host memory it read, on a job's NCCL group."""
    if takes_host_tensors(group):
        return group
    pg = group if group is not None else dist.group.WORLD
    private = _host_groups.get(pg)
    if private is None or private.closed:
        private = new_private_group(group)
        _host_groups[pg] = private
        weakref.finalize(pg, private.close, "its process group is gone")
    return private


def global_rank(group: Group, r: int) -> int:
    """The global rank of ``group``'s rank ``r`` (either kind of group; ``None``: the world)."""
    if isinstance(group, PrivateGroup):
        return group.ranks[r]
    return dist.get_global_rank(group, r) if group is not None and is_distributed() else r


def isend(t: torch.Tensor, dst: int, group: Group, tag: int = 0) -> "Posted":
    """Post a send of ``t`` to group rank ``dst`` (either kind of group)."""
    if isinstance(group, PrivateGroup):
        return Posted(group.backend().send([t], dst, tag))
    return Posted(dist.isend(t, dst=global_rank(group, dst), group=group, tag=tag))


def irecv(t: torch.Tensor, src: int, group: Group, tag: int = 0) -> "Posted":
    """Post a receive into ``t`` from group rank ``src`` (either kind of group)."""
    if isinstance(group, PrivateGroup):
        return Posted(group.backend().recv([t], src, tag))
    return Posted(dist.irecv(t, src=global_rank(group, src), group=group, tag=tag))


class Posted(NamedTuple):
    """A posted send or receive: :meth:`wait` raises :class:`PeerLostError` when the peer is lost."""
    work: Any

    def wait(self) -> Any:
        return _peers(self.work.wait)()


def close_private_groups(reason: str = "exit") -> None:
    """Close every open :class:`PrivateGroup` of this process (the exit handler's last step)."""
    for g in list(_private_groups):
        g.close(reason)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Group = None) -> int:
    if isinstance(group, PrivateGroup):
        return group.rank
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: Group = None) -> int:
    if isinstance(group, PrivateGroup):
        return group.size()
    return dist.get_world_size(group) if is_distributed() else 1


def local_world_size() -> Optional[int]:
    """The ranks on this node as torchrun says (``LOCAL_WORLD_SIZE``), or None when it is unset or
    not a positive integer (every reader of the variable parses it here, the same way)."""
    v = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(v) if v.isdigit() and int(v) > 0 else None


def own_global_rank(group: Group) -> int:
    """This process's global rank (a private group remembers it: the world may be destroyed)."""
    if isinstance(group, PrivateGroup):
        return group.global_rank
    return dist.get_rank() if is_distributed() else 0


def _group_rank(group: Group, global_rank: int) -> int:
    if isinstance(group, PrivateGroup):
        return group.group_rank(global_rank)
    return dist.get_group_rank(group, global_rank) if group is not None else global_rank


def _local(group: Group) -> bool:
    """No peers to talk to: not initialised, or a group of one (every helper then returns at once)."""
    if isinstance(group, PrivateGroup):
        group.backend()  # a closed group raises GroupClosedError instead of acting alone
        return group.size() == 1
    return not is_distributed() or get_world_size(group) == 1


# --------------------------------------------------------------------------- raw collectives
# The helpers below call these, which take group ranks and run on either kind of group.
def _peers(fn: Any) -> Any:
    """A collective that fails in the backend (a peer was killed, exited or cannot be reached: gloo's
    "Connection reset by peer", a timeout) raises a :class:`PeerLostError` saying so."""
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if isinstance(e, (CheckpointingException, GroupClosedError)):
                raise
            raise PeerLostError(
                f"rank {dist.get_rank() if is_distributed() else 0}: a collective of the checkpoint with the other ranks "
                f"failed: one of them exited, was killed or cannot be reached (its log says why): "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    return functools.wraps(fn)(run)


@_peers
def _c_all_gather(outs: List[torch.Tensor], t: torch.Tensor, group: Group) -> None:
    before = python_refs([t, *outs])
    if isinstance(group, PrivateGroup):
        group.backend().allgather([outs], [t]).wait()
    else:
        dist.all_gather(outs, t, group=group)
    settle([t, *outs], before)


@_peers
def _c_all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: Optional[List[int]], in_splits: Optional[List[int]],
                  group: Group) -> None:
    before = python_refs([out, inp])
    if isinstance(group, PrivateGroup):
        group.backend().alltoall_base(out, inp, out_splits or [], in_splits or [], AllToAllOptions()).wait()
    else:
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    settle([out, inp], before)


@_peers
def _c_gather(t: torch.Tensor, outs: Optional[List[torch.Tensor]], dst: int, group: Group) -> None:
    before = python_refs([t, *(outs or [])])
    if isinstance(group, PrivateGroup):
        opts = GatherOptions()
        opts.rootRank = group.group_rank(dst)
        group.backend().gather([outs] if outs is not None else [], [t], opts).wait()
    else:
        dist.gather(t, outs, dst=dst, group=group)
    settle([t, *(outs or [])], before)


@_peers
def _c_broadcast(t: torch.Tensor, src: int, group: Group) -> None:
    before = python_refs([t])
    if isinstance(group, PrivateGroup):
        opts = BroadcastOptions()
        opts.rootRank = group.group_rank(src)
        opts.rootTensor = 0
        group.backend().broadcast([t], opts).wait()
    else:
        dist.broadcast(t, src=src, group=group)
    settle([t], before)


@_peers
def _c_all_reduce(t: torch.Tensor, op: str, group: Group) -> None:
    before = python_refs([t])
    reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    if isinstance(group, PrivateGroup):
        opts = AllreduceOptions()
        opts.reduceOp = reduce_op
        group.backend().allreduce([t], opts).wait()
    else:
        dist.all_reduce(t, op=reduce_op, group=group)
    settle([t], before)


def broadcast_tensor(t: torch.Tensor, src: int, group: Group = None) -> None:
    """``t`` of global rank ``src`` into ``t`` on every rank (a shared read's bytes: not counted)."""
    _c_broadcast(t, src, group)


# --------------------------------------------------------------------------- traffic counters
@dataclass
class Traffic:
    """Bytes this process sent/received through the helpers below (see the module docstring)."""

    sent: int = 0
    received: int = 0
    calls: Dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, sent: int, received: int) -> None:
        with self.lock:
            self.sent += sent
            self.received += received
            self.calls[name] = self.calls.get(name, 0) + 1

    def reset(self) -> None:
        with self.lock:
            self.sent = self.received = 0
            self.calls = {}

    def snapshot(self) -> Dict[str, Any]:
        with self.lock:
            return {"sent": self.sent, "received": self.received, "calls": dict(self.calls)}


traffic = Traffic()


# --------------------------------------------------------------------------- byte collectives
def buffer_device(group: Group) -> torch.device:
    """Where the buffers of a collective or a transfer over ``group`` live: host memory unless the
    group takes CUDA tensors only (NCCL, :func:`takes_host_tensors`)."""
    if takes_host_tensors(group) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _to_tensor(payload: bytes, size: int, device: torch.device) -> torch.Tensor:
    t = torch.zeros(size, dtype=torch.uint8)
    if payload:
        t[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return t.to(device)


def _to_bytes(t: torch.Tensor, n: int) -> bytes:
    if n == 0:
        return b""
    t = t[:n].contiguous().cpu()
    return ctypes.string_at(t.data_ptr(), n)


def _ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def all_gather_bytes(payload: bytes, group: Group = None) -> List[bytes]:
    """Every rank's ``payload``, in group-rank order."""
    if _local(group):
        return [payload]
    world, me, dev = get_world_size(group), get_rank(group), buffer_device(group)
    sizes_t = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    _c_all_gather(sizes_t, _ints([len(payload)], dev), group)
    sizes = [int(t.item()) for t in sizes_t]
    longest = max(sizes)
    outs = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(world)]
    _c_all_gather(outs, _to_tensor(payload, longest, dev), group)
    traffic.add("all_gather", (world - 1) * (8 + longest), (world - 1) * (8 + longest))
    return [payload if r == me else _to_bytes(outs[r], sizes[r]) for r in range(world)]


def all_to_all_bytes(messages: Dict[int, bytes], group: Group = None) -> Dict[int, bytes]:
    """Send ``messages[d]`` to group rank ``d``; returns ``{src: message}`` of the non-empty ones received.

    Two ``all_to_all_single`` calls (sizes, then one byte tensor), supported by gloo
    with uneven splits; each rank receives only what is addressed to it.
    """
    me = get_rank(group)
    if _local(group):
        own = messages.get(me, b"")
        return {me: own} if own else {}
    world, dev = get_world_size(group), buffer_device(group)
    send_sizes = [len(messages.get(d, b"")) for d in range(world)]
    if max(send_sizes) >= 1 << 31:
        raise ValueError("all_to_all_bytes: a message of 2 GiB or more")
    # int32 sizes: this vector is the only part of the exchange that grows with the group
    recv_t = torch.empty(world, dtype=torch.int32, device=dev)
    _c_all_to_all(recv_t, torch.tensor(send_sizes, dtype=torch.int32, device=dev), None, None, group)
    recv_sizes = recv_t.cpu().tolist()
    blob = b"".join(messages.get(d, b"") for d in range(world))
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=dev)
    _c_all_to_all(out, _to_tensor(blob, len(blob), dev), recv_sizes, send_sizes, group)
    out = out.cpu()
    result: Dict[int, bytes] = {}
    pos = 0
    for src, n in enumerate(recv_sizes):
        if n:
            result[src] = _to_bytes(out[pos:], n)
        pos += n
    traffic.add(
        "all_to_all",
        4 * (world - 1) + sum(send_sizes) - send_sizes[me],
        4 * (world - 1) + sum(recv_sizes) - recv_sizes[me],
    )
    return result


def gather_bytes(payload: bytes, dst: int = 0, group: Group = None) -> Optional[List[bytes]]:
    """Every rank's ``payload`` at global rank ``dst`` (``None`` elsewhere); exact sizes, no padding."""
    if _local(group):
        return [payload]
    world, dev = get_world_size(group), buffer_device(group)
    at_dst = own_global_rank(group) == dst
    dst_group_rank = _group_rank(group, dst)
    size_t = _ints([len(payload)], dev)
    sizes_t = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)] if at_dst else None
    _c_gather(size_t, sizes_t, dst, group)
    recv_sizes = [int(t.item()) for t in sizes_t] if at_dst else [0] * world
    send_sizes = [0] * world
    send_sizes[dst_group_rank] = len(payload)
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=dev)
    _c_all_to_all(out, _to_tensor(payload, len(payload), dev), recv_sizes, send_sizes, group)
    if not at_dst:
        traffic.add("gather", 8 + len(payload), 0)
        return None
    out = out.cpu()
    result, pos = [], 0
    for n in recv_sizes:
        result.append(_to_bytes(out[pos:], n))
        pos += n
    traffic.add("gather", 0, 8 * (world - 1) + sum(recv_sizes) - len(payload))
    return result


def broadcast_bytes(payload: Optional[bytes], src: int = 0, group: Group = None) -> bytes:
    """``payload`` of global rank ``src`` on every rank."""
    if _local(group):
        return payload or b""
    dev = buffer_device(group)
    at_src = own_global_rank(group) == src
    n_t = _ints([len(payload or b"") if at_src else 0], dev)
    _c_broadcast(n_t, src, group)
    n = int(n_t.item())
    buf = _to_tensor(payload if at_src else b"", n, dev)
    _c_broadcast(buf, src, group)
    if at_src:
        traffic.add("broadcast", 8 + n, 0)
        return payload or b""
    traffic.add("broadcast", 0, 8 + n)
    return _to_bytes(buf, n)


def all_reduce_ints(values: Sequence[int], op: str = "max", group: Group = None) -> List[int]:
    """Element-wise ``max`` or ``sum`` of an int64 vector over the group (one small collective)."""
    if _local(group):
        return list(values)
    dev = buffer_device(group)
    t = _ints(values, dev)
    _c_all_reduce(t, op, group)
    traffic.add("all_reduce", 8 * len(values), 8 * len(values))
    return t.cpu().tolist()


def any_of_bits(bits: bytes, group: Group = None) -> bytes:
    """Bitwise OR of equally long byte strings over the group (a max all-reduce of bytes)."""
    if _local(group) or not bits:
        return bits
    dev = buffer_device(group)
    t = _to_tensor(bits, len(bits), dev)
    _c_all_reduce(t, "max", group)
    traffic.add("all_reduce", len(bits), len(bits))
    return _to_bytes(t, len(bits))


# --------------------------------------------------------------------------- objects (pickled)
def all_gather_object(obj: object, group: Group = None) -> List[Any]:
    if _local(group):
        return [obj]
    return [pickle.loads(b) for b in all_gather_bytes(dumps(obj), group)]


def gather_object(obj: object, dst: int = 0, group: Group = None) -> Optional[List[Any]]:
    """Gather to global rank ``dst``; returns the list there and ``None`` elsewhere."""
    if _local(group):
        return [obj]
    out = gather_bytes(dumps(obj), dst, group)
    return None if out is None else [pickle.loads(b) for b in out]


def broadcast_object(obj: object, src: int = 0, group: Group = None) -> Any:
    if _local(group):
        return obj
    data = broadcast_bytes(dumps(obj) if own_global_rank(group) == src else None, src, group)
    return pickle.loads(data)


@_peers
def barrier(group: Group = None) -> None:
    if _local(group):
        return
    if isinstance(group, PrivateGroup):
        group.backend().barrier().wait()
    else:
        dist.barrier(group=group)


def coordinator_rank(group: Group = None) -> int:
    """Global rank of the group's first member (writes shared files)."""
    return global_rank(group, 0)


def describe_error(e: BaseException) -> str:
    """One line for a rank's failure as the other ranks see it: type and message, and for
    errors that are not ours (bugs, OS errors) where it was raised."""
    if isinstance(e, CheckpointingException):
        return f"{type(e).__name__}: {e}"
    import traceback

    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


def agree_on_errors(local_error: Optional[str], group: Group = None) -> List[str]:
    """Every rank learns every rank's error message (``rank N: ...``): one 8-byte all-reduce when
    nothing failed; the messages are gathered only when some rank has one (O(world) bytes then)."""
    if _local(group):
        return [f"rank {own_global_rank(group)}: {local_error}"] if local_error else []
    if not all_reduce_ints([1 if local_error else 0], "max", group)[0]:
        return []
    errors = all_gather_object(local_error, group)
    return rank_errors(enumerate(errors), group)


def rank_errors(messages: Iterable[Tuple[int, Optional[str]]], group: Group = None) -> List[str]:
    """``rank N: message`` for each ``(group rank, message)`` with a message; N the global rank, as
    every message names ranks (a group's [0, 2] called global rank 2 "rank 1")."""
    return [f"rank {global_rank(group, r)}: {m}" for r, m in messages if m]


def raise_if_any_failed(local_exc: Optional[BaseException], errors: List[str], context: str) -> None:
    """Raise on every rank when any rank failed: a rank that failed itself re-raises its own
    exception (specific type, the other ranks' errors attached as a note); healthy ranks raise
    :class:`DistributedCheckpointingError` listing the causes."""
    if not errors and local_exc is None:
        return
    if local_exc is not None:
        if hasattr(local_exc, "add_note"):
            me = f"rank {own_global_rank(None)}: " if is_distributed() else ""
            others = "; failing ranks:\n  " + "\n  ".join(errors) if len(errors) > 1 else ""
            local_exc.add_note(me + context + others)
        raise local_exc
    raise DistributedCheckpointingError(f"{context}:\n  " + "\n  ".join(errors))
