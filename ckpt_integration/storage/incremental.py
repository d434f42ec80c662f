"""Incremental saves: which data files an earlier checkpoint of the same job already holds (storage layer).

A save given a *base* (``save(..., base=earlier_checkpoint)``) does not write a data file whose every
item is bit-identical to an item of one of the base's files: it puts that file in place by a hard
link (a server-side copy on object stores, :meth:`~.filesystem.Storage.link`) and records the
base's rows for its items. Every checkpoint therefore stays a complete directory of the ordinary
format that PyTorch DCP, Megatron-Core and every tool of this library read, and deleting any
checkpoint never breaks another (a hard link is a second name of the same bytes).

What is unchanged is decided by the digests the base recorded: a tensor item is unchanged when its
dtype, shape and data length equal the base item's and every data block's digest, computed now over
the bytes about to be saved, equals the recorded one (the first differing block ends the check, so a
trained tensor costs one block of hashing); an object when the digest of its bytes is equal. Only
the base files this rank's own writer wrote (``[prefix]__<rank>_<i>.distcp``) are candidates: the
ranks of a job whose layout did not change write the same items each save, and no two ranks can then
link one file.

So that whole files stay unchanged, a save puts the items expected to stay as they are in data
files of their own (:func:`stable_requests`): parameters with ``requires_grad=False`` (a frozen base
model, frozen embeddings) and items found unchanged against the base but stored in a file beside
changed ones. The first save of a fine-tuning job thus already separates the frozen weights, and
every later save links them.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch

from ..errors import CheckpointingException, CorruptCheckpointError
from ..planning.written import Blocks as Digests
from .checksum import BlockHash, block_hash
from .filesystem import CheckpointLocation, Storage, join
from .fs import tensor_buffer
from .item_table import BlockRecord
from .readers import retried
from .region_read import Blocks, verify_blocks

logger = logging.getLogger(__name__)

_DATA_FILE = re.compile(r"^(.*)__(\d+)_(\d+)\.distcp$")


def data_file_parts(name: str) -> Optional[Tuple[str, int, int]]:
    """``(prefix, rank, index)`` of a data file named ``[prefix]__<rank>_<index>.distcp``, else None."""
    m = _DATA_FILE.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), int(m.group(3)))


@dataclass(frozen=True)
class BaseItem:
    """One item of a base data file, as the base recorded it."""

    key: str
    offsets: Optional[Tuple[int, ...]]  # None for objects
    sizes: Optional[Tuple[int, ...]]
    dtype: Optional[torch.dtype]
    start: int
    length: int
    digest: int
    blocks: Optional[Digests]


@dataclass
class BaseFiles:
    """The data files of a base checkpoint that one rank may take, with their items."""

    directory: str
    storage: Storage
    block_hash: str
    files: Dict[str, List[BaseItem]] = field(default_factory=dict)  # the items of the keys this save writes
    counts: Dict[str, int] = field(default_factory=dict)  # how many items each file holds in all
    sizes: Dict[str, int] = field(default_factory=dict)  # recorded sizes (a truncated file is not taken)
    recorded: Any = None  # the base's fingerprints (storage.fingerprint.Recorded), where it has them


def base_files(opened: CheckpointLocation, rank: int, keys: Iterable[str]) -> Tuple[Optional[BaseFiles], str]:
    """What ``rank`` may take from the opened checkpoint ``opened``: the items of ``keys`` (the storage keys
    this save writes) stored in this rank's own data files there, or ``(None, why not)``: a base of another
    backend or whose digests are of another
    algorithm cannot be compared. Only those keys' records are decoded, and the table is searched once
    for all of them: a save of 20,000 small tensors pays milliseconds, not a second."""
    manifest = getattr(opened, "manifest", None)
    if getattr(opened, "backend", None) != "torch_dist" or manifest is None:
        return None, "it is not a torch_dist checkpoint of this library"
    table = manifest.item_table()
    md = opened.chunk_index().metadata_of(keys)
    out = BaseFiles(opened.path, opened.storage, manifest.hash.name, recorded=manifest.recorded_fingerprints())
    own: List[Tuple[Any, Any]] = []
    mine: Dict[str, bool] = {}  # file name -> written by this rank (a few files, thousands of items)
    for index, info in md.storage_data.items():
        name = info.relative_path
        if name not in mine:
            parts = data_file_parts(name)
            mine[name] = parts is not None and parts[1] == rank
        if mine[name]:
            own.append((index, info))
    if not own:
        return out, ""
    rids = [(info.relative_path, int(info.offset)) for _, info in own]
    rows = table.rows(rids)
    blocks = manifest.block_records().digests_many(rids)
    chunk_sizes: Dict[str, Dict[Tuple[int, ...], Tuple[int, ...]]] = {}
    for (index, info), row, rec in zip(own, rows.tolist(), blocks):
        if row < 0:
            continue
        smd = md.state_dict_metadata.get(index.fqn)
        offsets = None if index.offset is None else tuple(int(x) for x in index.offset)
        dtype = sizes = None
        if offsets is not None:
            if not hasattr(smd, "chunks"):
                continue
            if index.fqn not in chunk_sizes:
                chunk_sizes[index.fqn] = {tuple(c.offsets): tuple(c.sizes) for c in smd.chunks}
            sizes = chunk_sizes[index.fqn].get(offsets)
            dtype = smd.properties.dtype
        out.files.setdefault(info.relative_path, []).append(
            BaseItem(index.fqn, offsets, sizes, dtype, int(info.offset), int(info.length), table.item_digest(row), rec))
    for name in out.files:
        out.counts[name] = table.count_in(name)  # every item of the file, also those of keys this save does not write
        out.sizes[name] = int((manifest.files.get(name) or {}).get("size", -1))
    return out, ""


def _same_tensor(t: torch.Tensor, item: BaseItem, h: BlockHash) -> bool:
    """Whether ``t`` holds exactly the data ``item`` recorded (dtype, shape, every data block's digest)."""
    if item.blocks is None or item.dtype != t.dtype or item.sizes != tuple(t.shape):
        return False
    data_offset, n, bs, digests = item.blocks
    if n != t.numel() * t.element_size() or bs <= 0:
        return False
    first = 1 if data_offset > 0 else 0  # (the archive header's digest comes first)
    if len(digests) < first + -(-n // bs):
        return False
    if t.is_cpu and t.is_contiguous():  # (most tensors: one view of the bytes, no tensor op per block)
        data = tensor_buffer(t)
        return all(h.digest(data[k : k + bs]) == digests[first + j] for j, k in enumerate(range(0, n, bs)))
    # block by block, each to host memory on its own: a device tensor is never copied whole, and a strided one
    # (a column block of a matrix) is walked in element order, its stored order, with no byte view of it
    flat, per = t.detach().reshape(-1), bs // t.element_size()
    if per * t.element_size() != bs:
        return False
    for j, k in enumerate(range(0, t.numel(), per)):
        if h.digest(tensor_buffer(flat[k : k + per].cpu().contiguous())) != digests[first + j]:
            return False
    return True


def _same_bytes(data: bytes, item: BaseItem, h: BlockHash) -> bool:
    if item.offsets is not None or item.length != len(data):
        return False
    hasher = h.hasher()
    hasher.update(data)
    return hasher.intdigest() == item.digest


def unchanged(data: Union[torch.Tensor, bytes, bytearray, memoryview], item: BaseItem, h: BlockHash) -> bool:
    """Whether the request's ``data`` (a tensor chunk or an object's bytes) equals ``item``."""
    if isinstance(data, torch.Tensor):
        return _same_tensor(data, item, h)
    return _same_bytes(bytes(data), item, h)


@dataclass
class Reuse:
    """One rank's decision: base files to take whole (name -> [(request index, base item)]) and the
    requests found unchanged (to be written into stable files where their base file cannot be taken)."""

    base: BaseFiles
    linked: Dict[str, List[Tuple[int, BaseItem]]] = field(default_factory=dict)
    unchanged: Set[int] = field(default_factory=set)


def plan_reuse(requests: Sequence[Any], base: BaseFiles, h: BlockHash,
               fingerprints: Optional[Sequence[Optional[int]]] = None, hint: Optional[str] = None) -> Reuse:
    """Which of ``base``'s files hold exactly some of ``requests`` (``WriteRequest``s) and nothing else.

    ``hint``: the save's ``separation_hint``; a file holding keys on both sides of it is not taken (the
    save puts them into files of their own, which ``remove_sharded_tensors`` can then delete).

    ``fingerprints`` (one per request, as the save computes them for its manifest): a tensor whose
    fingerprint differs from the one the base recorded has changed, without hashing its bytes (every
    trained tensor and optimizer state at every save); an equal one is still compared block by block."""
    out = Reuse(base)
    if base.block_hash != h.name:
        return out
    by_item = {(r.storage_key, None if r.offsets is None else tuple(r.offsets)): i for i, r in enumerate(requests)}
    for name, items in base.files.items():
        pairs: List[Tuple[int, BaseItem]] = []
        whole = True
        for it in items:
            i = by_item.get((it.key, it.offsets))
            if i is None or _fingerprint_differs(base, it, fingerprints[i] if fingerprints is not None else None) \
                    or not unchanged(requests[i].data, it, h):
                whole = False
                continue
            out.unchanged.add(i)
            pairs.append((i, it))
        # a file is taken only if its items end where it ends: one that kept the bytes of items removed from
        # the base's table (``remove_sharded_tensors``) is written anew (and its dead bytes left behind)
        if whole and pairs and len(pairs) == base.counts.get(name, -1) \
                and max(it.start + it.length for _, it in pairs) == base.sizes.get(name, -1) \
                and (not hint or len({it.key.startswith(hint) for _, it in pairs}) == 1):
            out.linked[name] = pairs
    return out


def _fingerprint_differs(base: BaseFiles, item: BaseItem, value: Optional[int]) -> bool:
    if value is None or item.offsets is None or base.recorded is None:
        return False
    recorded = base.recorded.chunk(item.key, item.offsets)
    return recorded is not None and recorded[1] != value


def take_file(reuse: Reuse, name: str, directory: str, storage: Storage) -> Optional[bool]:
    """Put the base file ``name`` into ``directory`` (hard link / server-side copy), then read it and check
    every byte of its items against the digests the base recorded. True: taken; False: no link or copy is
    possible here; None: the file is not as the base recorded it (logged). Nothing is left behind unless
    True: the caller writes the bytes from memory.

    The save's own rows for these items are the base's (computed from memory, they equal them): a file
    damaged on disk since the base was saved would otherwise enter the new checkpoint under digests it
    fails, and every later incremental save would link it again (a run with ``base="auto"`` and top-k
    deletion would keep no loadable checkpoint). Reading costs less than the write it replaces."""
    base = reuse.base
    src, dst = join(base.directory, name), join(directory, name)
    try:
        why = None
        if not storage.remote and os.path.islink(src):
            # a hard link of a symbolic link is that link (into the base, or anywhere): the new checkpoint
            # would be refused by loads, or broken when what it points to is deleted
            why = "it is a symbolic link, not a file of the checkpoint"
        elif base.sizes.get(name, -1) < 0 or storage.size(src) != base.sizes[name]:
            why = "its size is not the one recorded"  # (truncated or replaced since the base committed)
    except OSError:
        return None
    if why is not None:
        logger.warning("incremental save: the base's %s is not intact (%s): writing its items from memory instead",
                       src, why)
        return None
    ident = _identity(storage, src)
    if not storage.link(src, dst):
        return False
    try:
        if storage.size(dst) == base.sizes[name]:
            # these items checked by this process since the file last changed: the identity holds the change
            # time, which every write sets (a tool that puts the modification time back cannot); the link sets
            # it too, so the identity after it is the one the next save finds. Items, not the file: a base whose
            # table lost some (``remove_sharded_tensors``) checks fewer, which says nothing of the others' bytes
            items = [it for _, it in reuse.linked.get(name, [])]
            checked = frozenset((it.start, it.length, it.digest, base.block_hash) for it in items)
            # (only when what was linked is the file the identity was taken of: replaced in between by another
            # writer's overwrite, the path named other bytes at the link, which nobody checked)
            after = _identity(storage, dst)  # (a read leaves it as it is: the one remembered below too)
            same = ident is not None and _linked_is(storage, ident, after, src)
            before = _INTACT.get(ident, frozenset()) if same else frozenset()
            why = None if checked <= before else _damage(storage, dst, items, block_hash(base.block_hash))
            if why is None:
                _remember(after, checked | before)
                return True
    except (OSError, CheckpointingException) as e:
        why = str(e)
    storage.remove_any(dst)
    logger.warning("incremental save: the base's %s is not intact (%s): writing its items from memory instead", src, why)
    return None


# files this process checked and found as their base recorded them, by identity, with the items checked
# (start, length, digest, digest kind): each save of a job links the same base files again, and reads each
# once (a file changed since has another identity)
_INTACT: Dict[Tuple[Any, ...], FrozenSet[Tuple[int, int, int, str]]] = {}
_INTACT_LOCK = threading.Lock()


def _remember(ident: Optional[Tuple[Any, ...]], checked: FrozenSet[Tuple[int, int, int, str]]) -> None:
    if ident is not None:
        with _INTACT_LOCK:
            _INTACT[ident] = checked
            while len(_INTACT) > 4096:
                _INTACT.pop(next(iter(_INTACT)))


def _identity(storage: Storage, path: str) -> Optional[Tuple[Any, ...]]:
    """What identifies the bytes of ``path``: device, inode, size, modification and change time locally; size and
    ETag (or modification time) on an object store; None where unknown (the file is then always checked)."""
    try:
        if not storage.remote:
            st = os.stat(path)
            return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
        info = retried(storage.fs, "info", path)
    except (OSError, CheckpointingException):
        return None
    tag = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime")
    return None if tag is None else (path, info.get("size"), str(tag))


def _linked_is(storage: Storage, ident: Tuple[Any, ...], linked: Optional[Tuple[Any, ...]], src: str) -> bool:
    """Whether the file linked (its identity ``linked``) is the one ``ident`` was taken of: locally the same inode
    (a link changes the change time, not the inode); on an object store the source unchanged after the copy."""
    if not storage.remote:
        return linked is not None and linked[:2] == ident[:2]
    return _identity(storage, src) == ident


def _damage(storage: Storage, path: str, items: Sequence[BaseItem], h: BlockHash, piece: int = 32 << 20) -> Optional[str]:
    """Why the items of the file ``path`` do not hold the bytes their base recorded, or None. Items with
    block digests are checked in pieces of about ``piece`` bytes, whole blocks each; others whole."""
    f = storage.open_reader(path, "base data file")
    buf = None  # one buffer for every piece (fresh memory per piece costs more than its hashing)
    try:
        for it in items:
            what = f"{it.key!r}" + ("" if it.offsets is None else f" at {list(it.offsets)}")
            if it.blocks is None:
                if h.digest(f.read(it.start, it.length)) != it.digest:
                    return f"{what}: its bytes differ from the base's record"
                continue
            d, n, bs, digests = it.blocks
            blocks = Blocks(BlockRecord(d, n, bs, digests, h).bounds(it.length), digests, h)
            bounds = blocks.lists()[0]
            i = 0
            while i < len(bounds) - 1:
                j = i + 1
                while j < len(bounds) - 1 and bounds[j + 1] - bounds[i] <= piece:
                    j += 1
                n = bounds[j] - bounds[i]
                if buf is None or len(buf) < n:
                    buf = bytearray(max(n, min(piece, it.length)))
                view = memoryview(buf)[:n]
                f.read_into(view, it.start + bounds[i])
                verify_blocks(blocks, path, it.start, what, bounds[i], view)
                i = j
    except (CorruptCheckpointError, ValueError) as e:
        return str(e)
    finally:
        f.close()
    return None


__all__ = ["BaseFiles", "BaseItem", "Reuse", "base_files", "data_file_parts", "plan_reuse", "take_file",
           "unchanged"]
