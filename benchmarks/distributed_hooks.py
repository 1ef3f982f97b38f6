"""Distributed capture overhead: every transformer block hooked, TP=2 and DP=2 on CPU (gloo).

Two processes (``torch.multiprocessing.spawn``, gloo, one thread each) run a ``transformers``
Llama (random weights, same seed on every rank; 4 layers, hidden 256, intermediate 1024,
8 heads / 4 kv heads, vocab 1000 by default) in two layouts, each timed against the same
distributed run without hooks:

* TP=2  the model parallelised with ``parallelize_module`` (q/k/v/gate/up column-parallel,
        o/down row-parallel) on a 1-D ``tp`` device mesh, every rank on the same input.

        no hooks              the parallelised model called directly (the floor)
        torchsurgery blocks   ``FlexModel(model, out, device_mesh=mesh)`` +
                              ``HookFunction("model.layers.*")``: each block's output is
                              whole on every rank, so each rank just keeps a CPU copy
        torchsurgery up_proj  ``HookFunction("model.layers.*.mlp.up_proj")``: column-parallel
                              outputs, sharded, all-gathered (what gathering costs)

* DP=2  the plain model on each rank, each rank with its own batch.

        no hooks              the plain model on each rank, which never meet
        floor                 the plain model plus one tiny message from rank 1 to rank 0
                              per step: the least that any way of having rank 0's captures
                              complete when its forward returns costs (the ranks meet once
                              per step)
        torchsurgery blocks   ``FlexModel(model, out, data_parallel_size=2)`` + blocks hooked;
                              both ranks' captures reach both ranks at the end of each
                              forward (the default, where flex_model has them)
        ... rank 0 only       the same with ``captures_on="first_rank"``: they reach rank 0
                              alone
        flex-model 0.1.0      its ``FlexModel`` (process groups forced to gloo) + one
                              ``HookFunction`` per block with an ``expected_shape`` hint

Two input sizes: one token (a decode-like step: batch 1 x seq 1, per rank for DP) and a
prefill (batch 2 x seq 128, per rank for DP). Before timing, the captures of one step, on
every rank that holds them, are checked against the unparallelised model run on the global
batch: one entry per hooked
module, with the full shape (DP: both ranks' rows; up_proj: the full intermediate size) and
the same values; a wrong capture stops the run. A peer that cannot run here is reported
with the reason instead of a time.

Timing: ranks meet at a barrier before and after each block of steps (so a block lasts as
long as its slowest rank); variants take turns within each round; rank 0 reports the median
ms/step over the rounds and the ratio to the no-hooks run of the same layout and input.

Target: capture overhead <= 1.15x the no-hooks run with every block hooked.

Run: .venv/bin/python benchmarks/distributed_hooks.py [--rounds 7] [--steps 20]
     [--prefill-steps 5] [--prefill-batch 2] [--prefill-seq 128] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from _machine import cpu_name

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WORLD = 2
VOCAB = 1000
TARGET = 1.15
Captures = dict[str, list[torch.Tensor]]


@dataclass
class Variant:
    """One way of running a step, and (for hooked variants) where its captures are found."""

    label: str
    step: Callable[[torch.Tensor], Any]
    out: Captures | None = None
    names: list[str] = field(default_factory=list)
    width: int = 0  # the full last dimension of every capture
    peer: bool = False  # a peer's failure is reported in the table; ours stops the run
    every_rank: bool = True  # every rank holds the captures (else rank 0 alone)


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_llama(hidden: int, layers: int) -> nn.Module:
    """The same random-weight Llama on every call (and so on every rank)."""
    import transformers

    heads = max(2, hidden // 32)
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        num_hidden_layers=layers,
        vocab_size=VOCAB,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def parallelise(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {f"model.layers.*.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan["model.layers.*.mlp.gate_proj"] = ColwiseParallel()
    plan["model.layers.*.mlp.up_proj"] = ColwiseParallel()
    plan["model.layers.*.self_attn.o_proj"] = RowwiseParallel()
    plan["model.layers.*.mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def plain(model: nn.Module) -> Variant:
    return Variant("no hooks", lambda ids: model(ids, use_cache=False))


def one_message(model: nn.Module, rank: int) -> Variant:
    """The plain model plus one tiny message from rank 1 to rank 0 per step: the least any
    scheme pays that has rank 0's captures complete when its forward returns."""
    note = torch.zeros(2, dtype=torch.int64)

    def step(ids: torch.Tensor) -> Any:
        out = model(ids, use_cache=False)
        if rank == 0:
            dist.recv(note, src=1)
        else:
            dist.send(note, dst=0)
        return out

    return Variant("floor: no hooks + 1 message/step", step)


