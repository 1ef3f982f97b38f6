"""Fixtures shared by the offloading tests."""

from __future__ import annotations

import pytest
import torch

import tardy


@pytest.fixture(params=["cpu", "tardy"])
def device(request: pytest.FixtureRequest, accelerator: torch.device) -> torch.device:
    """The CPU, then the suite's test device (tardy; skipped where another accelerator runs the suite)."""
    if request.param == "cpu":
        return torch.device("cpu")
    if accelerator.type != tardy.NAME:
        pytest.skip("runs on the tardy test device only")
    return accelerator
