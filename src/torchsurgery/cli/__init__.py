"""The ``torchsurgery`` command: inspect, trace and run real models.

Installed with the ``[cli]`` extra. Mistakes a user makes (a path that does not exist, a
glob that matches nothing, an output folder that is missing, a budget too small, an option
value it does not take) are reported as one ``error:`` line on stderr naming the option and
what it accepts, with exit code 2 and nothing written; never a traceback. Results go to
stdout as described in :mod:`torchsurgery.cli.output`.
"""

import sys
from pathlib import Path
from typing import Annotated, Any

from torchsurgery.cli.errors import CliError

try:
    import typer
except ImportError:  # pragma: no cover - exercised only without the extra
    typer = None  # type: ignore[assignment]


def _usage_errors() -> tuple[type[Exception], ...]:
    """The exception classes of wrong command lines: typer's own (recent) or click's (older typer)."""
    try:
        from typer.exceptions import TyperException

        return (TyperException,)
    except ImportError:  # pragma: no cover - typer < 0.20 raises click's
        import click

        return (click.ClickException,)


MODEL_HELP = (
    "A transformers model directory, a .safetensors file (config.json beside it), "
    "tiny-gpt2 / tiny-llama / tiny-bert, or nothing for the bundled all-MiniLM-L6-v2."
)


def _require_cli() -> None:
    if typer is None:
        print("error: the torchsurgery command needs its extra: pip install 'torchsurgery[cli]'", file=sys.stderr)
        raise SystemExit(2)


