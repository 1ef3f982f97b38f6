"""PyTorch's own test databases (``torch.testing._internal``), loaded without changing what other tests see."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import unittest
import warnings
from typing import Any


def internal(module: str, name: str) -> list[Any]:
    """``torch.testing._internal.<module>.<name>`` (``op_db``, ``module_db``), as a list.

    Its ``common_utils`` imports ``expecttest`` (a test-only package the project does not
    depend on) for a TestCase base class only, and freezes ``torch.backends`` flags on import
    (PyTorch's suite sets them in brackets only): a stand-in module is given for the first,
    the flags are thawed again after. (It also wraps TorchScript's ``__call__`` in a
    pass-through profiling hook, which changes nothing unless called with its own keyword.)
    """
    import torch

    stand_in = importlib.util.find_spec("expecttest") is None
    if stand_in:
        expecttest = types.ModuleType("expecttest")
        expecttest.TestCase = unittest.TestCase  # type: ignore[attr-defined]
        sys.modules["expecttest"] = expecttest
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = getattr(importlib.import_module(f"torch.testing._internal.{module}"), name)
    finally:
        if stand_in:
            del sys.modules["expecttest"]
    torch.backends.__allow_nonbracketed_mutation_flag = True  # type: ignore[attr-defined]
    return list(found)
