"""Restoring a memory snapshot into another world size or layout (an elastic restart).

The snapshots of the ranks that saved a step are read where they survive - this node's shared
memory first, otherwise served over the process group by a rank whose node holds a copy - and
resharded into the request, as :func:`ckpt_integration.load` reshards a durable checkpoint:

1. **records** (collective): for every saving rank ("old rank"), one rank whose node holds a copy
   reads its commit record (CRC-checked, and the snapshot every rank agreed on at the save) and
   all ranks learn every record's shards and regions (the common state and objects only where
   they are kept);
2. **plan** (local, :mod:`.plan`): every requested shard is cut into rectangles, each filled
   from the saved rectangles that overlap it; every element must be covered, else
   :class:`MemoryLayoutError` (nothing in memory holds it: use the durable tier). The bytes
   needed from each saved region are widened to whole digest blocks;
3. **fetch** (collective): each range is read once per rank that needs it, from a copy on its
   own node or from the serving rank of a node that holds one; every block is checked against
   the record's digests. A copy that fails is refused (logged, named) and the range fetched
   again from another copy; when no intact copy is left, :class:`MemoryCheckpointError` on
   every rank;
4. **fill**: the verified bytes are copied into the requested tensors.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterable, List, Optional, Protocol, Set, Tuple

import torch

from ..dict_utils import dict_list_map_inplace
from ..errors import CorruptCheckpointError, MemoryCheckpointError, MemoryLayoutError
from ..execution import dist
from ..execution.dist import Group, describe_error
from ..execution.preprocess import dtype_from_name, split_state_dict
from ..execution.transfer import Transfers
from ..mapping import ShardedObject, ShardedTensor
from ..planning.boxes import Box, relative_slices
from ..storage.checksum import DEFAULT_BLOCK_SIZE
from ..storage.safe_pickle import safe_torch_load
from . import slots
from .plan import CopyLocation, SavedPiece, block_hull, choose_sources, cover, saved_pieces
from .restore import (Inventory, Key, RestoreReport, check_owner, entry_id, finish_result, host_destination,
                      read_own)

logger = logging.getLogger(__name__)

_TAG = 31  # the fetch round's messages on the tier's private group
Need = Tuple[int, int]  # (old rank, region index)


class TierLike(Protocol):
    """A memory tier (``tier.MemoryCheckpoints``, which imports this module) as a restore reads and records it."""

    root: str
    trusted: bool
    allowed_globals: Optional[Iterable[Any]]
    rank: int
    job_id: str
    last_restore: Optional[RestoreReport]

    @property
    def group(self) -> Group: ...


@dataclass
class ElasticRestore:
    """Where this rank's bytes came from in an elastic restore."""

    sources: Dict[str, List[str]] = field(default_factory=dict)  # "own node" / "peer rank N" -> ranges
    refused: List[str] = field(default_factory=list)

    def describe(self, old_world: int) -> str:
        parts = [f"{src} ({len(r)} range(s))" for src, r in sorted(self.sources.items())]
        return f"memory of {old_world} rank(s), resharded: " + (", ".join(parts) or "no tensor bytes")


def load(tier: TierLike, request: Dict[str, Any], inv: Inventory, key: Key, saved_world: int) -> Any:
    """Collective: :meth:`MemoryCheckpoints.load` of a step saved by ``saved_world`` ranks or in
    another layout; records and logs where every byte range came from (``tier.last_restore``)."""
    result, rep = restore(request, inv, key, saved_world, tier.root, tier.group, tier.trusted, tier.allowed_globals)
    tier.last_restore = RestoreReport(key[0], rep.describe(saved_world), rep.refused, False, dict(rep.sources))
    logger.info("memory tier: rank %d restored step %d of job %r from %s", tier.rank, key[0], tier.job_id,
                tier.last_restore.source)
    for src, ranges in sorted(rep.sources.items()):
        logger.info("memory tier: rank %d read from %s: %s", tier.rank, src, "; ".join(ranges))
    return result


