"""``convert``: streaming conversion between checkpoint directories, torch.save files and safetensors."""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch

from ..errors import CheckpointingException, UntrustedObjectError
from ..storage.fs import tensor_buffer
from ..storage.opened import accepts_opened
from .common import (DEFAULT_MAX_SHARD_SIZE, DEFAULT_MEMORY_BUDGET, SAFETENSORS_INDEX, ProgressFactory, _no_progress,
                     parse_size)
from .sources import (DistCheckpointSource, SafetensorsSource, TensorInfo, TensorSource, TorchFileSource, _MappedFiles,
                      _restore_structure, _tensor_from_map, open_source)
from .writers import SafetensorsWriter, TorchSaveWriter


@dataclass
class ConvertResult:
    """What :func:`convert_checkpoint` wrote.

    ``files``: the names in the output directory (the file name for a torch output);
    ``file_count`` / ``file_bytes``: every file written, counted recursively (zarr writes one
    file per chunk), and their total size;
    ``skipped``: ShardedObject keys not written (torch / safetensors outputs hold tensors);
    ``skipped_common``: common-state entries not written, each with the reason.
    """

    output: str
    to: str
    tensors: int = 0
    bytes: int = 0
    files: List[str] = field(default_factory=list)
    file_count: int = 0
    file_bytes: int = 0
    skipped: List[str] = field(default_factory=list)
    skipped_common: List[str] = field(default_factory=list)


def _shard_plan(entries: List[Tuple[str, TensorInfo]], max_size: int) -> List[List[Tuple[str, TensorInfo]]]:
    shards: List[List[Tuple[str, TensorInfo]]] = []
    current: List[Tuple[str, TensorInfo]] = []
    size = 0
    for key, info in entries:
        if current and size + info.nbytes > max_size:
            shards.append(current)
            current, size = [], 0
        current.append((key, info))
        size += info.nbytes
    if current or not shards:
        shards.append(current)
    return shards


# --------------------------------------------------------------------------- convert: output handling
def _contains(parent: str, child: str) -> bool:
    """Whether resolved path ``child`` is ``parent`` or lies below it."""
    return os.path.commonpath([parent, child]) == parent


def _check_not_source(src: str, out: str) -> None:
    """Refuse an OUT that is SRC, holds SRC or lies inside SRC (resolved, symlinks followed).

    Replacing such an OUT would delete or change the source before (or while) it is read.
    """
    s, o = os.path.realpath(src), os.path.realpath(out)
    if s == o:
        raise CheckpointingException(
            f"output {out} is the source {src} itself: converting in place would destroy the source; choose another OUT")
    if _contains(o, s):
        raise CheckpointingException(
            f"output {out} contains the source {src}: replacing it would delete the source; choose another OUT")
    if _contains(s, o):
        raise CheckpointingException(
            f"output {out} lies inside the source {src}: writing there would change the source; choose another OUT")


def _check_output(out: str, overwrite: bool, is_dir: bool) -> None:
    """OUT must not exist (or be an empty directory, for directory outputs) unless ``overwrite``."""
    if os.path.lexists(out) and not overwrite and (not is_dir or not os.path.isdir(out) or os.listdir(out)):
        raise CheckpointingException(f"{out} already exists; pass --overwrite to replace it")


