"""Checkpoint tools behind the ``ckpt-integration`` command line (also usable as a library).

* :func:`inspect_checkpoint` - backend, tensors (shape, dtype, bytes, shard layout),
  ShardedObjects and common-state keys of a checkpoint directory.
* :func:`verify_checkpoint` - completeness, the size and CRC32 of every recorded file, item and
  block, and ``.metadata`` against the stored data (files opened with the loaders' containment checks).
* :func:`convert_checkpoint` - streaming conversion between a distributed checkpoint,
  ``torch.save`` files and (HF-style, sharded) safetensors, in both directions.
* :func:`diff_checkpoints` - keys, shapes, dtypes and max abs difference of two sources.
* :func:`export_checkpoint` - model weights for stock tools: HF safetensors or a Lightning ``.ckpt``
  (fused parts merged, optimizer state left out); :func:`export_recipe_object` records at save
  time what an export without the model's code needs.
* :func:`import_lightning_checkpoint` - a stock Lightning ``.ckpt`` / DCP directory as a checkpoint the
  DistCkpt strategies resume from (``convert --to torch_dist`` uses it for such sources).

Nothing here needs a GPU or ``torch.distributed``. Tensor data is streamed: at
most one *block* of ``memory_budget`` bytes (rows of one tensor, read with
:meth:`TorchDistReader.read_region`) is held at a time, so checkpoints larger
than RAM can be converted, verified and diffed. Inputs given as ``torch.save``
or safetensors files are memory-mapped (their pages stay in the page cache).

Modules: one per command (:mod:`.inspect`, :mod:`.verify`, :mod:`.convert`, :mod:`.diff`,
:mod:`.export`, :mod:`.lightning_import`) over the shared :mod:`.sources` (readers),
:mod:`.writers`, :mod:`.output` (checks on OUT, staging, the atomic commit) and :mod:`.common`
(sizes, progress); they form a DAG: ``convert -> lightning_import -> export -> output/writers``.
The names below are re-exported here so that ``from ckpt_integration.tools import X`` keeps working.
"""

from .common import (DEFAULT_MAX_SHARD_SIZE, DEFAULT_MEMORY_BUDGET, SAFETENSORS_INDEX, ProgressFactory, format_size,
                     no_progress, parse_size)
from .convert import ConvertResult, convert_checkpoint
from .diff import DiffReport, diff_checkpoints
from .export import ExportError, ExportResult, export_checkpoint
from .inspect import format_inspect, inspect_checkpoint
from .lightning_import import ImportResult, import_lightning_checkpoint, stock_lightning_kind
from .recipe import EXPORT_RECIPE_KEY, export_recipe, export_recipe_object
from .sources import (DistCheckpointSource, SafetensorsSource, TensorInfo, TensorSource, TorchFileSource, detect_kind,
                      open_source, plan_blocks, read_safetensors_header)
from .verify import VerifyReport, verify_checkpoint
from .writers import SafetensorsWriter, TorchSaveWriter

__all__ = [
    "inspect_checkpoint", "format_inspect",
    "verify_checkpoint", "VerifyReport",
    "convert_checkpoint", "ConvertResult",
    "diff_checkpoints", "DiffReport",
    "export_checkpoint", "ExportResult", "ExportError", "export_recipe", "export_recipe_object", "EXPORT_RECIPE_KEY",
    "import_lightning_checkpoint", "ImportResult", "stock_lightning_kind",
    "detect_kind", "open_source", "plan_blocks", "read_safetensors_header",
    "TensorInfo", "TensorSource", "DistCheckpointSource", "SafetensorsSource", "TorchFileSource",
    "SafetensorsWriter", "TorchSaveWriter",
    "parse_size", "format_size", "ProgressFactory", "no_progress",
    "DEFAULT_MEMORY_BUDGET", "DEFAULT_MAX_SHARD_SIZE", "SAFETENSORS_INDEX",
]
