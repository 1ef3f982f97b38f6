"""The first forward after ``offload``: does it wait for the native kernel's build?

Each case runs in a fresh process: a Llama-shaped ``transformers`` model (hidden 1024, 8
layers, 32k vocabulary, random weights), offloaded with bf16 or fp8 storage and fp32
compute, then one-token forwards (a decoding step's shape, where the native kernel
matters). The first forward right after ``offload`` is timed, then the process waits for
the kernel and times steady-state forwards (median of ``--steps``). Cases:

* ``installed``    ``TORCH_EXTENSIONS_DIR`` points at an empty directory, and the library
  that the install built (``setup.py``, next to the package's modules) is loaded: a fresh
  machine where pip installed torchsurgery from source with a C++ compiler;
* ``empty cache``  no library from the install either (as where the install found no
  compiler): the kernel is built while the first forwards run;
* ``cached``       the build from the case before is found in the cache and loaded.

The fp32 model's own first and steady forwards are timed in the same processes: a first
call of any model pays for allocations and lazy set-up, which is not the kernel's doing.

Run: .venv/bin/python benchmarks/first_forward.py [--repeats 3] [--threads 2] [--dtypes bf16,fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}

CHILD = r"""
import json, statistics, sys, time
import torch
import transformers
import torchsurgery
from torchsurgery.compact import narrow_matvec as module
from torchsurgery.compact.narrow_matvec import narrow_matvec

dtype, threads, steps = getattr(torch, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if sys.argv[4] != "installed":
    module._INSTALLED_DIR = None  # as if the install had built nothing
torch.set_num_threads(threads)
torch.manual_seed(0)
config = transformers.LlamaConfig(
    hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
    num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False,
)
model = transformers.LlamaForCausalLM(config).eval()
plain = transformers.LlamaForCausalLM(config).eval()
ids = torch.tensor([[7]])

def timed(m):
    start = time.perf_counter()
    with torch.no_grad():
        m(ids, logits_to_keep=1)
    return time.perf_counter() - start

plain_first = timed(plain)
plain_steady = statistics.median(timed(plain) for _ in range(steps))
start = time.perf_counter()
torchsurgery.offload(model, storage_dtype=dtype, dtype=torch.float32)
offload_s = time.perf_counter() - start
first = timed(model)
pending = narrow_matvec.pending
start = time.perf_counter()
ready = narrow_matvec.wait(dtype=dtype)  # this dtype's library only
waited = time.perf_counter() - start
timed(model)
steady = statistics.median(timed(model) for _ in range(steps))
print(json.dumps(dict(first=first, steady=steady, plain_first=plain_first, plain_steady=plain_steady,
                      offload_s=offload_s, pending=pending, ready=ready, waited=waited)))
"""


def run_case(dtype: str, threads: int, steps: int, extensions: str, case: str) -> dict[str, float]:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=extensions, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", CHILD, dtype, str(threads), str(steps), case], env=env,
                         capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--dtypes", default="bf16,fp8")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(__file__))
    from _machine import cpu_name

    print(f"machine: {cpu_name()}, {args.threads} threads; Llama-shaped model, one-token forwards")
    print(f"{'storage':<8}{'case':<13}{'first / steady':>16}{'[range]':>14}{'fp32 model first / steady':>28}"
          f"{'pending at first':>18}{'build s':>9}")
    for name in args.dtypes.split(","):
        rows: dict[str, list[dict[str, float]]] = {"installed": [], "empty cache": [], "cached": []}
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as extensions:
                for case in rows:
                    rows[case].append(run_case(DTYPES[name], args.threads, args.steps, extensions, case))
        for case, results in rows.items():
            ratios = [r["first"] / r["steady"] for r in results]
            plain = statistics.median(r["plain_first"] / r["plain_steady"] for r in results)
            pending = sum(bool(r["pending"]) for r in results)
            build = statistics.median(r["offload_s"] + r["first"] + r["waited"] for r in results)
            print(f"{name:<8}{case:<13}{statistics.median(ratios):>15.2f}x"
                  f"{f'[{min(ratios):.2f}-{max(ratios):.2f}]':>14}{plain:>27.2f}x"
                  f"{f'{pending}/{len(results)}':>18}{build:>9.1f}")


if __name__ == "__main__":
    main()
