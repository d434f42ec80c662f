"""``inspect``: describe a checkpoint (tensors, shard layout, objects, common state) from its metadata."""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from ..errors import CheckpointingException, UnsafeCheckpointError
from ..serialization import load_common_state_dict
from ..storage import checkpoint_dir as ckdir
from ..storage.opened import OpenedCheckpoint, backend_named, pinned, read_metadata
from ..storage.checksum import BLOCK_HASHES, block_hash
from ..storage.filesystem import CheckpointLocation, checked_path, is_remote, locate
from ..storage.torch_dist import DCP_METADATA_FILE
from ..storage.zarr_backend import ZarrReader, chunk_box, chunk_coords, chunk_file_names, object_file_name
from .common import dtype_name, dtype_size, format_size
from .sources import detect_kind, open_source

# how the checksum algorithms are named in the text output
_HASH_LABELS = {n: block_hash(n).label for n in BLOCK_HASHES}


def _layout_summary(global_shape: Tuple[int, ...], chunks: List[Tuple[Tuple[int, ...], Tuple[int, ...]]],
                    unit: str = "shard") -> str:
    n = len(chunks)
    if n == 1:
        return f"1 {unit} (whole tensor)"
    split_axes = [a for a in range(len(global_shape)) if any(s[a] != global_shape[a] for _, s in chunks)]
    grid = [len({o[a] for o, _ in chunks}) for a in split_axes]
    sizes = sorted({s for _, s in chunks})
    if len(split_axes) == 1:
        where = f"split along axis {split_axes[0]}"
    else:
        where = "grid " + "x".join(map(str, grid)) + " over axes " + ",".join(map(str, split_axes))
    if len(sizes) == 1:
        sz = f"each {list(sizes[0])}"
    else:
        shown = ", ".join(str(list(s)) for s in sizes[:4]) + (", ..." if len(sizes) > 4 else "")
        sz = f"uneven: {shown}"
    return f"{n} {unit}s, {where}, {sz}"


def _describe_value(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor {list(v.shape)} {dtype_name(v.dtype)}"
    if isinstance(v, (int, float, bool)) or v is None:
        return f"{type(v).__name__} = {v!r}"
    if isinstance(v, str):
        return f"str = {v[:60]!r}" + ("..." if len(v) > 60 else "")
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__} of {len(v)}"
    return type(v).__name__


def _common_keys(obj: Any, prefix: str = "") -> Dict[str, str]:
    out: Dict[str, str] = {}
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            p = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out.update(_common_keys(v, p))
            else:
                out[p] = _describe_value(v)
    elif prefix or not isinstance(obj, dict):
        out[prefix or "(root)"] = _describe_value(obj)
    return out


def _common_groups(state: Any) -> Dict[str, Dict[str, Any]]:
    """Per top-level dict of the common state: its flattened keys and its direct children.

    The text view folds a group with more than :data:`FOLD_AT` keys into one line
    (Lightning's ``loops`` alone flattens to ~90 keys).
    """
    if not isinstance(state, dict):
        return {}
    groups = {}
    for k, v in state.items():
        if isinstance(v, dict) and v:
            groups[str(k)] = {"keys": list(_common_keys(v, str(k))), "children": [str(c) for c in v]}
    return groups


def _zarr_layout(ck: CheckpointLocation) -> Tuple[Dict[str, List[Dict[str, Any]]], Dict[str, Dict[str, Any]], Dict[str, int]]:
    """``(shards, objects, files)`` of a zarr checkpoint, from the records in ``zarr_index.json``.

    zarr checkpoints have no DCP storage records: a tensor's "shards" are its chunk files
    (each a file of its own, so ``file_offset`` is 0) and the sizes come from the chunk
    and object records the save committed. Indexes written before records existed give
    ``length`` None and no files.
    """
    with ZarrReader(ck) as reader:
        records = reader.files or {}
        shards: Dict[str, List[Dict[str, Any]]] = {}
        for key, info in reader.index.get("tensors", {}).items():
            shape, chunks = [int(n) for n in info["shape"]], [int(c) for c in info["chunks"]]
            shards[key] = []
            for name in chunk_file_names(shape, chunks):
                box = chunk_box(chunk_coords(name), shape, chunks)
                record = records.get(f"{key}/{name}")
                shards[key].append({
                    "offsets": list(box.offsets),
                    "sizes": list(box.sizes),
                    "file": f"{key}/{name}", "file_offset": 0, "length": record.size if record else None,
                })
        objects = {}
        for key in reader.index.get("objects", []):
            record = records.get(object_file_name(key))
            objects[key] = {"key": key, "file": object_file_name(key), "length": record.size if record else None}
        files = {name: record.size for name, record in records.items()}
    return shards, objects, files


