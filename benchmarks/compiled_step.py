"""A compiled decoding step of an offloaded model against its eager step and the fp32 model's.

The Llama-shaped model of ``benchmarks/offload.py`` (hidden 1024 by default, ``--width 2048``
for the model whose weights are about 90% of the step; 8 layers), one token with a KV cache of
8, weights stored in bf16 (``--formats`` adds fp8 e4m3fn unscaled, ``fp8-chan`` and
``int8-chan``: a scale per output channel) and computed in fp32. ``torch.compile`` (inductor,
``fullgraph=True``) of the offloaded model calls the narrow product operator where the plain
model multiplies by a weight; the compiled step should cost what the eager step costs, or
less. Prints medians of several rounds and the ratios to the eager and the compiled fp32
model (compiled against compiled: what a user who compiles either model sees).

Run: .venv/bin/python benchmarks/compiled_step.py [--rounds 5] [--threads 2] [--width 2048]
[--formats bf16,fp8,fp8-chan,int8-chan]
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
from offload import DECODE_SHAPES, make_llama
from torchsurgery.compact import Scaled

FORMATS: dict[str, Any] = {
    "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8-chan": Scaled(torch.float8_e4m3fn), "int8-chan": Scaled(torch.int8),
}


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
    parser.add_argument("--width", type=int, default=1024, choices=sorted(DECODE_SHAPES))
    parser.add_argument("--formats", default="bf16", help=f"storage formats, of {','.join(FORMATS)}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    formats = args.formats.split(",")
    # every variant compiles the same forward code for its own model: one recompilation each
    # (the default limit, 8 per code object, is reached by four formats and the fp32 model)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * (len(formats) + 1))
    print(f"machine: {cpu_name()}, {args.threads} threads, torch {torch.__version__}; {args.width}-wide, "
          f"storage {', '.join(formats)}, fp32 compute")
    torch.manual_seed(0)
    base = make_llama(hidden_size=args.width, intermediate_size=DECODE_SHAPES[args.width]).eval()
    variants: dict[str, Any] = {"fp32 model, eager": base, "fp32 model, compiled": torch.compile(base, fullgraph=True)}
    for name in formats:
        offloaded = copy.deepcopy(base)
        torchsurgery.offload(offloaded, storage_dtype=FORMATS[name], dtype=torch.float32)
        variants[f"{name} storage, eager"] = offloaded
        variants[f"{name} storage, compiled"] = torch.compile(offloaded, fullgraph=True)
    prompt, token = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(8)), torch.tensor([[5]])
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, model in variants.items():
                times[name].append(step_time(model, prompt, token, args.steps))
    fp32, fp32_compiled = (statistics.median(times[f"fp32 model, {how}"]) for how in ("eager", "compiled"))
    print(f"one decoding step, medians of {args.rounds} rounds x {args.steps} steps [range]")
    print(f"{'variant':<26}{'step':>10}{'':<18}{'vs own eager':>13}{'vs fp32 eager':>15}{'vs fp32 compiled':>18}")
    for name, samples in times.items():
        t = statistics.median(samples)
        eager = statistics.median(times[name.replace("compiled", "eager")])
        print(f"{name:<26}{t * 1e3:8.2f} ms [{min(samples) * 1e3:6.2f}-{max(samples) * 1e3:6.2f}]"
              f"{t / eager:12.2f}x{t / fp32:14.2f}x{t / fp32_compiled:17.2f}x")

if __name__ == "__main__":
    main()