def ours(label: str, model: nn.Module, pattern: str, width: int, **sizes: Any) -> Variant:
    from torchsurgery import FlexModel, HookFunction

    out: Captures = {}
    flex = FlexModel(model, out, **sizes)
    every_rank = sizes.get("captures_on", "every_rank") == "every_rank"
    flex.register_forward_hook(HookFunction(pattern))
    names = [n for n, _ in model.named_modules() if _matches(pattern, n)]

    def step(ids: torch.Tensor) -> Any:
        out.clear()  # keep memory flat: only the last step's captures are kept
        return flex(ids, use_cache=False)

    return Variant(label, step, out, names, width, every_rank=every_rank)


def _matches(pattern: str, name: str) -> bool:
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(w in ("*", p) for w, p in zip(wanted, parts, strict=True))


def flex_model_peer(model: nn.Module, layers: int, hidden: int) -> Variant:
    from flex_model.core import FlexModel as PeerFlexModel
    from flex_model.core import HookFunction as PeerHookFunction

    real_new_group = dist.new_group

    def gloo_group(*args: Any, **kwargs: Any) -> Any:
        kwargs["backend"] = "gloo"  # flex-model 0.1.0 hard-codes NCCL
        return real_new_group(*args, **kwargs)

    out: Captures = {}
    dist.new_group = gloo_group  # type: ignore[assignment]
    try:
        flex = PeerFlexModel(model, out, data_parallel_size=WORLD)
    finally:
        dist.new_group = real_new_group  # type: ignore[assignment]
    names = [f"model.layers.{i}" for i in range(layers)]
    for n in names:
        # the local shape: nothing is tensor-sharded, the batch is gathered over DP ranks
        flex.register_forward_hook(PeerHookFunction(n, expected_shape=(None, None, hidden)))

    def step(ids: torch.Tensor) -> Any:
        out.clear()
        return flex(ids, use_cache=False)

    return Variant("flex-model 0.1.0", step, out, names, hidden, peer=True)


