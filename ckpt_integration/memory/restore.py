"""Restoring from the memory tier: what every node holds, which step is complete, verified reads.

* :func:`gather_inventory` (collective): every rank scans its node directory
  (:func:`.slots.scan`) and all ranks learn all valid slots and on which node they are.
* :func:`complete_steps`: the steps for which *every* owner of the current world has at least
  one valid copy (its own or a peer's) written by one incarnation of the job.
* :func:`fetch` (collective): every rank obtains its own snapshot of a step, from its own
  node's memory (mapped files, no transfer) or from the rank that serves a peer copy (one
  exchange, :mod:`.transfer`).
* :func:`fill_request`: verify every block of the snapshot while copying it into the
  requested tensors, and build what ``ci.load`` returns.
"""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..dict_utils import dict_list_map_inplace, merge
from ..errors import CorruptCheckpointError, MemoryLayoutError, StateVerificationError
from ..execution import dist
from ..execution.dist import Group
from ..execution.preprocess import dtype_from_name, dtype_name, restore_list_types, split_state_dict
from ..mapping import ShardedObject, ShardedTensor, apply_factory_merges
from ..planning.records import digest64
from ..storage.checksum import DEFAULT_BLOCK_SIZE, BlockHash
from ..storage.fingerprint import shard_fingerprints
from ..storage.safe_pickle import safe_torch_load
from . import slots
from .plan import CopyLocation, choose_sources
from .transfer import Outgoing, exchange

logger = logging.getLogger(__name__)

Key = Tuple[int, Tuple[int, str]]  # (step, incarnation)


@dataclass
class RestoreReport:
    """Where this rank's state came from in the last :meth:`~ckpt_integration.MemoryCheckpoints.load`."""

    step: int
    source: str  # "own memory" or "peer rank N"
    refused: List[str] = field(default_factory=list)  # copies that failed verification, and why
    # own memory read through this process's mappings of the files (a restore in the process that
    # saved): no page faults, a copy at memory speed; False when the files were read (a restart)
    from_mapping: bool = False
    # an elastic restore (another world size or layout): "own node" / "peer rank N" -> byte ranges
    ranges: Dict[str, List[str]] = field(default_factory=dict)



# --------------------------------------------------------------------------- inventory
@dataclass
class Inventory:
    """Every valid slot of the job on every node: ``entries[rank]`` as scanned by ``rank``."""

    nodes: List[str]  # node memory id of every rank
    entries: List[List[slots.Entry]]

    def copies(self, world: int) -> Dict[Key, Dict[int, List[CopyLocation]]]:
        """``{(step, incarnation): {owner: [copy, ...]}}`` for snapshots of a job of ``world`` ranks."""
        seen: Dict[Tuple[Key, int, str], List[int]] = {}
        for rank, es in enumerate(self.entries):
            for e in es:
                if e.world_size != world or not 0 <= e.owner < world:
                    continue
                seen.setdefault(((e.step, e.incarnation), e.owner, self.nodes[rank]), []).append(rank)
        out: Dict[Key, Dict[int, List[CopyLocation]]] = {}
        for (key, owner, node), ranks in sorted(seen.items()):
            out.setdefault(key, {}).setdefault(owner, []).append(CopyLocation(owner, node, tuple(sorted(set(ranks)))))
        return out

    def slot_of(self, rank: int, owner: int, key: Key) -> Optional[int]:
        for e in self.entries[rank]:
            if e.owner == owner and (e.step, e.incarnation) == key:
                return e.slot
        return None


def gather_inventory(root: str, job_id: str, node: str, group: Group) -> Inventory:
    mine = slots.scan(root, job_id)
    gathered = dist.all_gather_object((node, mine), group)
    return Inventory([g[0] for g in gathered], [g[1] for g in gathered])


