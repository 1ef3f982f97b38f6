"""Cost of ``import torchsurgery`` on top of an already imported torch.

Each round starts a fresh interpreter, imports torch, then times the import of
torchsurgery alone and, for scale, of ``torch.distributed.tensor`` (what the
distributed routing builds on). Rounds alternate so the machine's load hits both alike.

Run: .venv/bin/python benchmarks/import_time.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys

import torch

from _machine import cpu_name

_CODE = "import time, torch; t = time.perf_counter(); import {name}; print(time.perf_counter() - t)"


def _seconds(name: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _CODE.format(name=name)], check=True, capture_output=True, text=True
    ).stdout
    return float(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="fresh interpreters per import (default 7)")
    args = parser.parse_args()
    print(f"machine: {cpu_name()}, torch {torch.__version__}, Python {platform.python_version()}")
    names = ("torchsurgery", "torch.distributed.tensor")
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            samples[name].append(_seconds(name))
    ours = samples["torchsurgery"]
    print(f"\nimport on top of torch, {args.repeats} fresh interpreters each")
    print(f"{'import':<26}{'median s':>10}{'min s':>8}{'max s':>8}")
    for name in names:
        values = samples[name]
        print(f"{name:<26}{statistics.median(values):>10.3f}{min(values):>8.3f}{max(values):>8.3f}")
    ratios = [a / b for a, b in zip(ours, samples["torch.distributed.tensor"], strict=True)]
    print(f"\ntorchsurgery / torch.distributed.tensor: median {statistics.median(ratios):.2f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
