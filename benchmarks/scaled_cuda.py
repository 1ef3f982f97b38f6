"""Compact storage formats streamed to the accelerator: link bytes, time, and what they cost in accuracy.

A Llama-shaped model (transformers config, random weights of std 0.02 as transformers draws
them, bf16 compute) is offloaded to the accelerator under a quarter of its bf16 size in each
storage format: bf16 itself, fp8 e4m3fn unscaled (a plain cast), fp8 e4m3fn with a scale per
output channel and per tensor, and int8 with a scale per output channel
(``torchsurgery.compact.Scaled``). Printed per format, against the resident bf16 model:

* the budget: a quarter of the bf16 model, or the least the format's ring needs where that
  is more (a scaled weight is widened in its slot through fp32);
* the bytes one forward moves over the link (``stats().bytes_moved``) as a share of bf16's;
* ms per forward of a 128-token prompt (median of ``--repeats``), its ratio to the link
  floor (those bytes over the pinned host-to-device bandwidth measured here) and to bf16's;
* over a 256-token sequence (every position sees the same tokens: teacher forcing), the
  largest |logit| difference and the share of positions whose top-1 token agrees.

Run: .venv/bin/python benchmarks/scaled_cuda.py [--layers 16] [--hidden 2048] [--repeats 3]
(needs an accelerator; ``--device tardy`` runs it on the test suite's device, as a smoke test).
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import torch

import torchsurgery
from generate_cuda import model_arguments, set_up, timed
from torchsurgery.compact import Scaled


def formats() -> dict[str, Any]:
    return {
        "bf16": None,
        "fp8 unscaled": torch.float8_e4m3fn,
        "fp8 per-channel": Scaled(torch.float8_e4m3fn),
        "fp8 per-tensor": Scaled(torch.float8_e4m3fn, per="tensor"),
        "int8 per-channel": Scaled(torch.int8),
    }


def main() -> None:
    args = model_arguments(__doc__).parse_args()
    device, reference, size, bandwidth = set_up(args, "scaled_cuda.py")
    budget = size // 4
    g = torch.Generator().manual_seed(0)
    long = torch.randint(0, args.vocab, (1, 128), generator=g).to(device)
    sequence = torch.randint(0, args.vocab, (1, 256), generator=g).to(device)
    resident = copy.deepcopy(reference).to(device)
    with torch.inference_mode():
        want = resident(sequence).logits.float()
    del resident
    gc.collect()
    print(f"{'format':<18}{'link bytes':>11}{'ms/fwd128':>11}{'vs floor':>10}{'vs bf16':>9}{'max|dlogit|':>13}{'top-1':>8}"
          f"{'budget GiB':>12}")
    bf16: dict[str, float] = {}  # the first format's figures: bf16 runs first
    for label, fmt in formats().items():
        model = copy.deepcopy(reference)
        try:
            handle = torchsurgery.offload(model, device, budget=budget, storage_dtype=fmt, dtype=torch.bfloat16)
            given = budget
        except torchsurgery.errors.BudgetError as exc:  # the format's ring needs more: its least, named by the error
            given = exc.needed
            handle = torchsurgery.offload(model, device, budget=given, storage_dtype=fmt, dtype=torch.bfloat16)
        with torch.inference_mode():
            model(long)  # the first forward measures and plans
            before = handle.stats().bytes_moved
            model(long)
            moved = handle.stats().bytes_moved - before
            seconds, _ = timed(lambda m=model: m(long), device, args.repeats)
            got = model(sequence).logits.float()
        bf16.setdefault("seconds", seconds)
        bf16.setdefault("moved", max(1, moved))
        error = (got - want).abs().max().item()
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        floor = moved / bandwidth
        print(f"{label:<18}{moved / bf16['moved']:>10.2f}x{seconds * 1e3:>11.2f}{seconds / floor if floor else 0:>9.2f}x"
              f"{seconds / bf16['seconds']:>8.2f}x{error:>13.4f}{agree:>8.1%}{given / 2**30:>12.2f}")
        handle.remove()
        del model, handle
        gc.collect()


if __name__ == "__main__":
    main()
