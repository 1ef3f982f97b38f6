"""Two ways to call the command: a real subprocess whose stdout is a pipe, and in-process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# what importing torchao (a test dependency, which transformers imports when it is installed) logs
# with this torch: its native libraries, built for CUDA and another Python, fail to load, and torch
# warns of the enums it registers. Not the command's output: taken out of what the tests read.
_OTHER_LIBRARIES = re.compile(
    r"^(Failed to load \S*torchao\S*: .*|Skipping import of cpp extensions due to TORCHAO_\w+.*"
    r"|W\d{4} [\d:.]+ \d+ \S*torch/utils/_pytree\.py:\d+\] .*)\n", re.MULTILINE,
)


def command_stderr(text: str) -> str:
    """``text`` (a command's stderr) without the lines other libraries log when imported."""
    return _OTHER_LIBRARIES.sub("", text)


@dataclass
class Result:
    """What a call of the command left behind."""

    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        assert self.returncode == 0, self.stderr
        return json.loads(self.stdout)


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> Result:
    """``python -m torchsurgery ARGS`` in a subprocess; stdout and stderr are pipes."""
    environ = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env or {}))
    done = subprocess.run(
        [sys.executable, "-m", "torchsurgery", *args], capture_output=True, text=True, env=environ, cwd=cwd, timeout=300
    )
    return Result(done.returncode, done.stdout, command_stderr(done.stderr))


@pytest.fixture(scope="session")
def cli() -> Callable[..., Result]:
    return run_cli


@pytest.fixture
def call(capsys: pytest.CaptureFixture[str]) -> Callable[..., Result]:
    """The command in this process (faster; stdout is not a terminal here either)."""
    from torchsurgery.cli import main

    def invoke(*args: str) -> Result:
        capsys.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return invoke
