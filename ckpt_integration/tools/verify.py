"""``verify``: completeness of a checkpoint and the CRC32 of every recorded item."""

from __future__ import annotations

import collections
import math
import os
import zipfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from ..errors import CheckpointingException, UnsafeCheckpointError
from ..storage import checkpoint_dir as ckdir
from ..storage.checksum import crc32
from ..storage.torch_dist import DCP_METADATA_FILE, read_dcp_metadata
from .common import _READ_PIECE, ProgressFactory, _esize, _no_progress, format_size


@dataclass
class VerifyReport:
    """Result of :func:`verify_checkpoint`; ``ok`` is False when anything is damaged or missing."""

    path: str
    ok: bool = True
    checksums_available: bool = False
    items_checked: int = 0
    bytes_checked: int = 0
    problems: List[Dict[str, Any]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def add(self, message: str, file: Optional[str] = None, keys: Sequence[str] = ()) -> None:
        self.ok = False
        self.problems.append({"file": file, "message": message, "keys": sorted(set(keys))})

    def to_dict(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in ("path", "ok", "checksums_available", "items_checked",
                                               "bytes_checked", "problems", "notes")}

    def format(self) -> str:
        lines = [f"checkpoint: {self.path}"]
        lines += [f"  note: {n}" for n in self.notes]
        if self.ok:
            what = "checksums of" if self.checksums_available else "structure of"
            lines.append(f"OK: {what} {self.items_checked} items ({format_size(self.bytes_checked)}) verified")
        else:
            lines.append(f"DAMAGED: {len(self.problems)} problem(s)")
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


def _manifest_deleted(path: str, report: VerifyReport) -> bool:
    """Report a missing ``manifest.json`` of a checkpoint that was saved with one; True if so.

    Foreign checkpoints (Megatron-Core, DCP) never have one: their missing manifest is
    no damage. Ours record at save time that they have one (``checkpoint_dir.WRITER_FILE``).
    """
    if not ckdir.manifest_deleted(path):  # storage-aware: path may be a URL
        return False
    report.add(f"{os.path.join(path, ckdir.MANIFEST_FILE)} is missing, but {ckdir.WRITER_FILE} says the checkpoint "
               "was saved with it: the recorded checksums are lost", ckdir.MANIFEST_FILE)
    return True


def _verify_zarr(path: str, report: VerifyReport) -> VerifyReport:
    """zarr checkpoints: every array opens, every chunk and object file matches its recorded
    size and CRC32 (each bad file reported with its key), common.pt checksum. Checkpoints
    written before chunk records existed: every array is read in full instead."""
    from ..storage.zarr_backend import ZarrReader

    _manifest_deleted(path, report)
    try:
        ckdir.load_common(path, trusted=False)
    except UnsafeCheckpointError:
        pass  # readable, only not allow-listed: not damage
    except CheckpointingException as e:
        report.add(str(e), ckdir.COMMON_FILE)
    try:
        reader = ZarrReader(path)
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
                reader.array(key)  # zarr.json of the array: the chunk checks below do not read it
            except CheckpointingException as e:
                report.add(str(e), key, [key])
        for key, name, size, problem in reader.check_files():
            if problem:
                report.add(problem, name, [key])
            else:
                report.items_checked += 1
                report.bytes_checked += size
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
            report.bytes_checked += box.numel * _esize(dtype)
        except CheckpointingException as e:
            report.add(str(e), key, [key])
    for key in reader.index.get("objects", []):
        try:
            reader.read_bytes(key)
            report.items_checked += 1
        except CheckpointingException as e:
            report.add(str(e), key, [key])


def verify_checkpoint(path: str, progress: ProgressFactory = _no_progress, trusted: bool = False) -> VerifyReport:
    """Check that a checkpoint is complete and undamaged; stream every item's bytes through CRC32.

    Completeness: ``metadata.json`` (commit marker), ``.metadata`` and ``common.pt`` readable,
    every data file named in ``.metadata`` exists and is long enough, the chunks of every tensor
    cover it. Checksums: per item from ``manifest.json``; for checkpoints without a manifest
    (written by Megatron-Core or DCP) only the structure is checked and a note says so.
    Problems name the file and the tensors/objects stored in it.
    """
    path = os.fspath(path)
    report = VerifyReport(path)
    try:
        if ckdir.read_config(path).sharded_backend == "zarr":
            return _verify_zarr(path, report)
    except CheckpointingException as e:
        report.add(str(e))
        if not os.path.isdir(path) or not os.path.exists(os.path.join(path, DCP_METADATA_FILE)):
            return report
    try:
        md = read_dcp_metadata(path, trusted=trusted)
    except CheckpointingException as e:
        report.add(str(e), DCP_METADATA_FILE)
        return report
    try:
        manifest = ckdir.read_manifest(path)
    except CheckpointingException as e:
        report.add(str(e), ckdir.MANIFEST_FILE)
        manifest = None
    common = os.path.join(path, ckdir.COMMON_FILE)
    if not os.path.exists(common):
        report.add(f"{common} is missing (common state)", ckdir.COMMON_FILE)
    elif not zipfile.is_zipfile(common):
        report.add(f"{common} is damaged: not a torch.save archive", ckdir.COMMON_FILE)

    storage = md.storage_data or {}
    by_file: Dict[str, List[Tuple[MetadataIndex, Any]]] = collections.defaultdict(list)
    for index, info in storage.items():
        by_file[info.relative_path].append((index, info))
    # coverage of every tensor
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            total = math.prod(int(s) for s in meta.size)
            have = sum(math.prod(int(s) for s in c.sizes) for c in meta.chunks)
            if have != total:
                report.add(f"tensor {key!r}: saved chunks hold {have} of its {total} elements", None, [key])
            for c in meta.chunks:
                if MetadataIndex(key, torch.Size(c.offsets)) not in storage:
                    report.add(f"tensor {key!r}: chunk at {tuple(c.offsets)} has no storage location", None, [key])
    checksums = manifest.checksums() if manifest is not None else {}
    report.checksums_available = manifest is not None
    manifest_damaged = any(p["file"] == ckdir.MANIFEST_FILE for p in report.problems)
    if manifest is None and not manifest_damaged and not _manifest_deleted(path, report):
        report.notes.append("no manifest.json (checkpoint written by another tool): checksums are unavailable, "
                            "only the structure was verified")
    total_bytes = sum(info.length for info in storage.values())
    bar = progress(total=total_bytes, unit="B", unit_scale=True, desc="verify")
    try:
        for name in sorted(by_file):
            items = sorted(by_file[name], key=lambda x: x[1].offset)
            file = os.path.join(path, name)
            keys_in_file = [_item_name(i) for i, _ in items]
            try:
                size = os.path.getsize(file)
            except OSError:
                report.add(f"{file} is missing (listed in .metadata)", name, keys_in_file)
                bar.update(sum(i.length for _, i in items))
                continue
            expected = max(i.offset + i.length for _, i in items)
            if manifest is not None and name in manifest.files:
                expected = max(expected, int(manifest.files[name].get("size", 0)))
            if size < expected:
                cut = [_item_name(i) for i, info in items if info.offset + info.length > size]
                report.add(f"{file} is truncated: {size} bytes, expected {expected}", name, cut)
            elif manifest is not None and name in manifest.files and size != int(manifest.files[name]["size"]):
                report.add(f"{file} has {size} bytes, manifest.json says {manifest.files[name]['size']}", name, keys_in_file)
            damaged = []
            with open(file, "rb") as f:
                fd = f.fileno()
                for index, info in items:
                    if info.offset + info.length > size:
                        bar.update(info.length)
                        continue
                    expected_crc = checksums.get((name, info.offset))
                    report.items_checked += 1
                    report.bytes_checked += info.length
                    if expected_crc is None:
                        bar.update(info.length)
                        continue
                    crc, pos, end = 0, info.offset, info.offset + info.length
                    while pos < end:
                        piece = os.pread(fd, min(_READ_PIECE, end - pos), pos)
                        if not piece:
                            break
                        crc = crc32(piece, crc)
                        pos += len(piece)
                        bar.update(len(piece))
                    if crc != expected_crc:
                        damaged.append((index, info))
            if damaged:
                ranges = ", ".join(f"[{i.offset}, {i.offset + i.length})" for _, i in damaged[:5])
                report.add(f"{file}: checksum mismatch in {len(damaged)} item(s) at bytes {ranges}: the file is damaged",
                           name, [_item_name(i) for i, _ in damaged])
            if manifest is not None:
                missing = [_item_name(i) for i, info in items if (name, info.offset) not in checksums]
                if missing:
                    report.notes.append(f"{name}: {len(missing)} item(s) have no checksum in manifest.json")
    finally:
        bar.close()
    return report
