"""FramePack's low-VRAM pipeline on a CPU: plain ``.to()`` moves vs the pool vs the installer.

The pipeline of ``examples/framepack_low_vram.py`` at its "bench" size (random weights):
Llama and CLIP text encoding, a VAE encode, then per section the Hunyuan-video
(FramePack) transformer's denoising steps and a VAE decode, with the app's moves in and
out between the stages. Variants, each on its own copy of the models:

* plain .to()            whole-model ``.to()`` moves (the reference)
* pool                   ``torchsurgery.compat.framepack``'s functions (one ``DevicePool``)
* DynamicSwapInstaller   the same, plus the installer on the transformer and the Llama
                         encoder, as the app does on a small GPU

On a CPU the moves move nothing, so this measures what the machinery costs per step.
Times are medians over rounds in which the variants take turns (machine noise hits all
of them alike), divided by the number of denoising steps; ratios are to plain ``.to()``.
Peak resident memory is measured in a fresh process per variant.

Run: .venv/bin/python benchmarks/framepack_pool.py [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))

import framepack_low_vram as app  # noqa: E402
import torchsurgery.compat.framepack as framepack  # noqa: E402
from _machine import cpu_name  # noqa: E402

VARIANTS = ("plain .to()", "pool", "DynamicSwapInstaller")
CPU = torch.device("cpu")


def prepare(variant: str, base: Any) -> tuple[Any, Any]:
    """(models, memory functions) of one variant."""
    models = copy.deepcopy(base)
    if variant == "plain .to()":
        return models, app.plain_moves()
    if variant == "DynamicSwapInstaller":
        app.install_like_the_app(models, CPU)
    return models, framepack


def peak_rss_child(variant: str, sections: int, steps: int) -> None:
    models, memory = prepare(variant, app.build_models("bench"))
    app.run(models, memory, CPU, sections=sections, steps=steps, size="bench")
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def peak_rss(variant: str, args: argparse.Namespace) -> int:
    command = [sys.executable, __file__, "--child", variant, "--sections", str(args.sections), "--steps", str(args.steps),
               "--threads", str(args.threads)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return int(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sections", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        peak_rss_child(args.child, args.sections, args.steps)
        return
    print(f"machine: {cpu_name()}, {args.threads} threads, torch {torch.__version__}")
    base = app.build_models("bench")
    sizes = {name: sum(p.numel() * p.element_size() for p in m.parameters()) / 1e6 for name, m in vars(base).items()}
    print("models (MB): " + ", ".join(f"{name} {mb:.1f}" for name, mb in sizes.items()))
    prepared = {variant: prepare(variant, base) for variant in VARIANTS}
    reference = app.run(*prepared["plain .to()"], CPU, sections=args.sections, steps=args.steps, size="bench")
    for models, memory in prepared.values():  # warm-up, and the outputs agree
        got = app.run(models, memory, CPU, sections=args.sections, steps=args.steps, size="bench")
        for key, value in reference.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0)
    # wall time, and the process's CPU time (steadier on a machine shared with other work)
    samples: dict[str, dict[str, list[float]]] = {variant: {"wall": [], "cpu": []} for variant in VARIANTS}
    denoising = args.sections * args.steps
    for _ in range(args.repeats):
        for variant, (models, memory) in prepared.items():
            wall, cpu = time.perf_counter(), time.process_time()
            app.run(models, memory, CPU, sections=args.sections, steps=args.steps, size="bench")
            samples[variant]["wall"].append((time.perf_counter() - wall) / denoising * 1e3)
            samples[variant]["cpu"].append((time.process_time() - cpu) / denoising * 1e3)
    print(f"\n{args.sections} sections x {args.steps} steps, {args.repeats} rounds; ms per denoising step "
          "(whole pipeline / steps), median; ratio to plain .to(): median [range over rounds]")
    print(f"{'variant':22s} {'wall ms':>9s} {'wall ratio':>22s} {'CPU ms':>9s} {'CPU ratio':>22s} {'peak RSS MB':>12s}")
    for variant in VARIANTS:
        cells = []
        for clock in ("wall", "cpu"):
            values, plain = samples[variant][clock], samples["plain .to()"][clock]
            ratios = [v / p for v, p in zip(values, plain, strict=True)]
            cells.append(f"{statistics.median(values):9.1f} {statistics.median(ratios):7.3f}x "
                         f"[{min(ratios):.3f}-{max(ratios):.3f}]")
        rss = peak_rss(variant, args) / 1e6
        print(f"{variant:22s} {cells[0]} {cells[1]} {rss:12.0f}")


if __name__ == "__main__":
    main()
