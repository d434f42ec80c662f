"""``verify``: completeness of a checkpoint and the checksum of every file, item and block it records.

Everything is opened through the storage layer, as every load opens it: names from
``.metadata``, ``manifest.json`` or ``zarr_index.json`` that lead outside the checkpoint
(absolute, ``..``, separators, symbolic links out) are refused and special files (FIFOs,
devices, directories) are reported without being read, each as a problem of the report.
Data is streamed in pieces of 8 MiB, so memory stays small whatever the checkpoint size.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ..checkpoints import list_checkpoints
from ..errors import (CheckpointingException, CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError,
                      UnsupportedCheckpointError)
from ..storage import checkpoint_dir as ckdir
from .verify_files import (index_metadata, integrity_manifest_holds, read_manifest, recorded, recorded_size,
                           verify_common, verify_other_recorded_files)
from ..storage import chunk_index
from ..storage.checksum import CRC32, BlockHash, block_hash
from ..storage.filesystem import CheckpointLocation, FileReader, join, locate, name_problem
from ..storage.fingerprint import add, fingerprint
from ..storage.opened import OpenedCheckpoint, pinned
from ..storage.tensor_record import parse_tensor_record
from ..storage.torch_dist import DCP_METADATA_FILE, read_dcp_metadata
from ..storage.torch_dist_reader import TorchDistReader, load_item_tensor
from ..storage.zarr_backend import ZarrReader
from .common import READ_PIECE, ProgressFactory, dtype_size, no_progress, format_size, parse_size
from .sources import DistCheckpointSource


@dataclass
class VerifyReport:
    """Result of :func:`verify_checkpoint`; ``ok`` is False when anything is damaged, missing or refused.

    ``items_checked`` / ``bytes_checked``: stored items (tensor chunks, objects, zarr chunk
    files) and their bytes; ``blocks_checked``: block checksums compared; ``block_hash``: their
    algorithm (``"xxh3_64"`` for new saves, or ``"crc32"``; None without a manifest or for zarr); ``files_checked``: whole files compared with their
    recorded size and CRC32 (``.metadata``, ``common.pt``).
    """

    path: str
    ok: bool = True
    checksums_available: bool = False
    block_hash: Optional[str] = None
    items_checked: int = 0
    bytes_checked: int = 0
    blocks_checked: int = 0
    files_checked: int = 0
    problems: List[Dict[str, Any]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    state_checked: int = 0  # tensors whose read-back fingerprint was compared (verify --state)

    def add(self, message: str, file: Optional[str] = None, keys: Sequence[str] = (), unsupported: bool = False,
            unreadable: bool = False) -> None:
        """A problem; ``unsupported``: not damage, but something this version cannot verify as it
        is (an older manifest format to convert, a block digest it does not know); ``unreadable``: not
        damage, the storage did not answer (an object store's errors after every retry)."""
        self.ok = False
        for p in self.problems:  # one damage seen by two checks (e.g. a damaged manifest) is one problem
            if p["message"] == message:
                p["keys"] = sorted(set(p["keys"]) | set(keys))
                return
        self.problems.append({"file": file, "message": message, "keys": sorted(set(keys)),
                              "kind": "unsupported" if unsupported else "unreadable" if unreadable else "damage"})

    @property
    def unreadable(self) -> bool:
        """Not verified because the storage did not answer, and no damage found (``verify`` exits 2)."""
        kinds = {p["kind"] for p in self.problems}
        return "unreadable" in kinds and "damage" not in kinds

    def to_dict(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in ("path", "ok", "checksums_available", "block_hash", "items_checked",
                                               "bytes_checked", "blocks_checked", "files_checked", "state_checked",
                                               "problems", "notes")}

    def format(self) -> str:
        lines = [f"checkpoint: {self.path}"]
        lines += [f"  note: {n}" for n in self.notes]
        if self.ok:
            what = "checksums of" if self.checksums_available else "structure and record CRC32s of"
            lines.append(f"OK: {what} {self.items_checked} items ({format_size(self.bytes_checked)}) verified")
            if self.state_checked:
                lines.append(f"OK: state of {self.state_checked} tensors read back and equal to the saved state (fingerprints)")
        else:
            damaged = any(p["kind"] == "damage" for p in self.problems)
            why = "the storage did not answer: try again" if self.unreadable else "this version cannot verify it as it is"
            lines.append(f"DAMAGED: {len(self.problems)} problem(s)" if damaged else
                         f"NOT VERIFIED: {len(self.problems)} problem(s) (not damage: {why})")
            for p in self.problems:
                lines.append(f"  - {p['message']}")
                if p["keys"]:
                    shown = ", ".join(p["keys"][:20]) + (f", ... ({len(p['keys'])} in all)" if len(p["keys"]) > 20 else "")
                    lines.append(f"    affected: {shown}")
        return "\n".join(lines)


def _item_name(index: MetadataIndex) -> str:
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}[{', '.join(str(o) for o in index.offset)}]"