def restore(request: Dict[str, Any], inv: Inventory, key: Key, old_world: int, root: str, group: Group,
            trusted: bool, allowed_globals: Optional[Iterable[Any]]) -> Tuple[Any, ElasticRestore]:
    """Collective: fill ``request`` from step ``key`` saved by ``old_world`` ranks (see the module docstring)."""
    copies = inv.copies(old_world).get(key, {})
    where = f"memory snapshot of step {key[0]} (saved by {old_world} rank(s))"
    report = ElasticRestore()
    refused: Set[Tuple[int, str]] = set()
    headers, blobs = _records(inv, key, old_world, root, group, copies, refused, report, where)
    plan_err: Optional[str] = None
    try:
        todo, needs, loaded, extra = _plan(request, headers, blobs, trusted, allowed_globals, where)
    except MemoryLayoutError as e:
        plan_err, todo, needs = str(e), [], {}
    problems = [p for p in dist.all_gather_object(plan_err, group) if p]
    if problems:
        raise MemoryLayoutError(f"{where} does not hold the requested state: " + "; ".join(sorted(set(problems))[:4])
                                + ". Load the durable checkpoint instead")
    buffers = _fetch(needs, headers, inv, key, root, group, copies, refused, report, where)
    with torch.no_grad():
        for piece, ov, dst in todo:
            lo, buf = buffers[(piece.owner, piece.region)]
            dt = dtype_from_name(piece.dtype)  # (buf: a view whose byte 0 is the region's byte lo)
            first = piece.extent(ov)[0] + (buf.storage_offset() - lo) // dt.itemsize
            p = len(ov.sizes) - dst.dim()
            src = torch.empty(0, dtype=dt).set_(buf.untyped_storage(), first, ov.sizes[p:], piece.strides[p:])
            dst.copy_(src)
        for host, dev in extra["device_copies"]:
            dev.copy_(host)
    common = safe_torch_load(io.BytesIO(blobs[0]), trusted=trusted, allowed_globals=allowed_globals,
                             what=f"common state of {where}")["common"]
    result = finish_result(common, extra["nonpersistent"], loaded, extra["template"], extra["factories"])
    return result, report


# --------------------------------------------------------------------------- 1. records
def _records(inv: Inventory, key: Key, old_world: int, root: str, group: Group, copies: Dict[int, List[CopyLocation]],
             refused: Set[Tuple[int, str]], report: ElasticRestore, where: str) -> Tuple[Dict[int, Any], Dict[int, bytes]]:
    rank = dist.get_rank(group)
    headers: Dict[int, Any] = {}
    blobs: Dict[int, bytes] = {}
    pending = list(range(old_world))
    while pending:
        chosen, missing = choose_sources(pending, copies, refused)
        if missing:
            raise MemoryCheckpointError(f"{where}: no intact record left in memory for old rank(s) {missing}; refused: "
                                        + ("; ".join(report.refused) or "none") + ". Load the durable checkpoint instead")
        mine: Dict[int, Tuple[Any, Optional[bytes], Optional[str]]] = {}
        for owner, (node, server) in sorted(chosen.items()):
            if server != rank:
                continue
            try:
                slot = inv.slot_of(rank, owner, key)
                if slot is None:
                    raise CorruptCheckpointError(f"rank {rank} has no copy of old rank {owner}")
                rec = read_own(root, owner, slot, key)
                check_owner(rec, owner, f"{where}, old rank {owner}")
                keep = owner == 0 or any(s["kind"] == "object" for s in rec.header["shards"])
                mine[owner] = (rec.header, rec.blob if keep else None, None)
            except Exception as e:  # noqa: BLE001 - this copy is refused, another one is tried
                mine[owner] = (None, None, describe_error(e))
        pending = []
        for server, got in enumerate(dist.all_gather_object(mine, group)):
            for owner, (header, blob, err) in got.items():
                if err is not None:
                    node = chosen[owner][0]
                    refused.add((owner, node))
                    report.refused.append(f"old rank {owner}'s record on node {node[:8]} (rank {server}): {err}")
                    if server == rank:
                        logger.warning("memory tier: refused old rank %d's record in this node's memory: %s", owner, err)
                    pending.append(owner)
                    continue
                headers[owner] = header
                if blob is not None:
                    blobs[owner] = blob
    return headers, blobs


