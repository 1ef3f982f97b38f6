"""Ctrl-C anywhere in the command's life, in a real process: while torch's libraries load,
while transformers imports and the model loads, during the run and while the output is
written. Every outcome must be one ``error: interrupted`` line on stderr, exit code 130 and
no partial file, or (for a signal that came after the work was done) the whole result.

A signal is sent only once torch's C++ libraries are being mapped into the process (read in
``/proc/PID/maps``): by then the command's handler is installed (it comes before torch's
import), and what ran before it was the interpreter's own start-up. The later points are
fractions of an uninterrupted run's length; where each lands varies from run to run, and the
checks hold wherever it lands (docs/cli.md has a sweep at 0.1 s steps, run by hand).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import torchsurgery

from .conftest import command_stderr

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")

SRC = Path(torchsurgery.__file__).resolve().parents[1]
TORCH_DIR = str(Path(torch.__file__).resolve().parent)
# the console script (pyproject's [project.scripts]) is this module's main, run as pip's wrapper runs it
ENTRIES = {
    "python -m torchsurgery": [sys.executable, "-m", "torchsurgery"],
    "torchsurgery": [sys.executable, "-c", "import sys; from _torchsurgery_command import main; sys.exit(main())"],
}
RUN = ["run", "tiny-gpt2"]
TRACE = ["trace", "tiny-gpt2", "--hook", "h.*", "--text", "a cat", "--text", "a mat", "--batch-size", "1",
         "--out", "out.safetensors"]


def _start(entry: str, args: list[str], folder: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.Popen([*ENTRIES[entry], *args], cwd=folder, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _torch_loading(process: subprocess.Popen[str]) -> None:
    """Return once torch's libraries are mapped into ``process`` (or it has ended)."""
    maps = Path(f"/proc/{process.pid}/maps")
    while process.poll() is None:
        try:
            if TORCH_DIR in maps.read_text():
                return
        except OSError:  # ended meanwhile
            return
        time.sleep(0.005)


def _interrupt(entry: str, args: list[str], folder: Path, after: float) -> tuple[int, str]:
    process = _start(entry, args, folder)
    _torch_loading(process)
    time.sleep(after)
    process.send_signal(signal.SIGINT)  # a no-op on a process that has ended
    _, err = process.communicate(timeout=300)
    return process.returncode, command_stderr(err)


def _check(code: int, err: str, folder: Path, whole: dict[str, list[int]] | None) -> None:
    """One interrupted line and exit 130, or done; never a partial file (``whole``: the output's
    shapes when the command writes one)."""
    assert (code, err) in ((130, "error: interrupted\n"), (0, "")), (code, err)
    names = sorted(p.name for p in folder.iterdir())
    if whole is None:
        assert names == []
    elif names:  # the output was renamed into place before the signal: it must be whole
        assert names == ["out.safetensors"]
        assert {k: list(v.shape) for k, v in load_file(folder / "out.safetensors").items()} == whole
    else:
        assert code == 130


def test_the_console_script_is_the_module_that_handles_ctrl_c_first() -> None:
    pyproject = (SRC.parent / "pyproject.toml").read_text()
    scripts = pyproject.split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    assert [line for line in scripts.splitlines() if line.startswith("torchsurgery")] == [
        'torchsurgery = "_torchsurgery_command:main"'
    ]


def test_an_interrupt_removes_what_was_being_written_and_nothing_else(tmp_path: Path) -> None:
    # the handler alone, in a process that interrupts itself while a folder and a file are
    # being written: both go, a finished file stays
    program = (
        "import os, signal, time, _torchsurgery_interrupt as command\n"
        "command.install()\n"
        "open('done', 'w').close()\n"
        "os.mkdir('spill'); open('spill/part', 'w').close(); open('drawing', 'w').close()\n"
        "with command.removed_on_interrupt('spill'), command.removed_on_interrupt('drawing'):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(60)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stderr) == (130, "error: interrupted\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done"]


def test_an_interrupt_at_any_point_is_one_line_exit_130_and_no_partial_file(tmp_path: Path) -> None:
    # start-up: torch's C++ libraries loading, then transformers, the model (run writes nothing)
    for index, after in enumerate((0.0, 0.3, 1.0)):
        folder = tmp_path / f"run-{index}"
        folder.mkdir()
        entry = list(ENTRIES)[index % 2]
        code, err = _interrupt(entry, RUN, folder, after)
        _check(code, err, folder, None)

    # an uninterrupted trace gives the output's shapes and the length of a whole run
    folder = tmp_path / "whole"
    folder.mkdir()
    process = _start("torchsurgery", TRACE, folder)
    _torch_loading(process)
    began = time.perf_counter()
    _, err = process.communicate(timeout=300)
    length = time.perf_counter() - began
    assert (process.returncode, command_stderr(err)) == (0, "")
    whole = {k: list(v.shape) for k, v in load_file(folder / "out.safetensors").items()}

    # late: the model's load, the forwards, the output being written
    for index, fraction in enumerate((0.8, 0.95)):
        folder = tmp_path / f"trace-{index}"
        folder.mkdir()
        code, err = _interrupt(list(ENTRIES)[index % 2], TRACE, folder, fraction * length)
        _check(code, err, folder, whole)
