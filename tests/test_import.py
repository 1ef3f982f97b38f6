"""Importing torchsurgery is cheap and leaves CUDA alone."""

from __future__ import annotations

import subprocess
import sys

import torchsurgery


def _run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def test_import_does_not_initialise_cuda() -> None:
    out = _run("import torch, torchsurgery; print(torch.cuda.is_initialized())")
    assert out == "False"


def test_import_is_fast_relative_to_torch() -> None:
    # Time of importing torchsurgery on top of an already imported torch: it must not
    # drag in transformers, matplotlib or the CLI stack.
    code = (
        "import time, sys, torch; t = time.perf_counter(); import torchsurgery; "
        "dt = time.perf_counter() - t; "
        "heavy = [m for m in ('transformers', 'matplotlib', 'typer', 'diffusers') if m in sys.modules]; "
        "print(f'{dt:.3f}', ','.join(heavy))"
    )
    seconds, _, heavy = _run(code).partition(" ")
    assert heavy == ""
    assert float(seconds) < 2.0


def test_public_names_are_exported() -> None:
    for name in torchsurgery.__all__:
        assert hasattr(torchsurgery, name), name
