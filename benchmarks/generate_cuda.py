"""``generate()`` and a long forward on a Llama-shaped model offloaded to the accelerator under a quarter of its size.

The model (random bf16 weights, built from a transformers config) is offloaded with
``offload(model, device, budget=size / 4)``; the same programs run on the resident model
(the whole model on the device). Printed per variant:

* ms per generated token (greedy, after the prompt) and its ratio to the link floor: the
  bytes the offload streams per forward divided by the pinned host-to-device bandwidth
  measured here (``max`` with the resident model's time per token);
* ms per forward of a 128-token prompt and its ratio to the same floor;
* whether the tokens equal the resident model's.

Variants: ``prefetch`` 1 and 2, ``generate()`` as the model's first call and after a plain
forward. Device peak memory (the device's own statistics) is printed against the budget.

Run: .venv/bin/python benchmarks/generate_cuda.py [--layers 16] [--hidden 2048] [--tokens 32]
(needs an accelerator; ``--device tardy`` runs it on the test suite's device, as a smoke test).
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import torchsurgery
from _machine import cpu_name


def make(layers: int, hidden: int, vocab: int) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=hidden // 128 or 1, num_key_value_heads=max(1, hidden // 512), vocab_size=vocab,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def size_of(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def sync(device: torch.device) -> None:
    torch.accelerator.synchronize(device)


def pinned_bandwidth(device: torch.device, nbytes: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)
    sync(device)
    start = time.perf_counter()
    for _ in range(5):
        target.copy_(host, non_blocking=True)
    sync(device)
    return 5 * nbytes / (time.perf_counter() - start)


def timed(fn: Any, device: torch.device, repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def run(model: nn.Module, device: torch.device, prompt: torch.Tensor, long: torch.Tensor, tokens: int,
        repeats: int, warm_forward: bool) -> dict[str, Any]:
    """Seconds per generated token, per long forward, and the tokens."""
    with torch.inference_mode():
        if warm_forward:
            model(prompt)
        # the prompt's own forward is timed apart: per token = (all - prefill) / new tokens
        prefill, _ = timed(lambda: model(prompt), device, repeats)
        total, out = timed(lambda: model.generate(prompt, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens),
                           device, repeats)
        forward, _ = timed(lambda: model(long), device, repeats)
    return {"token": (total - prefill) / (tokens - 1), "forward": forward, "tokens": out}


def model_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The options the accelerator benchmarks share: the model's size, repeats, the device."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    return parser


def set_up(args: argparse.Namespace, script: str) -> tuple[torch.device, nn.Module, int, float]:
    """The device (tardy registered when named), the bf16 model, its size and the pinned bandwidth, printed."""
    if args.device == "tardy":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        import tardy

        tardy.register()
    device = torch.device(args.device)
    if device.type != "tardy" and not torch.accelerator.is_available():
        sys.exit(f"benchmarks/{script}: no accelerator here; run it on a machine with a GPU")
    reference = make(args.layers, args.hidden, args.vocab)
    size = size_of(reference)
    bandwidth = pinned_bandwidth(device, min(size, 1 << 30))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"device: {name}; host CPU: {cpu_name()}; torch {torch.__version__}")
    print(f"model: {size / 2**30:.2f} GiB bf16 (Llama-shaped, {args.layers} layers, hidden {args.hidden}); "
          f"budget {size / 4 / 2**30:.2f} GiB; pinned H2D {bandwidth / 1e9:.1f} GB/s")
    return device, reference, size, bandwidth


def main() -> None:
    parser = model_arguments(__doc__)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    device, reference, size, bandwidth = set_up(args, "generate_cuda.py")
    budget = size // 4
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab, (1, 16), generator=g).to(device)
    long = torch.randint(0, args.vocab, (1, 128), generator=g).to(device)

    resident = copy.deepcopy(reference).to(device)
    want = run(resident, device, prompt, long, args.tokens, args.repeats, warm_forward=True)
    del resident
    gc.collect()
    print(f"{'variant':<28}{'ms/token':>10}{'vs floor':>10}{'ms/fwd128':>11}{'vs floor':>10}{'peak/budget':>13}  tokens")
    print(f"{'resident':<28}{want['token'] * 1e3:>10.2f}{'':>10}{want['forward'] * 1e3:>11.2f}{'':>10}{'':>13}  -")
    worst = 0.0
    all_equal = True
    for prefetch in (1, 2):
        for warm in (False, True):
            model = copy.deepcopy(reference)
            torch.accelerator.reset_peak_memory_stats(device)
            before = torch.accelerator.memory_allocated(device)
            handle = torchsurgery.offload(model, device, budget=budget, prefetch=prefetch)
            got = run(model, device, prompt, long, args.tokens, args.repeats, warm_forward=warm)
            peak = torch.accelerator.max_memory_allocated(device) - before
            streamed = size - handle.stats().resident_bytes
            floor_token = max(want["token"], streamed / bandwidth)
            floor_forward = max(want["forward"], streamed / bandwidth)
            same = torch.equal(got["tokens"], want["tokens"])
            all_equal &= same
            worst = max(worst, got["token"] / floor_token, got["forward"] / floor_forward)
            label = f"prefetch={prefetch}, {'after a forward' if warm else 'generate first'}"
            print(f"{label:<28}{got['token'] * 1e3:>10.2f}{got['token'] / floor_token:>9.2f}x"
                  f"{got['forward'] * 1e3:>11.2f}{got['forward'] / floor_forward:>9.2f}x{peak / budget:>12.2f}x  "
                  f"{'equal' if same else 'DIFFERENT'}")
            handle.remove()
            del model, handle
            gc.collect()
    print(f"summary: worst ratio to the link floor {worst:.2f}x (target <= 1.05x); "
          f"tokens {'equal to the resident model in every variant' if all_equal else 'DIFFER'}")
    if not all_equal:
        sys.exit(1)


if __name__ == "__main__":
    main()
