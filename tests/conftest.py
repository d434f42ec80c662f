"""Suite-wide guard: no test may leave torch's process-wide safe-globals list changed.

A leaked entry (typically from a plain ``import megatron.core``; use
``tests.megatron_import.import_megatron``) widens what our restricted unpickler accepts for every
later test, so results would depend on test order.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _safe_globals_unchanged():
    before = list(torch.serialization.get_safe_globals())
    yield
    after = list(torch.serialization.get_safe_globals())
    if after != before:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
        added = [getattr(g, "__qualname__", repr(g)) for g in after if g not in before]
        pytest.fail(f"the test changed torch's process-wide safe globals (added {added}); "
                    "import Megatron-Core through tests.megatron_import.import_megatron")
