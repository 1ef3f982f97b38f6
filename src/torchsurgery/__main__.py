"""``python -m torchsurgery``: the same as the ``torchsurgery`` command."""

from torchsurgery.cli import main

if __name__ == "__main__":
    main()
