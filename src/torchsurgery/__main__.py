"""``python -m torchsurgery``: the same as the ``torchsurgery`` command."""

from _torchsurgery_interrupt import run_to_the_end
from torchsurgery.cli import main

if __name__ == "__main__":
    run_to_the_end(main)