def complete_steps(inv: Inventory, world: int) -> List[Key]:
    """Keys complete for all ``world`` owners, newest first (ties: the later incarnation)."""
    done = [k for k, per_owner in inv.copies(world).items() if len(per_owner) == world]
    return sorted(done, key=lambda k: (k[0], k[1][0]), reverse=True)


def key_for_step(inv: Inventory, world: int, step: int) -> Optional[Key]:
    for k in complete_steps(inv, world):
        if k[0] == step:
            return k
    return None


def complete_any(inv: Inventory) -> List[Tuple[Key, int]]:
    """``(key, world size it was saved with)`` of every step complete in the surviving memory,
    whatever job size took it (a restart into another size restores it resharded), newest first
    (the later run first on a tie). A step that a later run (incarnation) left is not offered: that
    run saved a lower step, so it went on from before it (a rollback, a start from scratch), also
    where the copies of the abandoned step survive on a node the later run did not have."""
    worlds = sorted({e.world_size for es in inv.entries for e in es})
    done = [(k, w) for w in worlds for k in complete_steps(inv, w)]
    done = [(k, w) for k, w in done if not any(o[1][0] > k[1][0] and o[0] < k[0] for o, _ in done)]
    return sorted(done, key=lambda kw: (kw[0][0], kw[0][1][0]), reverse=True)


def step_in_memory(inv: Inventory, step: int) -> Optional[Tuple[Key, int]]:
    """The complete snapshot of ``step`` that :func:`complete_any` ranks first (the latest run's, as
    ``latest()`` found it), or ``None``."""
    return next((kw for kw in complete_any(inv) if kw[0][0] == step), None)


# --------------------------------------------------------------------------- fetching
@dataclass
class Obtained:
    """This rank's snapshot of a step: the record and where its file bytes are."""

    record: slots.Record
    files: Dict[str, torch.Tensor]  # name -> uint8 (mapped own files, or received buffers)
    source: str  # "own memory" or "peer rank N"
    node: str
    fds: Dict[str, str] = field(default_factory=dict)  # own memory: name -> path (read with preadv)
    # own memory in the process that saved it: name -> this process's mapping of the file (its pages
    # are in the page tables already; copied from directly, see slots.Arena.mapped)
    warm: Dict[str, torch.Tensor] = field(default_factory=dict)


