"""The ``torchsurgery`` command's entry point: Ctrl-C is handled before anything else is imported.

The console script (``[project.scripts]``) is this module's :func:`main`, not
``torchsurgery.cli.main``: it imports the standard library alone, installs the interrupt
handler (:mod:`_torchsurgery_interrupt`), and only then imports the command, torch and all.
"""

from __future__ import annotations

from _torchsurgery_interrupt import install, run_to_the_end


def main() -> None:
    """The ``torchsurgery`` command: the handler first, then the command (torch and all)."""
    install()
    from torchsurgery.cli import main as command

    run_to_the_end(command)