# --------------------------------------------------------------------------- 2. plan
def _plan(request: Dict[str, Any], headers: Dict[int, Any], blobs: Dict[int, bytes], trusted: bool,
          allowed_globals: Optional[Iterable[Any]], where: str) -> Tuple[List[Tuple[SavedPiece, Box, torch.Tensor]], Dict[Need, Tuple[int, int]],
                                                     Any, Dict[str, Any]]:
    pieces: Dict[str, List[SavedPiece]] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    objects: Dict[str, Tuple[int, int]] = {}
    sizes: Dict[Need, int] = {}
    seen: Set[Tuple[Any, ...]] = set()
    for owner in sorted(headers):
        regions = headers[owner]["regions"]
        for s in headers[owner]["shards"]:
            if s["kind"] == "object":
                objects.setdefault(s["unique_key"], (owner, int(s["index"])))
                continue
            if entry_id(s) in seen:  # a replica of a shard already indexed
                continue
            seen.add(entry_id(s))
            shapes.setdefault(s["key"], tuple(s["global_shape"]))
            pieces.setdefault(s["key"], []).extend(saved_pieces(owner, s))
            sizes[(owner, int(s["region"]))] = int(regions[int(s["region"])][2])
    sharded, _common, nonpersistent, factories, template = split_state_dict(request)
    unpickled: Dict[int, Any] = {}
    todo: List[Tuple[SavedPiece, Box, torch.Tensor]] = []
    needs: Dict[Need, Tuple[int, int]] = {}
    device_copies: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def prepare(sh: object) -> Any:
        if isinstance(sh, ShardedObject):
            found = objects.get(sh.unique_key)
            if found is None:
                raise MemoryLayoutError(f"object {sh.unique_key!r} is in no snapshot")
            owner, index = found
            if owner not in unpickled:
                unpickled[owner] = safe_torch_load(io.BytesIO(blobs[owner]), trusted=trusted,
                                                   allowed_globals=allowed_globals, what=f"objects of {where}")
            return unpickled[owner]["objects"][index]
        if not isinstance(sh, ShardedTensor):
            return sh
        if shapes.get(sh.key) != tuple(sh.global_shape):
            raise MemoryLayoutError(f"{sh.key!r} " + ("is in no snapshot" if sh.key not in shapes else
                                    f"was saved with global shape {shapes[sh.key]}, requested {tuple(sh.global_shape)}"))
        out, host = host_destination(sh, device_copies)
        for part in replace(sh, data=host).unflattened():
            box = Box(tuple(part.global_offset), part.saved_shape())
            taken, left = cover(box, pieces[sh.key])
            if left:
                raise MemoryLayoutError(f"{left} of the {box.numel} elements of {sh.key!r} {box} are in no snapshot")
            for piece, ov in taken:
                todo.append((piece, ov, part.data[relative_slices(ov, box)[part.prepend_axis_num:]]))
                es = dtype_from_name(piece.dtype).itemsize
                first, end = piece.extent(ov)
                lo, hi = needs.get((piece.owner, piece.region), (first * es, end * es))
                needs[(piece.owner, piece.region)] = (min(lo, first * es), max(hi, end * es))
        return out

    loaded = dict_list_map_inplace(prepare, sharded)
    needs = {n: block_hull(lo, hi, sizes[n], DEFAULT_BLOCK_SIZE) for n, (lo, hi) in needs.items()}
    extra = {"nonpersistent": nonpersistent, "factories": factories, "template": template, "device_copies": device_copies}
    return todo, needs, loaded, extra


# --------------------------------------------------------------------------- 3. fetch
def _fetch(needs: Dict[Need, Tuple[int, int]], headers: Dict[int, Any], inv: Inventory, key: Key, root: str, group: Group,
           copies: Dict[int, List[CopyLocation]], refused: Set[Tuple[int, str]], report: ElasticRestore,
           where: str) -> Dict[Need, Tuple[int, torch.Tensor]]:
    rank = dist.get_rank(group)
    node = inv.nodes[rank]
    done: Dict[Need, Tuple[int, torch.Tensor]] = {}
    records = {o: slots.Record(h, b"") for o, h in headers.items()}
    maps: Dict[Tuple[int, str], torch.Tensor] = {}  # (old rank, file) -> this node's file, mapped once
    while True:
        chosen, _missing = choose_sources(sorted(copies), copies, refused)  # the same on every rank
        local: List[Need] = []
        asks: List[Tuple[int, int, int, int, int]] = []  # (old rank, region, lo, hi, serving rank)
        gone: List[int] = []
        for n, (lo, hi) in sorted(needs.items()):
            if n in done:
                continue
            if any(c.node == node and (n[0], node) not in refused for c in copies.get(n[0], ())):
                local.append(n)
            elif n[0] in chosen:
                asks.append((n[0], n[1], lo, hi, chosen[n[0]][1]))
            else:
                gone.append(n[0])
        everyone = dist.all_gather_object(asks, group)
        failed = _transfer(everyone, rank, records, inv, key, root, group, done, maps, report, where)
        for n in local:
            failed += _read_local(n, needs[n], records[n[0]], inv, key, root, rank, done, maps, report, where)
        outcome = dist.all_gather_object((failed, sorted(set(gone))), group)
        lost = sorted({o for _, g in outcome for o in g})
        if lost:
            raise MemoryCheckpointError(f"{where}: no intact copy left in memory of what old rank(s) {lost} saved; "
                                        "refused: " + ("; ".join(report.refused) or "none")
                                        + ". Load the durable checkpoint instead")
        news = [(r, f) for r, (fs, _) in enumerate(outcome) for f in fs]
        if not news:
            return done
        for r, (owner, copy_node, why) in news:
            refused.add((owner, copy_node))
            report.refused.append(f"old rank {owner}'s copy on node {copy_node[:8]} (read by rank {r}): {why}")
            if r == rank:
                logger.warning("memory tier: rank %d refused old rank %d's copy of step %d on node %s: %s", rank, owner,
                               key[0], copy_node[:8], why)


