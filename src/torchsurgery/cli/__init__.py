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
JSON_HELP = "Print one JSON document instead of a table."
DEVICE_HELP = "Where to compute: cpu, or an accelerator PyTorch reports (cuda, cuda:1, mps, xpu...)."
DTYPE_HELP = "Compute dtype: fp32, bf16 or fp16 (default: the model's own)."
STORAGE_DTYPE_HELP = "Store weights in bf16, fp16 or fp8 and cast them group by group (implies --offload)."
BUDGET_HELP = "Bytes the weights may keep resident where they compute, e.g. 64MB (implies --offload)."
GROUPS_HELP = "What moves together: blocks, leaves, or module names/globs separated by commas (implies --offload)."
PREFETCH_HELP = "Groups brought in ahead of the one running (implies --offload; default 1)."
STORAGE_HELP = (
    "Leave the weights in MODEL's safetensors file(s) and read each group from there when it runs, "
    "so a model larger than memory can be traced (implies --offload)."
)


def _require_cli() -> None:
    if typer is None:
        print("error: the torchsurgery command needs its extra: pip install 'torchsurgery[cli]'", file=sys.stderr)
        raise SystemExit(2)


def _build() -> Any:
    """The command with its three subcommands; each command's module is imported only when it runs."""
    app = typer.Typer(
        name="torchsurgery",
        help="Live, reversible surgery on PyTorch models: inspect a model, trace its activations, run it offloaded.",
        add_completion=False,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )
    for add in (_add_inspect, _add_trace, _add_run):
        add(app)
    return app


def _add_inspect(app: Any) -> None:
    @app.command()
    def inspect(
        model: Annotated[str | None, typer.Argument(help=MODEL_HELP, show_default=False)] = None,
        depth: Annotated[int | None, typer.Option(help="Show modules down to this depth.")] = None,
        filter: Annotated[str | None, typer.Option("--filter", help="Only modules whose name matches this glob.")] = None,
        json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
    ) -> None:
        """Show the module tree: type, parameters, bytes, dtype, where its tensors are, and any surgery."""
        from torchsurgery.cli import inspect as inspecting

        inspecting.command(model, depth, filter, json)


def _add_trace(app: Any) -> None:
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
        device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
        dtype: Annotated[str | None, typer.Option(help=DTYPE_HELP, show_default=False)] = None,
        offload: Annotated[bool, typer.Option("--offload", help="Run with the offload engine.")] = False,
        storage: Annotated[bool, typer.Option("--storage", help=STORAGE_HELP)] = False,
        storage_dtype: Annotated[str | None, typer.Option(help=STORAGE_DTYPE_HELP, show_default=False)] = None,
        budget: Annotated[str | None, typer.Option(help=BUDGET_HELP, show_default=False)] = None,
        groups: Annotated[str | None, typer.Option(help=GROUPS_HELP, show_default=False)] = None,
        prefetch: Annotated[int | None, typer.Option(help=PREFETCH_HELP, show_default=False)] = None,
        json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
    ) -> None:
        """Run the model over inputs and write every captured activation to a safetensors file."""
        from torchsurgery.cli import trace as tracing

        tracing.command(tracing.TraceRequest(
            model, list(hook), list(text), input_file, out, batch_size, max_length, plot, device, dtype,
            offload, storage, storage_dtype, budget, groups, prefetch, json,
        ))


def _add_run(app: Any) -> None:
    @app.command()
    def run(
        model: Annotated[str | None, typer.Argument(help=MODEL_HELP, show_default=False)] = None,
        device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
        dtype: Annotated[str | None, typer.Option(help=DTYPE_HELP, show_default=False)] = None,
        offload: Annotated[bool, typer.Option("--offload", help="Also run with the offload engine.")] = False,
        storage_dtype: Annotated[str | None, typer.Option(help=STORAGE_DTYPE_HELP, show_default=False)] = None,
        budget: Annotated[str | None, typer.Option(help=BUDGET_HELP, show_default=False)] = None,
        groups: Annotated[str | None, typer.Option(help=GROUPS_HELP, show_default=False)] = None,
        prefetch: Annotated[int | None, typer.Option(help=PREFETCH_HELP, show_default=False)] = None,
        text: Annotated[str, typer.Option(help="The input text.")] = "Surgery on a live model.",
        json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
    ) -> None:
        """Run the model plainly and (with --offload) offloaded; compare output, memory and time."""
        from torchsurgery.cli import run as running

        running.command(model, device, dtype, offload, storage_dtype, budget, groups, prefetch, text, json)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``torchsurgery`` command."""
    _require_cli()
    app = _build()
    try:
        # without standalone mode, typer returns the exit code of an Exit instead of raising it
        # (Ctrl-C becomes Exit(130)): it is ours to pass on
        code = app(args=argv, prog_name="torchsurgery", standalone_mode=False)
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
        code = _INTERRUPTED
    if code == _INTERRUPTED:
        print("error: interrupted", file=sys.stderr)
    if isinstance(code, int) and code:
        raise SystemExit(code)


_INTERRUPTED = 130  # the shell's code for a process ended by SIGINT
