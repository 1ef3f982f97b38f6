"""Time and peak memory of loading a ~1 GB safetensors checkpoint, against peers and the read floor.

* file-backed     ``with skeleton(): model = Model(config)`` then ``load_(model, dir)``
* forced copy     the same with ``load_(model, dir, copy=True)`` (reads spread over up to 4
                  threads), and with one reading thread, to show what the threads bring
* in place        ``load_(model, dir)`` into a model that already has its weights (undoable:
                  the values it overwrites are first kept aside), and the same with
                  ``undoable=False`` (nothing kept: the reads alone)
* naive           ``model = Model(config)`` then ``model.load_state_dict(load_file(path))``
* from_pretrained ``transformers``' own loader
* read floor      the file's bytes read with one ``readinto`` into one buffer: a fresh one
                  (its pages are faulted in by the read, as for any new memory) and one
                  already in memory (the bound for an in-place load). An undoable in-place
                  load also copies the bytes it overwrites into new memory: its bound is
                  the two floors added (a read into memory, one copy into new memory)

The model is a ``transformers`` Llama built from a config (random weights, fp32), saved
once with ``save_pretrained`` (so the file is in the page cache for every method). Each
method runs in a fresh process so that peaks do not mix. Peak memory is the peak resident
memory above the process's resident memory right before loading (after imports, and for
"in place" after building the model); "private" is the anonymous (not file-backed) memory
after the first forward above the same point: file-backed weights are in "peak" once they
have been used, but only in the page cache, not in "private". Both are ratios to the
model's size (1.0x: the loaded model itself).

Run: .venv/bin/python benchmarks/loading.py [--repeats 3] [--layers 12] [--shard-size 200MB]
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
METHODS = (
    "file-backed", "forced copy", "forced copy, 1 thread", "in place", "in place, undoable=False", "naive", "from_pretrained",
    "floor, fresh buffer", "floor, buffer in memory",
)


def _anonymous() -> int:
    """Resident anonymous memory of this process (bytes), from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise SystemExit("no RssAnon in /proc/self/status (not Linux?)")


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def child(method: str, folder: str, layers: int) -> None:
    """Run one load in this (fresh) process and print a JSON line with its figures."""
    import safetensors.torch
    import torch
    import transformers

    import torchsurgery

    torch.set_num_threads(1)  # one compute thread: spinning thread pools on a shared machine add noise
    config = transformers.LlamaConfig(num_hidden_layers=layers, **CONFIG)
    files = sorted(Path(folder).glob("*.safetensors"))
    # warm-up: the first model built in a process pays for lazy imports; no method should
    tiny = dict(CONFIG, vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=1, **tiny))
    model = None
    buffer = None
    size = sum(f.stat().st_size for f in files)
    if method.startswith("in place"):
        model = transformers.LlamaForCausalLM(config)
    elif method == "floor, buffer in memory":
        buffer = torch.zeros(size, dtype=torch.uint8)
    base, base_private = _rss(), _anonymous()
    start = time.perf_counter()
    if method.startswith("forced copy"):
        torchsurgery._checkpoint._THREADS = 1 if method.endswith("1 thread") else torchsurgery._checkpoint._THREADS
    if method == "file-backed" or method.startswith("forced copy"):
        with torchsurgery.skeleton():
            model = transformers.LlamaForCausalLM(config)
        torchsurgery.load_(model, folder, copy=method != "file-backed")
    elif method.startswith("in place"):
        assert model is not None
        torchsurgery.load_(model, folder, undoable=not method.endswith("undoable=False"))
    elif method == "naive":
        model = transformers.LlamaForCausalLM(config)
        state = {}
        for f in files:
            state.update(safetensors.torch.load_file(f))
        model.load_state_dict(state)
    elif method == "from_pretrained":
        model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    elif method.startswith("floor"):
        if buffer is None:
            buffer = torch.empty(size, dtype=torch.uint8)
        offset = 0
        for file in files:  # one read per file
            with open(file, "rb", buffering=0) as f:
                offset += f.readinto(buffer[offset:].numpy().data)
    else:
        raise SystemExit(f"unknown method {method}")
    seconds = time.perf_counter() - start
    figures: dict[str, float] = {"seconds": seconds, "model_bytes": size}
    if model is not None:
        model.eval()  # as from_pretrained leaves it
        with torch.no_grad():  # a lazily mapped checkpoint pays for its reads here
            model(torch.arange(8).unsqueeze(0))
        figures["with_forward"] = time.perf_counter() - start
        figures["private"] = _anonymous() - base_private
    figures["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    if model is not None:
        figures["model_bytes"] = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        figures["checksum"] = float(sum(p.double().sum() for p in model.parameters()))
    print(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--shard-size", default="100GB", help="save_pretrained's max_shard_size (e.g. 200MB)")
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
        transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size=args.shard_size)
        files = sorted(Path(folder).glob("*.safetensors"))
        print(f"checkpoint: {sum(f.stat().st_size for f in files) / 2**30:.2f} GiB in {len(files)} file(s), in the page cache")
        results: dict[str, list[dict[str, float]]] = {}
        for _ in range(args.repeats):
            for method in METHODS:  # interleaved, so that a busy spell of the machine hits all
                out = subprocess.run(
                    [sys.executable, __file__, "--layers", str(args.layers), "--child", method, folder],
                    capture_output=True, text=True,
                )
                if out.returncode:
                    raise SystemExit(f"{method} failed:\n{out.stderr}")
                results.setdefault(method, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    checksums = {m: r[0]["checksum"] for m, r in results.items() if "checksum" in r[0]}
    if len({round(c, 3) for c in checksums.values()}) != 1:
        raise SystemExit(f"the methods loaded different weights: {checksums}")

    def median(method: str, figure: str) -> float:
        return statistics.median(r[figure] for r in results[method])

    def medians(methods: str, figure: str) -> float:
        """The sum of the medians of methods joined by " + "."""
        return sum(median(m, figure) for m in methods.split(" + "))

    def spread(method: str, figure: str) -> str:
        values = [r[figure] for r in results[method]]
        return f"{min(values):.2f}-{max(values):.2f}"

    size = results["file-backed"][0]["model_bytes"]
    print(f"\nmodel: {size / 2**30:.2f} GiB fp32; medians (and ranges) of {args.repeats} runs, each in a fresh process")
    print(f"{'method':<26}{'peak':>7}{'private':>9}{'load s':>8}{'range':>11}{'+ 1st forward s':>17}{'range':>11}")
    for method in METHODS:
        private = f"{median(method, 'private') / size:.2f}x" if "private" in results[method][0] else "-"
        total = f"{median(method, 'with_forward'):.3f}" if "with_forward" in results[method][0] else "-"
        total_range = spread(method, "with_forward") if "with_forward" in results[method][0] else "-"
        print(
            f"{method:<26}{median(method, 'peak') / size:>6.2f}x{private:>9}{median(method, 'seconds'):>8.3f}"
            f"{spread(method, 'seconds'):>11}{total:>17}{total_range:>11}"
        )
    print("\nratios of medians:")
    ratios = [
        ("file-backed load + 1st forward / from_pretrained's", "file-backed", "from_pretrained", "with_forward"),
        ("file-backed load / from_pretrained's", "file-backed", "from_pretrained", "seconds"),
        ("forced copy load / floor (fresh buffer)", "forced copy", "floor, fresh buffer", "seconds"),
        ("in-place load / floor (fresh buffer)", "in place", "floor, fresh buffer", "seconds"),
        ("in-place load / floor (buffer in memory)", "in place", "floor, buffer in memory", "seconds"),
        ("in-place load, undoable=False / floor (buffer in memory)", "in place, undoable=False", "floor, buffer in memory", "seconds"),
        ("in-place load / both floors added (read + copy aside)", "in place", "floor, buffer in memory + floor, fresh buffer", "seconds"),
        ("forced copy load / the same with 1 reading thread", "forced copy", "forced copy, 1 thread", "seconds"),
        ("naive load / forced copy load", "naive", "forced copy", "seconds"),
    ]
    for label, ours, theirs, figure in ratios:
        print(f"  {label:<58}{median(ours, figure) / medians(theirs, figure):>6.2f}x")


if __name__ == "__main__":
    main()
