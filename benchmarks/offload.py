"""Layerwise casting on a CPU: bf16 storage, fp32 compute, against the fp32 model and peers.

Two models, both with weights stored in bf16 and computed in fp32:

* an 8-block MLP (d=1024, each block Linear(d, 4d) -> GELU -> Linear(4d, d));
* a ``transformers`` GPT-2 (12 layers, hidden 768, random weights).

Variants, each on its own copy of the model:

* fp32 model          the model as it is (the reference; weights 2x as large)
* torchsurgery        ``offload(model, storage_dtype=bf16, dtype=fp32)``
* access-time cast    the video app's way: every weight read returns ``Parameter(p.to(fp32))``
* diffusers           ``apply_layerwise_casting(storage_dtype=bf16, compute_dtype=fp32)``

Times are medians over rounds in which the variants take turns (machine noise hits all of
them alike), for a one-token step and a 512-token prefill. Memory: bytes of the stored
weights (the transient peak of our engine, bf16 storage plus at most two fp32 groups, is
checked in a fresh process by tests/offload/test_offload_engine.py).

Run: .venv/bin/python benchmarks/offload.py [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import torchsurgery
from _machine import cpu_name

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_mlp(d: int = 1024, blocks: int = 8) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(blocks)]).eval()


def make_gpt2() -> nn.Module:
    import transformers

    return transformers.GPT2Model(transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)).eval()


def access_time_cast(model: nn.Module, **to_kwargs: Any) -> None:
    """The seed application's installer, written out: convert on every attribute read."""
    for module in model.modules():
        original = type(module)

        def getattr_converting(self: nn.Module, name: str, _original: type = original) -> Any:
            params = self.__dict__.get("_parameters", {})
            if name in params and params[name] is not None:
                p = params[name]
                return nn.Parameter(p.to(**to_kwargs), requires_grad=p.requires_grad)
            buffers = self.__dict__.get("_buffers", {})
            if name in buffers and buffers[name] is not None:
                return buffers[name].to(**to_kwargs)
            return super(_original, self).__getattr__(name)  # type: ignore[misc]

        module.__class__ = type(f"AccessCast_{original.__name__}", (original,), {"__getattr__": getattr_converting})


def store_bf16(model: nn.Module, skip: Callable[[nn.Module, str], bool]) -> None:
    kept = {id(p) for n, m in model.named_modules() if skip(m, n) for p in m.parameters(recurse=False)}
    for p in model.parameters():
        if id(p) not in kept:
            p.data = p.data.bfloat16()


def variants(kind: str) -> dict[str, tuple[nn.Module, Callable[[], None]]]:
    """name -> (model, cleanup)."""
    torch.manual_seed(0)
    base = make_mlp() if kind == "mlp" else make_gpt2()
    skip = torchsurgery.DEFAULT_SKIP
    out: dict[str, tuple[nn.Module, Callable[[], None]]] = {"fp32 model": (base, lambda: None)}
    ours = copy.deepcopy(base)
    handle = torchsurgery.offload(ours, storage_dtype=torch.bfloat16, dtype=torch.float32)
    out["torchsurgery"] = (ours, handle.remove)
    seed = copy.deepcopy(base)
    store_bf16(seed, skip)
    access_time_cast(seed, dtype=torch.float32)
    out["access-time cast"] = (seed, lambda: None)
    try:
        from diffusers.hooks import apply_layerwise_casting

        theirs = copy.deepcopy(base)
        apply_layerwise_casting(theirs, storage_dtype=torch.bfloat16, compute_dtype=torch.float32)
        out["diffusers"] = (theirs, lambda: None)
    except Exception as exc:  # reported, not fatal
        print(f"diffusers apply_layerwise_casting unavailable: {exc}")
    return out


def inputs(kind: str, tokens: int) -> Callable[[nn.Module], Any]:
    generator = torch.Generator().manual_seed(tokens)  # the same input for every variant
    if kind == "mlp":
        x = torch.randn(tokens, 1024, generator=generator)
        return lambda m: m(x)
    ids = torch.randint(0, 50257, (1, tokens), generator=generator)
    return lambda m: m(ids).last_hidden_state


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="mlp,gpt2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {cpu_name()}, {args.threads} threads, torch {torch.__version__}; bf16 storage, fp32 compute")
    for kind in args.models.split(","):
        models = variants(kind)
        with torch.no_grad():
            reference = {t: inputs(kind, t)(models["fp32 model"][0]) for t in (1, 512)}
            rows: dict[str, dict[str, float]] = {name: {} for name in models}
            for tokens, label, steps in ((1, "1 token", 20), (512, "512 tokens", 2)):
                run = inputs(kind, tokens)
                for model, _ in models.values():
                    result = run(model)  # warm-up (compiles the fused kernel once per shape)
                    torch.testing.assert_close(result, reference[tokens], rtol=0.05, atol=0.05)
                samples: dict[str, list[float]] = {name: [] for name in models}
                for _ in range(args.repeats):
                    for name, (model, _) in models.items():
                        start = time.perf_counter()
                        for _ in range(steps):
                            run(model)
                        samples[name].append((time.perf_counter() - start) / steps * 1e3)
                for name in models:
                    rows[name][label] = statistics.median(samples[name])
            for name, (model, _) in models.items():
                rows[name]["weights MiB"] = weight_bytes(model) / 2**20
        ref = rows["fp32 model"]
        print(f"\n{kind}: median ms per step ({args.repeats} rounds), ratio to the fp32 model")
        print(f"{'variant':<18}{'1 token':>10}{'ratio':>8}{'512 tokens':>12}{'ratio':>8}{'weights MiB':>13}")
        for name, r in rows.items():
            print(
                f"{name:<18}{r['1 token']:>10.2f}{r['1 token'] / ref['1 token']:>7.2f}x"
                f"{r['512 tokens']:>12.1f}{r['512 tokens'] / ref['512 tokens']:>7.2f}x"
                f"{r['weights MiB']:>13.0f}"
            )
        for _, cleanup in models.values():
            cleanup()


if __name__ == "__main__":
    main()
