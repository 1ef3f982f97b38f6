"""Cost of class patching: per-call forward overhead, and patch+unpatch of a large model.

The same change (scale a Linear's output by a learnable factor) is made five ways and
timed on one small layer, where per-call overhead is what shows:

* plain         the unchanged nn.Linear (no scaling; the floor)
* subclass      a hand-written subclass of nn.Linear doing the scaling
* torchsurgery  the same forward as a torchsurgery.Patch applied to an existing instance
* parametrize   torch.nn.utils.parametrize scaling weight and bias
* functional    torch.func.functional_call with scaled parameters

Then every module of a 10,000-module model is patched and unpatched, next to
parametrize registering and removing a parametrization on each Linear.

Run: .venv/bin/python benchmarks/patching.py [--repeats 7] [--calls 20000]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

import torchsurgery
from _machine import cpu_name


class ScaledSubclass(nn.Linear):
    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class ScaledPatch(torchsurgery.Patch, nn.Linear):
    def __patch_init__(self) -> None:
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t * self.scale


class Marker(torchsurgery.Patch, nn.Module):
    """A patch for any module that adds one attribute."""

    def __patch_init__(self) -> None:
        self.marked = True


def _per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    for _ in range(min(calls, 200)):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def forward_overhead(width: int, calls: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    x = torch.randn(1, width)
    base = nn.Linear(width, width)
    plain = nn.Linear(width, width)
    plain.load_state_dict(base.state_dict())
    subclass = ScaledSubclass(width, width)
    subclass.load_state_dict({**base.state_dict(), "scale": torch.tensor(2.0)})
    patched = ScaledPatch.from_existing(nn.Linear(width, width))
    patched.load_state_dict(subclass.state_dict())
    para = nn.Linear(width, width)
    para.load_state_dict(base.state_dict())
    scale = Scale()
    parametrize.register_parametrization(para, "weight", scale)
    parametrize.register_parametrization(para, "bias", scale)
    functional_base = nn.Linear(width, width)
    functional_base.load_state_dict(base.state_dict())
    factor = nn.Parameter(torch.tensor(2.0))

    def functional() -> torch.Tensor:
        params = {"weight": base.weight * factor, "bias": base.bias * factor}
        return torch.func.functional_call(functional_base, params, (x,))

    with torch.no_grad():
        reference = subclass(x)
        for fn in (lambda: patched(x), lambda: para(x), functional):
            torch.testing.assert_close(fn(), reference)  # all five make the same change
        cases: dict[str, Callable[[], object]] = {
            "plain": lambda: plain(x),
            "subclass": lambda: subclass(x),
            "torchsurgery": lambda: patched(x),
            "parametrize": lambda: para(x),
            "functional": functional,
        }
        return {name: _per_call_us(fn, calls, repeats) for name, fn in cases.items()}


def many_modules(count: int, repeats: int) -> dict[str, float]:
    ours, theirs = [], []
    for _ in range(repeats):
        model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(count)])
        start = time.perf_counter()
        for m in model:
            torchsurgery.patch(m, Marker)
        for m in model:
            torchsurgery.unpatch(m)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        for m in model:
            parametrize.register_parametrization(m, "weight", nn.Identity())
        for m in model:
            parametrize.remove_parametrizations(m, "weight")
        theirs.append(time.perf_counter() - start)
    return {"torchsurgery": statistics.median(ours), "parametrize": statistics.median(theirs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--modules", type=int, default=10000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {cpu_name()}, 1 thread, torch {torch.__version__}, Python {platform.python_version()}")

    results = forward_overhead(args.width, args.calls, args.repeats)
    ref = results["subclass"]
    print(f"\nforward of Linear({args.width}, {args.width}) on one row, median of {args.repeats} x {args.calls} calls")
    print(f"{'variant':<14}{'us/call':>10}{'vs subclass':>14}")
    for name, us in results.items():
        print(f"{name:<14}{us:>10.2f}{us / ref:>13.2f}x")

    many = many_modules(args.modules, max(3, args.repeats // 2))
    print(f"\npatch + unpatch of every module of a {args.modules}-module model (median)")
    print(f"{'tool':<14}{'seconds':>10}{'us/module':>12}{'vs ours':>10}")
    for name, seconds in many.items():
        print(f"{name:<14}{seconds:>10.3f}{seconds / args.modules * 1e6:>12.1f}{seconds / many['torchsurgery']:>9.2f}x")


if __name__ == "__main__":
    main()