def _dcp_shards(md: Any, key: str, meta: TensorStorageMetadata) -> List[Dict[str, Any]]:
    """The saved chunks of a torch_dist tensor with the file and byte range of each."""
    storage = md.storage_data or {}
    shards = []
    for c in meta.chunks:
        info = storage.get(MetadataIndex(key, torch.Size(c.offsets)))
        shards.append({
            "offsets": [int(o) for o in c.offsets],
            "sizes": [int(s) for s in c.sizes],
            "file": getattr(info, "relative_path", None),
            "file_offset": getattr(info, "offset", None),
            "length": getattr(info, "length", None),
        })
    return shards


def _unsafe_file_names(path: str, files: Dict[Any, int]) -> List[str]:
    """Why data files named in ``.metadata`` would be refused by every load (a name or a symbolic
    link leading outside the checkpoint); nothing is opened."""
    out = []
    for name in files:
        try:
            checked_path(path, name, "data file", source=DCP_METADATA_FILE)
        except UnsafeCheckpointError as e:
            out.append(f"{e} (loads and verify refuse this checkpoint)")
    return out


def inspect_checkpoint(path: str, trusted: bool = False) -> Dict[str, Any]:
    """Describe a checkpoint directory as a JSON-serializable dict (nothing but metadata is read).

    Keys: ``path, kind`` (= ``backend``: ``torch_dist`` or ``zarr``), ``backend, backend_version,
    common_backend, manifest, manifest_expected, files`` (data file -> bytes), ``tensors`` (key ->
    shape, dtype, nbytes, shards, layout), ``objects``, ``common_state`` (``{"keys": {...}}`` or
    ``{"error": "..."}`` when loading it was refused as unsafe) and ``total_bytes``. For zarr the
    shards are the chunk files, sized from the records in ``zarr_index.json``.
    Safetensors and torch.save inputs are described too (without shard details).
    """
    with pinned(path, verified=True):  # (an opened checkpoint: its commit, pinned)
        where = locate(path)  # an opened checkpoint goes down as it is (its files are not read again)
        path = str(where)
        # a checkpoint directory on an object store (fsspec URL); locally: whatever is there
        kind = "torch_dist" if isinstance(where, OpenedCheckpoint) or is_remote(path) else detect_kind(path)
        if kind == "torch_dist" and not isinstance(where, OpenedCheckpoint):
            try:  # opened once for the reads below; one that cannot be opened is described as it is
                ck = OpenedCheckpoint(where, trusted=trusted)
            except CheckpointingException:
                ck = None
            if ck is not None:
                with ck:
                    return _inspect_dcp(ck, path, trusted)
        if kind != "torch_dist":
            with open_source(path, trusted=trusted) as src:
                tensors = {
                    k: {"shape": list(i.shape), "dtype": dtype_name(i.dtype), "nbytes": i.nbytes, "shards": [], "layout": kind}
                    for k, i in src.tensors.items()
                }
                return {"path": path, "kind": kind, "tensors": tensors, "objects": [], "common_state": None,
                        "total_bytes": sum(t["nbytes"] for t in tensors.values())}
        return _inspect_dcp(where, path, trusted)


def _shared_files(where: CheckpointLocation, files: Dict[str, int]) -> Optional[Dict[str, int]]:
    """``{data file: bytes}`` of the data files that are also part of other checkpoints (hard links
    of incremental saves: more than one name); None on object stores, whose copies share nothing."""
    storage, root = where.storage, where.path
    if storage.remote:
        return None
    out = {}
    for name in files:
        try:
            st = os.stat(os.path.join(root, name))
        except OSError:
            continue
        if st.st_nlink > 1:
            out[name] = st.st_size
    return out