# --------------------------------------------------------------------------- entry point
def verify_checkpoint(path: str, progress: ProgressFactory = no_progress, trusted: bool = False,
                      state: bool = False, memory_budget: Any = "256MiB") -> VerifyReport:
    """Check that a checkpoint is complete and undamaged, reading every byte it records.

    * every file ``manifest.json`` records has its recorded size, and ``.metadata`` and
      ``common.pt`` their recorded CRC32 (without a manifest: ``common.pt`` is a zip archive;
      a plain PyTorch DCP checkpoint has none);
    * every data file named in ``.metadata`` is a regular file inside the checkpoint, long
      enough for its items; every item matches its recorded digest and every 1 MiB block of
      tensor data its block digest (XXH3-64, or CRC32);
    * ``.metadata`` agrees with the data: each chunk's size and dtype with the stored tensor
      archive, and the chunks of every tensor cover its declared shape;
    * zarr: every chunk and object file against its record in ``zarr_index.json``, every
      array's ``zarr.json`` against the index.

    With ``state`` (``verify --state``), when the files are undamaged, every tensor is also read
    back whole, in row blocks of at most ``memory_budget`` bytes that cut across the saved chunks
    (another layout than the saved one), and its layout-independent fingerprint is compared with
    the one recorded at save (manifest format 5; docs/format.md, "Fingerprints"): the state the
    checkpoint holds, position by position, is the state that was saved.

    Problems name the file and the tensors/objects stored in the damaged part. A path that is
    not a checkpoint (missing, empty, a file, a directory of checkpoints) raises
    :class:`CheckpointNotFoundError` saying ``not a checkpoint`` and naming the checkpoints
    found inside; damage never raises, it is reported.
    """
    with pinned(path):  # (an opened checkpoint: its commit, pinned)
        # an opened checkpoint: its commit marker and manifest were read (and checked) when it was
        # opened, and the helpers below take them from it; the files verify checks are read here
        ck = locate(path)
        report = VerifyReport(str(ck))
        try:
            config: Optional[ckdir.CheckpointingConfig] = ckdir.read_config(ck)
        except CheckpointNotFoundError:
            raise _not_a_checkpoint(ck) from None
        except CheckpointingException as e:  # an interrupted save, a damaged or unsupported commit marker
            report.add(str(e), ckdir.CONFIG_FILE, unsupported=isinstance(e, UnsupportedCheckpointError))
            config = None
            if not ck.exists(DCP_METADATA_FILE):
                return report
        if not integrity_manifest_holds(ck, report):
            return report
        if config is not None and config.sharded_backend == "zarr":
            report = _verify_zarr(ck, report, progress)
        else:
            report = _verify_torch_dist(ck, report, progress, trusted)
        if state and report.ok:
            _verify_state(ck, report, progress, trusted, parse_size(memory_budget))
        return report


def _verify_state(ck: CheckpointLocation, report: VerifyReport, progress: ProgressFactory, trusted: bool,
                  budget: int) -> None:
    """Every tensor read back in row blocks and its fingerprint compared with the recorded one
    (through ``ck`` when it is an opened checkpoint)."""
    manifest = ckdir.read_manifest(ck)
    recorded = manifest.recorded_fingerprints() if manifest is not None else None
    if recorded is None:
        report.notes.append("state: the checkpoint records no fingerprints (saved before manifest format 5 or by "
                            "another tool): the state was not checkable")
        return
    with DistCheckpointSource(ck, trusted) as src:  # (a bare location: opened there)
        bar = progress(total=sum(i.nbytes for i in src.tensors.values()), unit="B", unit_scale=True, desc="state")
        try:
            for key, info in sorted(src.tensors.items()):
                expected = recorded.total(key)
                if expected is None:
                    report.add(f"tensor {key!r} has no recorded fingerprint: the manifest does not describe this "
                               "data", ckdir.MANIFEST_FILE, [key])
                    continue
                got = 0
                for box, block in src.iter_blocks(key, budget):
                    got = add(got, fingerprint(block, box.offsets))
                    bar.update(block.numel() * block.element_size())
                if got != expected:
                    report.add(f"tensor {key!r}: the state read back is not the state that was saved (its fingerprint "
                               "differs from the one recorded at save)", None, [key])
                report.state_checked += 1
        finally:
            bar.close()


