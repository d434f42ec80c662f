"""Import stock Lightning checkpoints as checkpoints that the DistCkpt strategies resume from.

Two inputs (detected by :func:`stock_lightning_kind`, used by ``convert --to torch_dist|zarr``):

* ``"ckpt"``: a ``.ckpt`` file of stock Lightning (``torch.save`` of the checkpoint dict with
  ``state_dict`` and ``pytorch-lightning_version``);
* ``"dcp"``: a directory of stock ``ModelParallelStrategy`` / ``FSDPStrategy`` with
  ``save_distributed_checkpoint=True`` (PyTorch DCP ``.metadata`` + ``*.distcp`` + Lightning's ``meta.pt``).

The output is what a DistCkpt strategy would have saved from the same state: model tensors
under their ``state_dict`` names (dict path ``state_dict -> name``), optimizer state as
``optimizer.state.<state>.<param key>`` tensors (scalars such as ``step`` as
objects under the same names), the rest of Lightning's dict as common state, and the strategy's marker.

What needs the LightningModule (``module=``): a stock ``.ckpt`` numbers optimizer state by
parameter *position* (``configure_optimizers`` order), which the file alone cannot map to
parameter names; without the module that optimizer state is **not carried** (listed in
``not_carried``; the result loads weights, but ``fit`` cannot resume from it). A DCP directory
keys optimizer state by parameter name and is carried whole without the module. Modules whose
``sharded_state_dict`` stores tensors differently (factories: ``qkv.weight`` as parts) need
``module=`` too, so that the output is stored the way the module asks for it.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..errors import CheckpointingException, CorruptCheckpointError, UntrustedObjectError
from ..mapping import ShardedTensor
from ..modules import ParallelLayout, module_sharded_state_dict
from ..optimizer import optimizer_key, optimizer_sharded_state_dict
from ..optimizer.sharding import optim_state_to_sharding_state
from ..serialization import save
from ..storage.opened import open_reader
from ..storage.filesystem import CheckpointLocation, locate
from ..storage.safe_pickle import safe_torch_load
from ..storage.torch_dist import read_dcp_metadata
from .common import DEFAULT_MEMORY_BUDGET, ProgressFactory, no_progress, parse_size
from .export import build_optimizers
from .output import ConvertResult, check_not_source, check_output, commit_output, discard_output, disk_usage, staging_path
from .recipe import export_recipe_object
from .sources import DistCheckpointSource, TensorInfo, TensorSource, check_zip_records, spill_tensors

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: Lightning's file of non-tensor state inside a distributed checkpoint directory
LIGHTNING_META_FILE = "meta.pt"
_VERSION_KEY = "pytorch-lightning_version"


@dataclass
class ImportResult(ConvertResult):
    """:class:`~ckpt_integration.tools.ConvertResult` of an import; ``source_kind`` is ``"ckpt"`` or
    ``"dcp"``, ``not_carried`` lists what the output lacks, each with the reason."""

    source_kind: str = ""
    not_carried: List[str] = field(default_factory=list)


# --------------------------------------------------------------------------- reading the inputs
def _load_file(path: str, trusted: bool, check: bool = True) -> Any:
    """``torch.load`` of a Lightning file (memory-mapped; weights-only unless ``trusted``).

    ``check``: first verify the zip records' CRC32s (``torch.load`` does not), so that damaged
    bytes fail here, naming the file and record, instead of being converted as values.
    Any other failure to load is a :class:`CorruptCheckpointError` naming the file.
    """
    if check:
        check_zip_records(path)
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=not trusted)
    except pickle.UnpicklingError as e:
        raise UntrustedObjectError(
            f"refusing to load {path} with weights_only=True ({str(e).splitlines()[0]}); "
            "pass --trusted (trusted=True) only if you trust the file") from None
    except CheckpointingException:
        raise
    except Exception as e:  # torch.load fails in many ways on a damaged or foreign file
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CorruptCheckpointError(f"{path} cannot be read by torch.load: {detail}") from None


def stock_lightning_kind(path: Union[str, os.PathLike], trusted: bool = False) -> Optional[str]:
    """``"ckpt"`` / ``"dcp"`` for a stock Lightning checkpoint file / distributed directory, else ``None``.

    A file is loaded (memory-mapped, weights-only unless ``trusted``) to look at its keys; one that
    cannot be loaded so is not recognized (the plain conversion reports why).
    """
    if isinstance(path, CheckpointLocation):
        return None  # opened as a checkpoint of ours (or DCP / Megatron-Core's): not a stock Lightning one
    path = os.fspath(path)
    if os.path.isdir(path):
        names = set(os.listdir(path))
        ok = {".metadata", LIGHTNING_META_FILE} <= names and "metadata.json" not in names
        return "dcp" if ok else None
    if not (os.path.isfile(path) and zipfile.is_zipfile(path)):
        return None
    try:
        obj = _load_file(path, trusted, check=False)  # (the conversion checks the file's CRCs)
    except Exception:  # noqa: BLE001 - not ours to judge here
        return None
    return "ckpt" if isinstance(obj, dict) and _VERSION_KEY in obj and isinstance(obj.get("state_dict"), dict) else None


class _DCPSource(DistCheckpointSource):
    """A DCP directory without our ``metadata.json`` (Lightning's own): tensors read block by block
    through our restricted ``.metadata`` reader; no checksums exist to verify."""

    def __init__(self, path: str, trusted: bool = False):
        TensorSource.__init__(self, path)
        self.trusted, self.kind, self.config, self.manifest = trusted, "torch_dist", None, None
        ck = locate(path)
        self.metadata = read_dcp_metadata(ck, trusted=trusted)
        self.reader = open_reader(ck, self.metadata, "torch_dist", None, verify_checksums=False)
        self.objects = []
        for key, md in sorted(self.metadata.state_dict_metadata.items()):
            if isinstance(md, TensorStorageMetadata):
                self.tensors[key] = TensorInfo(md.properties.dtype, tuple(int(s) for s in md.size))
            elif isinstance(md, BytesStorageMetadata):
                self.objects.append(key)

    def read_value(self, key: str) -> Any:
        """A non-tensor DCP item (``torch.save`` bytes), unpickled restricted unless trusted."""
        return safe_torch_load(io.BytesIO(self.reader.read_bytes(key)), trusted=self.trusted,
                               what=f"item {key!r} in {self.path}")


def _set_path(root: Dict[Any, Any], path: Tuple[Any, ...], value: object) -> None:
    node = root
    for i, p in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(node, list):
            while len(node) <= p:
                node.append(None)
            if node[p] is None:
                node[p] = [] if isinstance(nxt, int) else {}
            node = node[p]
        else:
            node = node.setdefault(p, [] if isinstance(nxt, int) else {})
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def _read_dcp(path: str, trusted: bool, where: str, budget: int, progress: ProgressFactory) -> Dict[str, Any]:
    """Lightning's checkpoint dict back from a DCP directory: ``meta.pt`` plus ``state_dict`` and
    ``optimizer_<i>`` (FQN-keyed, as ``get_optimizer_state_dict`` returns them)."""
    meta = _load_file(os.path.join(path, LIGHTNING_META_FILE), trusted)
    if not isinstance(meta, dict):
        raise CheckpointingException(f"{path}/{LIGHTNING_META_FILE} does not hold Lightning's checkpoint dict")
    src = _DCPSource(path, trusted=trusted)
    try:
        nested = src.metadata.planner_data or {}
        missing = [k for k in [*src.tensors, *src.objects] if k not in nested]
        if missing:
            raise CheckpointingException(f"{path}/.metadata does not say where {missing[:3]} belong (no planner data)")
        out: Dict[Any, Any] = {}
        for key, value in spill_tensors(src, list(src.tensors), where, budget, progress, "import").items():
            _set_path(out, tuple(nested[key]), value)
        for key in src.objects:
            _set_path(out, tuple(nested[key]), src.read_value(key))
    finally:
        src.close()
    unknown = [k for k in out if k != "state_dict" and not str(k).startswith("optimizer_")]
    if unknown or "state_dict" not in out:
        raise CheckpointingException(
            f"{path} is not a Lightning distributed checkpoint (top-level items {sorted(map(str, out))})")
    optimizers = [out[f"optimizer_{i}"] for i in range(len(out) - 1)]
    return {**meta, "state_dict": out["state_dict"], "optimizer_states": optimizers}


# --------------------------------------------------------------------------- building the output
def _module_from(module: Union[pl.LightningModule, Type[pl.LightningModule]], ckpt: Dict[str, Any]) -> Any:
    """A module instance with the checkpoint's weights: ``module`` given as a class is built the way
    ``load_from_checkpoint`` builds it (saved hyper-parameters, ``configure_model``)."""
    if isinstance(module, type):
        from lightning.pytorch.core.saving import _load_state

        return _load_state(module, dict(ckpt), strict=True)
    result = module.load_state_dict(ckpt["state_dict"], strict=True)
    del result
    return module


def _fqn_keyed_to_sharded(state: Dict[str, Any], model_sd: Dict[str, Any], prefix: str, where: str) -> Dict[str, Any]:
    """A name-keyed optimizer state (``get_optimizer_state_dict``) as our sharded optimizer state."""
    order = [fqn for g in state.get("param_groups", []) for fqn in g["params"]]
    unknown = [f for f in order if f not in model_sd]
    if unknown:
        raise CheckpointingException(f"{where}: optimizer {prefix} has state for {unknown[:5]}, which are not tensors of the state_dict")
    pid = {fqn: i for i, fqn in enumerate(order)}
    sd = {"state": {pid[f]: dict(s) for f, s in state.get("state", {}).items()},
          "param_groups": [{**g, "params": [pid[f] for f in g["params"]]} for g in state["param_groups"]]}
    for i in range(len(order)):
        sd["state"].setdefault(i, {})
    optim_state_to_sharding_state(sd, {pid[f]: model_sd[f] for f in order}, prefix=prefix)
    return sd


def _by_position(state: Dict[str, Any], optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> Dict[str, Any]:
    """A name-keyed optimizer state renumbered by the optimizer's parameter positions."""
    names = {id(p): n for n, p in module.named_parameters()}
    pos = {names[id(p)]: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    return {"state": {pos[f]: s for f, s in state.get("state", {}).items()},
            "param_groups": [{**g, "params": [pos[f] for f in g["params"]]} for g in state["param_groups"]]}


def _build_state(ckpt: Dict[str, Any], kind: str, module: Union[pl.LightningModule, Type[pl.LightningModule], None], optimizers: Optional[Sequence[Any]], where: str,
                 result: ImportResult) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    rest = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
    opt_states = ckpt.get("optimizer_states")
    state: Dict[str, Any] = dict(rest)
    if module is not None:
        module = _module_from(module, ckpt)
        model_sd = module_sharded_state_dict(module, "", {"layout": ParallelLayout()})
        state["_export_recipe"] = export_recipe_object(model_sd, 0, 1)
    else:
        model_sd = {k: ShardedTensor.from_rank_offsets(k, v.detach()) if isinstance(v, torch.Tensor) else v
                    for k, v in ckpt["state_dict"].items()}
    state["state_dict"] = model_sd
    carried = False
    if opt_states:
        if module is not None:
            opts = list(optimizers) if optimizers is not None else build_optimizers(module)
            if len(opts) != len(opt_states):
                raise CheckpointingException(f"{where} holds {len(opt_states)} optimizer state(s); the module configures {len(opts)}")
            for i, (opt, st) in enumerate(zip(opts, opt_states)):
                opt.load_state_dict(_by_position(st, opt, module) if kind == "dcp" else st)
                state[optimizer_key(i)] = optimizer_sharded_state_dict(opt, model_sd, prefix=optimizer_key(i), module=module)
            carried = True
        elif kind == "dcp":
            for i, st in enumerate(opt_states):
                state[optimizer_key(i)] = _fqn_keyed_to_sharded(st, model_sd, optimizer_key(i), where)
            carried = True
        else:
            result.not_carried.append(
                f"optimizer_states ({len(opt_states)} optimizer(s)): a stock .ckpt numbers parameters by position in "
                "configure_optimizers(), which only the LightningModule knows; pass --module pkg.mod:Class "
                "(module= in Python) to carry it. Without it the output loads weights, but fit cannot resume from it")
    n = len(opt_states) if carried else 0
    marker = {
        "lightning": 1,
        "world_size": None,  # no RNG states: stock Lightning does not save them
        "num_optimizers": n,
        "has_optimizer_states": carried or opt_states == [],
        "empty_keys": {k: type(v).__name__ for k, v in state.items() if isinstance(v, (list, dict)) and not v},
        "layout": {"tp": 1, "pp": 1, "dp": 1},
        "imported_from": f"stock Lightning {kind} ({ckpt.get(_VERSION_KEY, '?')})",
    }
    return state, marker


def import_lightning_checkpoint(
    src_path: Union[str, os.PathLike],
    out: Union[str, os.PathLike],
    *,
    to: str = "torch_dist",
    module: Union[pl.LightningModule, Type[pl.LightningModule], None] = None,
    optimizers: Optional[Sequence[torch.optim.Optimizer]] = None,
    overwrite: bool = False,
    trusted: bool = False,
    memory_budget: Union[int, str] = DEFAULT_MEMORY_BUDGET,
    progress: ProgressFactory = no_progress,
) -> ImportResult:
    """Convert a stock Lightning ``.ckpt`` file or distributed checkpoint directory into checkpoint
    directory ``out`` (backend ``to``: ``torch_dist`` or ``zarr``) that the DistCkpt strategies resume
    from with ``trainer.fit(model, ckpt_path=out)`` (any layout).

    ``module``: the LightningModule class (built from the saved hyper-parameters, like
    ``load_from_checkpoint``) or an instance (the weights are loaded into it); needed to carry a
    ``.ckpt``'s optimizer state and to store tensors the way the module's ``sharded_state_dict``
    does (factories). ``optimizers``: instead of calling ``configure_optimizers()`` on it.
    What could not be carried is listed in ``result.not_carried``.

    Example::

        import_lightning_checkpoint("stock/last.ckpt", "ckpt/imported", module=MyModule)
        Trainer(strategy=DistCkptDDPStrategy(), plugins=[DistCkptIO()]).fit(MyModule(), ckpt_path="ckpt/imported")
    """
    src_path, out = os.fspath(src_path), os.fspath(out)
    kind = stock_lightning_kind(src_path, trusted)
    if kind is None:
        raise CheckpointingException(
            f"{src_path} is not a stock Lightning checkpoint (a .ckpt file with 'state_dict' and '{_VERSION_KEY}', "
            f"or a directory with .metadata and {LIGHTNING_META_FILE})")
    check_not_source(src_path, out)
    check_output(out, overwrite, is_dir=True)
    result = ImportResult(out, to, source_kind=kind)
    tmp = staging_path(out, True)
    try:
        if kind == "ckpt":
            ckpt = _load_file(src_path, trusted)
        else:
            ckpt = _read_dcp(src_path, trusted, os.path.dirname(tmp), parse_size(memory_budget), progress)
        state, marker = _build_state(ckpt, kind, module, optimizers, src_path, result)
        tensors = [v for v in ckpt["state_dict"].values() if isinstance(v, torch.Tensor)]
        bar = progress(total=1, desc="save", unit="ckpt")
        save(state, tmp, sharded_strategy=to, validate_access_integrity=True, overwrite=True, content_metadata=marker)
        bar.update(1)
        bar.close()
        commit_output(tmp, out)
    except BaseException:
        discard_output(tmp)
        raise
    result.tensors = len(tensors)
    result.bytes = sum(t.numel() * t.element_size() for t in tensors)
    result.files = sorted(os.listdir(out))
    result.file_count, result.file_bytes = disk_usage(out)
    return result


__all__ = ["import_lightning_checkpoint", "stock_lightning_kind", "ImportResult", "LIGHTNING_META_FILE"]
