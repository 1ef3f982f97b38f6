"""Every docstring example in the package runs and shows what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import torchsurgery

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(torchsurgery.__path__, prefix="torchsurgery.")
    if not info.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_every_public_name_has_an_example() -> None:
    missing = []
    for name in torchsurgery.__all__:
        obj = getattr(torchsurgery, name)
        doc = getattr(obj, "__doc__", None) or ""
        if ">>>" not in doc:
            missing.append(name)
    assert not missing, f"public names without a runnable example: {missing}"
