"""Shared fixtures: a fixed seed for every test, the native kernel built first, and the CUDA marker."""

from __future__ import annotations

import os

import pytest
import torch

# No test may reach the network: models are built from configs or come from packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _native_kernel_built() -> None:
    """Every test sees the narrow-weight kernel as it is once built (or known unavailable).

    Outside the tests a forward never waits for the build (narrow products take a fallback
    until it is ready); here the same forward must take the same path in every run, so the
    suite waits once, at its start. tests/offloading/test_narrow.py tests the wait-free start.
    """
    from torchsurgery.offloading.narrow_matvec import narrow_matvec

    narrow_matvec.wait()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
