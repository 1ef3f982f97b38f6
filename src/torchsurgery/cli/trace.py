"""``torchsurgery trace``: capture activations over many inputs into one safetensors file."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchsurgery._names import select
from torchsurgery._validate import dtype_name
from torchsurgery.cli import models
from torchsurgery.cli.errors import CliError
from torchsurgery.cli.figures import figures
from torchsurgery.cli.models import LoadedModel
from torchsurgery.cli.options import OffloadOptions, parse_common
from torchsurgery.cli.output import Table, emit, human_bytes
from torchsurgery.cli.store import StreamingWriter
from torchsurgery.errors import NoMatchError
from torchsurgery.flex import FlexModel, HookFunction


@dataclass
class TraceRequest:
    """What ``torchsurgery trace`` was asked for, as given on the command line."""

    model: str | None
    hooks: list[str]
    texts: list[str]
    input_file: Path | None
    out: Path
    batch_size: int
    max_length: int
    plot: Path | None
    device: str
    dtype: str | None
    offload: bool
    storage: bool
    storage_dtype: str | None
    budget: str | None
    groups: str | None
    prefetch: int | None
    as_json: bool


def command(request: TraceRequest) -> None:
    """``torchsurgery trace``: check everything before loading, trace, write the file (and plot), print."""
    r = request
    where, compute, options = parse_common(
        r.device, r.dtype, r.offload, r.storage_dtype, r.budget, r.groups, r.prefetch, r.storage
    )
    for value, option in ((r.batch_size, "--batch-size"), (r.max_length, "--max-length")):
        if value < 1:
            raise CliError(f"{option}: {value} is below 1; give a positive number")
    if not r.hooks:
        raise CliError("give at least one --hook NAME_OR_GLOB (e.g. --hook 'encoder.layer.*')")
    texts = read_texts(r.texts, r.input_file)
    check_output(r.out, ".safetensors", "--out")
    if r.plot is not None:
        check_output(r.plot, ".png", "--plot")
    loaded = models.load(r.model, weights=not r.storage)
    compute = compute or next(loaded.model.parameters()).dtype
    shapes, stats, dtypes, seconds, offloaded = _trace_maybe_offloaded(loaded, r, texts, where, compute, options)
    document = {
        "command": "trace", "model": loaded.name, "class": type(loaded.model).__name__, "device": str(where),
        "dtype": dtype_name(compute), "out": str(r.out),
        "plot": str(r.plot) if r.plot is not None else None, "inputs": len(texts), "seconds": seconds,
        "texts_per_second": len(texts) / max(seconds, 1e-9), "offload": offloaded,
        "captures": [{"module": key, "shape": shapes[key], "dtype": dtypes[key], "mean": s["mean"],
                      "std": s["std"], "token_norm": s["norm"]} for key, s in stats.items()],
    }
    if r.plot is not None:
        from torchsurgery.cli.plot import plot_stats

        plot_stats(stats, r.plot, f"{loaded.name}: activation statistics over {len(texts)} inputs")
    emit(table(document), document, r.as_json)


def _trace_maybe_offloaded(
    loaded: LoadedModel,
    request: TraceRequest,
    texts: list[str],
    where: torch.device,
    compute: torch.dtype,
    options: OffloadOptions,
) -> tuple[dict[str, list[int]], dict[str, dict[str, float]], dict[str, str], float, dict[str, Any] | None]:
    """:func:`trace_with_progress`, with the model offloaded as ``options`` ask or moved to ``where``.

    Returns:
        What :func:`trace` returns, and the ``offload`` figures of the ``--json`` document (or ``None``).
    """
    handle = None
    if options.enabled:
        checkpoint = str(loaded.checkpoint) if loaded.checkpoint is not None else None
        handle = options.apply(loaded.model, where, compute, checkpoint)
    else:
        loaded.model.to(device=where, dtype=compute)
    try:
        shapes, stats, dtypes, seconds = trace_with_progress(
            loaded, request.hooks, texts, request.out, request.batch_size, request.max_length, where
        )
        offloaded = None
        if handle is not None:
            engine = handle.stats()
            offloaded = {
                **options.describe(),
                "streamed_from": str(loaded.checkpoint) if request.storage else "memory",
                **figures(loaded.model, where, compute, engine, engine.bytes_moved),
                "resident_groups": engine.resident_groups, "streamed_groups": engine.streamed_groups,
            }
    finally:
        if handle is not None and not request.storage:
            # (with --storage, undoing would read every weight back into memory; the process ends instead)
            handle.remove()
    return shapes, stats, dtypes, seconds, offloaded


def trace_with_progress(
    loaded: LoadedModel, hooks: list[str], texts: list[str], out: Path, batch_size: int, max_length: int,
    device: torch.device,
) -> tuple[dict[str, list[int]], dict[str, dict[str, float]], dict[str, str], float]:
    """:func:`trace` with a progress bar and throughput on stderr when it is a terminal."""
    from rich.console import Console

    err = Console(stderr=True)
    if not err.is_terminal:
        return trace(loaded, hooks, texts, out, batch_size, max_length, device)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("tracing"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
               TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("trace", total=len(texts), rate="")

        def advance(n: int) -> None:
            elapsed = progress.tasks[0].elapsed or 1e-9
            done = progress.tasks[0].completed + n
            progress.update(task, advance=n, rate=f"{done / elapsed:.1f} texts/s")

        return trace(loaded, hooks, texts, out, batch_size, max_length, device, advance)


@dataclass
class _Running:
    """Masked running statistics of one captured module."""

    count: int = 0
    total: float = 0.0
    squares: float = 0.0
    norms: float = 0.0
    tokens: int = 0
    shape: list[int] = field(default_factory=list)
    dtype: str = ""

    def add(self, tensor: torch.Tensor, mask: torch.Tensor) -> None:
        t = tensor.detach().float()
        if t.dim() >= 3 and tuple(t.shape[:2]) == tuple(mask.shape):
            keep = mask.bool()
            rows = t[keep]  # [tokens, hidden...]: padding excluded
            self.norms += float(rows.flatten(1).norm(dim=1).sum())
            self.tokens += rows.shape[0]
            t = rows
        else:
            self.norms += float(t.norm())
            self.tokens += 1
        self.count += t.numel()
        self.total += float(t.sum())
        self.squares += float((t * t).sum())

    def summary(self) -> dict[str, float]:
        mean = self.total / max(1, self.count)
        var = max(0.0, self.squares / max(1, self.count) - mean * mean)
        return {"mean": mean, "std": var**0.5, "norm": self.norms / max(1, self.tokens)}


def read_texts(texts: list[str], input_file: Path | None) -> list[str]:
    """The inputs: ``--text`` values, or the non-empty lines of ``--input-file``."""
    if input_file is not None:
        try:
            lines = input_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"cannot read the input file {str(input_file)!r}: {exc.__class__.__name__}") from exc
        texts = texts + [line.strip() for line in lines if line.strip()]
    if not texts:
        raise CliError("no inputs: give --text TEXT (repeatable) or --input-file FILE")
    return texts


def check_output(path: Path, suffix: str, option: str) -> None:
    """Refuse an output whose folder does not exist, or of the wrong kind."""
    if path.suffix != suffix:
        raise CliError(f"{option} must end in {suffix}, got {str(path)!r}")
    if not path.parent.is_dir():
        raise CliError(f"{option}: the folder {str(path.parent)!r} does not exist; create it first")


def trace(
    loaded: LoadedModel,
    hooks: list[str],
    texts: list[str],
    out: Path,
    batch_size: int,
    max_length: int,
    device: torch.device,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[dict[str, list[int]], dict[str, dict[str, float]], dict[str, str], float]:
    """Run ``loaded`` over ``texts`` on ``device`` with capture hooks; stream captures to ``out``.

    Returns:
        Each key's stored shape, each module's statistics and dtype, and the seconds taken.
    """
    captures: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(loaded.model, captures)
    try:
        _register(flex, hooks)
        writer = StreamingWriter(out, _metadata(loaded, hooks, texts, max_length))
        stats: dict[str, _Running] = {}
        start = time.perf_counter()
        try:
            for first in range(0, len(texts), batch_size):
                batch = texts[first : first + batch_size]
                inputs = {k: v.to(device) for k, v in loaded.encode(batch, max_length).items()}
                with torch.no_grad():
                    flex(**inputs)
                for key, values in captures.items():
                    tensor = values[-1]
                    writer.append(key, tensor)
                    running = stats.setdefault(key, _Running())
                    running.add(tensor, inputs["attention_mask"])
                    running.dtype = dtype_name(tensor.dtype)
                captures.clear()
                writer.append("attention_mask", inputs["attention_mask"])
                if on_batch is not None:
                    on_batch(len(batch))
        except BaseException:
            writer.abort()
            raise
        shapes = writer.close()
        seconds = time.perf_counter() - start
    finally:
        flex.restore()
    return shapes, {k: v.summary() for k, v in stats.items()}, {k: v.dtype for k, v in stats.items()}, seconds


def _register(flex: FlexModel, hooks: list[str]) -> None:
    """A capture hook on ``flex`` for each ``--hook`` pattern; a pattern that fits nothing is the user's error."""
    for pattern in hooks:
        try:
            flex.register_forward_hook(HookFunction(pattern))
        except NoMatchError as exc:
            raise CliError(exc.render("--hook")) from exc
        except ValueError as exc:
            raise CliError(f"--hook {pattern}: {exc}") from exc