def _inspect_dcp(where: CheckpointLocation, path: str, trusted: bool) -> Dict[str, Any]:
    """:func:`inspect_checkpoint` of a checkpoint directory (``where``: it, or its opened checkpoint)."""
    config = ckdir.read_config(where)
    backend = config.sharded_backend
    be = backend_named(backend)
    md = read_metadata(where, trusted=trusted, backend=backend)
    manifest = ckdir.read_manifest(where)
    storage = md.storage_data or {}
    warnings: List[str] = []
    if not be.dcp_metadata:  # zarr: chunk files and records from its own index
        zarr_shards, zarr_objects, files = _zarr_layout(where)
        checksummed = len(files)  # every chunk/object record carries a CRC32
    else:
        files = {}
        for info in storage.values():
            files[info.relative_path] = files.get(info.relative_path, 0) + info.length
        checksummed = len(manifest.checksums()) if manifest is not None else 0
        warnings += _unsafe_file_names(path, files)
    tensors: Dict[str, Any] = {}
    objects = []
    for key, meta in sorted(md.state_dict_metadata.items()):
        if isinstance(meta, TensorStorageMetadata):
            shape = tuple(int(s) for s in meta.size)
            shards = _dcp_shards(md, key, meta) if be.dcp_metadata else zarr_shards.get(key, [])
            shards.sort(key=lambda s: s["offsets"])
            unit = "shard" if be.dcp_metadata else "chunk"
            tensors[key] = {
                "shape": list(shape),
                "dtype": dtype_name(meta.properties.dtype),
                "nbytes": math.prod(shape) * dtype_size(meta.properties.dtype),
                "shards": shards,
                "layout": _layout_summary(shape, [(tuple(s["offsets"]), tuple(s["sizes"])) for s in shards], unit),
            }
        elif isinstance(meta, BytesStorageMetadata):
            if not be.dcp_metadata:
                objects.append(zarr_objects.get(key, {"key": key, "file": None, "length": None}))
                continue
            info = storage.get(MetadataIndex(key))
            objects.append({"key": key, "file": getattr(info, "relative_path", None), "length": getattr(info, "length", None)})
    try:
        state = load_common_state_dict(where, trusted=trusted)
        common: Dict[str, Any] = {"keys": _common_keys(state), "groups": _common_groups(state)}
    except UnsafeCheckpointError as e:
        common = {"error": str(e), "unsafe": True}
    except CheckpointingException as e:
        common = {"error": str(e)}
    return {
        "path": path,
        "kind": backend,
        "backend": backend,
        "backend_version": config.sharded_backend_version,
        "common_backend": config.common_backend,
        "common_backend_version": config.common_backend_version,
        "manifest": None if manifest is None else {
            "format": manifest.format, "version": manifest.version, "world_size": manifest.world_size,
            "library_version": manifest.library_version, "created": manifest.created,
            "checksummed_items": checksummed,
            # zarr chunk files are recorded with CRC32s in zarr_index.json; torch_dist blocks per the manifest
            "block_hash": be.block_hash or manifest.block_hash,
        },
        "manifest_expected": ckdir.manifest_expected(where),
        "files": dict(sorted(files.items())),
        "shared_files": _shared_files(where, files) if be.dcp_metadata else None,
        "tensors": tensors,
        "objects": objects,
        "common_state": common,
        "total_bytes": sum(t["nbytes"] for t in tensors.values()),
        "warnings": warnings,
    }


FOLD_AT = 8
"""Without ``--all``, a top-level common-state dict or a group of sharded objects with more
entries than this is shown as one line with its count."""


