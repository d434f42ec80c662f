"""``export``: a checkpoint's model weights for stock tools - Hugging Face safetensors or a Lightning ``.ckpt``.

The exported tensors are named as ``module.state_dict()`` names them: fused parameters that a
``ShardedTensorFactory`` stored as parts (``qkv.weight.part0/1/2``) are merged back, every
tensor is whole (any saved layout), optimizer state is left out (unless asked for, see
:func:`export_checkpoint`). Two ways to know the names:

* from disk (the command line): stored keys are the names (true for the default
  ``sharded_state_dict`` and :class:`~ckpt_integration.modules.ShardedModuleMixin`); the
  :mod:`export recipe <.recipe>` recorded at save time says which parts to merge and which
  keys were renamed or stacked. Without a recipe, ``X.part0..N`` groups are ambiguous (a fused
  parameter or parameters that are really called so) and the export refuses unless told
  (``merge_parts``). Tensors are streamed block by block (``memory_budget``).
* from the module (``module=``, Python): the module's own ``sharded_state_dict()`` is loaded in
  one process (factories merge themselves) and ``module.state_dict()`` is written. Needs
  memory for the module, which any ``merge_fn`` and hook works with.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import CheckpointingException, UntrustedObjectError
from ..mapping import object_key_of
from ..modules import ParallelLayout, load_into_module, module_sharded_state_dict
from ..optimizer import DEFAULT_PREFIX, load_optimizer_state, optimizer_key
from ..planning.boxes import Box
from ..serialization import load, load_common_state_dict
from ..storage.opened import OpenedCheckpoint, pinned
from ..storage.filesystem import locate, writing
from .common import DEFAULT_MAX_SHARD_SIZE, DEFAULT_MEMORY_BUDGET, ProgressFactory, no_progress, parse_size
from .output import check_not_source, check_output, commit_output, discard_output, staging_path
from .recipe import EXPORT_RECIPE_KEY, read_recipe
from .sources import DistCheckpointSource, TensorInfo, TensorSource, box_slices
from .writers import TorchSaveWriter, write_safetensors_folder

#: top-level entries of a Lightning checkpoint that hold training (not model) state
_TRAINING_KEYS = ("optimizer_states", "lr_schedulers", "callbacks")
_CONTENT_METADATA_KEY = "content_metadata"  # where ci.save keeps content_metadata in the common state
_LIGHTNING_MARKER = "_ckpt_integration_lightning"  # not imported: lightning.io pulls in Lightning
_PART_RE = re.compile(r"^(.+)\.part(\d+)$")


class ExportError(CheckpointingException):
    """The checkpoint cannot be exported as asked (ambiguous parts, names that collide, ...)."""


@dataclass
class ExportResult:
    """What :func:`export_checkpoint` wrote.

    ``merged``: names rebuilt from stored parts; ``skipped``: what was left out, each with the
    reason (optimizer state, keys outside ``strip_prefix``, objects, common state).
    """

    output: str
    to: str
    tensors: int = 0
    bytes: int = 0
    files: List[str] = field(default_factory=list)
    merged: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)


# --------------------------------------------------------------------------- a renamed / merged view of a source
_Piece = Tuple[str, Tuple[int, ...]]  # (stored key, index along prepended axes)


class _ExportView(TensorSource):
    """Output names over a source: each a stored tensor, a slice of a stacked one, or stored parts
    concatenated along axis 0; read block by block like any source."""

    kind = "export"

    def __init__(self, src: TensorSource, plan: Dict[str, List[_Piece]]):
        super().__init__(src.path)
        self.src = src
        self.pieces: Dict[str, List[Tuple[str, Tuple[int, ...], int, int]]] = {}
        for name, pieces in plan.items():
            infos = []
            for key, lead in pieces:
                info = src.tensors[key]
                if len(lead) > len(info.shape):
                    raise ExportError(f"{key!r} {list(info.shape)} has no index {list(lead)}")
                infos.append(TensorInfo(info.dtype, info.shape[len(lead):]))
            first = infos[0]
            if len(pieces) > 1:
                bad = [k for (k, _), i in zip(pieces, infos)
                       if i.dtype != first.dtype or not i.shape or i.shape[1:] != first.shape[1:]]
                if bad or not first.shape:
                    raise ExportError(
                        f"cannot merge {[k for k, _ in pieces]} into {name!r}: dtypes / shapes after axis 0 differ "
                        f"({', '.join(f'{k}: {i.dtype} {list(i.shape)}' for (k, _), i in zip(pieces, infos))})")
            shape = (sum(i.shape[0] for i in infos),) + first.shape[1:] if len(pieces) > 1 else first.shape
            self.tensors[name] = TensorInfo(first.dtype, tuple(shape))
            rows, start = [], 0
            for (key, lead), info in zip(pieces, infos):
                n = info.shape[0] if info.shape else 1
                rows.append((key, lead, start, n))
                start += n
            self.pieces[name] = rows

    def read_block(self, key: str, box: Box) -> torch.Tensor:
        pieces = self.pieces[key]
        if len(pieces) == 1 and not pieces[0][1]:
            return self.src.read_block(pieces[0][0], box)
        if not box.sizes:  # a 0-dim slice of a stacked tensor
            src_key, lead, _, _ = pieces[0]
            return self.src.read_block(src_key, Box(lead, (1,) * len(lead))).reshape(())
        lo, hi = box.offsets[0], box.offsets[0] + box.sizes[0]
        blocks = []
        for src_key, lead, start, n in pieces:
            a, b = max(lo, start), min(hi, start + n)
            if a >= b:
                continue
            sub = Box(lead + (a - start,) + box.offsets[1:], (1,) * len(lead) + (b - a,) + box.sizes[1:])
            blocks.append(self.src.read_block(src_key, sub).reshape((b - a,) + tuple(box.sizes[1:])))
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=0)


class _DictSource(TensorSource):
    """In-memory tensors (a module's state dict) as a source."""

    kind = "module"

    def __init__(self, path: str, tensors: Dict[str, torch.Tensor]):
        super().__init__(path)
        self._values = {k: t.detach().cpu() for k, t in tensors.items()}
        for k, t in self._values.items():
            self.tensors[k] = TensorInfo(t.dtype, tuple(t.shape))

    def read_block(self, key: str, box: Box) -> torch.Tensor:
        return self._values[key][box_slices(box)]


# --------------------------------------------------------------------------- what a checkpoint holds
def _optimizer_prefixes(src: DistCheckpointSource, marker: Dict[str, Any]) -> List[str]:
    """Prefixes of the optimizer states: from the Lightning marker, the default prefix
    (``optimizer.state.*`` tensors and scalar objects, as :mod:`ckpt_integration.optimizer` and
    Megatron-Core write them) and the per-param ``{prefix}.param_state.{key}`` objects of
    checkpoints written before scalars were stored in place."""
    prefixes = {optimizer_key(i) for i in range(int(marker.get("num_optimizers") or 0))}
    keys = [object_key_of(u) or u for u in src.objects] + list(src.tensors)
    if any(k.startswith(DEFAULT_PREFIX + ".state.") for k in keys):
        prefixes.add(DEFAULT_PREFIX)
    for key in keys:
        if ".param_state." in key:
            prefixes.add(key.split(".param_state.", 1)[0])
    return sorted(prefixes)


def _read_common(src: DistCheckpointSource, allowed: Sequence[Any], result: ExportResult) -> Optional[Dict[str, Any]]:
    """The common state, or ``None`` (noted in ``result.skipped``) when it is refused as unsafe.

    Only an untrusted-object refusal (objects outside the allow-list, without ``trusted``) is a
    note: the user chose not to trust it. A missing or damaged common state fails the export
    (as in ``convert``): without it the Lightning marker is lost, so optimizer state would be
    exported as model weights and the ``.ckpt`` would silently lack its training entries.
    """
    try:
        common = load_common_state_dict(src.checkpoint, trusted=src.trusted, allowed_globals=list(allowed))
    except UntrustedObjectError as e:
        result.skipped.append(f"the common state ({str(e).splitlines()[0]})")
        return None
    return dict(common) if isinstance(common, dict) else {"common": common}


def _allowed_globals() -> List[Any]:
    """Classes allowed in a Lightning common state, as :class:`~ckpt_integration.lightning.DistCkptIO` allows them."""
    allowed: List[Any] = []
    try:
        from lightning.fabric.utilities.data import AttributeDict

        allowed.append(AttributeDict)
    except ImportError:  # pragma: no cover
        pass
    try:
        from omegaconf import DictConfig, ListConfig

        allowed += [DictConfig, ListConfig]
    except ImportError:  # pragma: no cover
        pass
    return allowed


def _part_groups(keys: Sequence[str]) -> Dict[str, List[str]]:
    """``{base: [base.part0, ..., base.part{n-1}]}`` for complete groups (n >= 2) whose base is no key itself."""
    found: Dict[str, Dict[int, str]] = {}
    for k in keys:
        m = _PART_RE.match(k)
        if m:
            found.setdefault(m.group(1), {})[int(m.group(2))] = k
    present = set(keys)
    return {base: [parts[i] for i in range(len(parts))] for base, parts in sorted(found.items())
            if len(parts) >= 2 and set(parts) == set(range(len(parts))) and base not in present}


def _plan_from_disk(src: DistCheckpointSource, marker: Dict[str, Any], recipe: Optional[Dict[str, Any]],
                    merge_parts: Optional[bool], result: ExportResult) -> Dict[str, List[_Piece]]:
    """Output name -> stored pieces, for every model tensor of a checkpoint (optimizer state left out)."""
    prefixes = _optimizer_prefixes(src, marker)
    opt_keys = [k for k in src.tensors if any(k.startswith(p + ".state.") for p in prefixes)]
    if opt_keys:
        result.skipped.append(f"optimizer state: {len(opt_keys)} tensor(s) under {', '.join(p + '.state.' for p in prefixes)}")
    keys = [k for k in src.tensors if k not in set(opt_keys)]
    plan: Dict[str, List[_Piece]] = {}
    used: set = set()
    if recipe is not None and merge_parts is not False:
        opaque = {n: ks for n, ks in recipe["opaque"].items() if set(ks) & set(keys)}
        if opaque:
            raise ExportError(
                f"{src.path}: {len(opaque)} parameter(s) were saved through a ShardedTensorFactory whose merge_fn is "
                f"not a concatenation, e.g. {sorted(opaque)[:3]}; only the module's code can merge them: export from "
                "Python with export_checkpoint(..., module=model)")
        for name, m in sorted(recipe["merged"].items()):
            missing = [k for k in m["parts"] if k not in src.tensors]
            if missing:
                raise ExportError(f"{src.path}: parts {missing} of {name!r} (recorded in the export recipe) are not in the checkpoint")
            plan[name] = [(k, ()) for k in m["parts"]]
            used.update(m["parts"])
            result.merged.append(name)
    if recipe is not None:
        for key, name in recipe["renamed"].items():
            if key in keys and key not in used:
                plan[name] = [(key, ())]
                used.add(key)
        for key, names in recipe["stacked"].items():
            if key in keys:
                for name, index in names.items():
                    plan[name] = [(key, tuple(index))]
                used.add(key)
    rest = [k for k in keys if k not in used]
    groups = _part_groups(rest)
    if groups and merge_parts is None and recipe is None:
        shown = "; ".join(f"{b}: {', '.join(p.rsplit('.', 1)[1] for p in ps)}" for b, ps in list(groups.items())[:5])
        raise ExportError(
            f"{src.path} holds {len(groups)} group(s) of tensors named like the parts of fused parameters "
            f"({shown}{'; ...' if len(groups) > 5 else ''}) and records no export recipe saying how they were saved. "
            "Choose: merge_parts=True / --merge-parts (concatenate each group along axis 0, as "
            "ckpt_integration.modules.fused_column_parallel stores them), merge_parts=False / --keep-parts (export "
            "them as stored), or export from Python with module=model (the module's own merge)")
    if merge_parts:
        for base, parts in groups.items():
            plan[base] = [(k, ()) for k in parts]
            used.update(parts)
            result.merged.append(base)
    for k in keys:
        if k not in used:
            if k in plan:
                raise ExportError(f"{src.path}: two tensors would be exported as {k!r} (a stored key and a merged / renamed one)")
            plan[k] = [(k, ())]
    return plan


def _strip(plan: Dict[str, Any], prefix: Optional[str], result: ExportResult) -> Dict[str, Any]:
    if not prefix:
        return plan
    kept = {name[len(prefix):]: v for name, v in plan.items() if name.startswith(prefix) and len(name) > len(prefix)}
    if not kept:
        raise ExportError(f"no tensor name starts with {prefix!r} (names: {sorted(plan)[:5]}...)")
    outside = sorted(n for n in plan if not (n.startswith(prefix) and len(n) > len(prefix)))
    if outside:
        result.skipped.append(f"{len(outside)} tensor(s) outside prefix {prefix!r}: {', '.join(outside)}")
    return kept


def _model_objects(src: DistCheckpointSource, prefixes: Sequence[str]) -> List[str]:
    """ShardedObjects that may be model state (not RNG, optimizer or recipe objects)."""
    out = []
    for unique in src.objects:
        key = object_key_of(unique) or unique
        if key in (EXPORT_RECIPE_KEY, "lightning.rng_states") or any(
            key.startswith((p + ".state.", p + ".param_state.")) for p in prefixes
        ):
            continue
        out.append(key)
    return sorted(set(out))


# --------------------------------------------------------------------------- the module route
def _load_through_module(module: torch.nn.Module, path: str, trusted: bool) -> Dict[str, Any]:
    """Load the checkpoint into ``module`` through its own sharded state dict; returns that request."""
    request = module_sharded_state_dict(module, "", {"layout": ParallelLayout()})
    loaded = load(request, path, trusted=trusted, allowed_globals=_allowed_globals())
    load_into_module(module, {k: loaded[k] for k in request if k in loaded})
    return request


def _module_optimizer_states(module: Any, optimizers: Optional[Sequence[Any]], path: str,
                             marker: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The optimizers' ``state_dict()`` s (stock Lightning's ``optimizer_states``), loaded from the checkpoint."""
    if optimizers is None:
        optimizers = build_optimizers(module)
    saved = int(marker.get("num_optimizers") or 0)
    if not marker.get("has_optimizer_states") or saved != len(optimizers):
        raise ExportError(
            f"{path} holds {saved if marker.get('has_optimizer_states') else 'no'} optimizer state(s); the module "
            f"configures {len(optimizers)} optimizer(s)")
    model_sd = module_sharded_state_dict(module, "", {"layout": ParallelLayout()})
    states = []
    for i, opt in enumerate(optimizers):
        load_optimizer_state(opt, model_sd, path, prefix=optimizer_key(i), module=module)
        states.append(opt.state_dict())
    return states


def build_optimizers(module: Any) -> List[torch.optim.Optimizer]:
    """The optimizers of a LightningModule's ``configure_optimizers()``, called outside a Trainer.

    Raises :class:`ExportError` when the hook needs the Trainer (pass ``optimizers=`` then).
    """
    from lightning.pytorch.core.optimizer import _configure_optimizers

    try:
        conf = module.configure_optimizers()
        optimizers, _, _ = _configure_optimizers(conf)
    except Exception as e:  # noqa: BLE001 - user code
        raise ExportError(
            f"{type(module).__name__}.configure_optimizers() failed outside a Trainer ({type(e).__name__}: {e}); "
            "pass the optimizers yourself (optimizers=[...], over the module's parameters in the same order)") from e
    return [getattr(o, "optimizer", o) for o in optimizers]


# --------------------------------------------------------------------------- writers
def _write_hf_config(config: Any, out_dir: str, result: ExportResult) -> None:
    """``config.json`` next to the weights: a transformers config object, a dict, a file or a folder holding one."""
    if config is None:
        return
    target = os.path.join(out_dir, "config.json")
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(out_dir)
    elif isinstance(config, dict):
        with open(target, "w") as f:
            json.dump(config, f, indent=2)
    else:
        path = os.fspath(config)
        path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(path):
            raise ExportError(f"config {config!r}: no such file (expected a config.json or a folder holding one)")
        shutil.copyfile(path, target)
    result.files.append("config.json")


def _write_lightning(src: TensorSource, names: List[str], extra_state: Dict[str, Any], top: Dict[str, Any],
                     out_file: str, budget: int, bar: Any) -> None:
    """One ``torch.load``-able file ``{"state_dict": {name: tensor, ...}, **top}``, tensors streamed."""
    writer = TorchSaveWriter(out_file)
    try:
        for name in names:
            writer.begin_tensor(name, src.tensors[name])
            for _, block in src.iter_blocks(name, budget):
                writer.write(block)
                bar.update(block.numel() * block.element_size())
                del block
            writer.end_tensor()
        state_dict, writer.refs = writer.refs, {}  # the tensors go under "state_dict", not at the top
        state_dict.update(extra_state)
        writer.values["state_dict"] = state_dict
        for key, value in top.items():
            writer.add_value(key, value)
        writer.close()  # inside: pickling the top-level values can fail too
    except BaseException:
        writer.abort()
        raise


def _lightning_top_level(common: Optional[Dict[str, Any]], marker: Dict[str, Any], include_training: bool,
                         result: ExportResult) -> Dict[str, Any]:
    """The non-model entries of the exported ``.ckpt``: Lightning's, as its ``save_weights_only`` would keep them."""
    import lightning

    if common is None or not marker.get("lightning"):
        if common:
            result.skipped.append(f"common state {sorted(map(str, common))} (not a Lightning checkpoint)")
        return {"pytorch-lightning_version": lightning.__version__}
    n_opt = int(marker.get("num_optimizers") or 0)
    drop = {_CONTENT_METADATA_KEY, "state_dict", "rng_states"} | {optimizer_key(i) for i in range(n_opt)}
    if not include_training:
        drop |= set(_TRAINING_KEYS)
        left = sorted(k for k in _TRAINING_KEYS if k in common or k in marker.get("empty_keys", {}))
        if left:
            result.skipped.append(f"training state {left} (weights-only export; include_optimizer=True keeps it)")
    top = {k: v for k, v in common.items() if k not in drop}
    for k, kind in (marker.get("empty_keys") or {}).items():
        if k not in drop:
            top.setdefault(k, [] if kind == "list" else {})
    top.setdefault("pytorch-lightning_version", lightning.__version__)
    return top


# --------------------------------------------------------------------------- export
def export_checkpoint(
    src_path: str,
    out: str,
    to: str = "hf",
    *,
    module: Optional[torch.nn.Module] = None,
    strip_prefix: Optional[str] = None,
    merge_parts: Optional[bool] = None,
    include_optimizer: bool = False,
    optimizers: Optional[Sequence[torch.optim.Optimizer]] = None,
    config: Any = None,
    max_shard_size: Any = DEFAULT_MAX_SHARD_SIZE,
    memory_budget: Any = DEFAULT_MEMORY_BUDGET,
    overwrite: bool = False,
    trusted: bool = False,
    progress: ProgressFactory = no_progress,
) -> ExportResult:
    """Export the model weights of checkpoint directory ``src_path`` for stock tools.

    ``to="hf"``: folder ``out`` with HF-style sharded safetensors (``model.safetensors`` or
    ``model-0000i-of-0000n.safetensors``, at most ``max_shard_size`` each) and
    ``model.safetensors.index.json``; ``config`` (a ``transformers`` config, a dict, or the path of
    a ``config.json`` / a folder holding one) is written next to them so that
    ``AutoModel*.from_pretrained(out)`` loads it. ``to="lightning"``: one file ``out`` that stock
    ``LightningModule.load_from_checkpoint(out)`` loads: ``state_dict``, hyper-parameters, epoch,
    global step and loops (what Lightning's ``save_weights_only`` keeps).

    Names are the ``module.state_dict()`` names: from the module when ``module`` is given (it is
    loaded from the checkpoint in place, through its ``sharded_state_dict``), else from the stored
    keys, with parts merged per the checkpoint's export recipe or ``merge_parts`` (see the module
    docstring; ``None`` refuses ambiguous ``X.partN`` groups). ``strip_prefix="model."`` exports the
    tensors under that prefix without it (the submodule ``model``) and lists the others as skipped.
    Optimizer state is excluded; ``include_optimizer=True`` (``to="lightning"``, needs ``module``)
    adds ``optimizer_states`` (the module's ``configure_optimizers()``, or ``optimizers``, loaded
    from the checkpoint), ``lr_schedulers`` and ``callbacks``, so that stock Lightning resumes
    ``fit`` from the file. ``out`` is written beside itself and moved in place when complete.

    Example::

        export_checkpoint("ckpts/last.ckpt", "hf_out", "hf", strip_prefix="model.", config=hf_config)
        AutoModelForCausalLM.from_pretrained("hf_out")
    """
    with pinned(src_path, verified=True):  # (an opened checkpoint: its commit, pinned)
        to = {"huggingface": "hf", "safetensors": "hf", "ckpt": "lightning"}.get(to.lower(), to.lower())
        if to not in ("hf", "lightning"):
            raise ValueError(f"unknown export format {to!r}: choose hf or lightning")
        if include_optimizer and (to != "lightning" or module is None):
            raise ValueError("include_optimizer=True needs to='lightning' and module= (the optimizers are rebuilt from it)")
        given, src_path, out = src_path, locate(src_path).path, os.fspath(out)
        budget, max_shard_size = parse_size(memory_budget), parse_size(max_shard_size)
        check_not_source(src_path, out)
        check_output(out, overwrite, is_dir=to == "hf")
        result = ExportResult(out, to)
        src = DistCheckpointSource(given if isinstance(given, OpenedCheckpoint) else src_path, trusted=trusted)
        try:
            common = _read_common(src, _allowed_globals(), result)
            marker = dict((common or {}).get(_CONTENT_METADATA_KEY) or {})
            prefixes = _optimizer_prefixes(src, marker)
            extra_state: Dict[str, Any] = {}
            if module is not None:
                _load_through_module(module, src_path, trusted)
                state = module.state_dict()
                tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
                extra_state = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
                view: TensorSource = _DictSource(src_path, tensors)
                plan = {k: k for k in tensors}
                if not include_optimizer and any(k.startswith(p + ".state.") for k in src.tensors for p in prefixes):
                    result.skipped.append("optimizer state")
            else:
                recipe = read_recipe(src)
                pieces = _plan_from_disk(src, marker, recipe, merge_parts, result)
                view = _ExportView(src, pieces)
                plan = {k: k for k in pieces}
                objects = _model_objects(src, prefixes)
                if objects:
                    result.skipped.append(f"{len(objects)} ShardedObject(s) (export with module= to get a module's "
                                          f"non-tensor state): {', '.join(objects)}")
                saved_extra = (common or {}).get("state_dict")
                if isinstance(saved_extra, dict):
                    extra_state = {k: v for k, v in saved_extra.items() if not isinstance(v, torch.Tensor)}
            plan = _strip(plan, strip_prefix, result)
            if strip_prefix:
                result.merged = [n[len(strip_prefix):] for n in result.merged if n.startswith(strip_prefix)]
            names = sorted(plan)
            if strip_prefix:
                extra_state = {k[len(strip_prefix):]: v for k, v in extra_state.items() if k.startswith(strip_prefix)}
                view = _Renamed(view, plan)
            total = sum(view.tensors[n].nbytes for n in names)
            tmp = staging_path(out, to == "hf")
            bar = progress(total=total, unit="B", unit_scale=True, desc=f"export to {to}")
            try:
                with writing(out):  # (a full disk: CheckpointWriteError naming the output)
                    if to == "hf":
                        if extra_state:
                            result.skipped.append(f"non-tensor state {sorted(extra_state)} (safetensors holds tensors only)")
                        entries = [(n, view.tensors[n]) for n in names]
                        result.files += write_safetensors_folder(view, entries, tmp, max_shard_size, budget, bar)
                        _write_hf_config(config, tmp, result)
                    else:
                        top = _lightning_top_level(common, marker, include_optimizer, result)
                        if include_optimizer:
                            top["optimizer_states"] = _module_optimizer_states(module, optimizers, src_path, marker)
                            top.setdefault("lr_schedulers", [])
                        _write_lightning(view, names, extra_state, top, tmp, budget, bar)
                        result.files = [os.path.basename(os.path.abspath(out))]
                    commit_output(tmp, out)
            except BaseException:
                discard_output(tmp)
                raise
            finally:
                bar.close()
            result.tensors, result.bytes = len(names), total
            return result
        finally:
            src.close()


class _Renamed(TensorSource):
    """``view`` under new names (``{new: old}``)."""

    def __init__(self, view: TensorSource, names: Dict[str, str]):
        super().__init__(view.path)
        self.view, self.names = view, names
        self.tensors = {new: view.tensors[old] for new, old in names.items()}

    def read_block(self, key: str, box: Box) -> torch.Tensor:
        return self.view.read_block(self.names[key], box)


__all__ = ["export_checkpoint", "ExportResult", "ExportError", "build_optimizers"]
