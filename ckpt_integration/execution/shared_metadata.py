"""A load reads the checkpoint's metadata once and shares it: one reader, one broadcast.

The coordinator reads ``metadata.json``, ``manifest.json`` and the chunk index
(``chunk_index.bin``, or ``.metadata`` where a checkpoint has none; with their checks:
commit marker, checksums, safe unpickling) and broadcasts them as one compact message
(a string table and integers, see :mod:`..planning.records`): no pickle crosses ranks,
and the filesystem sees one reader instead of one per rank.
Every rank rebuilds the same :class:`SharedMetadata`. A failure on the coordinator
arrives on every rank as the same exception type and message, as if each had read
the files itself.

For zarr checkpoints only ``metadata.json`` and the manifest travel this way; each
rank's reader still opens the zarr index itself (storage layer).

:func:`open_shared` gives every rank an :class:`~..storage.opened.OpenedCheckpoint` of the
commit the coordinator read, which the load passes down with the :class:`SharedMetadata`.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import asdict, dataclass, replace
from typing import Iterable, Optional, Tuple, Union

from torch.distributed.checkpoint.metadata import Metadata

from .. import errors as errors_mod
from ..planning.records import MessageWriter, decode
from ..storage import checkpoint_dir as ckdir
from ..storage.checkpoint_index import CheckpointIndex
from ..storage.chunk_index import CHUNK_INDEX_FILE, CompactMetadata, compact_of_index, parse_index
from ..storage.filesystem import canonical
from ..storage.item_table import ItemTable
from ..storage.opened import OpenedCheckpoint
from . import dist
from .dist import Group


@dataclass
class SharedMetadata:
    """A checkpoint's metadata as a load uses it.

    ``compact`` is the checkpoint's chunk index (:mod:`..storage.chunk_index`: read from
    ``chunk_index.bin``, or encoded from ``.metadata`` where there is none; None for zarr,
    whose readers read the zarr index). ``metadata`` is the whole DCP ``Metadata`` where the
    coordinator unpickled it; elsewhere it is decoded from the index on demand.
    :meth:`metadata_for` builds chunk records only for the keys a rank requests (every key is
    listed, with its dtype and shape), so a rank's work is O(keys + its chunks) rather than
    O(all chunks).
    """

    backend: str
    metadata: Optional[Metadata]
    manifest: Optional[ckdir.Manifest]
    compact: Optional[CompactMetadata] = None
    config: Optional[ckdir.CheckpointingConfig] = None  # metadata.json
    path: str = ""  # where the coordinator opened it (``filesystem.canonical``): every rank must read there

    def metadata_for(self, keys: Optional[Iterable[str]] = None) -> Optional[Metadata]:
        """The DCP ``Metadata`` to load ``keys`` (all keys when None): with an index, the requested
        keys with their dtype and shape (``chunk_index.checkpoint_keys`` names every key), storage
        records of the requested objects and **no tensor chunk lists** (see
        :meth:`CompactMetadata.metadata_for`)."""
        if self.compact is None:
            return self.metadata
        return self.compact.metadata_for(keys)

    def full_metadata(self) -> Optional[Metadata]:
        """The whole DCP ``Metadata``, chunk lists included (decoded once from the index)."""
        if self.metadata is None and self.compact is not None:
            self.metadata = self.compact.full()
        return self.metadata


# The broadcast: a frame with the lengths of the head and of the item table and whether they are
# compressed, the head (backend, manifest text, commit marker, path), the manifest's item table (format
# 4: its binary columns as the coordinator decoded them, so no other rank parses text or base64;
# older formats: nothing, their tables travel in the manifest's JSON text), then the chunk index
# as stored (already compressed: the coordinator sends the file's bytes, neither decoding nor
# re-encoding them). Head and table are compressed (zlib level 1) only for a job on several
# nodes: on one node the broadcast is a copy through shared memory, and compressing the JSON tables of
# format 3 for 20,000 small tensors (2.6 MB) took 26 ms on the coordinator and 7 ms on every other rank.
# Compressed, the table travels in its wire form (``ItemTable.for_wire``: without the item digests
# that its block digests determine, its integer columns as differences). The frame's flags: 1
# compressed, 2 a table in wire form, 4 a format-6 checkpoint: ``index.bin`` as stored in place of the
# table and the chunk index (compressed already; each rank derives both from it).
_LEVEL = 1
_FRAME = struct.Struct("<IBQ")
_COMPRESSED, _WIRE, _INDEX = 1, 2, 4


def one_node(group: Group = None) -> bool:
    """Whether every rank of ``group`` runs on this node, as torchrun says (``LOCAL_WORLD_SIZE``
    at least the group's size); unknown (no ``LOCAL_WORLD_SIZE``): False."""
    lws = dist.local_world_size()
    return lws is not None and lws >= dist.get_world_size(group)


def encode_shared(shared: SharedMetadata, compress: bool = True) -> bytes:
    w = MessageWriter()
    w.sid("")  # index 0: no error
    config = json.dumps(asdict(shared.config)) if shared.config is not None else ""
    m = shared.manifest
    text = "" if m is None else ckdir.manifest_json(replace(m, tables=""))
    w.add(0, w.sid(shared.backend), w.sid(text), w.sid(config), w.sid(shared.path))
    index = m.index() if m is not None else None
    if index is not None:  # format 6: index.bin as stored (compressed already); every view is derived from it
        return _frame(w, index.raw, compress, flags=_INDEX)
    table = m.item_table() if m is not None else None
    raw, wire = b"", False
    if table is not None:  # (a table that arrived in wire form is sent on in it: those are its bytes)
        raw, wire = table.for_wire() if compress else (table.raw, table.wire)
    return _frame(w, shared.compact.raw if shared.compact is not None else b"", compress, raw,
                  _WIRE if wire else 0)


def _frame(head: MessageWriter, index: bytes, compress: bool = True, table: bytes = b"", flags: int = 0) -> bytes:
    h = zlib.compress(head.tobytes(), _LEVEL) if compress else head.tobytes()
    t = zlib.compress(table, _LEVEL) if compress and table else table
    flags |= _COMPRESSED if compress else 0
    return _FRAME.pack(len(h), flags, len(t)) + h + t + index


def encode_failure(e: BaseException) -> bytes:
    w = MessageWriter()
    w.add(1, w.sid(type(e).__name__), w.sid(str(e)))
    return _frame(w, b"")


def decode_shared(buf: bytes, where: str = "the broadcast chunk index") -> SharedMetadata:
    n, flags, nt = _FRAME.unpack_from(buf, 0)
    compressed = flags & _COMPRESSED
    head = buf[_FRAME.size : _FRAME.size + n]
    strings, ints = decode(zlib.decompress(head) if compressed else head)
    if ints[0]:
        raise _rebuild_failure(strings[ints[1]], strings[ints[2]])
    backend, manifest_json, config_json, path = (strings[i] for i in ints[1:5])
    manifest = ckdir.Manifest(**json.loads(manifest_json)) if manifest_json else None
    config = ckdir.CheckpointingConfig(**json.loads(config_json)) if config_json else None
    table = buf[_FRAME.size + n : _FRAME.size + n + nt]
    index = buf[_FRAME.size + n + nt :]
    if flags & _INDEX and manifest is not None:  # format 6: one index, read and checked by rank 0
        manifest.attach_index(CheckpointIndex(bytes(index), manifest.hash, f"{ckdir.INDEX_FILE} (as rank 0 read it)"))
        return SharedMetadata(backend, None, manifest, compact_of_index(manifest.index()), config=config, path=path)
    if manifest is not None:
        # the coordinator decoded and checked this table (read_manifest); decoding it here is a
        # few numpy views (its structure is checked again: the same bytes give the same verdict)
        raw = zlib.decompress(table) if compressed and table else bytes(table)
        manifest.attach_item_table(ItemTable(raw, manifest.hash, f"{ckdir.MANIFEST_FILE} (as rank 0 read it)",
                                             wire=bool(flags & _WIRE)))
    compact = parse_index(index, where) if index else None
    return SharedMetadata(backend, None, manifest, compact, config=config, path=path)


def _rebuild_failure(name: str, message: str) -> BaseException:
    """The coordinator's exception as the same type here (checkpointing errors), or a wrapper naming it."""
    cls = getattr(errors_mod, name, None)
    if isinstance(cls, type) and issubclass(cls, errors_mod.CheckpointingException):
        return cls(message)
    return errors_mod.DistributedCheckpointingError(f"rank 0 could not read the checkpoint metadata: {name}: {message}")


def read_local(checkpoint_dir: Union[str, os.PathLike], trusted: bool = False) -> SharedMetadata:
    """What the coordinator reads (also the whole job's metadata in a single process)."""
    ck = checkpoint_dir if isinstance(checkpoint_dir, OpenedCheckpoint) else OpenedCheckpoint(checkpoint_dir, trusted)
    return shared_of(ck)


def shared_of(ck: OpenedCheckpoint) -> SharedMetadata:
    """What an opened checkpoint read, as a load uses it (its chunk index: ``.metadata`` is
    unpickled only where the index is missing or does not describe it)."""
    compact = ck.chunk_index()
    return SharedMetadata(ck.backend, ck.loaded_metadata(), ck.manifest, compact, config=ck.config, path=canonical(ck))


def open_shared(checkpoint_dir: Union[str, os.PathLike], group: Group = None, trusted: bool = False) -> Tuple[OpenedCheckpoint, SharedMetadata]:
    """Collective: open ``checkpoint_dir`` on the coordinator (``metadata.json``, manifest,
    ``.metadata``: read and checked once for the job) and give every rank an opened checkpoint of
    the same commit, built from one broadcast without touching storage. A failure on the
    coordinator is raised on every rank."""
    if not dist.is_distributed() or dist.get_world_size(group) == 1:
        ck = OpenedCheckpoint(checkpoint_dir, trusted)
        ck.shared = shared_of(ck)
        return ck, ck.shared
    coord = dist.coordinator_rank(group)
    payload: Optional[bytes] = None
    local: Optional[BaseException] = None
    ck: Optional[OpenedCheckpoint] = None
    if dist.get_rank(group) == 0:
        try:
            ck = OpenedCheckpoint(checkpoint_dir, trusted)
            ck.shared = shared_of(ck)
            payload = encode_shared(ck.shared, compress=not one_node(group))
        except Exception as e:  # every rank raises it, below
            payload, local = encode_failure(e), e
    payload = dist.broadcast_bytes(payload, src=coord, group=group)
    if local is not None:
        raise local
    if ck is not None:  # the coordinator plans from the same index (chunk records of its keys only)
        return ck, ck.shared
    shared = decode_shared(payload, f"{checkpoint_dir}/{CHUNK_INDEX_FILE} (as rank 0 read it)")
    ck = OpenedCheckpoint(checkpoint_dir, trusted, config=shared.config, manifest=shared.manifest, shared=shared)
    return ck, shared