def _not_a_checkpoint(ck: CheckpointLocation) -> CheckpointNotFoundError:
    """The error for a path that is no checkpoint, naming the checkpoints directly inside it."""
    storage, root, path = ck.storage, ck.path, str(ck)
    if not storage.exists(root):
        return CheckpointNotFoundError(f"{path} is not a checkpoint: it does not exist"
                                       + ckdir.interrupted_overwrite_hint(ck))
    if not storage.isdir(root):
        return CheckpointNotFoundError(f"{path} is not a checkpoint: it is a file, not a checkpoint directory")
    names = storage.listdir(root)
    if not names:
        return CheckpointNotFoundError(f"{path} is not a checkpoint: the directory is empty")
    found = list_checkpoints(root)
    found += [join(root, n) for n in names if join(root, n) not in found and storage.isdir(join(root, n))
              and ckdir.is_plain_dcp(ck.at(join(root, n)))]
    if found:
        shown = ", ".join(sorted(found)[:10]) + (f", ... ({len(found)} in all)" if len(found) > 10 else "")
        return CheckpointNotFoundError(
            f"{path} is not a checkpoint (it has no {ckdir.CONFIG_FILE}), but it holds {len(found)} "
            f"checkpoint(s): {shown}; verify each of them")
    return CheckpointNotFoundError(f"{path} is not a checkpoint: the directory has no {ckdir.CONFIG_FILE} "
                                   "and no checkpoints inside")


# --------------------------------------------------------------------------- zarr
def _verify_zarr(ck: CheckpointLocation, report: VerifyReport, progress: ProgressFactory) -> VerifyReport:
    """zarr checkpoints: every array opens and matches the index, every chunk and object file
    matches its recorded size and CRC32 (each bad file reported with its key), ``common.pt``.
    Checkpoints written before chunk records existed: every array is read in full instead."""
    manifest, _ = read_manifest(ck, report)
    verify_common(ck, manifest, report)
    if manifest is not None:
        verify_other_recorded_files(ck, manifest, set(), report)
    try:
        reader = ZarrReader(ck.afresh())  # (its index read from the file, never a kept copy)
    except CheckpointingException as e:
        report.add(str(e), "zarr_index.json")
        return report
    with reader:
        if reader.files is None:
            _verify_zarr_unrecorded(reader, report)
            return report
        report.checksums_available = True
        for key in sorted(reader.chunks):
            try:
                reader.array(key)  # zarr.json of the array: the file checks below do not read it
                reader.validate_tensor(key)  # declared shape vs the recorded chunk files
            except CheckpointingException as e:
                report.add(str(e), key, [key])
        bar = progress(total=sum(r.size for r in reader.files.values()), unit="B", unit_scale=True, desc="verify")
        try:
            for key, name, size, problem in reader.check_files():
                if problem:
                    report.add(problem, name, [key])
                else:
                    report.items_checked += 1
                    report.bytes_checked += size
                bar.update(size)
        finally:
            bar.close()
    return report


def _verify_zarr_unrecorded(reader: Any, report: VerifyReport) -> None:
    """An index without file records: read every array in full (missing chunks read as zeros)."""
    report.notes.append("zarr checkpoint written before chunk checksums were recorded: "
                        "arrays were read in full, missing chunk files cannot be detected")
    for key, chunks in sorted(reader.chunks.items()):
        box = chunks[0].box
        dtype = reader.metadata.state_dict_metadata[key].properties.dtype
        try:
            reader.read_region(key, chunks[0], box, torch.empty(box.sizes, dtype=dtype), dtype)
            report.items_checked += 1
            report.bytes_checked += box.numel * dtype_size(dtype)
        except CheckpointingException as e:
            report.add(str(e), key, [key])
    for key in reader.index.get("objects", []):
        try:
            reader.read_bytes(key)
            report.items_checked += 1
        except CheckpointingException as e:
            report.add(str(e), key, [key])