def _shorten(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _format_common(common: Dict[str, Any], show_all: bool) -> List[str]:
    keys = common["keys"]
    groups = {} if show_all else {g: d for g, d in common.get("groups", {}).items() if len(d["keys"]) > FOLD_AT}
    folded = {k: g for g, d in groups.items() for k in d["keys"]}
    head = f"common state: {len(keys)} key(s)"
    if groups:
        head += f"; {len(groups)} group(s) of more than {FOLD_AT} keys folded (--all lists every key)"
    lines = [head]
    shown = set()
    for k, v in keys.items():
        g = folded.get(k)
        if g is None:
            lines.append(f"  {k}: {v}")
        elif g not in shown:
            shown.add(g)
            children = groups[g]["children"]
            names = ", ".join(_shorten(c) for c in children[:4]) + (", ..." if len(children) > 4 else "")
            lines.append(f"  {g}: {len(groups[g]['keys'])} keys under {names}")
    return lines


def _format_objects(objects: List[Dict[str, Any]], show_all: bool) -> List[str]:
    lines = [f"sharded objects: {len(objects)}"]
    by_top: Dict[str, List[Dict[str, Any]]] = {}
    for o in objects:
        by_top.setdefault(o["key"].split("/")[0].split(".")[0], []).append(o)
    for top, group in by_top.items():
        if show_all or len(group) <= FOLD_AT:
            lines += [f"  {o['key']} ({format_size(o['length'] or 0)} in {o['file']})" for o in group]
            continue
        size = sum(o["length"] or 0 for o in group)
        files = len({o["file"] for o in group})
        lines.append(f"  {top}.*: {len(group)} shards ({format_size(size)} in {files} file(s); --all lists them)")
    return lines


def format_inspect(info: Dict[str, Any], show_shards: bool = False, show_all: bool = False) -> str:
    """Render :func:`inspect_checkpoint` output as text: a tree of keys split on ``'.'``.

    Large groups of the common state and of the sharded objects are folded into one line
    each (more than :data:`FOLD_AT` entries); ``show_all`` lists every entry.
    """
    lines = [f"checkpoint: {info['path']}"]
    is_dir = "backend" in info  # a checkpoint directory (torch_dist or zarr), not a file
    if is_dir:
        lines.append(f"  backend: {info['backend']} (version {info['backend_version']}), common state: "
                     f"{info['common_backend']} (version {info['common_backend_version']})")
        m = info["manifest"]
        if m:
            lines.append(f"  written by: {m['format']} {m['library_version']} on {m['world_size']} rank(s); "
                         f"{m['checksummed_items']} checksummed items ({_HASH_LABELS.get(m.get('block_hash'), m.get('block_hash'))})")
        elif info.get("manifest_expected"):
            lines.append("  manifest.json is missing although it was saved with one: run verify")
        else:
            lines.append("  no manifest.json: written by another tool (Megatron-Core / PyTorch DCP); no checksums")
        shared = info.get("shared_files")
        lines.append(f"  data files: {len(info['files'])} ({format_size(sum(info['files'].values()))})" + (
            f"; {len(shared)} of them ({format_size(sum(shared.values()))}) shared with other checkpoints (hard links "
            "of incremental saves)" if shared else ""))
        lines += [f"  warning: {w}" for w in info.get("warnings", [])]
    else:
        lines.append(f"  kind: {info['kind']}")
    lines.append(f"  tensors: {len(info['tensors'])} ({format_size(info['total_bytes'])})")
    lines.append("")
    lines.append("tensors:")
    tree: Dict[str, Any] = {}
    for key in info["tensors"]:
        node = tree
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):  # a key is both a leaf and a prefix
                break
        node.setdefault(parts[-1], {})["\0leaf"] = key

    def render(node: Dict[str, Any], depth: int) -> None:
        for name, child in node.items():
            if name == "\0leaf":
                continue
            pad = "  " * depth
            if "\0leaf" in child:
                t = info["tensors"][child["\0leaf"]]
                lines.append(f"{pad}{name}: {t['shape']} {t['dtype']} {format_size(t['nbytes'])}"
                             + (f"  [{t['layout']}]" if t["shards"] else ""))
                if show_shards:
                    for s in t["shards"]:
                        box = ", ".join(f"{o}:{o + z}" for o, z in zip(s["offsets"], s["sizes"]))
                        lines.append(f"{pad}    [{box}] in {s['file']} @ {s['file_offset']} (+{s['length']})")
            if any(k != "\0leaf" for k in child):
                if "\0leaf" not in child:
                    lines.append(f"{pad}{name}")
                render(child, depth + 1)

    render(tree, 1)
    if is_dir:
        lines.append("")
        lines += _format_objects(info["objects"], show_all)
        lines.append("")
        common = info["common_state"]
        if "error" in common:
            lines.append("common state: not shown - " + common["error"])
            if common.get("unsafe"):
                lines.append("  (rerun with --trusted to load it anyway, only if you trust this checkpoint)")
        else:
            lines += _format_common(common, show_all)
    return "\n".join(lines)
