"""The one way tests import Megatron-Core: without keeping its process-wide torch safe-globals.

``import megatron.core`` calls ``torch.serialization.add_safe_globals`` for ``argparse.Namespace``,
``PosixPath``, numpy arrays, ... . Our restricted loader honours torch's process-wide list (the
user's opt-in), so a plain import would silently widen what loads everywhere in this process, and
tests refusing such globals would pass or fail depending on which test file ran first.
``tests/conftest.py`` fails any test that leaves the list changed.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch


def import_megatron(module: str = "megatron.core") -> ModuleType:
    """``module`` (``megatron.core`` or a submodule), skipping the test only where it cannot be imported.

    The safe-globals list is restored afterwards; later ``from megatron.core... import`` statements
    in the same test find the package imported already and register nothing more.
    """
    before = list(torch.serialization.get_safe_globals())
    try:
        pytest.importorskip("megatron.core")
        return importlib.import_module(module)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
