"""The command itself: help, usage errors and mistakes as one line, in real subprocesses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def test_help_on_every_command(cli: Callable[..., Any]) -> None:
    for command in ([], ["inspect"], ["trace"], ["run"]):
        result = cli(*command, "--help")
        assert result.returncode == 0 and "Usage" in result.stdout


def test_a_bare_command_prints_its_help_and_succeeds(cli: Callable[..., Any]) -> None:
    result = cli()
    assert result.returncode == 0 and "Usage" in result.stdout and "inspect" in result.stdout


def test_usage_errors_are_one_line_pointing_at_help(cli: Callable[..., Any]) -> None:
    result = cli("run", "--no-such-option")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["error: No such option: --no-such-option (see torchsurgery run --help)"]
    unknown = cli("frobnicate")
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: No such command 'frobnicate'")


def test_mistakes_are_one_error_line_with_exit_2(cli: Callable[..., Any]) -> None:
    result = cli("inspect", "/no/such/model")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: no such model: '/no/such/model'; give a model directory, a .safetensors file, "
        "or one of tiny-gpt2, tiny-llama, tiny-bert"
    ]
