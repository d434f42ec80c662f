"""The modules the fork server of ``tests/forked.py`` imports once for every rank it forks.

Only imports: no module may start work here (no process group, no CUDA, no thread pool of ours),
since every rank is forked from this state. Megatron-Core is imported the suite's way
(``tests.megatron_import``: torch's process-wide safe-globals list is left as it was), so a rank
sees exactly the list a freshly started rank would see after its own ``import_megatron``.
"""

import importlib
import pkgutil


def _try(name: str) -> None:
    try:
        importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - a missing optional package: the rank imports it itself
        pass


for _name in ("numpy", "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.multiprocessing",
              "torch.distributed.tensor", "torch.distributed.fsdp", "pytest", "safetensors.torch", "zarr",
              "fsspec", "lightning", "lightning.pytorch", "lightning.fabric", "torchmetrics", "omegaconf"):
    _try(_name)

import ckpt_integration  # noqa: E402

for _mod in pkgutil.walk_packages(ckpt_integration.__path__, "ckpt_integration."):
    _try(_mod.name)


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