def _staging_path(out: str, is_dir: bool) -> str:
    """A fresh hidden sibling of OUT to write into; :func:`_commit_output` moves it to OUT.

    A sibling (same filesystem) so that the final move is a rename, and so that the old
    OUT stays intact until the new output is complete.
    """
    parent, base = os.path.split(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{base}.convert-tmp-{uuid.uuid4().hex[:8]}")
    if is_dir:
        os.mkdir(tmp)
    return tmp


def _remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _commit_output(tmp: str, out: str) -> None:
    """Put the finished output ``tmp`` in place of OUT; only now is an old OUT removed."""
    if not os.path.lexists(out) or (not os.path.isdir(tmp) and not os.path.isdir(out)) or os.path.islink(out):
        os.replace(tmp, out)  # atomic: OUT is the old or the new output at every instant
        return
    # a directory on either side cannot be replaced atomically: move the old one aside first
    old = f"{tmp}.old"
    os.rename(out, old)
    os.rename(tmp, out)
    _remove_path(old)


def _disk_usage(path: str) -> Tuple[int, int]:
    """``(number of files, total bytes)`` of a file or of a directory tree."""
    if not os.path.isdir(path):
        return 1, os.path.getsize(path)
    count = size = 0
    for root, _, names in os.walk(path):
        for name in names:
            count += 1
            size += os.path.getsize(os.path.join(root, name))
    return count, size


def _discard_output(tmp: str) -> None:
    """Remove a failed conversion's partial output (and a writer's ``.partial`` file)."""
    for path in (tmp, tmp + ".partial"):
        try:
            _remove_path(path)
        except OSError:
            pass  # best effort: the original error is the one to report


# --------------------------------------------------------------------------- convert: common state
def _load_common_for_output(src: TensorSource, result: ConvertResult) -> Dict[Any, Any]:
    """The common state of a checkpoint source as a dict (empty for other sources).

    A common state that is refused as unsafe (objects outside the allow-list, without
    ``--trusted``) is recorded in ``result.skipped_common`` instead of failing the tensor
    conversion (the user chose not to trust it; the summary names it). A damaged or missing
    one fails the conversion: an output silently without the common state is a loss.
    """
    if not isinstance(src, DistCheckpointSource):
        return {}
    from ..serialization import load_common_state_dict

    try:
        common = load_common_state_dict(src.path, trusted=src.trusted)
    except UntrustedObjectError as e:
        result.skipped_common.append(f"the common state ({str(e).splitlines()[0]})")
        return {}
    return common if isinstance(common, dict) else {"common": common}


def _weights_only_loadable(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` can load ``value`` (plain data, tensors, allow-listed types)."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
        return True
    except Exception:  # pickling and the weights-only unpickler fail in many ways
        return False


def _common_values_for_torch(src: TensorSource, tensor_names: set, result: ConvertResult) -> Dict[Any, Any]:
    """Common-state entries to store next to the tensors of a torch output, at their own top-level keys.

    Skipped (and listed in ``result.skipped_common``): entries whose key is already taken by
    a tensor, and entries ``torch.load(weights_only=True)`` could not load, so that the
    output stays loadable without ``weights_only=False``.
    """
    values = {}
    for key, value in _load_common_for_output(src, result).items():
        if key in tensor_names:
            result.skipped_common.append(f"{key!r} (same key as a tensor)")
        elif not _weights_only_loadable(value):
            result.skipped_common.append(f"{key!r} (not loadable with torch.load(weights_only=True))")
        else:
            values[key] = value
    return values


# --------------------------------------------------------------------------- convert
def _write_safetensors(src: TensorSource, entries: List[Tuple[str, TensorInfo]], out_dir: str, max_shard_size: int,
                       budget: int, bar: Any, result: ConvertResult) -> None:
    """HF-style folder: size-bounded ``.safetensors`` files and ``model.safetensors.index.json``."""
    plan = _shard_plan(entries, max_shard_size)
    n = len(plan)
    weight_map: Dict[str, str] = {}
    for i, shard in enumerate(plan):
        name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        writer = SafetensorsWriter(os.path.join(out_dir, name), shard)
        try:
            for key, _ in shard:
                for _, block in src.iter_blocks(key, budget):
                    writer.write(block)
                    bar.update(block.numel() * block.element_size())
                    del block
                weight_map[key] = name
        except BaseException:
            writer.f.close()
            raise
        writer.close()
        result.files.append(name)
    index = {"metadata": {"total_size": sum(i.nbytes for _, i in entries)}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, SAFETENSORS_INDEX), "w") as f:
        json.dump(index, f, indent=2)
    result.files.append(SAFETENSORS_INDEX)


def _write_torch(src: TensorSource, entries: List[Tuple[str, TensorInfo]], out_file: str, nested: bool,
                 budget: int, bar: Any, result: ConvertResult) -> None:
    """One ``torch.load``-able file: the tensors, and the common state of a checkpoint source."""
    tensor_names = {k.split(".")[0] for k, _ in entries} if nested else {k for k, _ in entries}
    common = _common_values_for_torch(src, tensor_names, result)
    writer = TorchSaveWriter(out_file)
    try:
        for key, info in entries:
            writer.begin_tensor(key, info)
            for _, block in src.iter_blocks(key, budget):
                writer.write(block)
                bar.update(block.numel() * block.element_size())
                del block
            writer.end_tensor()
        for key, value in common.items():
            writer.add_value(key, value)
    except BaseException:
        writer.abort()
        raise
    writer.close(nested=nested)


@accepts_opened('src_path')
def convert_checkpoint(
    src_path: str,
    to: str,
    out: str,
    *,
    max_shard_size: Any = DEFAULT_MAX_SHARD_SIZE,
    memory_budget: Any = DEFAULT_MEMORY_BUDGET,
    overwrite: bool = False,
    trusted: bool = False,
    nested: bool = False,
    progress: ProgressFactory = _no_progress,
    module: Any = None,
) -> ConvertResult:
    """Convert a checkpoint dir / torch.save file / safetensors file or folder into ``to`` at ``out``.

    ``to``: ``"safetensors"`` (folder ``out`` with size-bounded files and
    ``model.safetensors.index.json``), ``"torch"`` (one ``torch.load``-able file ``out``, a flat
    dict ``{key: tensor}``, nested on ``'.'`` with ``nested=True``, plus the common state of a
    checkpoint input at its own top-level keys) or ``"torch_dist"`` / ``"zarr"`` (checkpoint
    directory ``out``, written with :func:`ckpt_integration.save`; non-tensor values of a torch.save
    input, and common state / ShardedObjects of a checkpoint input, are kept).

    ``out`` may not be the source, contain it or lie inside it. The output is written into a
    hidden sibling of ``out`` and moved to ``out`` when complete, so with ``overwrite`` the old
    ``out`` is replaced only by a finished conversion (a failed one leaves it untouched).

    Tensors are streamed in blocks of at most ``memory_budget`` bytes for the safetensors and
    torch outputs. The torch_dist output of a checkpoint input spills tensors to a temporary file
    next to ``out`` and saves them memory-mapped.

    A stock Lightning checkpoint (``.ckpt`` file or ``ModelParallelStrategy`` DCP directory) converted
    to ``torch_dist`` / ``zarr`` is imported as a checkpoint the DistCkpt strategies resume from
    (:func:`~ckpt_integration.tools.lightning_import.import_lightning_checkpoint`, which ``module``
    is for); the result is then an ``ImportResult`` listing what was ``not_carried``.
    """
    to = to.lower().replace("-", "_")
    if to not in ("safetensors", "torch", "torch_dist", "zarr"):
        raise ValueError(f"unknown output format {to!r}: choose torch, safetensors, torch_dist or zarr")
    if to in ("torch_dist", "zarr"):
        from .lightning_import import import_lightning_checkpoint, stock_lightning_kind

        if stock_lightning_kind(src_path, trusted=trusted):
            return import_lightning_checkpoint(src_path, out, to=to, module=module, overwrite=overwrite,
                                               trusted=trusted, memory_budget=memory_budget, progress=progress)
    if module is not None:
        raise ValueError("module= is for importing stock Lightning checkpoints (--to torch_dist or zarr)")
    max_shard_size = parse_size(max_shard_size)
    budget = parse_size(memory_budget)
    out = os.fspath(out)
    _check_not_source(os.fspath(src_path), out)
    is_dir = to != "torch"
    _check_output(out, overwrite, is_dir)
    src = open_source(src_path, trusted=trusted)
    result = ConvertResult(out, to)
    try:
        tmp = _staging_path(out, is_dir)
        try:
            _convert_into(src, to, tmp, max_shard_size, budget, nested, progress, result)
            _commit_output(tmp, out)
        except BaseException:
            _discard_output(tmp)
            raise
        if to == "torch":
            result.files = [os.path.basename(os.path.abspath(out))]
        result.file_count, result.file_bytes = _disk_usage(out)
        return result
    finally:
        src.close()


def _convert_into(src: TensorSource, to: str, target: str, max_shard_size: int, budget: int, nested: bool,
                  progress: ProgressFactory, result: ConvertResult) -> None:
    """Write the conversion of ``src`` to ``target`` (the staging path of OUT)."""
    entries = list(src.tensors.items())
    if to in ("torch_dist", "zarr"):
        _convert_to_torch_dist(src, target, budget, progress, result, backend=to)
        return
    if isinstance(src, DistCheckpointSource):
        result.skipped = list(src.objects)
    total = sum(i.nbytes for _, i in entries)
    bar = progress(total=total, unit="B", unit_scale=True, desc=f"convert to {to}")
    try:
        if to == "safetensors":
            common = _load_common_for_output(src, result)
            result.skipped_common += [f"{k!r} (safetensors holds tensors only)" for k in common]
            _write_safetensors(src, entries, target, max_shard_size, budget, bar, result)
        else:
            _write_torch(src, entries, target, nested, budget, bar, result)
    finally:
        bar.close()
    result.tensors, result.bytes = len(entries), total


def _convert_to_torch_dist(
    src: TensorSource, out: str, budget: int, progress: ProgressFactory, result: ConvertResult, backend: str = "torch_dist"
) -> None:
    from ..mapping import ShardedObject, ShardedTensor
    from ..serialization import load_common_state_dict, save

    spill_map = None
    if isinstance(src, DistCheckpointSource):
        # Stream every tensor into one spill file, then hand save() memory-mapped views of it.
        entries = list(src.tensors.items())
        offsets: Dict[str, int] = {}
        pos = 0
        for key, info in entries:
            offsets[key] = pos
            pos += info.nbytes + (-info.nbytes % 64)
        fd, spill = tempfile.mkstemp(prefix=".ckpt-convert-spill-", dir=os.path.dirname(os.path.abspath(out)))
        try:
            with os.fdopen(fd, "wb") as f:
                bar = progress(total=sum(i.nbytes for _, i in entries), unit="B", unit_scale=True, desc="read")
                for key, info in entries:
                    f.seek(offsets[key])
                    for _, block in src.iter_blocks(key, budget):
                        if block.numel():
                            f.write(tensor_buffer(block.contiguous()))
                        bar.update(block.numel() * block.element_size())
                bar.close()
                f.truncate(max(pos, 1))
            spill_map = _MappedFiles().get(spill)
        finally:
            os.remove(spill)  # the mapping keeps the data reachable until it is dropped
        tensors = {k: _tensor_from_map(spill_map, i.dtype, i.shape, offsets[k]) for k, i in entries}
        sd: Dict[str, Any] = {}
        try:
            common = load_common_state_dict(src.path, trusted=src.trusted)
        except CheckpointingException as e:
            raise CheckpointingException(f"cannot copy the common state: {e}") from None
        if isinstance(common, dict):
            sd.update(common)
        else:
            sd["common"] = common
        for key, t in tensors.items():
            sd[key] = ShardedTensor.from_rank_offsets(key, t)
        for unique_key in src.objects:
            obj = ShardedObject.empty_from_unique_key(unique_key)
            obj.data = src.read_object(unique_key)
            sd[unique_key] = obj
    elif isinstance(src, TorchFileSource):
        sharded = {k: ShardedTensor.from_rank_offsets(k, src.tensor(k)) for k in src.tensors}
        sd = _restore_structure(src.structure, sharded)
        if not isinstance(sd, dict):
            raise CheckpointingException(f"{src.path} does not hold a dict")
    else:
        assert isinstance(src, SafetensorsSource)
        sd = {k: ShardedTensor.from_rank_offsets(k, src.tensor(k)) for k in src.tensors}
        if src.metadata:
            sd["safetensors_metadata"] = dict(src.metadata)
    bar = progress(total=1, desc="save", unit="ckpt")
    save(sd, out, validate_access_integrity=True, overwrite=True, sharded_strategy=backend)
    bar.update(1)
    bar.close()
    result.tensors = len(src.tensors)
    result.bytes = sum(i.nbytes for i in src.tensors.values())
    result.files = sorted(os.listdir(out))
    del sd
