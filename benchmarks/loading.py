"""Peak memory and time of loading a ~1 GB safetensors checkpoint, three ways.

* torchsurgery   ``with skeleton(): model = Model(config)`` then ``load_(model, dir)``
* naive          ``model = Model(config)`` then ``model.load_state_dict(load_file(path))``
* from_pretrained  ``transformers``' own loader

The model is a ``transformers`` Llama built from a config (random weights, fp32), saved
once with ``save_pretrained``. Each method runs in a fresh subprocess so that peaks do
not mix; peak resident memory is measured above the process's resident memory right
before loading starts (after imports), and reported as a ratio to the model's size (the
floor is 1.0x: the loaded model itself).

Run: .venv/bin/python benchmarks/loading.py [--repeats 3] [--layers 12]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import cpu_name

CONFIG = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def child(method: str, folder: str, layers: int) -> None:
    """Run one load in this (fresh) process and print a JSON line with its figures."""
    import safetensors.torch
    import torch
    import transformers

    import torchsurgery

    torch.set_num_threads(2)
    config = transformers.LlamaConfig(num_hidden_layers=layers, **CONFIG)
    # warm-up: the first model built in a process pays for lazy imports; no method should
    tiny = dict(CONFIG, vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=1, **tiny))
    base = _rss()
    start = time.perf_counter()
    if method == "torchsurgery":
        with torchsurgery.skeleton():
            model = transformers.LlamaForCausalLM(config)
        torchsurgery.load_(model, folder)
    elif method == "naive":
        model = transformers.LlamaForCausalLM(config)
        model.load_state_dict(safetensors.torch.load_file(os.path.join(folder, "model.safetensors")))
    elif method == "from_pretrained":
        model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        raise SystemExit(f"unknown method {method}")
    seconds = time.perf_counter() - start
    with torch.no_grad():  # a lazily mapped checkpoint pays for its reads here
        model(torch.arange(8).unsqueeze(0))
    first_forward = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    print(json.dumps({"seconds": seconds, "with_forward": first_forward, "peak_above_base": peak - base, "model_bytes": size, "checksum": checksum}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.layers)
        return

    import torch
    import transformers

    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, transformers {transformers.__version__}")
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(num_hidden_layers=args.layers, **CONFIG)
        transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="100GB")
        files = sorted(Path(folder).glob("*.safetensors"))
        print(f"checkpoint: {sum(f.stat().st_size for f in files) / 2**30:.2f} GiB in {len(files)} file(s)")
        results: dict[str, list[dict[str, float]]] = {}
        for _ in range(args.repeats):
            for method in ("torchsurgery", "naive", "from_pretrained"):
                out = subprocess.run(
                    [sys.executable, __file__, "--layers", str(args.layers), "--child", method, folder],
                    check=True, capture_output=True, text=True,
                )
                results.setdefault(method, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    checksums = {m: r[0]["checksum"] for m, r in results.items()}
    if len({round(c, 3) for c in checksums.values()}) != 1:
        raise SystemExit(f"the methods loaded different weights: {checksums}")
    size = results["torchsurgery"][0]["model_bytes"]
    ours_time = statistics.median(r["seconds"] for r in results["torchsurgery"])
    print(f"\nmodel: {size / 2**30:.2f} GiB fp32; medians of {args.repeats} runs, each in a fresh process")
    ours_total = statistics.median(r["with_forward"] for r in results["torchsurgery"])
    print(f"{'method':<18}{'peak / model':>14}{'load s':>9}{'vs ours':>9}{'+1st forward s':>16}{'vs ours':>9}")
    for method, runs in results.items():
        peak = statistics.median(r["peak_above_base"] for r in runs) / size
        seconds = statistics.median(r["seconds"] for r in runs)
        total = statistics.median(r["with_forward"] for r in runs)
        print(
            f"{method:<18}{peak:>13.2f}x{seconds:>9.2f}{seconds / ours_time:>8.2f}x"
            f"{total:>16.2f}{total / ours_total:>8.2f}x"
        )


if __name__ == "__main__":
    main()
