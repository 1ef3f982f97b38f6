"""Layerwise casting on a CPU: bf16 storage, fp32 compute, against the fp32 model and peers.

Models, all with weights stored in bf16 and computed in fp32:

* ``shapes12``  a stack of 12 ``nn.Linear`` layers, each of a different shape, at 1-4 rows
  (a decoding step with a short prompt or a small batch);
* ``mlp``       an 8-block MLP (d=1024, each block Linear(d, 4d) -> GELU -> Linear(4d, d)),
  1 and 512 tokens;
* ``gpt2``      a ``transformers`` GPT-2 (12 layers, hidden 768, random weights), 1 and 512
  tokens;
* ``llama``     a Llama-shaped ``transformers`` model (hidden 1024, 8 layers, 16 heads over 4
  key/value heads, 32k vocabulary) generating 32 tokens greedily after a 3-token prompt,
  and the same model at 512 tokens of prefill.

Variants, each on its own copy of the model:

* fp32 model          the model as it is (the reference; weights 2x as large)
* torchsurgery        ``offload(model, storage_dtype=bf16, dtype=fp32)``
* ts compiled only    the same, with the native kernel switched off: what runs where no C++
                      compiler is found (compiled kernels for up to 4 rows, casts beyond)
* access-time cast    the seed's ``DynamicSwapInstaller`` way: every weight read returns
                      ``Parameter(p.to(fp32))``
* diffusers           ``apply_layerwise_casting(storage_dtype=bf16, compute_dtype=fp32)``
* bf16 model          (llama only) the model cast to bf16: bf16 storage and bf16 compute
* torchsurgery fp8    (llama only) ``offload`` with fp8 (e4m3fn) storage, fp32 compute

For the Llama-shaped model the script also times one decoding step (a KV cache of 8
tokens) at hidden sizes 1024 and 2048 (``--decode-widths``; at 2048 the weights are about 90%
of the step) in every storage format — bf16, fp8 (e4m3fn, unscaled), fp8 with a scale per
output channel and int8 with a scale per output channel (``torchsurgery.compact.Scaled``) —
against the fp32 model and against its floor, and splits it into the time inside the
native kernel and the rest of the step.

Rounds: the variants take turns inside each round (machine noise hits all of them alike);
each round gives every variant a ratio to the fp32 model of that round; the table shows
the median time, the median ratio and the range of the ratios over the rounds.

The floor: each round also times a contiguous read of a 1 GiB buffer (this machine's
memory read bandwidth, measured in this process, beyond a server CPU's last-level cache); for one-token steps the ``floor``
column is the step's time over (bytes of weights the step reads / that bandwidth).

Run: .venv/bin/python benchmarks/offload.py [--rounds 7] [--threads 2] [--models shapes12,mlp,gpt2,llama]
(``--models decode``: the decoding steps alone, ``--decode-widths 2048`` one of them)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import torchsurgery
from _machine import describe
from torchsurgery.compact import narrow, stored_values
from torchsurgery.compact.narrow_matvec import narrow_matvec

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPES12_DIMS = [1024, 2816, 1536, 2048, 1280, 3072, 1152, 2304, 896, 2560, 1792, 3328, 1024]


def make_shapes12() -> nn.Module:
    """12 Linear layers, no two of the same shape (attention, GQA, MLP and head-like sizes)."""
    dims = SHAPES12_DIMS
    layers: list[nn.Module] = []
    for a, b in zip(dims, dims[1:], strict=False):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers).eval()


def make_mlp(d: int = 1024, blocks: int = 8) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(blocks)]).eval()


def make_gpt2() -> nn.Module:
    import transformers

    return transformers.GPT2Model(transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)).eval()


def make_llama(hidden_size: int = 1024, intermediate_size: int = 2816, vocab_size: int = 32000) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=vocab_size, max_position_embeddings=2048, tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


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


@contextlib.contextmanager
def kernel_replaced(replacement: Callable[..., Any]) -> Iterator[None]:
    """Narrow products call ``replacement`` where they would call the native kernel."""
    kernel = narrow.narrow_matvec
    narrow.narrow_matvec = replacement  # type: ignore[assignment]
    try:
        yield
    finally:
        narrow.narrow_matvec = kernel


def native_off() -> contextlib.AbstractContextManager[None]:
    """Few-row steps without the native kernel (as where no compiler is found)."""
    return kernel_replaced(lambda *args: None)


CONTEXTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {"ts compiled only": native_off}
OURS = ("torchsurgery", "ts compiled only")


MAKERS: dict[str, Callable[[], nn.Module]] = {
    "shapes12": make_shapes12, "mlp": make_mlp, "gpt2": make_gpt2, "llama": make_llama,
}


def variants(kind: str) -> dict[str, tuple[nn.Module, Callable[[], None]]]:
    """name -> (model, cleanup)."""
    torch.manual_seed(0)
    base = MAKERS[kind]()
    skip = torchsurgery.DEFAULT_SKIP
    out: dict[str, tuple[nn.Module, Callable[[], None]]] = {"fp32 model": (base, lambda: None)}
    ours = copy.deepcopy(base)
    handle = torchsurgery.offload(ours, storage_dtype=torch.bfloat16, dtype=torch.float32)
    out["torchsurgery"] = (ours, handle.remove)
    if kind == "llama":  # fp8 (e4m3fn) storage: half the bytes again
        ours8 = copy.deepcopy(base)
        handle8 = torchsurgery.offload(ours8, storage_dtype=torch.float8_e4m3fn, dtype=torch.float32)
        out["torchsurgery fp8"] = (ours8, handle8.remove)
    if kind != "llama":  # (generation: the few-row layers are the same ones)
        ours2 = copy.deepcopy(base)
        handle2 = torchsurgery.offload(ours2, storage_dtype=torch.bfloat16, dtype=torch.float32)
        out["ts compiled only"] = (ours2, handle2.remove)
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
    if kind == "llama":
        out["bf16 model"] = (copy.deepcopy(base).to(torch.bfloat16), lambda: None)
    return out


def step_fn(kind: str, tokens: int) -> Callable[[nn.Module], torch.Tensor]:
    """One forward over ``tokens`` rows (the same input for every variant)."""
    generator = torch.Generator().manual_seed(tokens)
    if kind in ("mlp", "shapes12"):
        x = torch.randn(tokens, 1024, generator=generator)
        return lambda m: m(x)
    vocab = 32000 if kind == "llama" else 50257
    ids = torch.randint(0, vocab, (1, tokens), generator=generator)
    if kind == "llama":
        return lambda m: m(ids, logits_to_keep=1).logits.float()
    return lambda m: m(ids).last_hidden_state


def generate_fn(new_tokens: int = 32) -> Callable[[nn.Module], torch.Tensor]:
    ids = torch.randint(0, 32000, (1, 3), generator=torch.Generator().manual_seed(3))
    return lambda m: m.generate(
        ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )


def read_bytes(model: nn.Module) -> int:
    """Bytes of weights a one-token step reads: every parameter outside embeddings."""
    skipped = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return sum(stored_values(p).nbytes for p in model.parameters() if id(p) not in skipped)


def weight_bytes(model: nn.Module) -> int:
    return sum(stored_values(p).nbytes for p in model.parameters())


class Bandwidth:
    """Memory read bandwidth: a reduction over a 1 GiB buffer (beyond the caches: server CPUs' last
    level reaches 300 MiB)."""

    def __init__(self) -> None:
        self.buffer = torch.ones(256 << 20)

    def measure(self) -> float:
        self.buffer.sum()
        start = time.perf_counter()
        for _ in range(3):
            self.buffer.sum()
        return 3 * self.buffer.numel() * 4 / (time.perf_counter() - start)


def compare(
    models: dict[str, tuple[nn.Module, Callable[[], None]]],
    run: Callable[[nn.Module], Any],
    rounds: int,
    steps: int,
    bandwidth: Bandwidth | None = None,
) -> tuple[dict[str, list[float]], list[float]]:
    """Per-variant step times (ms) per round, and the bandwidth (bytes/s) of each round."""
    samples: dict[str, list[float]] = {name: [] for name in models}
    bandwidths: list[float] = []
    for _ in range(rounds):
        if bandwidth is not None:
            bandwidths.append(bandwidth.measure())
        for name, (model, _) in models.items():
            with CONTEXTS.get(name, contextlib.nullcontext)():
                start = time.perf_counter()
                for _ in range(steps):
                    run(model)
            samples[name].append((time.perf_counter() - start) / steps * 1e3)
    return samples, bandwidths


def summarise(samples: dict[str, list[float]]) -> dict[str, tuple[float, float, float, float]]:
    """name -> (median ms, median ratio to fp32, lowest ratio, highest ratio)."""
    ref = samples["fp32 model"]
    out = {}
    for name, times in samples.items():
        ratios = [t / r for t, r in zip(times, ref, strict=True)]
        out[name] = (statistics.median(times), statistics.median(ratios), min(ratios), max(ratios))
    return out


def print_table(title: str, columns: dict[str, dict[str, str]]) -> None:
    print(f"\n{title}")
    names = list(next(iter(columns.values())))
    print(f"{'variant':<18}" + "".join(f"{label:>30}" for label in columns))
    for name in names:
        print(f"{name:<18}" + "".join(f"{columns[label].get(name, ''):>30}" for label in columns))


def cell(stat: tuple[float, float, float, float], floor: float | None = None) -> str:
    ms, ratio, low, high = stat
    text = f"{ms:8.2f} ms {ratio:5.2f}x [{low:.2f}-{high:.2f}]"
    return text + (f" {floor:4.2f}F" if floor is not None else "")


def bench_steps(kind: str, token_counts: list[int], rounds: int, bandwidth: Bandwidth, few_steps: int = 10) -> None:
    models = variants(kind)
    columns: dict[str, dict[str, str]] = {}
    with torch.no_grad():
        for tokens in token_counts:
            run = step_fn(kind, tokens)
            reference = run(models["fp32 model"][0])
            for name, (model, _) in models.items():
                with CONTEXTS.get(name, contextlib.nullcontext)():
                    got = run(model)  # warm-up (builds or compiles the kernels)
                if "fp8" not in name:  # fp8's rounding is checked by the tests, against fp8-rounded weights
                    torch.testing.assert_close(got.float(), reference, rtol=0.05, atol=0.05)
            steps = 2 if tokens >= 256 else few_steps
            samples, bandwidths = compare(models, run, rounds, steps, bandwidth if tokens <= 4 else None)
            stats = summarise(samples)
            column = columns[f"{tokens} token{'s' if tokens > 1 else ''}"] = {}
            for name, stat in stats.items():
                floor = None
                if bandwidths and name in ("fp32 model", *OURS):
                    nbytes = read_bytes(models[name][0])
                    floor = statistics.median(t / 1e3 / (nbytes / bw) for t, bw in zip(samples[name], bandwidths, strict=True))
                column[name] = cell(stat, floor)
        column = columns["weights"] = {}
        for name, (model, _) in models.items():
            column[name] = f"{weight_bytes(model) / 2**20:.0f} MiB, reads {read_bytes(model) / 2**20:.0f} MiB"
    print_table(f"{kind}: median per step, median ratio to fp32 [range over {rounds} rounds], F = x the floor", columns)
    for _, cleanup in models.values():
        cleanup()


def bench_generation(rounds: int) -> None:
    models = variants("llama")
    run = generate_fn(32)
    with torch.no_grad():
        reference = run(models["fp32 model"][0])
        for name, (model, _) in models.items():
            got = run(model)
            agree = (got == reference).float().mean().item()
            print(f"llama generate warm-up: {name} agrees with fp32 on {agree:.0%} of tokens")
        samples, _ = compare(models, run, rounds, 1)
    stats = summarise(samples)
    column = {name: cell(stat) for name, stat in stats.items()}
    print_table(f"llama: generate 32 tokens after a 3-token prompt, median ratio to fp32 [range over {rounds} rounds]",
                {"generate 32": column})
    for _, cleanup in models.values():
        cleanup()


def _no_weights(x: torch.Tensor, out: int) -> torch.Tensor:
    """A Linear's output shape without its product (for the step's work that reads no weights)."""
    return x.new_empty(*x.shape[:-1], out)


class _KernelClock:
    """Time spent inside the native kernel's calls (the narrow products of a step)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._kernel = narrow.narrow_matvec

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        out = self._kernel(*args)
        self.seconds += time.perf_counter() - start
        return out

    def installed(self) -> contextlib.AbstractContextManager[None]:
        return kernel_replaced(self)


