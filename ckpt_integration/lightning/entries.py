"""The entries of a Lightning checkpoint saved by the DistCkpt strategies and plugins, besides the model.

Shared by the strategies, Fabric, the one-process loading paths and the memory tier: the key of
the RNG states and their safe-unpickle form, which entries a load fills itself, and which keys are
no model keys (optimizer, RNG, export recipe) when a load reports missing and unexpected keys.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Set, Tuple

import numpy as np

from ..mapping import ShardedTensor, ShardedTensorFactory
from ..tools.recipe import EXPORT_RECIPE_KEY

__all__ = ["RNG_KEY", "rng_to_safe", "rng_from_safe", "sharded_keys", "model_key_report"]

RNG_KEY = "lightning.rng_states"
_OPTIMIZER_KEY_RE = re.compile(r"^optimizer(_\d+)?\.")


def rng_to_safe(states: Dict[str, Any]) -> Dict[str, Any]:
    """Lightning's RNG states in a form the restricted unpickler loads (numpy arrays as lists)."""
    out = dict(states)
    if "numpy" in out:  # numpy arrays are not on the safe-unpickle allow-list: store lists
        name, keys, pos, has_gauss, cached = out["numpy"]
        out["numpy"] = (name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached))
    return out


def rng_from_safe(states: Dict[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`rng_to_safe`, as Lightning's ``_set_rng_states`` takes them."""
    out = dict(states)
    if "numpy" in out:
        name, keys, pos, has_gauss, cached = out["numpy"]
        out["numpy"] = (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
    if "python" in out and isinstance(out["python"], list):  # checkpoints written before tuples were kept
        v = out["python"]
        out["python"] = (v[0], tuple(v[1]), v[2])
    return out


def sharded_keys(request: Mapping[str, Any]) -> Set[str]:
    """Dict paths of ``request`` holding tensors (ShardedTensors, factories): filled by the load itself."""
    return {k for k, v in request.items() if isinstance(v, (ShardedTensor, ShardedTensorFactory))}


def model_key_report(ckpt_not_requested: Set[str], requested_not_in_ckpt: Set[str]) -> Tuple[List[str], List[str]]:
    """``(missing, unexpected)`` model keys in ``torch.nn.Module.load_state_dict``'s terms from the sets
    ``ckpt_integration.load(strict="return_all")`` returns (checkpoint keys nobody requested; requested
    keys the checkpoint lacks). Optimizer, RNG and export-recipe entries of a Lightning checkpoint are no
    model keys."""
    not_model = (RNG_KEY, EXPORT_RECIPE_KEY)
    unexpected = sorted(k for k in ckpt_not_requested if not _OPTIMIZER_KEY_RE.match(k) and not k.startswith(not_model))
    return sorted(k for k in requested_not_in_ckpt if not k.startswith(RNG_KEY)), unexpected
