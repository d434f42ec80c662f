"""Collectives that also work without ``torch.distributed`` (a single process).

Every save/load exchanges only small metadata (compact records, error messages);
tensors never go through these helpers. All of them move **bytes** (objects are
pickled here) so that each call knows exactly what it carries: :data:`traffic`
counts the bytes this process sent and received through them, which tests read to
check that the metadata traffic per rank does not grow with the world size.

Counting rule (what lands on this rank from others, as the tensors the backend
moves): an all-gather delivers every other rank's padded buffer plus its size; an
all-to-all the messages addressed here plus one 4-byte size per rank; a gather only
to its destination; a broadcast the size and payload to every other rank; an
all-reduce its vector once.

``src``/``dst`` arguments are global ranks, as in ``torch.distributed``.
"""

from __future__ import annotations

import ctypes
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Optional[Any] = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: Optional[Any] = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def _local(group: Optional[Any]) -> bool:
    """No peers to talk to: not initialised, or a group of one (every helper then returns at once)."""
    return not is_distributed() or get_world_size(group) == 1


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
def _device(group: Optional[Any]) -> torch.device:
    """Where the buffers of a collective live: host memory unless the backend only takes CUDA tensors."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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


def all_gather_bytes(payload: bytes, group: Optional[Any] = None) -> List[bytes]:
    """Every rank's ``payload``, in group-rank order."""
    if _local(group):
        return [payload]
    world, me, dev = get_world_size(group), get_rank(group), _device(group)
    sizes_t = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes_t, _ints([len(payload)], dev), group=group)
    sizes = [int(t.item()) for t in sizes_t]
    longest = max(sizes)
    outs = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(outs, _to_tensor(payload, longest, dev), group=group)
    traffic.add("all_gather", (world - 1) * (8 + longest), (world - 1) * (8 + longest))
    return [payload if r == me else _to_bytes(outs[r], sizes[r]) for r in range(world)]


def all_to_all_bytes(messages: Dict[int, bytes], group: Optional[Any] = None) -> Dict[int, bytes]:
    """Send ``messages[d]`` to group rank ``d``; returns ``{src: message}`` of the non-empty ones received.

    Two ``all_to_all_single`` calls (sizes, then one byte tensor), supported by gloo
    with uneven splits; each rank receives only what is addressed to it.
    """
    me = get_rank(group)
    if _local(group):
        own = messages.get(me, b"")
        return {me: own} if own else {}
    world, dev = get_world_size(group), _device(group)
    send_sizes = [len(messages.get(d, b"")) for d in range(world)]
    if max(send_sizes) >= 1 << 31:
        raise ValueError("all_to_all_bytes: a message of 2 GiB or more")
    # int32 sizes: this vector is the only part of the exchange that grows with the group
    recv_t = torch.empty(world, dtype=torch.int32, device=dev)
    dist.all_to_all_single(recv_t, torch.tensor(send_sizes, dtype=torch.int32, device=dev), group=group)
    recv_sizes = recv_t.cpu().tolist()
    blob = b"".join(messages.get(d, b"") for d in range(world))
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=dev)
    dist.all_to_all_single(out, _to_tensor(blob, len(blob), dev), recv_sizes, send_sizes, group=group)
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


def gather_bytes(payload: bytes, dst: int = 0, group: Optional[Any] = None) -> Optional[List[bytes]]:
    """Every rank's ``payload`` at global rank ``dst`` (``None`` elsewhere); exact sizes, no padding."""
    if _local(group):
        return [payload]
    world, dev = get_world_size(group), _device(group)
    at_dst = dist.get_rank() == dst
    dst_group_rank = dist.get_group_rank(group, dst) if group is not None else dst
    size_t = _ints([len(payload)], dev)
    sizes_t = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)] if at_dst else None
    dist.gather(size_t, sizes_t, dst=dst, group=group)
    recv_sizes = [int(t.item()) for t in sizes_t] if at_dst else [0] * world
    send_sizes = [0] * world
    send_sizes[dst_group_rank] = len(payload)
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=dev)
    dist.all_to_all_single(out, _to_tensor(payload, len(payload), dev), recv_sizes, send_sizes, group=group)
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


