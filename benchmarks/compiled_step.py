"""A compiled decoding step of an offloaded model against its eager step and the fp32 model's.

The Llama-shaped model of ``benchmarks/offload.py`` (hidden 1024, 8 layers), one token with
a KV cache of 8, weights stored in bf16 and computed in fp32. ``torch.compile`` (inductor,
``fullgraph=True``) of the offloaded model calls the narrow product operator where the plain
model multiplies by a weight; the compiled step should cost what the eager step costs, or
less. Prints medians of several rounds and the ratios.

Run: .venv/bin/python benchmarks/compiled_step.py [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
import transformers
from torch import nn

import torchsurgery
from _machine import cpu_name
from offload import make_llama


def step_time(model: nn.Module, prompt: torch.Tensor, token: torch.Tensor, steps: int) -> float:
    """Seconds per decoding step, with a static cache so compiled steps keep one shape."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=prompt.shape[1] + steps + 4)
    model(prompt, past_key_values=cache, use_cache=True)
    position = torch.tensor([prompt.shape[1]])
    model(token, past_key_values=cache, use_cache=True, cache_position=position)  # compiles, on the first call
    start = time.perf_counter()
    for i in range(steps):
        model(token, past_key_values=cache, use_cache=True, cache_position=position + 1 + i)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {cpu_name()}, {args.threads} threads, torch {torch.__version__}; bf16 storage, fp32 compute")
    torch.manual_seed(0)
    base = make_llama().eval()
    offloaded = copy.deepcopy(base)
    torchsurgery.offload(offloaded, storage_dtype=torch.bfloat16, dtype=torch.float32)
    variants: dict[str, Any] = {
        "fp32 model, eager": base,
        "fp32 model, compiled": torch.compile(base, fullgraph=True),
        "bf16 storage, eager": offloaded,
        "bf16 storage, compiled": torch.compile(offloaded, fullgraph=True),
    }
    prompt, token = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(8)), torch.tensor([[5]])
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, model in variants.items():
                times[name].append(step_time(model, prompt, token, args.steps))
    eager = statistics.median(times["bf16 storage, eager"])
    fp32 = statistics.median(times["fp32 model, eager"])
    print(f"one decoding step, medians of {args.rounds} rounds x {args.steps} steps [range]")
    for name, samples in times.items():
        t = statistics.median(samples)
        print(f"{name:<24}{t * 1e3:8.2f} ms [{min(samples) * 1e3:.2f}-{max(samples) * 1e3:.2f}]"
              f"{t / eager:8.2f}x bf16 eager{t / fp32:8.2f}x fp32 eager")


if __name__ == "__main__":
    main()