def fetch(
    inv: Inventory, key: Key, root: str, group: Group, refused: Iterable[Tuple[int, str]] = (),
    owners: Optional[Sequence[int]] = None,
) -> Tuple[Optional[Obtained], Optional[str], List[int], Dict[int, Tuple[str, int]]]:
    """Collective: every rank in ``owners`` (default all) obtains its own snapshot of ``key``.

    Returns ``(obtained or None, local error or None, owners without a usable copy, the
    chosen {owner: (node, serving rank)})``. All ranks take part in the exchange whatever
    happens locally.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    copies = inv.copies(world).get(key, {})
    owners = list(range(world)) if owners is None else list(owners)
    chosen, missing = choose_sources(owners, copies, set(refused))
    local_err: Optional[str] = None
    obtained: Optional[Obtained] = None
    sends: Dict[int, Outgoing] = {}
    for owner, (node, server) in sorted(chosen.items()):
        if server == rank and owner != rank:
            try:
                sends[owner] = _outgoing(inv, rank, owner, key, root)
            except Exception as e:  # the requester gets "nothing" and reports it
                logger.warning("memory tier: rank %d cannot serve rank %d's copy: %s", rank, owner, e)
                sends[owner] = Outgoing(None, {})
    sources = [chosen[rank][1]] if rank in chosen and chosen[rank][1] != rank else []
    if rank in chosen and chosen[rank][1] == rank:
        try:
            obtained = _own(inv, rank, key, root, chosen[rank][0])
        except Exception as e:
            local_err = f"own memory (node {chosen[rank][0][:8]}): {type(e).__name__}: {e}"
    recv_buffers: Dict[str, torch.Tensor] = {}

    def buffers_for(src: int, rec: slots.Record) -> Dict[str, torch.Tensor]:
        recv_buffers.update({n: torch.empty(s, dtype=torch.uint8) for n, s in rec.files().items()})
        return recv_buffers

    try:
        got, errors = exchange(sends, sources, buffers_for, group, lambda s: f"copy served by rank {s}")
        if errors:
            local_err = local_err or "; ".join(f"copy from peer rank {s}: {e}" for s, e in errors.items())
    except Exception as e:
        got = {}
        local_err = local_err or f"transfer failed: {type(e).__name__}: {e}"
    if sources and local_err is None:
        src = sources[0]
        rec = got.get(src)
        if rec is None:
            local_err = local_err or f"peer rank {src} had no readable copy"
        else:
            try:
                _check_header(rec, rank, key)
                obtained = Obtained(rec, dict(recv_buffers), f"peer rank {src}", chosen[rank][0])
            except Exception as e:
                local_err = f"copy from peer rank {src}: {e}"
    return obtained, local_err, missing, chosen


def use_own_mappings(got: Obtained, arenas: Sequence[slots.Arena]) -> None:
    """Restoring in the process that took the snapshot: read from its own mappings of the files
    (``arenas``: that process's, by slot)."""
    slot = got.record.header.get("slot")
    if slot not in slots.SLOTS:
        return
    for name, size in got.record.files().items():
        m = arenas[slot].mapped(name, size)
        if m is not None:
            got.warm[name] = m


def _check_header(rec: slots.Record, owner: int, key: Key) -> None:
    if rec.owner != owner or (rec.step, rec.incarnation) != key:
        raise CorruptCheckpointError(f"record is of rank {rec.owner} step {rec.step}, not rank {owner} step {key[0]}")


def read_own(root: str, owner: int, slot: int, key: Key) -> slots.Record:
    rec = slots.read_record(root, owner, slot)
    if rec is None:
        raise CorruptCheckpointError(f"slot {slot} of rank {owner} disappeared")
    _check_header(rec, owner, key)
    return rec


def _own(inv: Inventory, rank: int, key: Key, root: str, node: str) -> Obtained:
    slot = inv.slot_of(rank, rank, key)
    assert slot is not None
    rec = read_own(root, rank, slot, key)
    files = slots.open_files(root, rank, rec.files())
    paths = {n: os.path.join(slots.owner_dir(root, rank), n) for n in files}
    return Obtained(rec, files, "own memory", node, paths)


def _outgoing(inv: Inventory, rank: int, owner: int, key: Key, root: str) -> Outgoing:
    slot = inv.slot_of(rank, owner, key)
    if slot is None:
        raise CorruptCheckpointError(f"rank {rank} has no copy of rank {owner} step {key[0]}")
    rec = read_own(root, owner, slot, key)
    return Outgoing(rec.raw, slots.open_files(root, owner, rec.files()))


# --------------------------------------------------------------------------- filling a request
def _reader(got: Obtained) -> Any:
    """``read(file, offset, out)``: bytes of a snapshot file into ``out`` (a uint8 array)."""
    fds: Dict[str, int] = {}

    def read(name: str, offset: int, out: np.ndarray) -> None:
        warm = got.warm.get(name)
        if warm is not None:  # a copy at memory speed (a fresh mapping would fault in every page)
            np.copyto(out, warm[offset:offset + len(out)].numpy())
        elif name in got.fds:  # own memory: the kernel copies from tmpfs (no page faults on a fresh mapping)
            fd = fds.get(name)
            if fd is None:
                fd = fds[name] = os.open(got.fds[name], os.O_RDONLY)
            view, done = memoryview(out), 0
            while done < len(out):
                n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise CorruptCheckpointError(f"memory snapshot file {got.fds[name]} is shorter than recorded")
                done += n
        else:
            np.copyto(out, got.files[name][offset:offset + len(out)].numpy())

    def close() -> None:
        for fd in fds.values():
            os.close(fd)

    return read, close


def verified_copy(read: Callable[[str, int, np.ndarray], None], name: str, offset: int, out: np.ndarray, digests: np.ndarray, where: str,
                  h: BlockHash) -> None:
    """Read a region into ``out`` block by block, checking each block's digest (of ``h``) while it is in cache."""
    n, block = len(out), DEFAULT_BLOCK_SIZE
    if len(digests) != (n + block - 1) // block:
        raise CorruptCheckpointError(f"{where}: {len(digests)} block checksums for {n} bytes")
    digest = h.digest
    for i, o in enumerate(range(0, n, block)):
        part = out[o:o + block]
        read(name, offset + o, part)
        if digest(part) != int(digests[i]):
            raise CorruptCheckpointError(f"{where}: {h.label} mismatch in block {i} (bytes {o}..{o + len(part)})")


def _bytes_of(t: torch.Tensor) -> Optional[np.ndarray]:
    """A uint8 view of a contiguous CPU tensor's bytes, else ``None``."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, dtype=np.uint8)


def shard_id(sh: Union[ShardedTensor, ShardedObject]) -> Tuple[Any, ...]:
    """What identifies a saved value independent of where it sits in the dict."""
    if isinstance(sh, ShardedObject):
        return ("object", sh.unique_key)
    fr = sh.flattened_range
    return ("tensor", sh.key, tuple(sh.global_offset), tuple(sh.local_shape), None if fr is None else (fr.start, fr.stop))


def shard_header(sh: Union[ShardedTensor, ShardedObject]) -> Dict[str, Any]:
    """How a snapshot record describes one saved value (read back by :func:`entry_id` and :func:`as_sharded`)."""
    rid = sh.replica_id
    rid = list(rid) if isinstance(rid, tuple) else rid
    if isinstance(sh, ShardedObject):
        return {"kind": "object", "key": sh.key, "unique_key": sh.unique_key, "global_shape": list(sh.global_shape),
                "global_offset": list(sh.global_offset), "replica_id": rid}
    fr = sh.flattened_range
    return {
        "kind": "tensor", "key": sh.key, "dtype": dtype_name(sh.dtype), "local_shape": list(sh.local_shape),
        "global_shape": list(sh.global_shape), "global_offset": list(sh.global_offset), "replica_id": rid,
        "axis_fragmentations": None if sh.axis_fragmentations is None else list(sh.axis_fragmentations),
        "prepend_axis_num": sh.prepend_axis_num, "allow_shape_mismatch": sh.allow_shape_mismatch,
        "flattened_range": None if fr is None else [fr.start, fr.stop],
    }


def entry_id(s: Dict[str, Any]) -> Tuple[Any, ...]:
    if s["kind"] == "object":
        return ("object", s["unique_key"])
    fr = s["flattened_range"]
    return ("tensor", s["key"], tuple(s["global_offset"]), tuple(s["local_shape"]), None if fr is None else tuple(fr))


def content_digest(shards: Sequence[Dict[str, Any]]) -> int:
    """A digest of what a record holds: its shards (what identifies each) and their fingerprints,
    whatever the order and wherever the bytes sit (the same for every copy of one snapshot)."""
    rows = sorted(json.dumps([list(entry_id(s)), s.get("fingerprint")], default=list) for s in shards)
    return digest64("\n".join(rows).encode())


def check_owner(rec: slots.Record, rank: int, where: str) -> None:
    """The record holds what ``rank`` saved (the digest every rank agreed on for it at the snapshot):
    a copy of another rank, or of another snapshot, is refused even if its bytes are intact."""
    agreed = rec.header.get("owner_digests")
    if not agreed or rank >= len(agreed):
        return  # a record written before the digests were agreed on
    if content_digest(rec.header["shards"]) != agreed[rank]:
        keys = sorted({s.get("key") for s in rec.header["shards"]})
        raise StateVerificationError(
            f"{where}: this copy is not the snapshot rank {rank} saved (its shards and their fingerprints differ "
            f"from those every rank agreed on at the snapshot); keys {keys[:8]}{' ...' if len(keys) > 8 else ''}")


def fill_request(
    sharded_state_dict: Dict[str, Any], got: Obtained, where: str, trusted: bool,
    allowed_globals: Optional[Iterable[Any]],
    rank: Optional[int] = None, verify_state: bool = False,
) -> Any:
    """Verify ``got`` block by block while copying it into the request; return what ``ci.load`` would.

    The copy must be the one ``rank`` saved (:func:`check_owner`); with ``verify_state`` every
    restored tensor's fingerprint is compared with the one recorded from the staged bytes."""
    rec = got.record
    if rank is not None:
        check_owner(rec, rank, where)
    sharded, _req_common, nonpersistent, factories, template = split_state_dict(sharded_state_dict)
    saved = {entry_id(s): s for s in rec.header["shards"]}
    blob = safe_torch_load(io.BytesIO(rec.blob), trusted=trusted, allowed_globals=allowed_globals,
                           what=f"common state of {where}")
    by_region: Dict[int, List[Tuple[Dict[str, Any], torch.Tensor]]] = {}
    device_copies: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def prepare(sh: object) -> Any:
        if not isinstance(sh, (ShardedTensor, ShardedObject)):
            return sh
        entry = saved.get(shard_id(sh))
        if entry is None or (isinstance(sh, ShardedTensor) and tuple(entry["global_shape"]) != sh.global_shape):
            what = f"object {sh.unique_key!r}" if isinstance(sh, ShardedObject) else (
                f"{sh.key!r} at offset {sh.global_offset} with local shape {sh.local_shape}")
            raise MemoryLayoutError(f"{where}: {what} is not in the snapshot (the layout changed): "
                                    "load the durable checkpoint, which reshards")
        if isinstance(sh, ShardedObject):
            return blob["objects"][entry["index"]]
        out, host = host_destination(sh, device_copies)
        by_region.setdefault(entry["region"], []).append((entry, host))
        if verify_state and entry.get("fingerprint") is not None:
            checks.append((replace(sh, data=host), entry))
        return out

    checks: List[Tuple[ShardedTensor, Dict[str, Any]]] = []
    loaded = dict_list_map_inplace(prepare, sharded)
    copy_regions(got, by_region, where)
    if checks:
        for (sh, entry), fp in zip(checks, shard_fingerprints([c[0] for c in checks])):
            if fp != int(entry["fingerprint"]):
                raise StateVerificationError(
                    f"{where}: tensor {sh.key!r} at offset {sh.global_offset} restored on rank {rank} is not what was "
                    "saved (its fingerprint differs from the one recorded from the snapshot's bytes)")
    with torch.no_grad():
        for host, dev in device_copies:
            dev.copy_(host)
    return finish_result(blob["common"], nonpersistent, loaded, template, factories)


def host_destination(sh: ShardedTensor, device_copies: List[Tuple[torch.Tensor, torch.Tensor]]
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(what the restore returns, the host tensor it fills)`` for a requested tensor: its own data
    (a new tensor when it has none); a device tensor is filled through a host tensor, copied to it
    afterwards (``device_copies``)."""
    shape = (sh.flat_numel(),) if sh.flattened_range is not None else sh.local_shape
    out = sh.data if sh.data is not None else torch.empty(shape, dtype=sh.dtype)
    if out.device.type == "cpu":
        return out, out.detach()
    host = torch.empty(shape, dtype=sh.dtype)
    device_copies.append((host, out))
    return out, host


def finish_result(common: object, nonpersistent: object, loaded: object, template: object, factories: dict) -> Any:
    """What ``ci.load`` returns: the common state with the loaded values merged in."""
    result = common if isinstance(common, dict) else {"__common__": common}
    merge(result, nonpersistent)
    merge(result, loaded)
    result = restore_list_types(result, template)
    if factories:
        result = apply_factory_merges(result, factories)
    return result


def copy_regions(got: Obtained, by_region: Dict[int, List[Tuple[Dict[str, Any], torch.Tensor]]], where: str) -> None:
    """Fill each destination from its region, every byte checked against the block digests."""
    regions, h = got.record.regions, got.record.block_hash
    read, close = _reader(got)
    try:
        with torch.no_grad():
            for idx, wants in sorted(by_region.items()):
                name, offset, nbytes, digests = regions[idx]
                entry, host = wants[0]
                what = f"{where}, region {idx} ({entry.get('key')!r})"
                dest = _bytes_of(host) if len(wants) == 1 else None
                if (dest is not None and len(dest) == nbytes and entry["elem_offset"] == 0
                        and dtype_from_name(entry["dtype"]) == host.dtype and _contiguous(entry["size"], entry["stride"])):
                    verified_copy(read, name, offset, dest, digests, what, h)  # straight into the tensor
                    continue
                scratch = torch.empty(nbytes, dtype=torch.uint8)
                verified_copy(read, name, offset, scratch.numpy(), digests, what, h)
                for entry, host in wants:
                    host.copy_(_view(scratch.untyped_storage(), 0, entry).reshape(host.shape))
    finally:
        close()


def _view(storage: torch.UntypedStorage, byte_offset: int, entry: Dict[str, Any]) -> torch.Tensor:
    """The saved tensor ``entry`` inside ``storage`` whose region starts at ``byte_offset``."""
    dt = dtype_from_name(entry["dtype"])
    es = torch.empty((), dtype=dt).element_size()
    return torch.empty(0, dtype=dt).set_(storage, byte_offset // es + entry["elem_offset"], entry["size"], entry["stride"])


def as_sharded(got: Obtained, trusted: bool, allowed_globals: Optional[Iterable[Any]]) -> Tuple[List[Any], Any]:
    """The snapshot as (ShardedTensors / ShardedObjects viewing its bytes, common state): what
    ``persist`` hands to the durable save (no copy)."""
    rec = got.record
    blob = safe_torch_load(io.BytesIO(rec.blob), trusted=trusted, allowed_globals=allowed_globals,
                           what=f"common state of the memory snapshot of step {rec.step}")
    regions = rec.regions
    out: List[Any] = []
    for s in rec.header["shards"]:
        rid = s["replica_id"]
        rid = tuple(rid) if isinstance(rid, list) else rid
        if s["kind"] == "object":
            out.append(ShardedObject(s["key"], blob["objects"][s["index"]], tuple(s["global_shape"]),
                                     tuple(s["global_offset"]), rid))
            continue
        name, offset, _, _ = regions[s["region"]]
        data = _view(got.files[name].untyped_storage(), offset, s)
        fr = s["flattened_range"]
        out.append(ShardedTensor(
            s["key"], data, dtype_from_name(s["dtype"]), tuple(s["local_shape"]), tuple(s["global_shape"]),
            tuple(s["global_offset"]), None if s["axis_fragmentations"] is None else tuple(s["axis_fragmentations"]),
            rid, s["prepend_axis_num"], s["allow_shape_mismatch"], None if fr is None else slice(fr[0], fr[1]),
        ))
    return out, blob["common"]


def _contiguous(size: Sequence[int], stride: Sequence[int]) -> bool:
    expect = 1
    for s, st in zip(reversed(list(size)), reversed(list(stride))):
        if s != 1 and st != expect:
            return False
        expect *= s
    return True


def verify_all(got: Obtained, where: str) -> None:
    """Check every block of every region (before a snapshot is persisted)."""
    for idx, (name, offset, nbytes, digests) in enumerate(got.record.regions):
        slots.verify_region(got.files[name][offset:offset + nbytes].numpy(), digests, f"{where}, region {idx}",
                            got.record.block_hash)
