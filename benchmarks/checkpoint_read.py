"""Reading a safetensors file into tensors that already exist: our ``preadv`` against ``safe_open``.

* preadv     ``torchsurgery._checkpoint.SafetensorsSource.read_many``: the bytes go straight
             from the page cache into the destination tensors, several tensors per system call
             (what ``load_`` does for a model that already has its weights)
* safe_open  ``safetensors.safe_open(...).get_tensor(key)`` for each key (a view of safetensors'
             own map of the file), then ``out.copy_(tensor)`` into the same destination tensors

The file is written once and read once before timing, so both read from the page cache; the
two methods alternate, and the median of ``--repeats`` runs is printed with the ratio.

Run: .venv/bin/python benchmarks/checkpoint_read.py [--megabytes 512] [--tensors 128] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from _machine import cpu_name
from torchsurgery._checkpoint import SafetensorsSource


def _state(megabytes: int, tensors: int) -> dict[str, torch.Tensor]:
    """``tensors`` fp32 and bf16 matrices of about ``megabytes`` MB in all."""
    per = megabytes * 2**20 // tensors
    state = {}
    for i in range(tensors):
        dtype = torch.float32 if i % 2 else torch.bfloat16
        state[f"layers.{i}.weight"] = torch.randn(per // dtype.itemsize // 1024, 1024).to(dtype)
    return state


def _with_preadv(path: Path, outs: dict[str, torch.Tensor]) -> None:
    source = SafetensorsSource([path])
    try:
        source.read_many(list(outs.items()))
    finally:
        source.close()


def _with_safe_open(path: Path, outs: dict[str, torch.Tensor]) -> None:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for key, out in outs.items():
            out.copy_(f.get_tensor(key))


def _timed(run: Callable[[], None], times: list[float]) -> None:
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=512, help="size of the file")
    parser.add_argument("--tensors", type=int, default=128, help="how many tensors it holds")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each method")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.safetensors"
        state = _state(args.megabytes, args.tensors)
        save_file(state, path)
        outs = {k: torch.empty_like(v) for k, v in state.items()}
        del state
        methods = {"preadv": lambda: _with_preadv(path, outs), "safe_open": lambda: _with_safe_open(path, outs)}
        times: dict[str, list[float]] = {name: [] for name in methods}
        for run in methods.values():
            run()  # the file into the page cache, the destinations' pages faulted in
        for _ in range(args.repeats):
            for name, run in methods.items():
                _timed(run, times[name])
        size = path.stat().st_size
    print(f"{size / 2**20:.0f} MB in {args.tensors} tensors, read into existing tensors; "
          f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in medians.items():
        print(f"  {name:10s} {seconds * 1e3:8.1f} ms  {size / seconds / 2**30:6.2f} GiB/s")
    print(f"  safe_open / preadv: {medians['safe_open'] / medians['preadv']:.2f}x the time")


if __name__ == "__main__":
    main()
