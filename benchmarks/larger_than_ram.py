"""A model larger than the machine's memory, streamed from its checkpoint, against the disk's floor.

The script writes a model of ``--scale`` times the machine's memory (``MemTotal``; default
1.2x) as sharded safetensors (random MLP blocks, alternately fp32 and bf16, computed in fp32),
one shard at a time so the model is never whole in memory. It builds the model with
``torchsurgery.skeleton()`` and streams it from the shards with ``offload(storage=...,
host_budget=...)`` (default 4 GiB), then times:

* the cold forward (the page cache emptied of the shards first), which reads the whole model;
* the warm forward, which reads what the host tier does not keep;

each against the disk's floor measured in the same run: ``dd bs=64M`` of the same shards, with
and without ``iflag=direct`` (the cache emptied first with ``posix_fadvise(DONTNEED)``), and
4 direct reads of 32 MiB in flight (as the offload reads, with nothing to compute): the
fastest of the three. ``ratio`` is the forward's time over (bytes it read / the floor's speed).
Bytes read come from ``stats().storage_bytes_read``; ``rss+`` is the process's peak resident
size during the offload's forwards over its size before it.

Peers, on the same files in the same process: accelerate's disk offload (``disk_offload``
with an offload folder whose index points into the safetensors shards, as transformers
writes it for ``device_map`` with ``"disk"``), and diffusers' group offloading with
``offload_to_disk_path`` (it writes its own copy of every group from a model held in memory,
so it runs only where the model fits in memory and its copy on the disk).

Run: ``python benchmarks/larger_than_ram.py`` (``--scale 0.1`` for a quick check). The files
go to a temporary folder under ``--dir`` and are deleted at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import torchsurgery  # noqa: E402
from _machine import describe  # noqa: E402

GiB = 1 << 30


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size


def block_dtype(i: int) -> torch.dtype:
    return torch.bfloat16 if i % 2 else torch.float32


def block_bytes(d: int, i: int) -> int:
    return (8 * d * d + 5 * d) * block_dtype(i).itemsize


def write_model(folder: Path, d: int, n: int, shard_bytes: int) -> Path:
    """The model's blocks as shards of about ``shard_bytes``, one shard in memory at a time."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(set(weight_map.values())):05d}.safetensors"
        save_file(shard, folder / name)
        weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    generator = torch.Generator().manual_seed(0)
    for i in range(n):
        dtype = block_dtype(i)
        for part, shape in (("up", (4 * d, d)), ("down", (d, 4 * d))):
            fan_in = shape[1]
            weight = torch.randn(shape, generator=generator).mul_(fan_in**-0.5).to(dtype)
            shard[f"blocks.{i}.{part}.weight"] = weight
            shard[f"blocks.{i}.{part}.bias"] = torch.randn(shape[0], generator=generator).mul_(0.01).to(dtype)
        size += block_bytes(d, i)
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*.safetensors"))


def evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (written back first)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd_speed(files: list[Path], direct: bool) -> float:
    """Bytes per second of ``dd bs=64M`` reading ``files`` one after another, from a cold cache."""
    evict(files)
    start = time.perf_counter()
    for path in files:
        flags = ["iflag=direct"] if direct else []
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M", *flags], check=True, capture_output=True)
    return sum(p.stat().st_size for p in files) / (time.perf_counter() - start)


def parallel_direct_speed(files: list[Path], threads: int = 4, piece: int = 32 << 20) -> float:
    """Bytes per second of reading ``files`` in order with ``threads`` direct reads of ``piece``
    bytes in flight (as the offload's reader keeps them, with nothing to compute), from a cold cache."""
    import concurrent.futures
    import mmap

    evict(files)
    buffers = [mmap.mmap(-1, piece) for _ in range(threads)]  # page-aligned, reused
    jobs = [(path, offset) for path in files for offset in range(0, path.stat().st_size, piece)]

    def read(job: tuple[Path, int], buffer: mmap.mmap) -> None:
        path, offset = job
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            os.preadv(fd, [buffer], offset)
        finally:
            os.close(fd)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for i in range(0, len(jobs), threads):
            list(pool.map(read, jobs[i : i + threads], buffers))
    return sum(p.stat().st_size for p in files) / (time.perf_counter() - start)


