"""Host staging of state dicts for async save (capability 7).

:class:`StateDictStager` copies every tensor of a nested structure into host
buffers so that a background writer sees a consistent snapshot while training
goes on and updates the live tensors in place:

* **every** strided tensor is copied, CPU tensors too (a reference would let an
  in-place update tear the checkpoint);
* buffers are allocated on the first call and **reused** on later calls with the
  same structure: a storage seen before (same storage identity) gets its old
  buffer back, and otherwise any cached buffer of the same byte size is reused
  (tensors re-created each step still reuse buffers). ``stats`` counts
  allocations and reuses so tests can check that a second save allocates nothing;
* buffers are pinned when CUDA is available (fast, asynchronous device-to-host
  copies); nothing is allocated on the device;
* storage sharing is preserved: all tensors viewing one storage become views of
  one staged buffer (tied weights stay tied). Only the byte range of the storage
  that the tensors actually cover is staged;
* containers are rebuilt: dict (incl. OrderedDict/defaultdict), list, tuple,
  NamedTuple, set, dataclasses and other objects, the last ones via
  :func:`copy.deepcopy` with the staged tensors pre-seeded in the memo (so
  custom ``__deepcopy__``/``__reduce__`` hooks work and their tensors are
  staged, not cloned). Tensors the stager cannot see (hidden in opaque objects),
  tensor subclasses and non-strided tensors are copied by ``deepcopy`` (a
  correct snapshot, without buffer reuse). ``nn.Parameter`` becomes a plain tensor.

A stager's buffers back the copies it returned last; call :meth:`stage` again
only once the previous copies are no longer in use (the async queue keeps one
stager per save that may be in flight).

**Deferred copies** (async save's background snapshot): :meth:`StateDictStager.prepare`
does everything above in the caller except the copies of large storages, which it
returns as a :class:`PendingCopy` to :meth:`~PendingCopy.run` on another thread
(``Tensor.copy_`` releases the GIL). The staged structure exists at once (its tensors
are views of buffers that :meth:`~PendingCopy.run` fills), so non-tensor state is
snapshotted in the caller and cannot race with training. Small storages, storages
whose version counter cannot be read (inference tensors) and storages that an earlier
deferred copy saw modified are copied before ``prepare`` returns: forward passes
modify small state without bumping version counters (BatchNorm running statistics).
For the deferred ones, :meth:`~PendingCopy.changed` compares every source tensor's
``_version`` with its value at ``prepare``: an in-place update in between is seen
(updates through ``.data``, ``set_``, NumPy views or raw storage are not).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointingException
from ..storage.fingerprint import fingerprint

__all__ = ["PendingCopy", "StagingStats", "StateDictStager"]

_ALIGN = 64  # staged byte ranges start at a multiple of this (>= any element size)

_StorageKey = Tuple[str, int, int]  # (device, data_ptr, nbytes) of the source storage


@dataclass
class StagingStats:
    """Counters of a :class:`StateDictStager` (cumulative over all ``stage`` calls)."""

    stage_calls: int = 0
    allocations: int = 0  # host buffers allocated
    allocated_bytes: int = 0
    reused: int = 0  # buffers reused from an earlier call
    freed: int = 0  # cached buffers dropped because the structure changed
    tensors_staged: int = 0  # tensors turned into views of staged buffers
    storages_staged: int = 0  # distinct source storages copied
    copied_bytes: int = 0
    fallback_copies: int = 0  # tensors copied by deepcopy (subclass / non-strided / hidden)
    last_allocations: int = 0  # allocations in the latest call
    last_copied_bytes: int = 0
    last_seconds: float = 0.0
    deferred_bytes: int = 0  # bytes copied later by PendingCopy.run
    last_deferred_bytes: int = 0
    copy_now_learned: int = 0  # storages copied before returning because they changed during a deferred copy


def _is_plain_tensor(x: object) -> bool:
    return type(x) in (torch.Tensor, torch.nn.Parameter) and x.layout == torch.strided and x.device.type != "meta"


def _storage_key(t: torch.Tensor) -> Optional[_StorageKey]:
    s = t.untyped_storage()
    ptr = s.data_ptr()
    if ptr == 0:
        return None
    return (str(t.device), ptr, s.nbytes())


def _byte_extent(t: torch.Tensor) -> Tuple[int, int]:
    """[start, end) byte range of ``t`` inside its storage."""
    es = t.element_size()
    if t.numel() == 0:
        start = t.storage_offset() * es
        return start, start
    lo = t.storage_offset()
    hi = lo
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:  # negative strides do not exist in torch, kept for safety
            lo += (size - 1) * stride
    return lo * es, (hi + 1) * es


def _byte_view(storage: torch.UntypedStorage, device: torch.device, start: int, length: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (length,), (1,))


class _Group:
    """All tensors of one call that view one source storage."""

    __slots__ = ("key", "storage", "device", "lo", "hi", "buffer", "members", "versions")

    def __init__(self, key: Optional[_StorageKey], storage: torch.UntypedStorage, device: torch.device):
        self.key = key
        self.storage = storage
        self.device = device
        self.lo = None  # type: Optional[int]
        self.hi = 0
        self.buffer = None  # type: Optional[torch.UntypedStorage]
        self.members: List[torch.Tensor] = []  # the source tensors viewing this storage
        self.versions: List[int] = []  # their version counters at prepare (deferred groups only)


class _Uncopyable(Exception):
    """A value of the state deepcopy refuses; ``keys``: its path, filled in on the way out."""

    def __init__(self, obj: object, cause: BaseException):
        super().__init__()
        self.obj, self.cause, self.keys = obj, f"{type(cause).__name__}: {cause}", []


class StateDictStager:
    """Copies nested state into reusable host buffers (see the module docstring).

    Args:
        pin_memory: pin the buffers; default: ``torch.cuda.is_available()``.
        share_memory: put buffers in shared memory (for a worker process).
        copy_threads: copy large CPU storages with this many threads (torch's
            ``copy_`` already parallelises; >1 splits storages across a pool).
        allocator: ``allocator(sizes) -> [UntypedStorage, ...]`` makes the new buffers of one
            call at once (e.g. slices of one file in shared memory, see
            :mod:`ckpt_integration.memory`); default: one host tensor per buffer.
        copy_now: the set of storages seen modified during a deferred copy, copied before returning
            from then on; stagers of one queue share theirs (the lesson is the state's, not the slot's).

    Example::

        stager = StateDictStager()
        snapshot = stager.stage(state)      # first call allocates
        snapshot = stager.stage(state)      # same structure: no allocation
        assert stager.stats.last_allocations == 0
    """

    def __init__(self, pin_memory: Optional[bool] = None, share_memory: bool = False, copy_threads: int = 1,
                 allocator: Optional[Callable[[List[int]], List[torch.UntypedStorage]]] = None,
                 copy_now: Optional[set] = None):
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.share_memory = share_memory
        self.copy_threads = max(1, int(copy_threads))
        self.allocator = allocator
        self.stats = StagingStats()
        self._by_key: Dict[_StorageKey, torch.UntypedStorage] = {}
        self._lock = threading.Lock()
        self._pending: Optional["PendingCopy"] = None  # deferred copies into our buffers, if running
        self._copy_now: set = set() if copy_now is None else copy_now  # (see copy_now)
        self._streams: Dict[Any, Any] = {}  # CUDA side streams for deferred copies

    # -- buffers ---------------------------------------------------------------------------
    @property
    def buffers(self) -> List[torch.UntypedStorage]:
        """The cached host buffers (those backing the copies returned last)."""
        return list(self._by_key.values())

    @property
    def cached_bytes(self) -> int:
        """Bytes held in cached host buffers."""
        return sum(b.nbytes() for b in self._by_key.values())

    def clear(self) -> None:
        """Drop all cached buffers (the next ``stage`` allocates again)."""
        with self._lock:
            self._by_key.clear()

    def _allocate(self, nbytes: int) -> torch.UntypedStorage:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        if self.share_memory:
            t.share_memory_()
        self.stats.allocations += 1
        self.stats.last_allocations += 1
        self.stats.allocated_bytes += nbytes
        return t.untyped_storage()

    def _assign_buffers(self, groups: List[_Group]) -> None:
        """Give every group a buffer: same source storage first, then any free one of the same size."""
        old = self._by_key
        new: Dict[Any, torch.UntypedStorage] = {}
        need: List[_Group] = []
        for g in groups:
            size = g.hi - g.lo
            buf = old.pop(self._cache_key(g), None) if g.key is not None else None
            if buf is not None and buf.nbytes() == size:
                g.buffer = buf
                self.stats.reused += 1
            else:
                if buf is not None:
                    old[("free", id(buf))] = buf
                need.append(g)
        free_by_size: Dict[int, List[torch.UntypedStorage]] = defaultdict(list)
        for buf in old.values():
            free_by_size[buf.nbytes()].append(buf)
        fresh: List[_Group] = []
        for g in need:
            pool = free_by_size.get(g.hi - g.lo)
            if pool:
                g.buffer = pool.pop()
                self.stats.reused += 1
            else:
                fresh.append(g)
        if fresh and self.allocator is not None:
            sizes = [g.hi - g.lo for g in fresh]
            for g, buf in zip(fresh, self.allocator(sizes)):
                g.buffer = buf
            self.stats.allocations += len(fresh)
            self.stats.last_allocations += len(fresh)
            self.stats.allocated_bytes += sum(sizes)
        else:
            for g in fresh:
                g.buffer = self._allocate(g.hi - g.lo)
        self.stats.freed += sum(len(v) for v in free_by_size.values())
        for i, g in enumerate(groups):
            new[self._cache_key(g) if g.key is not None else ("anon", i)] = g.buffer
        self._by_key = new

    def _cache_key(self, g: _Group) -> Any:
        return (g.key, g.lo, g.hi)

    # -- traversal -------------------------------------------------------------------------
    def _collect(self, obj: object, tensors: Dict[int, torch.Tensor], seen: set) -> None:
        """Find every plain tensor reachable through standard containers and object attributes."""
        stack = [obj]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                if _is_plain_tensor(x):
                    tensors.setdefault(id(x), x)
                continue
            if x is None or isinstance(x, (str, bytes, bytearray, int, float, bool, complex, torch.dtype, torch.device)):
                continue
            if id(x) in seen:
                continue
            seen.add(id(x))
            if isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, (list, tuple, set, frozenset)):
                stack.extend(x)
            elif dataclasses.is_dataclass(x) and not isinstance(x, type):
                stack.extend(getattr(x, f.name, None) for f in dataclasses.fields(x))
            else:
                d = getattr(x, "__dict__", None)
                if isinstance(d, dict) and not isinstance(x, type):
                    stack.extend(d.values())
                for slot in getattr(type(x), "__slots__", ()) or ():
                    if isinstance(slot, str) and hasattr(x, slot):
                        stack.append(getattr(x, slot))

    def _rebuild(self, obj: object, staged: Dict[int, torch.Tensor], memo: Dict[int, Any]) -> Any:
        if isinstance(obj, torch.Tensor):
            s = staged.get(id(obj))
            if s is not None:
                return s
            self.stats.fallback_copies += 1
            return copy.deepcopy(obj, memo)
        if obj is None or isinstance(obj, (str, bytes, int, float, bool, complex, torch.dtype, torch.device)):
            return obj
        oid = id(obj)
        if oid in memo:
            return memo[oid]
        t = type(obj)
        if t is dict:
            out: Any = {}
            memo[oid] = out
            for k, v in obj.items():
                try:
                    out[k] = self._rebuild(v, staged, memo)
                except _Uncopyable as e:
                    e.keys.insert(0, k)  # (the key path named by prepare's error)
                    raise
            return out
        if t is list:
            out = []
            memo[oid] = out
            for i, v in enumerate(obj):
                try:
                    out.append(self._rebuild(v, staged, memo))
                except _Uncopyable as e:
                    e.keys.insert(0, i)
                    raise
            return out
        if t is tuple:
            out = tuple(self._rebuild(v, staged, memo) for v in obj)
            memo[oid] = out
            return out
        if isinstance(obj, tuple) and hasattr(t, "_fields"):  # NamedTuple
            out = t(*(self._rebuild(v, staged, memo) for v in obj))
            memo[oid] = out
            return out
        # everything else (OrderedDict, defaultdict, dataclasses, sets, custom classes):
        # deepcopy honours the class's own hooks; staged tensors are pre-seeded in the memo.
        try:
            return copy.deepcopy(obj, memo)
        except Exception as e:  # noqa: BLE001 - a lock, a generator, a lambda...: named by prepare
            raise _Uncopyable(obj, e) from None

    # -- public ----------------------------------------------------------------------------
    def stage(self, state: object) -> Any:
        """Return a copy of ``state`` whose tensors live in this stager's host buffers.

        Blocks until every copy is complete (device copies are synchronised), so
        the caller may modify ``state`` as soon as this returns.
        """
        return self.prepare(state).state

    def prepare(self, state: object, *, defer_from_bytes: Optional[int] = None) -> "PendingCopy":
        """Stage ``state``, leaving the copies of storages of ``defer_from_bytes`` or more to later.

        Returns a :class:`PendingCopy`: its ``state`` is the staged structure; the
        deferred storages are copied by its :meth:`~PendingCopy.run` (any thread). With
        ``defer_from_bytes=None`` nothing is deferred (``run`` has nothing to do).
        The stager's buffers stay in use until ``run`` returned; a later ``prepare``
        waits for that.
        """
        if self._pending is not None:
            self._pending.done.wait()
        t0 = time.perf_counter()
        with self._lock:
            self.stats.stage_calls += 1
            self.stats.last_allocations = 0
            self.stats.last_copied_bytes = 0
            self.stats.last_deferred_bytes = 0
            tensors: Dict[int, torch.Tensor] = {}
            self._collect(state, tensors, set())
            groups: Dict[Any, _Group] = {}
            order: List[_Group] = []
            member: Dict[int, _Group] = {}
            for tid, t in tensors.items():
                key = _storage_key(t)
                gkey = key if key is not None else ("anon", tid)
                g = groups.get(gkey)
                if g is None:
                    g = groups[gkey] = _Group(key, t.untyped_storage(), t.device)
                    order.append(g)
                lo, hi = _byte_extent(t)
                g.lo = lo if g.lo is None else min(g.lo, lo)
                g.hi = max(g.hi, hi)
                g.members.append(t)
                member[tid] = g
            for g in order:
                g.lo = (g.lo // _ALIGN) * _ALIGN
                g.hi = max(g.hi, g.lo)
            self._assign_buffers(order)
            now, later = self._split(order, defer_from_bytes)
            pending = PendingCopy(self, later)  # versions recorded before anything is copied
            self._copy(now)
            staged: Dict[int, torch.Tensor] = {}
            memo: Dict[int, Any] = {}
            for tid, t in tensors.items():
                g = member[tid]
                es = t.element_size()
                off = t.storage_offset() - g.lo // es
                v = torch.empty(0, dtype=t.dtype).set_(g.buffer, off, t.size(), t.stride())
                if t.is_conj():  # lazy conjugate / negative views: keep their meaning
                    v = v.conj()
                if t.is_neg():
                    v = torch._neg_view(v)
                staged[tid] = v
                memo[tid] = v
            memo[id(memo)] = list(tensors.values())  # keep sources alive while memo ids are used
            self.stats.tensors_staged += len(tensors)
            self.stats.storages_staged += len(order)
            try:
                pending.state = self._rebuild(state, staged, memo)
            except _Uncopyable as e:
                name = ".".join(map(str, e.keys))
                raise CheckpointingException(f"{repr(name) if name else 'the state'} ({type(e.obj).__name__}) cannot be "
                                             f"copied for the background save ({e.cause}); nothing was written") from None
            self.stats.last_seconds = time.perf_counter() - t0
            if later:
                self._pending = pending
            else:
                pending.done.set()
            return pending

    def _split(self, groups: List[_Group], defer_from_bytes: Optional[int]) -> Tuple[List[_Group], List[_Group]]:
        """(copy now, copy later): only large CPU/CUDA storages whose versions are readable wait."""
        if defer_from_bytes is None:
            return groups, []
        now, later = [], []
        for g in groups:
            defer = (
                g.hi - g.lo >= defer_from_bytes
                and g.device.type in ("cpu", "cuda")
                and (g.key is None or g.key not in self._copy_now)
            )
            if defer:
                try:
                    g.versions = [t._version for t in g.members]
                except RuntimeError:  # inference tensors have no version counter: cannot be watched
                    defer = False
            (later if defer else now).append(g)
        return now, later

    def _remember_changed(self, groups: List[_Group]) -> None:
        for g in groups:
            if g.key is not None and g.key not in self._copy_now:
                self._copy_now.add(g.key)
                self.stats.copy_now_learned += 1

    def _side_stream(self, device: torch.device) -> Any:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def _copy(self, groups: List[_Group], background: bool = False, events: Optional[Dict[Any, Any]] = None) -> None:
        device_copies = False
        jobs = []
        streams = {}
        for g in groups:
            n = g.hi - g.lo
            if n == 0 or _moved(g):  # (freed or resized since prepare: refused after the copy)
                continue
            src = _byte_view(g.storage, g.device, g.lo, n)
            dst = _byte_view(g.buffer, torch.device("cpu"), 0, n)
            if g.device.type != "cpu":
                if background and g.device.type == "cuda":
                    # a side stream, ordered after the work queued before the save (the event),
                    # so later training kernels are not held up behind this copy
                    stream = streams.get(g.device)
                    if stream is None:
                        stream = streams[g.device] = self._side_stream(g.device)
                        stream.wait_event(events[g.device])
                    with torch.cuda.stream(stream):
                        dst.copy_(src, non_blocking=self.pin_memory)
                else:
                    dst.copy_(src, non_blocking=self.pin_memory)
                    device_copies = True
            else:
                jobs.append((dst, src))
            self.stats.copied_bytes += n
            self.stats.last_copied_bytes += n
        if self.copy_threads > 1 and len(jobs) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(self.copy_threads, thread_name_prefix="ckpt-stage") as pool:
                list(pool.map(lambda j: j[0].copy_(j[1]), jobs))
        else:
            for dst, src in jobs:
                dst.copy_(src)
        for stream in streams.values():
            stream.synchronize()
        if device_copies:
            for dev in {g.device for g in groups if g.device.type == "cuda"}:
                torch.cuda.synchronize(dev)
            for dev in {g.device for g in groups if g.device.type not in ("cpu", "cuda")}:
                mod = getattr(torch, dev.type, None)
                if mod is not None and hasattr(mod, "synchronize"):
                    mod.synchronize()


def _moved(g: _Group) -> bool:
    """Whether ``g``'s source storage was freed, resized or reallocated since ``prepare`` (a byte view
    of it would grow it again, zero-filled, and copy zeros)."""
    return g.key is not None and (g.storage.data_ptr(), g.storage.nbytes()) != g.key[1:]


def _copy_matches(g: _Group) -> bool:
    """Whether the staged bytes of ``g`` equal its source right after the copy. The source cannot
    change before the snapshot is complete (the next optimizer step waits for it), so a
    difference is a change made during the copy that bypassed the version counters: the staged
    state would be a mix of two states, one that never existed. A CPU source is compared byte for
    byte; a device source by fingerprints (:mod:`..storage.fingerprint`: computed on the device,
    nothing copied back)."""
    n = g.hi - g.lo
    if n <= 0 or g.storage is None or g.buffer is None:
        return True
    if _moved(g):
        return False
    src = _byte_view(g.storage, g.device, g.lo, n)
    dst = _byte_view(g.buffer, torch.device("cpu"), 0, n)
    if g.device.type == "cpu":
        return torch.equal(src, dst)
    return fingerprint(src) == fingerprint(dst)


class PendingCopy:
    """The deferred part of :meth:`StateDictStager.prepare`: copies of large storages.

    ``state`` is the staged structure (complete once :meth:`run` returned);
    ``done`` is set when :meth:`run` ended (or at once if nothing was deferred);
    ``nbytes`` is what :meth:`run` copies. :meth:`changed` names the source tensors
    whose version counter moved since ``prepare``.
    """

    def __init__(self, stager: StateDictStager, groups: List[_Group]):
        self.stager = stager
        self.state: Any = None
        self.done = threading.Event()
        self.seconds = 0.0
        self._groups = groups
        self._ran = False
        self.torn: List[_Group] = []  # groups whose copy did not match the source after the copy
        self.nbytes = sum(g.hi - g.lo for g in groups)
        # the storages copied later (snapshot.py waits before a module whose buffer is one of them runs)
        self.sources = {t.untyped_storage().data_ptr() for g in groups for t in g.members}
        # device work queued before the save must come first: an event on the caller's stream
        self._events: Dict[Any, Any] = {}
        for dev in {g.device for g in groups if g.device.type == "cuda"}:
            stager._side_stream(dev)  # created in the caller's thread
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            self._events[dev] = ev

    def run(self) -> None:
        """Copy the deferred storages (once; any thread). ``done`` is set even if it fails."""
        if self._ran:
            return
        self._ran = True
        t0 = time.perf_counter()
        try:
            self.stager._copy(self._groups, background=True, events=self._events)
            self.stager.stats.deferred_bytes += self.nbytes
            self.stager.stats.last_deferred_bytes += self.nbytes
            self.torn = [g for g in self._groups if not _copy_matches(g)]
        finally:
            for g in self._groups:
                g.storage = None  # the source storages are not needed any more
            self.seconds = time.perf_counter() - t0
            self.done.set()

    def changed(self) -> List[torch.Tensor]:
        """Source tensors modified in place since ``prepare``: their version counter moved, or (a
        change that bypasses version counters: ``.data``, raw storage, another thread's kernel)
        the copy differs from its source right after it was made (:func:`_copy_matches`).

        Their storages are copied before ``prepare`` returns in later saves.
        """
        torn = {id(g) for g in self.torn}
        out = [t for g in self._groups for t, v in zip(g.members, g.versions) if t._version != v or id(g) in torn]
        if out:
            ids = {id(t) for t in out}
            self.stager._remember_changed([g for g in self._groups if any(id(t) in ids for t in g.members)])
        return out

    def release(self) -> None:
        """Drop the references to the source tensors (after the last :meth:`changed`)."""
        for g in self._groups:
            g.members = []
            g.versions = []
