"""The ``torchsurgery`` command: inspect, trace and run real models.

Installed with the ``[cli]`` extra. Mistakes a user makes (a path that does not exist, a
glob that matches nothing, an output folder that is missing, a budget too small) are
reported as one ``error:`` line and a non-zero exit, never a traceback.
"""

import sys
from pathlib import Path
from typing import Annotated, Any

from torchsurgery.cli.errors import CliError

try:
    import click
    import typer
    from rich.console import Console
    from rich.table import Table
except ImportError:  # pragma: no cover - exercised only without the extra
    typer = None  # type: ignore[assignment]


MODEL_HELP = (
    "A transformers model directory, a .safetensors file (config.json beside it), "
    "tiny-gpt2 / tiny-llama / tiny-bert, or nothing for the bundled all-MiniLM-L6-v2."
)


def _require_cli() -> None:
    if typer is None:
        print("error: the torchsurgery command needs its extra: pip install 'torchsurgery[cli]'", file=sys.stderr)
        raise SystemExit(2)


def _console() -> Any:
    return Console(stderr=False, highlight=False)


def _build() -> Any:
    app = typer.Typer(
        name="torchsurgery",
        help="Live, reversible surgery on PyTorch models: inspect a model, trace its activations, run it offloaded.",
        add_completion=False,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
    )

    @app.command()
    def inspect(
        model: Annotated[str | None, typer.Argument(help=MODEL_HELP, show_default=False)] = None,
        depth: Annotated[int | None, typer.Option(help="Show modules down to this depth.")] = None,
        filter: Annotated[str | None, typer.Option("--filter", help="Only modules whose name matches this glob.")] = None,
    ) -> None:
        """Show the module tree: type, parameters, bytes, dtype, device and any surgery."""
        from torchsurgery.cli import models
        from torchsurgery.cli.inspect import module_rows

        loaded = models.load(model)
        rows = module_rows(loaded.model, depth, filter)
        table = Table(title=f"{loaded.name}: {type(loaded.model).__name__}", title_justify="left")
        for column, justify in (("module", "left"), ("type", "left"), ("params", "right"), ("bytes", "right"),
                                ("dtype", "left"), ("device", "left"), ("surgery", "left")):
            table.add_column(column, justify=justify)  # type: ignore[arg-type]
        for row in rows:
            indent = "  " * row["level"]
            table.add_row(f"{indent}{row['name']}", row["type"], f"{row['params']:,}", row["bytes"],
                          row["dtype"], row["device"], row["surgery"])
        _console().print(table)

    @app.command()
    def trace(
        model: Annotated[str | None, typer.Argument(help=MODEL_HELP, show_default=False)] = None,
        hook: Annotated[list[str], typer.Option("--hook", help="Module name or glob to capture (repeatable).")] = [],  # noqa: B006
        text: Annotated[list[str], typer.Option("--text", help="An input text (repeatable).")] = [],  # noqa: B006
        input_file: Annotated[Path | None, typer.Option("--input-file", help="A file with one input text per line.")] = None,
        out: Annotated[Path, typer.Option("--out", help="Where to write the captures (.safetensors).")] = Path("trace.safetensors"),
        batch_size: Annotated[int, typer.Option(min=1, help="Inputs per forward.")] = 8,
        max_length: Annotated[int, typer.Option(min=1, help="Tokens per input (padded/truncated).")] = 64,
        plot: Annotated[Path | None, typer.Option("--plot", help="Also draw per-layer statistics to this PNG.")] = None,
    ) -> None:
        """Run the model over inputs and write every captured activation to a safetensors file."""
        from torchsurgery.cli import models
        from torchsurgery.cli import trace as tracing

        if not hook:
            raise CliError("give at least one --hook NAME_OR_GLOB (e.g. --hook 'encoder.layer.*')")
        texts = tracing.read_texts(list(text), input_file)
        tracing.check_output(out, ".safetensors", "--out")
        if plot is not None:
            tracing.check_output(plot, ".png", "--plot")
        loaded = models.load(model)
        console = _console()
        err = Console(stderr=True)
        if err.is_terminal:
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

                shapes, stats, dtypes, seconds = tracing.trace(loaded, hook, texts, out, batch_size, max_length, advance)
        else:
            shapes, stats, dtypes, seconds = tracing.trace(loaded, hook, texts, out, batch_size, max_length)
        table = Table(title=f"{len(texts)} inputs through {loaded.name} in {seconds:.2f} s "
                      f"({len(texts) / max(seconds, 1e-9):.1f} texts/s) -> {out}", title_justify="left")
        for column in ("module", "shape", "dtype", "mean", "std", "token norm"):
            table.add_column(column, justify="left" if column in ("module", "shape", "dtype") else "right")
        for key, s in stats.items():
            table.add_row(key, str(shapes[key]), dtypes[key], f"{s['mean']:+.4f}", f"{s['std']:.4f}", f"{s['norm']:.3f}")
        console.print(table)
        if plot is not None:
            from torchsurgery.cli.plot import plot_stats

            plot_stats(stats, plot, f"{loaded.name}: activation statistics over {len(texts)} inputs")
            console.print(f"plot: {plot}")

    @app.command()
    def run(
        model: Annotated[str | None, typer.Argument(help=MODEL_HELP, show_default=False)] = None,
        offload: Annotated[bool, typer.Option("--offload", help="Also run with the offload engine.")] = False,
        budget: Annotated[str | None, typer.Option(help="Device bytes the weights may take, e.g. 64MB.")] = None,
        storage_dtype: Annotated[str | None, typer.Option(help="Store weights in bf16, fp16 or fp8.")] = None,
        text: Annotated[str, typer.Option(help="The input text.")] = "Surgery on a live model.",
    ) -> None:
        """Run the model, plainly and (with --offload) offloaded; compare output, memory and time."""
        from torchsurgery.cli import models
        from torchsurgery.cli.errors import parse_size
        from torchsurgery.cli.run import compare, parse_dtype

        size = parse_size(budget) if budget is not None else None
        dtype = parse_dtype(storage_dtype) if storage_dtype is not None else None
        loaded = models.load(model)
        r = compare(loaded, text, offload or size is not None or dtype is not None, size, dtype)
        table = Table(title=f"{loaded.name}: output {r['shape']}, norm {r['norm']:.4f}", title_justify="left")
        for column in ("run", "weights", "peak device weights", "time", "vs plain", "max |diff|"):
            table.add_column(column, justify="left" if column == "run" else "right")
        mib = 2**20
        table.add_row("plain", f"{r['plain_bytes'] / mib:.1f} MiB", f"{r['plain_bytes'] / mib:.1f} MiB",
                      f"{r['plain_seconds'] * 1e3:.1f} ms", "1.00x", "-")
        if "offload_seconds" in r:
            table.add_row(
                f"offload ({r['streamed']} streamed, {r['resident']} resident groups)",
                f"{r['offload_bytes'] / mib:.1f} MiB", f"{r['peak_device_bytes'] / mib:.1f} MiB",
                f"{r['offload_seconds'] * 1e3:.1f} ms", f"{r['offload_seconds'] / r['plain_seconds']:.2f}x",
                f"{r['max_abs_diff']:.2e}",
            )
        _console().print(table)

    return app


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``torchsurgery`` command."""
    _require_cli()
    app = _build()
    try:
        app(args=argv, prog_name="torchsurgery", standalone_mode=False)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except click.exceptions.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    except click.ClickException as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None
    except click.exceptions.Abort:
        print("error: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
