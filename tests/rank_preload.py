"""The modules the fork server of ``tests/forked.py`` imports once for every rank it forks.

Only imports: no module may start work here (no process group, no CUDA, no thread pool of ours),
since every rank is forked from this state. Megatron-Core is imported the suite's way
(``tests.megatron_import``: torch's process-wide safe-globals list is left as it was), so a rank
sees exactly the list a freshly started rank would see after its own ``import_megatron``.
"""

import gc
import importlib
import pkgutil


def _try(name: str) -> None:
    try:
        importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - a missing optional package: the rank imports it itself
        pass


for _name in ("numpy", "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.multiprocessing",
              "torch.distributed.tensor", "torch.distributed.fsdp", "pytest", "safetensors.torch", "zarr",
              "fsspec", "lightning", "lightning.pytorch", "lightning.fabric", "torchmetrics", "omegaconf", "hydra"):
    _try(_name)


def _ours() -> None:
    """Every module of the package (one that fails to import is left to the rank: its error is the test's)."""
    try:
        import ckpt_integration
    except BaseException:  # noqa: BLE001
        return
    for mod in pkgutil.walk_packages(ckpt_integration.__path__, "ckpt_integration.", onerror=lambda name: None):
        _try(mod.name)


_ours()


def _megatron() -> None:
    import torch

    before = list(torch.serialization.get_safe_globals())
    try:
        _try("megatron.core")
        _try("megatron.core.dist_checkpointing")
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


_megatron()

# Everything imported so far lives as long as the process: out of the collector's sight, a rank's
# garbage collections cost what they would in a new interpreter (and leave the shared pages alone).
gc.collect()
gc.freeze()