# --------------------------------------------------------------------------- torch_dist
@dataclass
class _Chunk:
    """What ``.metadata`` says a stored tensor item holds."""

    key: str
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)


def _verify_torch_dist(ck: CheckpointLocation, report: VerifyReport, progress: ProgressFactory,
                       trusted: bool) -> VerifyReport:
    manifest, manifest_reported = read_manifest(ck, report)
    report.checksums_available = manifest is not None
    report.block_hash = manifest.block_hash if manifest is not None else None
    plain = ckdir.is_plain_dcp(ck)
    if manifest is None and not manifest_reported:
        report.notes.append(("a plain PyTorch DCP checkpoint (no metadata.json): no common state and" if plain else
                             "no manifest.json (checkpoint written by another tool):") + " no checksums of ours; the "
                            "structure and the CRC32 of every tensor's zip record were verified")
    try:
        # its bytes read and checked (size + CRC32) as every load reads them
        # (read from the file, never what an opened checkpoint decoded from its index)
        md: Optional[Metadata] = read_dcp_metadata(ck.afresh(), trusted=trusted, manifest=manifest)
        if "crc32" in recorded(manifest, DCP_METADATA_FILE):
            report.files_checked += 1
    except CheckpointingException as e:
        report.add(str(e), DCP_METADATA_FILE)
        md = index_metadata(manifest, report)
    if not plain:
        verify_common(ck, manifest, report)
    data_files = {getattr(info, "relative_path", None) for info in (md.storage_data or {}).values()
                  if isinstance(getattr(info, "relative_path", None), str)} if md is not None else set()
    checked: Dict[str, bytes] = {}
    if manifest is not None:
        checked = verify_other_recorded_files(ck, manifest, data_files, report)
    if md is None:
        return report
    index = checked.get(chunk_index.CHUNK_INDEX_FILE)  # (read once: checked above, compared here)
    named = ckdir.INDEX_FILE if manifest is not None and manifest.index() is not None else chunk_index.CHUNK_INDEX_FILE
    for problem in chunk_index.index_problems(ck, manifest, md, index):  # what loads plan from vs .metadata
        report.add(problem, named)
    affected = _check_coverage(md, report)
    affected |= _DataPass(ck, md, manifest, report, progress).run()
    _validate_tensors(ck, md, manifest, affected, report)
    if isinstance(ck, OpenedCheckpoint) and report.ok and ck.loaded_metadata() is None:
        ck.dcp_metadata = md  # checked above: what reads through the opened checkpoint use (--state)
    return report


def _check_coverage(md: Metadata, report: VerifyReport) -> Set[str]:
    """Every tensor's chunks hold exactly its declared elements and have a storage record."""
    storage = md.storage_data or {}
    affected = set()
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            total = math.prod(int(s) for s in meta.size)
            have = sum(math.prod(int(s) for s in c.sizes) for c in meta.chunks)
            if have != total:
                report.add(f"tensor {key!r}: saved chunks hold {have} of its {total} elements", None, [key])
                affected.add(key)
            for c in meta.chunks:
                if MetadataIndex(key, torch.Size(c.offsets)) not in storage:
                    report.add(f"tensor {key!r}: chunk at {tuple(c.offsets)} has no storage location", None, [key])
                    affected.add(key)
    return affected


def _validate_tensors(ck: CheckpointLocation, md: Metadata, manifest: Optional[ckdir.Manifest], affected: Set[str],
                      report: VerifyReport) -> None:
    """The loaders' own check of declared shapes against the chunks (for tensors not reported yet)."""
    try:
        reader = TorchDistReader(ck, md, manifest=manifest, verify_checksums=False)
    except UnsafeCheckpointError:
        return  # a data file name leading outside: reported by the data pass, file by file
    except CheckpointingException as e:  # a chunk outside its tensor, an invalid byte range
        report.add(str(e), DCP_METADATA_FILE)
        return
    with reader:
        for key, meta in sorted(md.state_dict_metadata.items()):
            if isinstance(meta, TensorStorageMetadata) and key not in affected:
                try:
                    reader.validate_tensor(key)
                except CheckpointingException as e:
                    report.add(str(e), DCP_METADATA_FILE, [key])