def _metadata(loaded: LoadedModel, hooks: list[str], texts: list[str], max_length: int) -> dict[str, str]:
    """What the captures file says of itself: the model, the modules, the layout and the inputs (or their hashes)."""
    short = sum(len(t) for t in texts) <= 65536
    return {
        "model": loaded.name,
        "modules": json.dumps(sorted({name for pattern in hooks for name, _ in select(loaded.model, pattern)})),
        "max_length": str(max_length),
        "layout": "one row per input, in order, padded to max_length; see attention_mask",
        ("texts" if short else "text_sha256"): json.dumps(
            texts if short else [hashlib.sha256(t.encode()).hexdigest() for t in texts]
        ),
    }


def table(document: dict[str, Any]) -> Table:
    """``trace``'s summary: one row per captured module."""
    seconds = document["seconds"]
    title = (f"{document['inputs']} inputs through {document['model']} on {document['device']}, {document['dtype']} "
             f"in {seconds:.2f} s ({document['texts_per_second']:.1f} texts/s) -> {document['out']}")
    out = Table(title, [("module", "left"), ("shape", "left"), ("dtype", "left"), ("mean", "right"),
                        ("std", "right"), ("token norm", "right")])
    for c in document["captures"]:
        out.add(c["module"], str(c["shape"]), c["dtype"], f"{c['mean']:+.4f}", f"{c['std']:.4f}", f"{c['token_norm']:.3f}")
    offloaded = document["offload"]
    if offloaded is not None:
        out.notes.append(
            f"offload: {human_bytes(offloaded['resident_bytes'])} resident, {human_bytes(offloaded['streamed_bytes'])} "
            f"streamed from {offloaded['streamed_from']}, {human_bytes(offloaded['moved_bytes'])} moved in all, "
            f"{len(offloaded['resident_groups']) + len(offloaded['streamed_groups'])} groups ({offloaded['groups']})"
        )
    if document["plot"] is not None:
        out.notes.append(f"plot: {document['plot']}")
    return out
