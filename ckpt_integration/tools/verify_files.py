"""The checks of ``verify`` on the files beside the data (tools layer): the manifest, recorded sizes and
CRC32s, the common state (``common.pt`` or Megatron-Core 0.19's ``common_state`` object) and Megatron-Core's
``integrity.json``. ``report`` is the :class:`~.verify.VerifyReport` being filled."""

from __future__ import annotations

import io
import zipfile
from typing import Any, Dict, List, Optional, Protocol, Sequence, Set, Tuple

from ..errors import CheckpointingException, UnsupportedCheckpointError
from ..storage import checkpoint_dir as ckdir
from ..storage.chunk_index import compact_of_index
from ..storage.opened import EMBEDDED_COMMON_KEY, embedded_common_key
from ..storage.filesystem import CheckpointLocation
from ..storage.checksum import INTEGRITY_FILE, read_sha_manifest, sha_problems
from ..storage.torch_dist import DCP_METADATA_FILE, read_dcp_metadata


class Report(Protocol):
    """The report being filled (``verify.VerifyReport``, whose module imports this one)."""

    notes: List[str]
    files_checked: int

    def add(self, message: str, file: Optional[str] = None, keys: Sequence[str] = (), unsupported: bool = False) -> None: ...


def integrity_manifest_holds(ck: CheckpointLocation, report: Report) -> bool:
    """A checkpoint without our manifest but with Megatron-Core's ``integrity.json``: every file it lists
    against its SHA-256 (each problem reported, naming the file); False when any differs."""
    try:  # (a manifest this version does not read, e.g. an older format: named as the manifest's problem)
        if ckdir.read_manifest(ck) is not None:
            return True
    except CheckpointingException as e:
        report.add(str(e), ckdir.MANIFEST_FILE, unsupported=isinstance(e, UnsupportedCheckpointError))
        return False
    try:
        files = read_sha_manifest(ck)
    except CheckpointingException as e:
        report.add(str(e), INTEGRITY_FILE)
        return False
    if files is None:
        return True
    problems = sha_problems(ck, files)
    for problem, name in problems:
        report.add(problem, name)
    if not problems:
        report.notes.append(f"{INTEGRITY_FILE}: {len(files)} file(s) match their recorded SHA-256 (Megatron-Core)")
    return not problems


def read_manifest(ck: CheckpointLocation, report: Report) -> Tuple[Optional[ckdir.Manifest], bool]:
    """``(manifest or None, whether its absence or damage was reported)`` (an opened checkpoint: the
    manifest it read and checked at open)."""
    try:
        manifest = ckdir.read_manifest(ck)
    except CheckpointingException as e:
        report.add(str(e), ckdir.MANIFEST_FILE, unsupported=isinstance(e, UnsupportedCheckpointError))
        return None, True
    try:  # format 6: the items' digests are in index.bin (as a damaged manifest, nothing can be checked without it)
        if manifest is not None:
            manifest.index()
    except CheckpointingException as e:
        report.add(str(e), ckdir.INDEX_FILE)
        return None, True
    if manifest is None and ckdir.manifest_deleted(ck):
        # ours record at save time that they have one (ckpt_integration.json); foreign ones
        # (Megatron-Core, DCP) never have one, which is no damage
        report.add(f"{ck.file(ckdir.MANIFEST_FILE)} is missing, but {ckdir.WRITER_FILE} says the checkpoint "
                   "was saved with it: the recorded checksums are lost", ckdir.MANIFEST_FILE)
        return None, True
    return manifest, False


def recorded(manifest: Optional[ckdir.Manifest], name: str) -> Dict[str, Any]:
    return ((manifest.files if manifest is not None else {}).get(name)) or {}