class _DataPass:
    """Streams every data file once: sizes, item digests, block digests, and each tensor archive
    against what ``.metadata`` says it holds. Returns the keys of the tensors found damaged."""

    def __init__(self, ck: CheckpointLocation, md: Metadata, manifest: Optional[ckdir.Manifest],
                 report: VerifyReport, progress: ProgressFactory):
        self.ck, self.md, self.manifest, self.report = ck, md, manifest, report
        self.progress = progress
        self.checksums = manifest.checksums() if manifest is not None else {}
        self.blocks = manifest.block_records() if manifest is not None else {}
        self.hash = manifest.hash if manifest is not None else None
        self.chunks: Dict[MetadataIndex, _Chunk] = {}
        for key, meta in md.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                for c in meta.chunks:
                    numel = math.prod(int(s) for s in c.sizes)
                    self.chunks[MetadataIndex(key, torch.Size(c.offsets))] = _Chunk(key, numel, meta.properties.dtype)
        self.affected: Set[str] = set()
        self.unparsed = 0

    def problem(self, message: str, file: Optional[str], items: Sequence[MetadataIndex], unreadable: bool = False) -> None:
        self.report.add(message, file, [_item_name(i) for i in items], unreadable=unreadable)
        self.affected.update(i.fqn for i in items)

    def run(self) -> Set[str]:
        by_file: Dict[str, List[Tuple[MetadataIndex, Any]]] = collections.defaultdict(list)
        for index, info in (self.md.storage_data or {}).items():
            name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
            if not isinstance(name, str):  # (a str name leading outside is refused by the storage layer's open)
                self.problem(f"refusing {self.ck.file(DCP_METADATA_FILE)}: {_item_name(index)} is stored in "
                             f"{name!r}: {name_problem(name)}", DCP_METADATA_FILE, [index])
                continue
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
                self.problem(f"{self.ck.file(DCP_METADATA_FILE)} is damaged: {_item_name(index)} has an invalid byte "
                             f"range ({offset!r}, {length!r})", DCP_METADATA_FILE, [index])
                continue
            by_file[name].append((index, info))
        total = sum(info.length for items in by_file.values() for _, info in items)
        self.bar = self.progress(total=total, unit="B", unit_scale=True, desc="verify")
        try:
            for name in sorted(by_file):
                self.verify_file(name, sorted(by_file[name], key=lambda x: x[1].offset))
        finally:
            self.bar.close()
        if self.unparsed:
            self.report.notes.append(f"{self.unparsed} tensor item(s) are archives of an unusual layout: loaded as a load "
                                     "loads them, and their dtype and size compared with .metadata")
        return self.affected

    def verify_file(self, name: str, items: List[Tuple[MetadataIndex, Any]]) -> None:
        file = self.ck.file(name)
        indexes = [i for i, _ in items]
        try:
            reader = self.ck.open(name, "data file", source=DCP_METADATA_FILE)
        except FileNotFoundError:
            reader = None
            self.problem(f"{file} is missing (listed in .metadata)", name, indexes)
        except CheckpointingException as e:  # refused: a name or link leading outside, a FIFO, a directory
            reader = None
            self.problem(str(e), name, indexes, unreadable=getattr(e, "transient", False))
        if reader is None:
            self.bar.update(sum(info.length for _, info in items))
            return
        try:
            self._verify_items(reader, name, file, items)
        except CheckpointingException as e:  # an OS error while reading (CheckpointReadError) or a file that shrank
            self.problem(str(e), name, indexes, unreadable=getattr(e, "transient", False))
        finally:
            reader.close()

    def _verify_items(self, reader: FileReader, name: str, file: str, items: List[Tuple[MetadataIndex, Any]]) -> None:
        size = reader.size
        expected = max(info.offset + info.length for _, info in items)
        recorded = recorded_size(self.manifest, name)
        if size < max(expected, recorded or 0):
            cut = [i for i, info in items if info.offset + info.length > size]
            self.problem(f"{file} is truncated: {size} bytes, expected {max(expected, recorded or 0)}", name, cut)
        elif recorded is not None and size != recorded:
            self.problem(f"{file} has {size} bytes, {ckdir.MANIFEST_FILE} says {recorded}", name, [i for i, _ in items])
        damaged: List[Tuple[MetadataIndex, Any, List[Tuple[int, int]]]] = []
        for index, info in items:
            if info.offset + info.length > size:
                self.bar.update(info.length)
                continue
            bad = self._verify_item(reader, name, file, index, info)
            if bad is not None:
                damaged.append((index, info, bad))
        if damaged:
            ranges = ", ".join(f"[{a}, {b})" for _, info, bad in damaged for a, b in bad or [(info.offset, info.offset + info.length)])
            ranges = ranges if len(ranges) < 300 else ranges[:300] + ", ..."
            self.problem(f"{file}: checksum mismatch in {len(damaged)} item(s) at bytes {ranges}: the file is damaged",
                         name, [i for i, _, _ in damaged])
        if self.manifest is not None:
            unrecorded = [i for i, info in items if (name, info.offset) not in self.checksums
                          and (name, info.offset) not in self.blocks]
            if unrecorded:
                self.problem(f"{ckdir.MANIFEST_FILE} has no checksum for {len(unrecorded)} item(s) in {file}: the manifest "
                             "is damaged or does not belong to this checkpoint (loads of them fail)", name, unrecorded)

    def _verify_item(self, reader: FileReader, name: str, file: str, index: MetadataIndex,
                     info: Any) -> Optional[List[Tuple[int, int]]]:
        """Check one item; a list of damaged byte ranges (empty: the whole item) if its data is
        damaged, ``None`` otherwise (other problems are reported here)."""
        rid = (name, info.offset)
        expected = self.checksums.get(rid)
        brec = self.blocks.get(rid)
        chunk = self.chunks.get(index)
        bounds = None
        if expected is None and brec is None:  # another writer's: its zip records' own CRC32s, as a load checks
            self.report.items_checked += 1
            self.report.bytes_checked += info.length
            self.bar.update(info.length)
            return self._check_archive(reader, file, index, info, chunk, None) if chunk is not None else None
        if brec is not None:
            try:
                bounds = brec.bounds(info.length)
            except ValueError as e:
                self.problem(f"{self.ck.file(ckdir.MANIFEST_FILE)}: the block record of {_item_name(index)} in {file} "
                             f"is damaged: {e}", ckdir.MANIFEST_FILE, [index])
                brec = None
        crc, bad, whole = _stream_item(reader, info.offset, info.length, self.hash, bounds,
                                       brec.digests if brec is not None else None, self.bar)
        self.report.items_checked += 1
        self.report.bytes_checked += info.length
        if bounds is not None:
            self.report.blocks_checked += len(bounds) - 1
        if bad and (expected is None or crc != expected):
            return [(info.offset + int(bounds[b]), info.offset + int(bounds[b + 1])) for b in bad[:5]]
        if bad:  # the data matches the item digest but not the block digests: the manifest's block table is wrong
            self.problem(f"{self.ck.file(ckdir.MANIFEST_FILE)} is damaged: {len(bad)} block checksum(s) of "
                         f"{_item_name(index)} in {file} do not match the data, whose whole-item checksum does "
                         "(loads of those blocks fail)", ckdir.MANIFEST_FILE, [index])
            return None
        if expected is not None and crc != expected:
            if brec is None:
                return []
            self.problem(f"{self.ck.file(ckdir.MANIFEST_FILE)} is damaged: the checksum of {_item_name(index)} in "
                         f"{file} does not match the data, whose block checksums do", ckdir.MANIFEST_FILE, [index])
            return None
        if chunk is not None:  # (a small item is parsed from the bytes just checked: no second read)
            self._check_archive(reader if whole is None else _InMemory(whole, info.offset), file, index, info, chunk, brec)
        return None

    def _check_archive(self, reader: FileReader, file: str, index: MetadataIndex, info: Any, chunk: _Chunk,
                       brec: Any) -> Optional[List[Tuple[int, int]]]:
        """What ``.metadata`` says the chunk holds (elements x dtype) against the stored archive; without
        digests of ours (``brec`` None), the byte range of a tensor record that fails its zip CRC32."""
        what = f"chunk at {tuple(index.offset or ())} of {chunk.key!r}"
        declared = f".metadata says {chunk.numel} elements of {chunk.dtype} ({chunk.nbytes} bytes)"
        if brec is not None and brec.data_length != chunk.nbytes:
            self.problem(f"{file}: {what} holds {brec.data_length} bytes of data, but {declared}", info.relative_path, [index])
            return
        try:
            rec = parse_tensor_record(reader, info.offset, info.length, file)
        except CorruptCheckpointError as e:
            self.problem(str(e), info.relative_path, [index])
            return
        if rec is None:  # (loaded as a load would: restricted torch.load of the item, then its size and dtype)
            self.unparsed += 1
            try:
                t = load_item_tensor(reader.read(info.offset, info.length), chunk.numel, file, what)
                if t.dtype != chunk.dtype:
                    raise CorruptCheckpointError(f"{file}: {what} is not a tensor of {declared}")
            except CorruptCheckpointError as e:
                self.problem(f"{file}: {what} cannot be loaded: {e}", info.relative_path, [index])
            return
        start = rec.data_offset + rec.storage_offset * dtype_size(rec.dtype)
        numel = math.prod(rec.shape)
        if rec.dtype != chunk.dtype or numel != chunk.numel:
            self.problem(f"{file}: {what} is stored as {numel} elements of {rec.dtype}, but {declared}",
                         info.relative_path, [index])
        elif start + chunk.nbytes > info.length:
            self.problem(f"{file}: the tensor data of {what} exceeds its stored item", info.relative_path, [index])
        elif brec is not None and rec.is_contiguous and chunk.nbytes and start != brec.data_offset:  # (no data: no place)
            self.problem(f"{self.ck.file(ckdir.MANIFEST_FILE)} is damaged: its block record places the data of {what} "
                         f"at byte {brec.data_offset} of the item, the archive at byte {start}", ckdir.MANIFEST_FILE, [index])
        elif brec is None and rec.member_crc is not None:
            lo, crc = info.offset + rec.data_offset, block_hash(CRC32)
            if _stream_item(reader, lo, rec.member_size, crc, None, None, no_progress())[0] != rec.member_crc:
                return [(lo, lo + rec.member_size)]
        return None