def broadcast_bytes(payload: Optional[bytes], src: int = 0, group: Optional[Any] = None) -> bytes:
    """``payload`` of global rank ``src`` on every rank."""
    if _local(group):
        return payload or b""
    dev = _device(group)
    at_src = dist.get_rank() == src
    n_t = _ints([len(payload or b"") if at_src else 0], dev)
    dist.broadcast(n_t, src=src, group=group)
    n = int(n_t.item())
    buf = _to_tensor(payload if at_src else b"", n, dev)
    dist.broadcast(buf, src=src, group=group)
    if at_src:
        traffic.add("broadcast", 8 + n, 0)
        return payload or b""
    traffic.add("broadcast", 0, 8 + n)
    return _to_bytes(buf, n)


def all_reduce_ints(values: Sequence[int], op: str = "max", group: Optional[Any] = None) -> List[int]:
    """Element-wise ``max`` or ``sum`` of an int64 vector over the group (one small collective)."""
    if _local(group):
        return list(values)
    dev = _device(group)
    t = _ints(values, dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    traffic.add("all_reduce", 8 * len(values), 8 * len(values))
    return t.cpu().tolist()


def any_of_bits(bits: bytes, group: Optional[Any] = None) -> bytes:
    """Bitwise OR of equally long byte strings over the group (a max all-reduce of bytes)."""
    if _local(group) or not bits:
        return bits
    dev = _device(group)
    t = _to_tensor(bits, len(bits), dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    traffic.add("all_reduce", len(bits), len(bits))
    return _to_bytes(t, len(bits))


# --------------------------------------------------------------------------- objects (pickled)
def all_gather_object(obj: Any, group: Optional[Any] = None) -> List[Any]:
    if _local(group):
        return [obj]
    return [pickle.loads(b) for b in all_gather_bytes(pickle.dumps(obj), group)]


def gather_object(obj: Any, dst: int = 0, group: Optional[Any] = None) -> Optional[List[Any]]:
    """Gather to global rank ``dst``; returns the list there and ``None`` elsewhere."""
    if _local(group):
        return [obj]
    out = gather_bytes(pickle.dumps(obj), dst, group)
    return None if out is None else [pickle.loads(b) for b in out]


def broadcast_object(obj: Any, src: int = 0, group: Optional[Any] = None) -> Any:
    if _local(group):
        return obj
    data = broadcast_bytes(pickle.dumps(obj) if dist.get_rank() == src else None, src, group)
    return pickle.loads(data)


def barrier(group: Optional[Any] = None) -> None:
    if is_distributed() and get_world_size(group) > 1:
        dist.barrier(group=group)


def coordinator_rank(group: Optional[Any] = None) -> int:
    """Global rank of the group's first member (writes shared files)."""
    if not is_distributed():
        return 0
    if group is None:
        return 0
    return dist.get_global_rank(group, 0)


def describe_error(e: BaseException) -> str:
    """One line for a rank's failure as the other ranks see it: type and message, and for
    errors that are not ours (bugs, OS errors) where it was raised."""
    from ..errors import CheckpointingException

    if isinstance(e, CheckpointingException):
        return f"{type(e).__name__}: {e}"
    import traceback

    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


def agree_on_errors(local_error: Optional[str], group: Optional[Any] = None) -> List[str]:
    """Every rank learns every rank's error message (``rank N: ...``).

    One 8-byte all-reduce when nothing failed; the messages are gathered only when
    some rank has one (a failure path, where O(world) bytes are acceptable).
    """
    if _local(group):
        return [f"rank {get_rank(group)}: {local_error}"] if local_error else []
    if not all_reduce_ints([1 if local_error else 0], "max", group)[0]:
        return []
    errors = all_gather_object(local_error, group)
    return [f"rank {r}: {e}" for r, e in enumerate(errors) if e]


def raise_if_any_failed(local_exc: Optional[BaseException], errors: List[str], context: str) -> None:
    """Raise on every rank when any rank failed.

    A rank that failed itself re-raises its own exception (specific type, with
    the other ranks' errors attached as a note); healthy ranks raise
    :class:`DistributedCheckpointingError` listing the causes.
    """
    if not errors and local_exc is None:
        return
    from ..errors import DistributedCheckpointingError

    if local_exc is not None:
        if hasattr(local_exc, "add_note"):
            from torch.distributed import get_rank

            me = f"rank {get_rank()}: " if is_distributed() else ""
            others = "; failing ranks:\n  " + "\n  ".join(errors) if len(errors) > 1 else ""
            local_exc.add_note(me + context + others)
        raise local_exc
    raise DistributedCheckpointingError(f"{context}:\n  " + "\n  ".join(errors))
