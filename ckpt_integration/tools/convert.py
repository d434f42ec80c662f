"""``convert``: streaming conversion between checkpoint directories, torch.save files and safetensors."""

from __future__ import annotations

import io
import os
from typing import Any, Dict, List, Tuple

import torch

from ..errors import CheckpointingException, UntrustedObjectError
from ..storage.opened import pinned
from ..storage.filesystem import locate, writing
from ..mapping import ShardedObject, ShardedTensor, object_key_of
from ..serialization import load_common_state_dict, save
from .common import DEFAULT_MAX_SHARD_SIZE, DEFAULT_MEMORY_BUDGET, ProgressFactory, no_progress, parse_size
from .lightning_import import import_lightning_checkpoint, stock_lightning_kind
from .output import ConvertResult, check_not_source, check_output, commit_output, discard_output, disk_usage, staging_path
from .sources import (DistCheckpointSource, SafetensorsSource, TensorInfo, TensorSource, TorchFileSource, open_source,
                      restore_structure, spill_tensors)
from .writers import TorchSaveWriter, write_safetensors_folder


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
    try:
        common = load_common_state_dict(src.checkpoint, trusted=src.trusted)
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
def _write_torch(src: TensorSource, entries: List[Tuple[str, TensorInfo]], out_file: str, nested: bool,
                 budget: int, bar: Any, result: ConvertResult) -> None:
    """One ``torch.load``-able file: the tensors, and the common state of a checkpoint source."""
    tensor_names = {k.split(".")[0] for k, _ in entries} if nested else {k for k, _ in entries}
    if nested:  # "emb" and "emb.scale": one key would have to be a tensor and a dict at once
        keys = {k for k, _ in entries}
        clash = next((k for k in sorted(keys) if any(k[:i] in keys for i in range(len(k)) if k[i] == ".")), None)
        if clash is not None:
            parent = next(clash[:i] for i in range(len(clash)) if clash[i] == "." and clash[:i] in keys)
            raise CheckpointingException(f"--nested cannot write tensors {parent!r} and {clash!r}: {parent!r} would be "
                                         "a tensor and a dict at once; convert without --nested")
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
    progress: ProgressFactory = no_progress,
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
    with pinned(src_path, verified=True):  # (an opened checkpoint: its commit, pinned)
        to = to.lower().replace("-", "_")
        if to not in ("safetensors", "torch", "torch_dist", "zarr"):
            raise ValueError(f"unknown output format {to!r}: choose torch, safetensors, torch_dist or zarr")
        if to in ("torch_dist", "zarr"):
            if stock_lightning_kind(src_path, trusted=trusted):
                return import_lightning_checkpoint(src_path, out, to=to, module=module, overwrite=overwrite,
                                                   trusted=trusted, memory_budget=memory_budget, progress=progress)
        if module is not None:
            raise ValueError("module= is for importing stock Lightning checkpoints (--to torch_dist or zarr)")
        max_shard_size = parse_size(max_shard_size)
        budget = parse_size(memory_budget)
        out = os.fspath(out)
        check_not_source(locate(src_path).path, out)
        is_dir = to != "torch"
        check_output(out, overwrite, is_dir)
        src = open_source(src_path, trusted=trusted)
        result = ConvertResult(out, to)
        try:
            tmp = staging_path(out, is_dir)
            try:
                with writing(out):  # (a full disk: CheckpointWriteError naming the output, not a bare OSError)
                    _convert_into(src, to, tmp, max_shard_size, budget, nested, progress, result)
                    commit_output(tmp, out)
            except BaseException:
                discard_output(tmp)
                raise
            if to == "torch":
                result.files = [os.path.basename(os.path.abspath(out))]
            result.file_count, result.file_bytes = disk_usage(out)
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
            result.files += write_safetensors_folder(src, entries, target, max_shard_size, budget, bar)
        else:
            _write_torch(src, entries, target, nested, budget, bar, result)
    finally:
        bar.close()
    result.tensors, result.bytes = len(entries), total


def _convert_to_torch_dist(
    src: TensorSource, out: str, budget: int, progress: ProgressFactory, result: ConvertResult, backend: str = "torch_dist"
) -> None:
    if isinstance(src, DistCheckpointSource):
        # every tensor streamed into one spill file; save() gets memory-mapped views of it
        entries = list(src.tensors.items())
        tensors = spill_tensors(src, [k for k, _ in entries], os.path.dirname(os.path.abspath(out)), budget, progress,
                                "convert")
        sd: Dict[str, Any] = {}
        try:
            common = load_common_state_dict(src.checkpoint, trusted=src.trusted)
        except CheckpointingException as e:
            raise CheckpointingException(f"cannot copy the common state: {e}") from None
        if isinstance(common, dict):
            sd.update(common)
        else:
            sd["common"] = common
        # tensors and objects under a key of their own: a common-state entry may have a tensor's key
        # (the two are separate namespaces); a dict holding only those leaves no trace in the common state
        sharded: Dict[str, Any] = {key: ShardedTensor.from_rank_offsets(key, t) for key, t in tensors.items()}
        for unique_key in src.objects:
            if object_key_of(unique_key) is None:  # a plain DCP byte item (a non-tensor value under its own key)
                if unique_key in sd:
                    raise CheckpointingException(f"{src.path}: {unique_key!r} is both a byte item and a common-state key")
                sd[unique_key] = src.read_object(unique_key)  # (common state: what load_common_state_dict returns)
                continue
            obj = ShardedObject.empty_from_unique_key(unique_key)
            obj.data = src.read_object(unique_key)
            sharded[unique_key] = obj
        slot = "sharded"
        while slot in sd:
            slot = "_" + slot
        sd[slot] = sharded
    elif isinstance(src, TorchFileSource):
        sharded = {k: ShardedTensor.from_rank_offsets(k, src.tensor(k)) for k in src.tensors}
        sd = restore_structure(src.structure, sharded)
        if not isinstance(sd, dict):
            raise CheckpointingException(f"{src.path} does not hold a dict")
    else:
        assert isinstance(src, SafetensorsSource)
        sd = {k: ShardedTensor.from_rank_offsets(k, src.tensor(k)) for k in src.tensors}
        if src.metadata:
            sd["safetensors_metadata"] = dict(src.metadata)
    # the step the source recorded (save(step=...), or Megatron's iteration): commit order and "last"
    # read it, and a step given explicitly is not in the common state to be found again
    manifest = getattr(src, "manifest", None)
    step = getattr(manifest, "step", None) if isinstance(src, DistCheckpointSource) else None
    bar = progress(total=1, desc="save", unit="ckpt")
    save(sd, out, validate_access_integrity=True, overwrite=True, sharded_strategy=backend, step=step)
    bar.update(1)
    bar.close()
    result.tensors = len(src.tensors)
    result.bytes = sum(i.nbytes for i in src.tensors.values())
    result.files = sorted(os.listdir(out))
    del sd
