"""GPU streaming: a model of a few GB with a device budget of a quarter of it (needs CUDA).

Variants, each on a freshly built model (so host memory does not add up):

* resident            the whole model on the GPU (the compute floor)
* torchsurgery        ``offload(model, "cuda", budget=size / 4)``
* accelerate          ``cpu_offload(model, execution_device="cuda")``
* diffusers           ``apply_group_offloading(block_level, use_stream=True)``
* access-time swap    the video app's installer: every weight read converts to CUDA

Printed per variant: ms per forward (median), peak device memory above what was allocated
before the variant (the input), peak host memory while the variant ran (``VmHWM``, reset
before each variant), and the ratio to the physical floor ``max(resident compute, streamed
bytes / pinned H2D bandwidth)`` with the bandwidth measured here. Each variant is undone and
its model freed (``gc.collect()``: models with hooks hold reference cycles) before the next
one starts, so no variant's leftovers count in another's peak.

Run: .venv/bin/python benchmarks/offload_cuda.py [--blocks 12] [--d 4096] [--tokens 512]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import torchsurgery
from _machine import cpu_name


def make(blocks: int, d: int) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(blocks)]
    return nn.Sequential(*layers).to(torch.bfloat16).eval()


def pinned_bandwidth(nbytes: int = 1 << 30) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - start)


def reset_host_peak() -> None:
    """Start a new peak of this process's resident memory (Linux: VmHWM)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def host_peak() -> int:
    """This process's peak resident memory since :func:`reset_host_peak`, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def access_time_swap(model: nn.Module) -> None:
    for module in model.modules():
        original = type(module)

        def getattr_converting(self: nn.Module, name: str, _original: type = original) -> Any:
            params = self.__dict__.get("_parameters", {})
            if name in params and params[name] is not None:
                return nn.Parameter(params[name].to("cuda"), requires_grad=False)
            return super(_original, self).__getattr__(name)  # type: ignore[misc]

        module.__class__ = type(f"Swap_{original.__name__}", (original,), {"__getattr__": getattr_converting})


def setups(budget: int) -> dict[str, Callable[[nn.Module], Any]]:
    def resident(m: nn.Module) -> None:
        m.cuda()

    def ours(m: nn.Module) -> Any:
        return torchsurgery.offload(m, "cuda", budget=budget)

    def accelerate_offload(m: nn.Module) -> None:
        from accelerate import cpu_offload

        cpu_offload(m, execution_device=torch.device("cuda"))

    def diffusers_groups(m: nn.Module) -> None:
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(m, onload_device=torch.device("cuda"), offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1, use_stream=True)

    return {"resident": resident, "torchsurgery": ours, "accelerate": accelerate_offload,
            "diffusers": diffusers_groups, "access-time swap": access_time_swap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    size = sum(p.numel() * p.element_size() for p in make(1, args.d).parameters()) * args.blocks
    budget = size // 4
    bandwidth = pinned_bandwidth()
    print(f"machine: {torch.cuda.get_device_name()}, host {cpu_name()}, torch {torch.__version__}")
    print(f"model: {size / 2**30:.2f} GiB bf16, budget {budget / 2**30:.2f} GiB, pinned H2D {bandwidth / 1e9:.1f} GB/s")
    x = torch.randn(1, args.tokens, args.d, device="cuda", dtype=torch.bfloat16)
    rows: dict[str, tuple[float, float, float] | str] = {}
    for name, setup in setups(budget).items():
        model = make(args.blocks, args.d)
        handle: Any = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        reset_host_peak()
        try:
            handle = setup(model)
            with torch.no_grad():
                model(x)  # warm-up (records the order)
                torch.cuda.synchronize()
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    model(x)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
            rows[name] = (statistics.median(times), torch.cuda.max_memory_allocated() - before, host_peak())
            if hasattr(handle, "stats"):
                print(f"torchsurgery stats: {handle.stats()}")
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            rows[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        finally:
            if hasattr(handle, "remove"):
                handle.remove()
            del model, handle
            gc.collect()  # hooks and patches hold reference cycles: free the model now
    compute = rows["resident"][0] if isinstance(rows["resident"], tuple) else float("nan")
    floor = max(compute, (size - budget) / bandwidth)
    print(f"\nfloor: max(compute {compute * 1e3:.1f} ms, streamed bytes / bandwidth {(size - budget) / bandwidth * 1e3:.1f} ms)")
    print(f"{'variant':<18}{'ms/forward':>12}{'vs floor':>10}{'peak GPU GiB':>14}{'peak host GiB':>15}")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"{name:<18}  {row}")
        else:
            seconds, device_peak, host = row
            print(f"{name:<18}{seconds * 1e3:>12.1f}{seconds / floor:>9.2f}x{device_peak / 2**30:>14.2f}{host / 2**30:>15.2f}")


if __name__ == "__main__":
    main()