def timed_forwards(model: nn.Module, x: torch.Tensor, files: list[Path], warm: int) -> tuple[list[float], torch.Tensor]:
    """Seconds of a cold forward (the cache emptied of ``files`` first), then of ``warm`` more."""
    times = []
    out = x
    with torch.no_grad():
        evict(files)
        for _ in range(1 + warm):
            start = time.perf_counter()
            out = model(x)
            times.append(time.perf_counter() - start)
    return times, out


def run_torchsurgery(index: Path, d: int, n: int, x: torch.Tensor, host_budget: int, warm: int) -> dict[str, Any]:
    with torchsurgery.skeleton():
        model = Net(d, n)
    gc.collect()
    before = status("VmRSS")
    reset_peak_rss()
    handle = torchsurgery.offload(model, storage=index, host_budget=host_budget, dtype=torch.float32)
    files = shards(index.parent)
    reads: list[int] = []
    times: list[float] = []
    with torch.no_grad():
        evict(files)
        for _ in range(1 + warm):
            start = time.perf_counter()
            out = model(x)
            times.append(time.perf_counter() - start)
            reads.append(handle.stats().storage_bytes_read)
    stats = handle.stats()
    growth = status("VmHWM") - before
    tiers = [g.tier for g in handle.plan.groups]
    handle.remove()
    return {"times": times, "reads": reads, "rss": growth, "out": out, "peak_host": stats.peak_host_bytes,
            "host_groups": tiers.count("host"), "largest": max(block_bytes(d, i) for i in range(n))}


def run_accelerate(index: Path, d: int, n: int, x: torch.Tensor, warm: int, folder: Path) -> dict[str, Any]:
    """accelerate's disk offload, its offload index pointing into the safetensors shards."""
    from accelerate import disk_offload
    from accelerate.hooks import remove_hook_from_submodules

    weight_map = json.loads(index.read_text())["weight_map"]
    with torchsurgery.skeleton():
        model = Net(d, n)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    entries = {k: {"safetensors_file": str(index.parent / f), "weight_name": k, "dtype": "float32", "shape": shapes[k]}
               for k, f in weight_map.items()}
    offload_dir = folder / "accelerate"
    offload_dir.mkdir()
    (offload_dir / "index.json").write_text(json.dumps(entries))
    before = status("VmRSS")
    reset_peak_rss()
    disk_offload(model, offload_dir, execution_device=torch.device("cpu"))
    times, out = timed_forwards(model, x, shards(index.parent), warm)
    growth = status("VmHWM") - before
    remove_hook_from_submodules(model)
    return {"times": times, "rss": growth, "out": out}