class _InMemory:
    """The ``read(offset, length)`` of a :class:`FileReader`, served from an item's bytes."""

    def __init__(self, data: memoryview, base: int):
        self.data, self.base = data, base

    def read(self, offset: int, length: int) -> bytes:
        start = max(0, offset - self.base)
        return bytes(self.data[start:start + max(0, length)])


def _stream_item(reader: FileReader, offset: int, length: int, h: BlockHash, bounds: Optional[np.ndarray],
                 digests: Any, bar: Any) -> Tuple[int, List[int], Optional[memoryview]]:
    """``(item digest, indexes of the blocks whose digest differs from digests, the item's bytes
    if it was read in one piece)``, reading the item once in pieces of 8 MiB. With blocks the
    item digest is derived from the block digests (as the writer does), so every byte is
    checksummed once; without, it is the digest of the item's bytes."""
    bad: List[int] = []
    got: List[int] = []  # digests of the blocks so far
    running = h.hasher()  # the whole item's (without blocks) or the current block's
    pos = b = 0
    while pos < length:
        n = min(READ_PIECE, length - pos)
        piece = memoryview(reader.read(offset + pos, n))
        if len(piece) != n:
            raise CorruptCheckpointError(f"{reader.path} is truncated: needed bytes [{offset + pos}, {offset + pos + n}) "
                                         f"but the file ends at {offset + pos + len(piece)}")
        if bounds is None:
            running.update(piece)
        else:
            i = 0
            while i < n:
                left = int(bounds[b + 1]) - (pos + i)  # bytes of block b not fed yet
                take = min(n - i, left)
                running.update(piece[i:i + take])
                i += take
                if take == left:
                    got.append(running.intdigest())
                    if got[-1] != int(digests[b]):
                        bad.append(b)
                    b, running = b + 1, h.hasher()
        pos += n
        bar.update(n)
    if bounds is None:
        digest = running.intdigest()
    else:
        digest = h.item_digest(got, np.diff(bounds).tolist())
    return digest, bad, (piece if length and length <= READ_PIECE else None)