def reference(model: nn.Module, ids: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """What the hooked modules output in one unparallelised process on ``ids``."""
    store: dict[str, torch.Tensor] = {}
    handles = [
        model.get_submodule(n).register_forward_hook(
            lambda m, a, o, n=n: store.__setitem__(n, _first(o).detach().clone())
        )
        for n in names
    ]
    try:
        model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return store


def check(where: str, variant: Variant, want: dict[str, torch.Tensor], shape: tuple[int, ...]) -> None:
    """This rank's captures of the last step: one per hooked module, full shape, right values."""
    out = variant.out
    assert out is not None
    what = f"{where} {variant.label}"
    if sorted(out) != sorted(variant.names):
        raise RuntimeError(f"{what}: captured keys {sorted(out)}, expected {sorted(variant.names)}")
    for name in variant.names:
        got = out[name]
        if len(got) != 1:
            raise RuntimeError(f"{what}: {len(got)} captures of {name!r} in one step, expected 1")
        if tuple(got[0].shape) != shape or got[0].device.type != "cpu":
            raise RuntimeError(
                f"{what}: {name!r} captured with shape {list(got[0].shape)} on {got[0].device}, "
                f"expected {list(shape)} on cpu"
            )
        try:
            torch.testing.assert_close(got[0], want[name], rtol=1e-4, atol=1e-5)
        except AssertionError as exc:
            raise RuntimeError(f"{what}: {name!r} differs from one process: {exc}") from None


def _agree_failed(failed: bool) -> bool:
    """Whether any rank failed (every rank must call this)."""
    flag = torch.tensor([int(failed)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _block(step: Callable[[torch.Tensor], Any], ids: torch.Tensor, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step(ids)
    dist.barrier()
    return (time.perf_counter() - start) / steps * 1e3


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {(text[0] if text else '')[:90]}"


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=args.timeout))
    try:
        with torch.no_grad():
            run(rank, args)
    finally:
        dist.destroy_process_group()


def run(rank: int, args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    hidden, layers = args.hidden, args.layers
    inner = 4 * hidden
    ref_model = make_llama(hidden, layers)
    blocks = f"{layers} blocks"
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    tp = [
        plain(parallelise(make_llama(hidden, layers), mesh)),
        ours(f"torchsurgery, {blocks}", parallelise(make_llama(hidden, layers), mesh), "model.layers.*", hidden,
             device_mesh=mesh),
        ours(f"torchsurgery, {layers} up_proj", parallelise(make_llama(hidden, layers), mesh),
             "model.layers.*.mlp.up_proj", inner, device_mesh=mesh),
    ]
    dp = [
        plain(make_llama(hidden, layers)),
        one_message(make_llama(hidden, layers), rank),
        ours(f"torchsurgery, {blocks}", make_llama(hidden, layers), "model.layers.*", hidden,
             data_parallel_size=WORLD),
        ours(f"torchsurgery, {blocks}, rank 0 only", make_llama(hidden, layers), "model.layers.*", hidden,
             data_parallel_size=WORLD, captures_on="first_rank"),
    ]
    failures: dict[str, str] = {}
    if not args.skip_peer:
        peer: Variant | None = None
        reason = ""
        try:
            peer = flex_model_peer(make_llama(hidden, layers), layers, hidden)
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            reason = f"could not run: {_reason(exc)}"
        if _agree_failed(peer is None):
            failures["flex-model 0.1.0"] = reason or "could not run on the other rank"
        else:
            assert peer is not None
            dp.append(peer)

    sizes = [("1 token", 1, 1, args.steps), ("prefill", args.prefill_batch, args.prefill_seq, args.prefill_steps)]
    gen = torch.Generator().manual_seed(1)
    rows: list[tuple[str, str, str, float | str, float | None]] = []
    for layout, variants in (("TP=2", tp), ("DP=2", dp)):
        for size_name, batch, seq, steps in sizes:
            every = torch.randint(VOCAB, (WORLD * batch, seq), generator=gen)
            if layout == "TP=2":
                ids, global_ids = every[:batch], every[:batch]
                shown = f"{size_name} ({batch}x{seq})"
            else:
                ids, global_ids = every[rank * batch : (rank + 1) * batch], every
                shown = f"{size_name} ({batch}x{seq} per rank)"
            for variant in list(variants):
                failed = ""
                try:
                    for _ in range(2):  # warm-up
                        variant.step(ids)
                    if variant.out is not None:
                        variant.step(ids)
                        if rank == 0 or variant.every_rank:
                            want = reference(ref_model, global_ids, variant.names)
                            check(layout, variant, want, (global_ids.shape[0], seq, variant.width))
                except Exception as exc:
                    if not variant.peer:
                        raise  # a wrong capture of ours stops the run
                    failed = f"failed: {_reason(exc)}"
                if _agree_failed(bool(failed)):
                    variants.remove(variant)
                    failures[variant.label] = failed or "failed on the other rank"
            samples: dict[str, list[float]] = {v.label: [] for v in variants}
            for _ in range(args.rounds):
                for variant in variants:
                    samples[variant.label].append(_block(variant.step, ids, steps))
            times = {label: statistics.median(values) for label, values in samples.items()}
            for label, ms in times.items():
                rows.append((layout, label, shown, ms, ms / times["no hooks"]))
    rows += [("DP=2", label, "-", reason, None) for label, reason in failures.items()]
    if rank == 0:
        report(args, ref_model, rows)


def report(
    args: argparse.Namespace, model: nn.Module, rows: list[tuple[str, str, str, float | str, float | None]]
) -> None:
    params = sum(p.numel() for p in model.parameters())
    heads = max(2, args.hidden // 32)
    print(f"machine: {cpu_name()}, {os.cpu_count()} core(s); {WORLD} processes x 1 thread, gloo; torch {torch.__version__}")
    print(
        f"Llama (random weights): {args.layers} layers, hidden {args.hidden}, intermediate {4 * args.hidden}, "
        f"{heads} heads ({heads // 2} kv), vocab {VOCAB}: {params / 1e6:.2f}M parameters"
    )
    print(
        f"median ms/step of {args.rounds} rounds x {args.steps} steps (1 token), {args.rounds} x "
        f"{args.prefill_steps} (prefill); variants take turns; ranks meet at a barrier around each block"
    )
    print("\n| layout | variant | input | ms/step | vs no hooks |")
    print("|---|---|---|---:|---:|")
    worst = 0.0
    for layout, label, shown, value, ratio in rows:
        if isinstance(value, str):
            print(f"| {layout} | {label} | {shown} | n/a | {value} |")
            continue
        print(f"| {layout} | {label} | {shown} | {value:.2f} | {ratio:.3f}x |")
        if ratio is not None and label.startswith("torchsurgery") and "blocks" in label:
            worst = max(worst, ratio)
    verdict = "met" if worst <= TARGET else "NOT met"
    print(f"\ntorchsurgery with every block hooked: worst {worst:.3f}x of no hooks (target <= {TARGET}x: {verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="steps per round, one token")
    parser.add_argument("--prefill-steps", type=int, default=5, help="steps per round, prefill")
    parser.add_argument("--prefill-batch", type=int, default=2)
    parser.add_argument("--prefill-seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0, help="gloo timeout (s): a hang fails instead")
    parser.add_argument("--skip-peer", action="store_true", help="leave flex-model 0.1.0 out")
    args = parser.parse_args()
    mp.spawn(worker, args=(_free_port(), args), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
