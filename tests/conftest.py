"""Suite-wide guard: no test may leave torch's process-wide safe-globals list changed.

A leaked entry (typically from a plain ``import megatron.core``; use
``tests.megatron_import.import_megatron``) widens what our restricted unpickler accepts for every
later test, so results would depend on test order. torch registers its own classes when its
submodules are first imported (``torch._dynamo`` adds ``_DimRange``): those are not a leak.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _safe_globals_unchanged():
    before = list(torch.serialization.get_safe_globals())
    yield
    after = list(torch.serialization.get_safe_globals())
    added = [g for g in after if g not in before and not _torch_own(g)]
    if added:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals([g for g in after if g not in added])
        added = [getattr(g, "__qualname__", repr(g)) for g in added]
        pytest.fail(f"the test changed torch's process-wide safe globals (added {added}); "
                    "import Megatron-Core through tests.megatron_import.import_megatron")


def _torch_own(g) -> bool:
    entry = g[0] if isinstance(g, tuple) else g  # (object, "module.name") entries are allowed too
    return (getattr(entry, "__module__", "") or "").split(".")[0] == "torch"
