"""The native narrow-weight kernel against the memory's read bandwidth, and how far ahead to read.

For each weight dtype (bf16, fp8 e4m3fn, fp8 e5m2, int8 with a scale per output), one-row
products against 32 weights of ``--shape`` (4096x1024 by default: 256 MiB of bf16, far beyond
the caches) one after the other, as a decoding step reads them, at several distances ahead
(``narrow_matvec.ahead``, bytes of the weight row asked for ahead of the sums; 0: none).
Next to them: torch's own fp32 product (oneDNN) over the same shapes, and a contiguous read of
a 1 GiB buffer (the floor). Each figure is bytes of weights read per second: the median of
``--rounds`` rounds, the variants taking turns within each round, with the ratio to the
bandwidth measured in the same round.

``--arch haswell,x86-64`` also builds the kernel as it is built for those CPUs (``-march``:
``haswell`` is an AVX2 host without AVX-512, as AMD's before Zen 4 and Intel's client CPUs;
``x86-64`` the baseline, SSE2 alone) and measures each build on this host, at the default
distance ahead: the same memory, read by the code those hosts run.

Run: .venv/bin/python benchmarks/narrow_kernel.py [--rounds 7] [--threads 2] [--shape 4096x1024]
[--arch haswell]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from _machine import describe
from torchsurgery.compact import native_build
from torchsurgery.compact.narrow_matvec import kernel_at, narrow_matvec

AHEAD = (0, 1024, 2048, 3072, 4096, 8192)
DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


def weights(dtype: torch.dtype, shape: tuple[int, int], count: int) -> list[torch.Tensor]:
    if dtype == torch.int8:
        return [torch.randint(-127, 128, shape, dtype=torch.int8) for _ in range(count)]
    return [(torch.randn(shape) * 0.02).to(dtype) for _ in range(count)]


def other_build(
    arch: str, dtype: torch.dtype, directory: str, x: torch.Tensor, scale: torch.Tensor,
    stored: dict[torch.dtype, list[torch.Tensor]],
) -> Callable[[], int]:
    """The products of ``stored[dtype]`` by the kernel built for ``-march=arch``."""
    path = f"{directory}/{arch}-{dtype}.so"
    why = native_build.build(native_build.KINDS[str(dtype).removeprefix("torch.")], path, yielding=False, arch=arch)
    fn = kernel_at(path)
    if why is not None or fn is None:
        raise SystemExit(f"the kernel for -march={arch} did not build: {why}")
    built = fn

    def run() -> int:
        for w in stored[dtype]:
            built(x, w, None, False, scale if dtype == torch.int8 else None)
        return sum(w.nbytes for w in stored[dtype])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shape", default="4096x1024", help="out x in of each weight")
    parser.add_argument("--count", type=int, default=32, help="weights read one after the other")
    parser.add_argument("--arch", default="", help="other builds to measure (-march values, comma-separated)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not narrow_matvec.wait():
        raise SystemExit(f"no native kernel: {narrow_matvec.unavailable}")
    out, inp = (int(n) for n in args.shape.split("x"))
    x, scale = torch.randn(1, inp), torch.rand(out) * 0.01
    stored = {dtype: weights(dtype, (out, inp), args.count) for dtype in DTYPES}
    wide = [torch.randn(out, inp) for _ in range(max(1, args.count // 2))]
    buffer = torch.ones(256 << 20)

    def kernel(dtype: torch.dtype, ahead: int) -> Callable[[], int]:
        def run() -> int:
            narrow_matvec.ahead = ahead
            for w in stored[dtype]:
                narrow_matvec(x, w, None, False, scale if dtype == torch.int8 else None)
            return sum(w.nbytes for w in stored[dtype])
        return run

    def fp32() -> int:
        for w in wide:
            torch.nn.functional.linear(x, w)
        return sum(w.nbytes for w in wide)

    def floor() -> int:
        buffer.sum()
        return buffer.nbytes

    variants: dict[str, Callable[[], int]] = {"memory read (floor)": floor, "torch fp32 (oneDNN)": fp32}
    for dtype in DTYPES:
        for ahead in AHEAD:
            variants[f"{str(dtype).removeprefix('torch.')} ahead {ahead}"] = kernel(dtype, ahead)
    scratch = tempfile.TemporaryDirectory()
    for arch in filter(None, args.arch.split(",")):
        for dtype in DTYPES:
            variants[f"{str(dtype).removeprefix('torch.')} {arch}"] = other_build(arch, dtype, scratch.name, x, scale, stored)
    speeds: dict[str, list[float]] = {name: [] for name in variants}
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    default = narrow_matvec.ahead
    for _ in range(args.rounds):
        for name, run in variants.items():
            run()  # warm: the first pass pays for page faults and thread start-up
            start = time.perf_counter()
            nbytes = run()
            speeds[name].append(nbytes / (time.perf_counter() - start))
        for name in variants:
            ratios[name].append(speeds[name][-1] / speeds["memory read (floor)"][-1])
    narrow_matvec.ahead = default
    print(f"machine: {describe(args.threads)}, torch {torch.__version__}; {args.count} weights of {out}x{inp}, 1 row")
    print(f"{'variant':<28}{'GB/s':>8}{'x floor':>9}  [range of the ratio]   (default ahead: {default} bytes)")
    for name in variants:
        r = ratios[name]
        print(f"{name:<28}{statistics.median(speeds[name]) / 1e9:8.1f}{statistics.median(r):9.2f}  [{min(r):.2f}-{max(r):.2f}]")


if __name__ == "__main__":
    main()
