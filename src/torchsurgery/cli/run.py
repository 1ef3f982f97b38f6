"""``torchsurgery run``: run a model plainly and with the offload engine, side by side.

Sizes are reported in the words of :mod:`torchsurgery.cli.figures`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

import torchsurgery
from torchsurgery._validate import dtype_name
from torchsurgery.cli import models
from torchsurgery.cli.errors import CliError
from torchsurgery.cli.figures import figures
from torchsurgery.cli.options import OffloadOptions, parse_common
from torchsurgery.cli.output import Table, emit, human_bytes


def command(
    model: str | None,
    device: str,
    dtype: str | None,
    offload: bool,
    storage_dtype: str | None,
    budget: str | None,
    groups: str | None,
    prefetch: int | None,
    text: str,
    as_json: bool,
) -> None:
    """``torchsurgery run``: check the options, load MODEL, run it both ways, print the figures."""
    where, compute, options = parse_common(device, dtype, offload, storage_dtype, budget, groups, prefetch)
    loaded = models.load(model)
    result = compare(loaded, text, where, compute, options)
    emit(table(result), result, as_json)


def _main_tensor(output: Any) -> torch.Tensor:
    for attr in ("last_hidden_state", "logits"):
        if hasattr(output, attr):
            return getattr(output, attr)
    if isinstance(output, torch.Tensor):
        return output
    return output[0]


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _timed(
    loaded: models.LoadedModel,
    inputs: dict[str, torch.Tensor],
    device: torch.device,
    handle: torchsurgery.OffloadHandle | None = None,
    repeats: int = 3,
) -> tuple[torch.Tensor, float, int]:
    """The output, the median seconds of ``repeats`` forwards, and the bytes the last one moved."""
    times, out, moved = [], None, 0
    with torch.no_grad():
        for _ in range(repeats):
            before = handle.stats().bytes_moved if handle is not None else 0
            _sync(device)
            start = time.perf_counter()
            out = _main_tensor(loaded.model(**inputs))
            _sync(device)
            times.append(time.perf_counter() - start)
            moved = handle.stats().bytes_moved - before if handle is not None else 0
    assert out is not None
    return out, statistics.median(times), moved


def compare(
    loaded: models.LoadedModel,
    text: str,
    device: torch.device,
    dtype: torch.dtype | None,
    options: OffloadOptions,
) -> dict[str, Any]:
    """Run plainly on ``device``, then (with ``options.enabled``) offloaded; figures for both.

    Returns:
        The ``--json`` document of ``run`` (see the command's documentation).
    """
    model = loaded.model
    inputs = {k: v.to(device) for k, v in loaded.encode([text], max_length=64).items()}
    compute = dtype or next(model.parameters()).dtype
    result: dict[str, Any] = {
        "command": "run", "model": loaded.name, "class": type(model).__name__, "device": str(device),
        "dtype": dtype_name(compute), "text": text, "output": None, "plain": None, "offload": None,
    }
    if dtype is not None:
        model.to(dtype=dtype)
    plain = None
    try:
        model.to(device)
        plain, seconds, _ = _timed(loaded, inputs, device)
        result["plain"] = {"seconds": seconds, **figures(model, device, compute)}
        result["output"] = {"shape": list(plain.shape), "norm": float(plain.float().norm())}
    except torch.OutOfMemoryError:
        if not options.enabled:
            raise CliError(f"{loaded.name} does not fit on {device}; add --offload (and --budget)") from None
        result["plain"] = {"error": f"does not fit on {device}"}
    finally:
        model.to("cpu")
        if device.type != "cpu":
            torch.accelerator.empty_cache()
    if not options.enabled:
        return result
    handle = options.apply(model, device, dtype)
    try:
        out, seconds, moved = _timed(loaded, inputs, device, handle)
        stats = handle.stats()
        result["offload"] = {
            **options.describe(),
            "seconds": seconds,
            **figures(model, device, compute, stats, moved),
            "resident_groups": stats.resident_groups,
            "streamed_groups": stats.streamed_groups,
            "vs_plain": seconds / result["plain"]["seconds"] if plain is not None else None,
            "max_abs_diff": float((out.float() - plain.float()).abs().max()) if plain is not None else None,
            "hint": stats.hint,
        }
        if result["output"] is None:
            result["output"] = {"shape": list(out.shape), "norm": float(out.float().norm())}
    finally:
        handle.remove()
    return result


def table(result: dict[str, Any]) -> Table:
    """``run``'s figures as a table: one row per run, sizes in bytes of weights."""
    device = torch.device(result["device"])
    output = result["output"]
    title = f"{result['model']} ({result['class']}) on {device}, {result['dtype']}"
    if output is not None:
        title += f": output {output['shape']}, norm {output['norm']:.4f}"
    columns = [("run", "left"), ("time", "right"), ("vs plain", "right"), ("max |diff|", "right"),
               ("held", "right"), ("resident", "right"), ("streamed", "right"), ("moved/forward", "right")]
    accelerator = device.type != "cpu"
    if accelerator:
        columns.append((f"peak on {device}", "right"))
    out = Table(title, columns)
    for name in ("plain", "offload"):
        run = result[name]
        if run is None:
            continue
        if "error" in run:
            out.add(name, run["error"], *[""] * (len(columns) - 2))
            continue
        cells = [
            name, f"{run['seconds'] * 1e3:.1f} ms",
            "1.00x" if name == "plain" else (f"{run['vs_plain']:.2f}x" if run["vs_plain"] is not None else "-"),
            "-" if name == "plain" or run["max_abs_diff"] is None else f"{run['max_abs_diff']:.2e}",
            human_bytes(run["held_bytes"]), human_bytes(run["resident_bytes"]), human_bytes(run["streamed_bytes"]),
            human_bytes(run["moved_bytes"]),
        ]
        if accelerator:
            cells.append(human_bytes(run["peak_bytes"]))
        out.add(*cells)
    offloaded = result["offload"]
    if offloaded is not None:
        out.notes.append(groups_note(offloaded))
    return out


def groups_note(offloaded: dict[str, Any]) -> str:
    """One line on how the engine split the model: how many groups, how far ahead it brings them in."""
    planned = len(offloaded["resident_groups"]) + len(offloaded["streamed_groups"])
    return f"offload: {planned} groups ({offloaded['groups']}), prefetch {offloaded['prefetch']}"