def run_diffusers(index: Path, d: int, n: int, x: torch.Tensor, warm: int, folder: Path) -> dict[str, Any] | str:
    """diffusers' group offloading to disk: needs the model in memory, and a copy of it on the disk."""
    model_bytes = sum(p.stat().st_size for p in shards(index.parent))
    if model_bytes > meminfo("MemAvailable") // 2:
        return "needs the model in memory to write its group files: it does not fit"
    if model_bytes > shutil.disk_usage(folder).free // 2:
        return "needs a second copy of the model on the disk: no room"
    from diffusers.hooks import apply_group_offloading
    from safetensors.torch import load_file

    model = Net(d, n)
    for path in shards(index.parent):
        model.load_state_dict({k: v.float() for k, v in load_file(path).items()}, strict=False)
    before = status("VmRSS")
    reset_peak_rss()
    apply_group_offloading(model, onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, offload_to_disk_path=str(folder / "diffusers"))
    files = sorted((folder / "diffusers").glob("*.safetensors"))
    times, out = timed_forwards(model, x, files, warm)
    return {"times": times, "rss": status("VmHWM") - before, "out": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.2, help="model size over the machine's memory (MemTotal)")
    parser.add_argument("--host-budget-gib", type=float, default=4.0)
    parser.add_argument("--width", type=int, default=3072, help="hidden size d of the blocks (Linear d->4d->d)")
    parser.add_argument("--shard-gib", type=float, default=2.0)
    parser.add_argument("--warm", type=int, default=2, help="warm forwards after the cold one")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--peers", default="accelerate,diffusers")
    parser.add_argument("--keep", type=Path, default=None,
                        help="write the model to this folder once and keep it (later runs with the same size reuse it)")
    args = parser.parse_args()
    d = args.width
    target = int(args.scale * meminfo("MemTotal"))
    per_pair = block_bytes(d, 0) + block_bytes(d, 1)
    n = max(2, round(2 * target / per_pair))
    model_bytes = sum(block_bytes(d, i) for i in range(n))
    free = shutil.disk_usage(args.dir).free
    if model_bytes > free - 2 * GiB:
        raise SystemExit(f"the model takes {model_bytes / GiB:.1f} GiB and {args.dir} has {free / GiB:.1f} GiB free")
    print(f"# {describe(torch.get_num_threads())}; memory {meminfo('MemTotal') / GiB:.1f} GiB, "
          f"model {model_bytes / GiB:.1f} GiB ({n} blocks of d={d}, fp32 and bf16 alternately), "
          f"host_budget {args.host_budget_gib} GiB", flush=True)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="larger-than-ram-", dir=args.dir))
    try:
        index = folder / "model.safetensors.index.json"
        written = folder / "written.json"
        if not (index.exists() and written.exists() and json.loads(written.read_text()) == [d, n, args.shard_gib]):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            start = time.perf_counter()
            index = write_model(folder, d, n, int(args.shard_gib * GiB))
            written.write_text(json.dumps([d, n, args.shard_gib]))
            print(f"# written in {time.perf_counter() - start:.0f} s", flush=True)
        files = shards(folder)
        buffered, direct, parallel = dd_speed(files, False), dd_speed(files, True), parallel_direct_speed(files)
        floor = max(buffered, direct, parallel)
        print(f"# disk floor: dd bs=64M {buffered / 1e9:.2f} GB/s buffered, {direct / 1e9:.2f} GB/s direct; "
              f"4 direct reads of 32 MiB in flight {parallel / 1e9:.2f} GB/s", flush=True)
        x = torch.randn(1, d, generator=torch.Generator().manual_seed(1))
        ours = run_torchsurgery(index, d, n, x, int(args.host_budget_gib * GiB), args.warm)
        rows = [("torchsurgery", ours["times"], ours["reads"], ours["rss"])]
        print(f"# torchsurgery: host tier {ours['host_groups']} groups, peak_host_bytes {ours['peak_host'] / GiB:.2f} GiB; "
              f"rss+ target <= 2 x {ours['largest'] / GiB:.2f} + {args.host_budget_gib} + 0.75 GiB", flush=True)
        peers = [p for p in args.peers.split(",") if p]
        for peer in peers:
            run = run_accelerate if peer == "accelerate" else run_diffusers
            result = run(index, d, n, x, args.warm, folder)
            if isinstance(result, str):
                print(f"# {peer}: not run: {result}")
                continue
            same = torch.equal(result["out"], ours["out"])
            print(f"# {peer}: output {'equal' if same else 'differs'} (bit for bit)", flush=True)
            rows.append((peer, result["times"], [model_bytes] * len(result["times"]), result["rss"]))
        print()
        print("| variant | forward | seconds | bytes read (GiB) | floor (s) | ratio | rss+ (GiB) |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for name, times, reads, rss in rows:
            for label, t, r in [("cold", times[0], reads[0])] + [
                ("warm (median)", statistics.median(times[1:]), statistics.median(reads[1:]))
            ] * (len(times) > 1):
                print(f"| {name} | {label} | {t:.2f} | {r / GiB:.2f} | {r / floor:.2f} | {t / (r / floor) if r else float('nan'):.2f} "
                      f"| {rss / GiB:.2f} |")
        print(f"\nfloor speed {floor / 1e9:.2f} GB/s; command: python benchmarks/larger_than_ram.py {' '.join(sys.argv[1:])}")
    finally:
        shutil.rmtree(folder / "accelerate", ignore_errors=True)
        shutil.rmtree(folder / "diffusers", ignore_errors=True)
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
