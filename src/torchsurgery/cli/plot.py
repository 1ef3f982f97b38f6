"""Per-layer activation statistics as a picture."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from _torchsurgery_interrupt import removed_on_interrupt


def plot_stats(stats: dict[str, dict[str, float]], path: Path, title: str) -> None:
    """Draw mean, standard deviation and mean token norm per hooked module.

    The picture is drawn to a file beside ``path`` and renamed to it when whole.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> out = Path(tempfile.mkdtemp()) / "s.png"
        >>> plot_stats({"a": {"mean": 0.1, "std": 1.0, "norm": 3.0}}, out, "demo")
        >>> out.read_bytes()[:4] == b"\\x89PNG"
        True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(stats)
    x = range(len(names))
    fig, axes = plt.subplots(3, 1, figsize=(max(6.0, 0.45 * len(names) + 2), 7.5), sharex=True)
    panels = (("norm", "mean token L2 norm", "#3b6ea8"), ("std", "standard deviation", "#c2703d"), ("mean", "mean", "#4f9a58"))
    for ax, (key, label, color) in zip(axes, panels, strict=True):
        values = [stats[n][key] for n in names]
        ax.plot(list(x), values, marker="o", color=color, linewidth=1.8)
        ax.fill_between(list(x), values, alpha=0.12, color=color)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xticks(list(x))
    axes[-1].set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    # a fresh name beside the target, opened as any file the user writes (mkstemp's would keep
    # mode 0600 through the rename, where the user's umask gives the other outputs 0644)
    drawing = str(path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.png")
    try:
        with removed_on_interrupt(drawing):
            fig.savefig(drawing, dpi=110, format="png")
            os.replace(drawing, path)
    finally:
        plt.close(fig)
        if os.path.exists(drawing):
            os.remove(drawing)
