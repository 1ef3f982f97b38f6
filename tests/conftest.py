"""Shared fixtures: a fixed seed for every test, the native kernel built first, and the
accelerator the suite runs on.

Where torch reports an accelerator (a GPU), the accelerator tests run on it. Everywhere else
the suite builds and registers its own, ``tardy`` (``tests/tardy``): an asynchronous device on
the CPU whose copies land late, so that the same tests run and a missing wait fails them. If
it cannot be built the session stops with the build's error: nothing is skipped silently.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

import tardy

# No test may reach the network: models are built from configs or come from packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: pytest.Config) -> None:
    if torch.accelerator.is_available() and not tardy.registered():
        return  # a real accelerator: the tests run on it
    try:
        tardy.register()
    except Exception as exc:
        pytest.exit(
            f"tests/tardy: the test accelerator could not be built, so the accelerator tests cannot run "
            f"(a C++ compiler and ninja are needed; torch's extension build says: {type(exc).__name__}: {exc})",
            returncode=3,
        )


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _native_kernel_built() -> None:
    """Every test sees the narrow-weight kernel as it is once built (or known unavailable).

    Outside the tests a forward never waits for the build (narrow products take a fallback
    until it is ready); here the same forward must take the same path in every run, so the
    suite waits once, at its start. tests/compact/test_narrow.py tests the wait-free start.
    """
    from torchsurgery.compact.narrow_matvec import narrow_matvec

    narrow_matvec.wait()


@pytest.fixture(autouse=True)
def _stalls_measured_by_a_still_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host tier chooses its groups again by how long the first forward waited for each
    (:mod:`torchsurgery.offloading.file_reader`). On a busy machine a wait is whatever the
    scheduler makes it, so the suite measures waits by a clock that stands still: no choice
    changes, every forward reads what the plan says. The tests of that choice script the waits
    (tests/offloading/test_host_tier.py)."""
    from torchsurgery.offloading import file_reader

    monkeypatch.setattr(file_reader, "_clock", lambda: 0.0)


@pytest.fixture(autouse=True)
def _no_hazards() -> Iterator[None]:
    """Memory a test freed while another stream's use of it was unordered fails that test."""
    yield
    if tardy.registered():
        found = tardy.hazards()
        if found:
            pytest.fail("tardy found hazards: " + "; ".join(found))


@pytest.fixture
def accelerator() -> torch.device:
    """The accelerator of this run: the machine's own, or ``tardy:0``."""
    device = torch.accelerator.current_accelerator()
    assert device is not None
    return torch.device(device.type, 0)


@pytest.fixture
def exact_on_tardy(accelerator: torch.device) -> dict[str, float]:
    """``assert_close`` tolerances for two computations of the same values by different calls.

    On tardy both run the CPU's kernels: bit for bit. On a GPU, cuBLAS may pick another
    algorithm for another call (a weight dequantised per product against a parameter): one
    rounding of fp32 apart.
    """
    return {"rtol": 0.0, "atol": 0.0} if accelerator.type == "tardy" else {"rtol": 2e-6, "atol": 1e-7}


@pytest.fixture
def allocation_bytes(accelerator: torch.device) -> Callable[[int], int]:
    """The bytes the accelerator's allocator counts for one allocation of ``n`` bytes.

    CUDA's caching allocator rounds every block up to a multiple of 512 bytes; the test device
    counts what was asked. Measured, not assumed: a one-byte allocation shows the granule.
    """
    torch.accelerator.synchronize()
    before = torch.accelerator.memory_allocated()
    probe = torch.empty(1, dtype=torch.uint8, device=accelerator)
    granule = torch.accelerator.memory_allocated() - before
    del probe
    return lambda n: -(-n // granule) * granule


@pytest.fixture
def on_tardy(accelerator: torch.device) -> torch.device:
    """``tardy:0``, for tests of what only the test device can show (poison, lazy copies, hazards)."""
    if accelerator.type != tardy.NAME:
        pytest.skip("runs on the tardy test device only")
    return accelerator