def _build() -> Any:
    app = typer.Typer(
        name="torchsurgery",
        help="Live, reversible surgery on PyTorch models: inspect a model, trace its activations, run it offloaded.",
        add_completion=False,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )
    as_json = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a table.")]
    device_help = "Where to compute: cpu, or an accelerator PyTorch reports (cuda, cuda:1, mps, xpu...)."
    dtype_help = "Compute dtype: fp32, bf16 or fp16 (default: the model's own)."
    storage_dtype_help = "Store weights in bf16, fp16 or fp8 and cast them group by group (implies --offload)."
    budget_help = "Bytes the weights may keep resident where they compute, e.g. 64MB (implies --offload)."
    groups_help = ("What moves together: blocks, leaves, or module names/globs separated by commas "
                   "(implies --offload).")
    prefetch_help = "Groups brought in ahead of the one running (implies --offload; default 1)."

    @app.command()
    def inspect(
        model: Annotated[str | None, typer.Argument(help=MODEL_HELP, show_default=False)] = None,
        depth: Annotated[int | None, typer.Option(help="Show modules down to this depth.")] = None,
        filter: Annotated[str | None, typer.Option("--filter", help="Only modules whose name matches this glob.")] = None,
        json: as_json = False,
    ) -> None:
        """Show the module tree: type, parameters, bytes, dtype, where its tensors are, and any surgery."""
        from torchsurgery.cli import inspect as inspecting
        from torchsurgery.cli import models
        from torchsurgery.cli.output import emit

        if depth is not None and depth < 0:
            raise CliError(f"--depth: {depth} is below 0; give 0 for the model alone, 1 for its children...")
        loaded = models.load(model)
        rows = inspecting.module_rows(loaded.model, depth, filter)
        kind = type(loaded.model).__name__
        document = {"command": "inspect", "model": loaded.name, "class": kind,
                    "modules": [{k: v for k, v in row.items() if k != "level"} for row in rows]}
        emit(inspecting.table(f"{loaded.name}: {kind}", rows, indent=sys.stdout.isatty()), document, json)

    @app.command()
    def trace(
        model: Annotated[str | None, typer.Argument(help=MODEL_HELP, show_default=False)] = None,
        hook: Annotated[list[str], typer.Option("--hook", help="Module name or glob to capture (repeatable).")] = [],  # noqa: B006
        text: Annotated[list[str], typer.Option("--text", help="An input text (repeatable).")] = [],  # noqa: B006
        input_file: Annotated[Path | None, typer.Option("--input-file", help="A file with one input text per line.")] = None,
        out: Annotated[Path, typer.Option("--out", help="Where to write the captures (.safetensors).")] = Path("trace.safetensors"),
        batch_size: Annotated[int, typer.Option(help="Inputs per forward.")] = 8,
        max_length: Annotated[int, typer.Option(help="Tokens per input (padded/truncated).")] = 64,
        plot: Annotated[Path | None, typer.Option("--plot", help="Also draw per-layer statistics to this PNG.")] = None,
        device: Annotated[str, typer.Option(help=device_help)] = "cpu",
        dtype: Annotated[str | None, typer.Option(help=dtype_help, show_default=False)] = None,
        offload: Annotated[bool, typer.Option("--offload", help="Run with the offload engine.")] = False,
        storage: Annotated[bool, typer.Option(
            "--storage", help="Leave the weights in MODEL's safetensors file(s) and read each group from there when "
            "it runs, so a model larger than memory can be traced (implies --offload).")] = False,
        storage_dtype: Annotated[str | None, typer.Option(help=storage_dtype_help, show_default=False)] = None,
        budget: Annotated[str | None, typer.Option(help=budget_help, show_default=False)] = None,
        groups: Annotated[str | None, typer.Option(help=groups_help, show_default=False)] = None,
        prefetch: Annotated[int | None, typer.Option(help=prefetch_help, show_default=False)] = None,
        json: as_json = False,
    ) -> None:
        """Run the model over inputs and write every captured activation to a safetensors file."""
        from torchsurgery._validate import dtype_name
        from torchsurgery.cli import models
        from torchsurgery.cli import trace as tracing
        from torchsurgery.cli.figures import figures as weight_figures
        from torchsurgery.cli.options import (
            COMPUTE_DTYPES,
            OffloadOptions,
            parse_device,
            parse_dtype,
        )
        from torchsurgery.cli.output import emit

        where = parse_device(device)
        compute = parse_dtype(dtype, "--dtype", COMPUTE_DTYPES) if dtype is not None else None
        options = OffloadOptions.parse(offload, storage_dtype, budget, groups, prefetch, storage)
        for value, option in ((batch_size, "--batch-size"), (max_length, "--max-length")):
            if value < 1:
                raise CliError(f"{option}: {value} is below 1; give a positive number")
        if not hook:
            raise CliError("give at least one --hook NAME_OR_GLOB (e.g. --hook 'encoder.layer.*')")
        texts = tracing.read_texts(list(text), input_file)
        tracing.check_output(out, ".safetensors", "--out")
        if plot is not None:
            tracing.check_output(plot, ".png", "--plot")
        loaded = models.load(model, weights=not storage)
        compute = compute or next(loaded.model.parameters()).dtype
        handle = None
        if options.enabled:
            checkpoint = str(loaded.checkpoint) if loaded.checkpoint is not None else None
            handle = options.apply(loaded.model, where, compute, checkpoint)
        else:
            loaded.model.to(device=where, dtype=compute)
        try:
            shapes, stats, dtypes, seconds = _trace_with_progress(tracing, loaded, hook, texts, out, batch_size,
                                                                  max_length, where)
            offloaded = None
            if handle is not None:
                engine = handle.stats()
                offloaded = {
                    **options.describe(),
                    "streamed_from": str(loaded.checkpoint) if storage else "memory",
                    **weight_figures(loaded.model, where, compute, engine, engine.bytes_moved),
                    "resident_groups": engine.resident_groups, "streamed_groups": engine.streamed_groups,
                }
        finally:
            if handle is not None and not storage:
                # (with --storage, undoing would read every weight back into memory; the process ends instead)
                handle.remove()
        document = {
            "command": "trace", "model": loaded.name, "class": type(loaded.model).__name__, "device": str(where),
            "dtype": dtype_name(compute), "out": str(out),
            "plot": str(plot) if plot is not None else None, "inputs": len(texts), "seconds": seconds,
            "texts_per_second": len(texts) / max(seconds, 1e-9), "offload": offloaded,
            "captures": [{"module": key, "shape": shapes[key], "dtype": dtypes[key], "mean": s["mean"],
                          "std": s["std"], "token_norm": s["norm"]} for key, s in stats.items()],
        }
        if plot is not None:
            from torchsurgery.cli.plot import plot_stats

            plot_stats(stats, plot, f"{loaded.name}: activation statistics over {len(texts)} inputs")
        emit(tracing.table(document), document, json)

    @app.command()
    def run(
        model: Annotated[str | None, typer.Argument(help=MODEL_HELP, show_default=False)] = None,
        device: Annotated[str, typer.Option(help=device_help)] = "cpu",
        dtype: Annotated[str | None, typer.Option(help=dtype_help, show_default=False)] = None,
        offload: Annotated[bool, typer.Option("--offload", help="Also run with the offload engine.")] = False,
        storage_dtype: Annotated[str | None, typer.Option(help=storage_dtype_help, show_default=False)] = None,
        budget: Annotated[str | None, typer.Option(help=budget_help, show_default=False)] = None,
        groups: Annotated[str | None, typer.Option(help=groups_help, show_default=False)] = None,
        prefetch: Annotated[int | None, typer.Option(help=prefetch_help, show_default=False)] = None,
        text: Annotated[str, typer.Option(help="The input text.")] = "Surgery on a live model.",
        json: as_json = False,
    ) -> None:
        """Run the model plainly and (with --offload) offloaded; compare output, memory and time."""
        from torchsurgery.cli import models
        from torchsurgery.cli import run as running
        from torchsurgery.cli.options import (
            COMPUTE_DTYPES,
            OffloadOptions,
            parse_device,
            parse_dtype,
        )
        from torchsurgery.cli.output import emit

        where = parse_device(device)
        compute = parse_dtype(dtype, "--dtype", COMPUTE_DTYPES) if dtype is not None else None
        options = OffloadOptions.parse(offload, storage_dtype, budget, groups, prefetch)
        loaded = models.load(model)
        result = running.compare(loaded, text, where, compute, options)
        emit(running.table(result), result, json)

    return app


def _trace_with_progress(tracing: Any, loaded: Any, *args: Any) -> Any:
    """``tracing.trace`` with a progress bar and throughput on stderr when it is a terminal."""
    from rich.console import Console

    err = Console(stderr=True)
    if not err.is_terminal:
        return tracing.trace(loaded, *args)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    total = len(args[1])
    columns = (TextColumn("tracing"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
               TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("trace", total=total, rate="")

        def advance(n: int) -> None:
            elapsed = progress.tasks[0].elapsed or 1e-9
            done = progress.tasks[0].completed + n
            progress.update(task, advance=n, rate=f"{done / elapsed:.1f} texts/s")

        return tracing.trace(loaded, *args, advance)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``torchsurgery`` command."""
    _require_cli()
    app = _build()
    try:
        app(args=argv, prog_name="torchsurgery", standalone_mode=False)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    except _usage_errors() as exc:
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
            print(ctx.get_help())  # a bare command: its help, as --help would
            raise SystemExit(0) from None
        command = ctx.command_path if ctx is not None else "torchsurgery"
        message = " ".join(exc.format_message().split())  # type: ignore[attr-defined]
        print(f"error: {message} (see {command} --help)", file=sys.stderr)
        raise SystemExit(2) from None
    except (typer.Abort, KeyboardInterrupt):
        print("error: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
