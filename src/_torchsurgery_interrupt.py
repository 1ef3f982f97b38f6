"""Ctrl-C for the ``torchsurgery`` command, handled from its first instruction.

Importing anything of the ``torchsurgery`` package imports torch first, for seconds, and an
interrupt then would end in a traceback or, landing while torch's C++ libraries initialise,
in an abort. This module imports the standard library alone: the command's entry point
(:mod:`_torchsurgery_command`) installs its handler before it imports the command, and
``python -m torchsurgery`` gets the same handler from the package's ``__init__``, before it
imports torch (:func:`install_if_run_as_module`). The command's modules register here what
they are writing (:func:`removed_on_interrupt`); nothing here imports them.

From then on Ctrl-C (SIGINT) ends the process at once, wherever it lands (an import, the
model's load, a forward, a destructor): it removes the files being written
(:func:`removed_on_interrupt`), prints ``error: interrupted`` on stderr and exits with 130
through ``os._exit``. No exception unwinds through torch's C++ code or a ``__del__`` (where
it would be printed and ignored), and no C++ static destructor runs on a half-initialised
library. What runs before the handler is installed is the interpreter's own start-up.

Example:
    >>> import os, tempfile
    >>> import _torchsurgery_interrupt as interrupt
    >>> spill = tempfile.mkdtemp()
    >>> with interrupt.removed_on_interrupt(spill):
    ...     spill in interrupt.partial_paths()
    True
    >>> spill in interrupt.partial_paths(), os.path.isdir(spill)  # still there: not interrupted
    (False, True)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import NoReturn

INTERRUPTED = 130
"""The exit code of an interrupted command (the shell's code for a process ended by SIGINT)."""

_partial: list[str] = []  # files and folders being written, removed on an interrupt


@contextlib.contextmanager
def removed_on_interrupt(path: str | os.PathLike[str]) -> Iterator[None]:
    """Within the block, an interrupt of the command removes ``path`` (a file or a folder)
    before the process ends; write a result there and rename it into place when complete."""
    entry = os.fspath(path)
    _partial.append(entry)
    try:
        yield
    finally:
        _partial.remove(entry)


def partial_paths() -> list[str]:
    """What an interrupt now would remove, oldest first."""
    return list(_partial)


def _interrupted(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the clean-up short
    for path in reversed(_partial):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
    # straight to the file descriptor: sys.stderr may be the very object the signal interrupted
    os.write(2, b"error: interrupted\n")
    os._exit(INTERRUPTED)


def install() -> None:
    """From now on, Ctrl-C ends this process as the command does (see the module's docstring)."""
    signal.signal(signal.SIGINT, _interrupted)


def _module_run() -> str | None:
    """The module ``python -m`` was given on this process's command line, or None."""
    args = getattr(sys, "orig_argv", [])[1:]
    for index, arg in enumerate(args):
        if arg == "-m":
            return args[index + 1] if index + 1 < len(args) else None
        if arg.startswith("-m"):
            return arg[2:]
    return None


def install_if_run_as_module() -> None:
    """:func:`install` when this process is ``python -m torchsurgery`` and is locating it
    (``sys.argv[0]`` is then ``"-m"``): the package's ``__init__`` calls this first."""
    if sys.argv[:1] == ["-m"] and _module_run() == "torchsurgery":
        install()


def run_to_the_end(command: Callable[[], object]) -> NoReturn:
    """Run ``command`` and end the process with its exit status, skipping the interpreter's shutdown.

    At shutdown Python puts the default SIGINT handler back, and tearing torch down takes a
    while: a Ctrl-C landing then would kill the process by the signal after its work was
    done. Output is flushed first; results were renamed into place by the command.
    """
    try:
        command()
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code or 0)