def _no_reads() -> contextlib.AbstractContextManager[None]:
    """The native kernel answering an uninitialised output: offload's own path, no weight read."""

    def answer(x: torch.Tensor, weight: torch.Tensor, bias: Any, transposed: bool, scale: Any = None) -> torch.Tensor:
        return _no_weights(x, weight.shape[1] if transposed else weight.shape[0])

    return kernel_replaced(answer)


DECODE_SHAPES = {1024: 2816, 2048: 5632}  # hidden size -> MLP width (Llama's ratio)


def decode_variants(base: nn.Module) -> dict[str, nn.Module]:
    """The fp32 model and one copy per storage format, each computing in fp32."""
    from torchsurgery.compact import Scaled

    models: dict[str, nn.Module] = {"fp32 model": base}
    formats: list[tuple[str, Any]] = [
        ("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn),
        ("fp8 per-chan", Scaled(torch.float8_e4m3fn)), ("int8 per-chan", Scaled(torch.int8)),
    ]
    for label, fmt in formats:
        model = copy.deepcopy(base)
        torchsurgery.offload(model, storage_dtype=fmt, dtype=torch.float32)
        models[label] = model
    return models


def bench_decode(rounds: int, bandwidth: Bandwidth, width: int = 1024, steps: int = 10) -> None:
    """One decoding step of a Llama-shaped model (a KV cache of 8 tokens) in each storage format.

    Prints the step's time, its ratio to the fp32 model's step (median over rounds of the
    ratio within a round), its floor (the bytes of weights it reads over the bandwidth
    measured in the same rounds), and where the time goes: inside the native kernel (with
    its own floor) and everything else (attention, norms, the cache, Python).
    """
    import transformers

    torch.manual_seed(0)
    base = make_llama(hidden_size=width, intermediate_size=DECODE_SHAPES[width])
    # the same model with every Linear answering an uninitialised output of its shape: the
    # step's work that reads no weights (attention, norms, rotary embeddings, the cache,
    # transformers' Python, at the model's own sizes), a floor of its own
    no_weights = make_llama(hidden_size=width, intermediate_size=DECODE_SHAPES[width])
    for module in no_weights.modules():
        if isinstance(module, nn.Linear):
            module.forward = functools.partial(_no_weights, out=module.out_features)  # type: ignore[method-assign]
            module.weight = nn.Parameter(torch.empty(0))  # the weights are never read: no memory for them
    models = decode_variants(base)
    prompt, token = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(8)), torch.tensor([[5]])

    def cache_for(model: nn.Module) -> Any:
        cache = transformers.DynamicCache(config=model.config)
        model(prompt, past_key_values=cache, use_cache=True)
        return cache

    times: dict[str, list[float]] = {name: [] for name in [*models, "no weights"]}
    kernel: dict[str, list[float]] = {name: [] for name in models}
    no_reads: dict[str, list[float]] = {name: [] for name in models}
    bandwidths: list[float] = []
    with torch.no_grad():
        reference = base(token, past_key_values=cache_for(base), use_cache=True).logits
        got = models["bf16"](token, past_key_values=cache_for(models["bf16"]), use_cache=True).logits
        torch.testing.assert_close(got, reference, rtol=0.05, atol=0.05)  # the others: benchmarks/accuracy.py
        for _ in range(rounds):
            bandwidths.append(bandwidth.measure())
            for name, model in [*models.items(), ("no weights", no_weights)]:
                cache = cache_for(model)
                model(token, past_key_values=cache, use_cache=True)  # the cache's first growth
                clock = _KernelClock()
                with clock.installed():
                    start = time.perf_counter()
                    for _ in range(steps):
                        model(token, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    times[name].append((time.perf_counter() - start) / steps)
                if name in kernel:
                    kernel[name].append(clock.seconds / steps)
                if name in models and name != "fp32 model":  # the same steps with no weight read: offload's Python alone
                    with _no_reads():
                        start = time.perf_counter()
                        for _ in range(steps):
                            model(token, past_key_values=cache, use_cache=True, logits_to_keep=1)
                        no_reads[name].append((time.perf_counter() - start) / steps)
    print_decode(width, models, times, kernel, no_reads, bandwidths, steps)


def print_decode(
    width: int, models: dict[str, nn.Module], times: dict[str, list[float]], kernel: dict[str, list[float]],
    no_reads: dict[str, list[float]], bandwidths: list[float], steps: int,
) -> None:
    """The decode table: one line per storage format."""
    bw = statistics.median(bandwidths)
    rounds = len(bandwidths)
    print(f"\nllama {width}-wide: one decoding step (KV cache of 8), medians of {rounds} rounds x {steps} steps; "
          f"floor = weight bytes read / {bw / 1e9:.1f} GB/s")
    own = statistics.median(times["no weights"])
    print(f"{'variant':<15}{'step':>10}{'vs fp32':>9}{'floor':>10}{'ratio':>8}{'in kernel':>12}{'kernel/floor':>14}"
          f"{'the rest':>10}{'rest - own':>12}{'python':>10}{'cold':>10}{'step/(floor+own)':>18}")
    for name, model in models.items():
        t, k = statistics.median(times[name]), statistics.median(kernel[name])
        versus = statistics.median(a / b for a, b in zip(times[name], times["fp32 model"], strict=True))
        floor = read_bytes(model) / bw
        kernel_text = f"{k * 1e3:9.2f} ms{k / floor:13.2f}x" if k else f"{'-':>12}{'-':>14}"
        rest = f"{(t - k - own) * 1e3:9.2f} ms" if k else f"{'-':>12}"
        if no_reads[name]:
            python = statistics.median(no_reads[name]) - own
            split = f"{python * 1e3:7.2f} ms{(t - k - own - python) * 1e3:7.2f} ms"
        else:
            split = f"{'-':>10}{'-':>10}"
        print(f"{name:<15}{t * 1e3:7.2f} ms{versus:8.2f}x{floor * 1e3:7.2f} ms{t / floor:7.2f}x{kernel_text}"
              f"{(t - k) * 1e3:7.2f} ms{rest}{split}{t / (floor + own):17.2f}x")
    print(f"the model's own work (the same model, its Linears answering uninitialised outputs): {own * 1e3:.2f} ms a "
          "step; 'vs fp32' is the median over rounds of the step's time over the fp32 model's in the same round; "
          "'rest - own' is what the step spends outside the kernel beyond that work, split into 'python' "
          "(the same steps with the kernel answering uninitialised outputs: offload's Python per product and "
          "its output buffers) and 'cold' (what remains: the model's own work slowed by the weights just "
          "streamed through the caches)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="shapes12,mlp,gpt2,llama")
    parser.add_argument("--steps", type=int, default=10, help="steps per round for 1-4 rows")
    parser.add_argument("--decode-widths", default="1024,2048", help="hidden sizes of the decoding-step models")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not narrow_matvec.wait():  # steady state: the kernel built (benchmarks/first_forward.py times the start)
        print(f"no native kernel: {narrow_matvec.unavailable}")
    print(f"machine: {describe(args.threads)}, torch {torch.__version__}; narrow storage, fp32 compute")
    bandwidth = Bandwidth()
    samples = [bandwidth.measure() for _ in range(5)]
    print(f"memory read bandwidth: median {statistics.median(samples) / 1e9:.1f} GB/s "
          f"[{min(samples) / 1e9:.1f}-{max(samples) / 1e9:.1f}] (sum over a 1 GiB buffer)")
    for kind in args.models.split(","):
        if kind == "shapes12":
            bench_steps(kind, [1, 2, 3, 4], args.rounds, bandwidth, args.steps)
        elif kind in ("llama", "decode"):  # decode: the decoding steps alone
            for width in args.decode_widths.split(","):
                bench_decode(args.rounds, bandwidth, int(width))
            if kind == "decode":
                continue
            bench_generation(args.rounds)
            bench_steps(kind, [512], max(3, args.rounds // 2), bandwidth)
        else:
            bench_steps(kind, [1, 512], args.rounds, bandwidth, args.steps)


if __name__ == "__main__":
    main()