def _verify(buf: torch.Tensor, lo: int, rec: slots.Record, region: int, what: str) -> None:
    name, offset, nbytes, digests = rec.regions[region]
    b = DEFAULT_BLOCK_SIZE
    slots.verify_region(buf.numpy(), digests[lo // b:lo // b + -(-buf.numel() // b)], what, rec.block_hash)


def _note(report: ElasticRestore, source: str, owner: int, region: int, lo: int, hi: int) -> None:
    report.sources.setdefault(source, []).append(f"old rank {owner} region {region} bytes {lo}..{hi}")


def _mapped(maps: Dict[Tuple[int, str], torch.Tensor], root: str, owner: int, rec: slots.Record, name: str) -> torch.Tensor:
    """This node's file ``name`` of ``owner``'s copy, mapped once per restore (read or served from)."""
    if (owner, name) not in maps:
        maps[(owner, name)] = slots.open_files(root, owner, {name: rec.files()[name]})[name]
    return maps[(owner, name)]


def _read_local(n: Need, span: Tuple[int, int], rec: slots.Record, inv: Inventory, key: Key, root: str, rank: int,
                done: Dict[Need, Tuple[int, torch.Tensor]], maps: Dict[Tuple[int, str], torch.Tensor],
                report: ElasticRestore, where: str) -> List[Tuple[int, str, str]]:
    """Read a range from the copy in this node's memory (any rank of the node may: it is the node's directory)."""
    owner, region = n
    lo, hi = span
    node = inv.nodes[rank]
    try:
        if inv.slot_of(rank, owner, key) is None:  # (what this rank scanned: this node's directory)
            raise CorruptCheckpointError(f"the copy of old rank {owner} disappeared")
        name, offset, _nbytes, _ = rec.regions[region]
        # a view of the file's mapping: its pages are the node's shared memory, mapped, not copied
        # (a read into a fresh buffer faults in and zeroes a page per 4 KiB first: 2-3x slower)
        buf = _mapped(maps, root, owner, rec, name)[offset + lo:offset + hi]
        _verify(buf, lo, rec, region, f"{where}, old rank {owner}'s region {region} in this node's memory")
    except Exception as e:  # noqa: BLE001 - refused; another copy is tried
        return [(owner, node, describe_error(e))]
    done[n] = (lo, buf)
    _note(report, "own node", owner, region, lo, hi)
    return []


def _transfer(everyone: List[List[Tuple[int, int, int, int, int]]], rank: int, records: Dict[int, slots.Record],
              inv: Inventory, key: Key, root: str, group: Group, done: Dict[Need, Tuple[int, torch.Tensor]],
              maps: Dict[Tuple[int, str], torch.Tensor], report: ElasticRestore, where: str) -> List[Tuple[int, str, str]]:
    """Serve the ranges asked of this rank and receive those it asked for (in one order on both
    sides). A server that cannot read its copy sends zeros: the receiver's digest check refuses them."""
    moves = Transfers(group, _TAG)
    for requester, asks in enumerate(everyone):
        for owner, region, lo, hi, server in asks:
            if server != rank:
                continue
            name, offset, _n, _ = records[owner].regions[region]
            try:
                if inv.slot_of(rank, owner, key) is None:
                    raise CorruptCheckpointError(f"the copy of old rank {owner} disappeared")
                data = _mapped(maps, root, owner, records[owner], name)[offset + lo:offset + hi]
            except Exception as e:  # noqa: BLE001
                logger.warning("memory tier: rank %d cannot serve old rank %d's copy: %s", rank, owner, e)
                data = torch.zeros(hi - lo, dtype=torch.uint8)
            moves.send(data, requester)
    received = []
    for owner, region, lo, hi, server in everyone[rank]:
        buf = torch.empty(hi - lo, dtype=torch.uint8)
        moves.recv(buf, server)
        received.append((owner, region, lo, hi, server, buf))
    try:
        moves.settle()
    except Exception as e:  # a dead peer or a timeout: the restore fails on every rank
        raise MemoryCheckpointError(f"{where}: fetching from a peer failed: {describe_error(e)}") from None
    failed = []
    for owner, region, lo, hi, server, buf in received:
        try:
            _verify(buf, lo, records[owner], region, f"{where}, old rank {owner}'s region {region} from rank {server}")
        except CorruptCheckpointError as e:
            failed.append((owner, inv.nodes[server], str(e)))
            continue
        done[(owner, region)] = (lo, buf)
        _note(report, f"peer rank {server}", owner, region, lo, hi)
    return failed