def recorded_size(manifest: Optional[ckdir.Manifest], name: str) -> Optional[int]:
    size = recorded(manifest, name).get("size")
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def verify_common(ck: CheckpointLocation, manifest: Optional[ckdir.Manifest], report: Report) -> None:
    """``common.pt``: its recorded size and CRC32 (the check every load makes), else a zip archive.
    Read from the file (never a copy an opened checkpoint kept)."""
    fresh = ck.afresh()
    file = ck.file(ckdir.COMMON_FILE)
    try:
        data = ckdir.read_verified_file(fresh, ckdir.COMMON_FILE, manifest, "common state file")
    except FileNotFoundError:
        if manifest is not None and ckdir.COMMON_FILE in manifest.files:
            report.add(f"{file} is missing (common state, recorded in {ckdir.MANIFEST_FILE})", ckdir.COMMON_FILE)
            return
        try:  # Megatron-Core 0.19's layout: the common state is an object in the data, checked with the items
            embedded = embedded_common_key(read_dcp_metadata(fresh, manifest=manifest))
        except CheckpointingException:
            embedded = None
        if embedded is None:
            report.add(f"{file} is missing (common state), and no '{EMBEDDED_COMMON_KEY}' object holds it",
                       ckdir.COMMON_FILE)
        else:
            report.notes.append(f"the common state is the object {embedded!r} in the data (no {ckdir.COMMON_FILE})")
        return
    except CheckpointingException as e:  # damaged, refused (outside the checkpoint), not a regular file
        report.add(str(e), ckdir.COMMON_FILE)
        return
    if "crc32" in recorded(manifest, ckdir.COMMON_FILE):
        report.files_checked += 1
        return
    if manifest is not None:
        report.notes.append(f"{ckdir.COMMON_FILE} has no checksum in {ckdir.MANIFEST_FILE}: only its format was checked")
    if not zipfile.is_zipfile(io.BytesIO(data)):
        report.add(f"{file} is damaged: not a torch.save archive", ckdir.COMMON_FILE)


def verify_other_recorded_files(ck: CheckpointLocation, manifest: ckdir.Manifest, data_files: Set[str],
                                 report: Report) -> Dict[str, bytes]:
    """Files the manifest records that ``.metadata`` does not name (checked by the data pass);
    returns the bytes of those checked whole against their CRC32 (the chunk index)."""
    fresh = ck.afresh()
    whole: Dict[str, bytes] = {}
    for name in sorted(manifest.files):
        if name in (DCP_METADATA_FILE, ckdir.COMMON_FILE) or name in data_files:
            continue
        entry = manifest.files[name]
        file = ck.file(name)
        try:
            if "crc32" in entry:
                whole[name] = ckdir.read_verified_file(fresh, name, manifest)
                report.files_checked += 1
                continue
            reader = ck.open(name, "data file", source=ckdir.MANIFEST_FILE)
        except FileNotFoundError:
            report.add(f"{file} is missing (recorded in {ckdir.MANIFEST_FILE})", name)
            continue
        except CheckpointingException as e:
            report.add(str(e), name)
            continue
        try:
            size = recorded_size(manifest, name)
            if size is not None and reader.size != size:
                report.add(f"{file} has {reader.size} bytes, {ckdir.MANIFEST_FILE} says {size}", name)
        finally:
            reader.close()
    return whole


def index_metadata(manifest: Optional[ckdir.Manifest], report: Report) -> Any:
    """Where ``.metadata`` could not be read: the DCP ``Metadata`` that loads plan from, decoded from the
    checkpoint's index (``index.bin``), so that the data is still checked and its damage reported;
    None (and a note saying the data was not checked) when there is no usable index either."""
    try:
        index = manifest.index() if manifest is not None else None
    except CheckpointingException:  # (reported with the other recorded files)
        index = None
    if index is None:
        report.notes.append(f"the data was not checked: neither {DCP_METADATA_FILE} nor the index could be read")
        return None
    report.notes.append(f"{DCP_METADATA_FILE} could not be read: the data was checked through the index "
                        f"({ckdir.INDEX_FILE}), as loads read it")
    return compact_of_index(index).full()
