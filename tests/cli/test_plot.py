"""Per-layer statistics drawn to a PNG."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torchsurgery.cli.plot import plot_stats

pytest.importorskip("matplotlib")
Image = pytest.importorskip("PIL.Image")


def _stats(count: int) -> dict[str, dict[str, float]]:
    return {f"layers.{i}": {"mean": 0.01 * i, "std": 1.0 + i, "norm": 3.0 * (i + 1)} for i in range(count)}


def test_plot_is_a_png_that_widens_with_the_modules(tmp_path: Path) -> None:
    few, many = tmp_path / "few.png", tmp_path / "many.png"
    plot_stats(_stats(3), few, "three")
    plot_stats(_stats(40), many, "forty")
    sizes = []
    for path in (few, many):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(path) as image:
            sizes.append(image.size)
    assert 400 <= sizes[0][0] < sizes[1][0] <= 4000  # one tick per module fits
    assert sizes[0][1] == sizes[1][1] and 300 <= sizes[0][1] <= 4000


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_the_picture_gets_the_mode_the_users_umask_gives_any_file(tmp_path: Path, umask: int) -> None:
    """As the safetensors beside it: a plain file written by the same process, the same mode."""
    import os
    import stat

    previous = os.umask(umask)
    try:
        plot_stats(_stats(2), tmp_path / "trace.png", "two")
        (tmp_path / "plain").write_bytes(b"")
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "trace.png").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "trace.png"]  # no drawing left behind


def test_trace_plot_option_draws_the_traced_modules(call: Callable[..., Any], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    plot = tmp_path / "stats.png"
    result = call("trace", "tiny-bert", "--hook", "encoder.layer.*", "--text", "one", "--text", "two",
                  "--out", str(tmp_path / "t.safetensors"), "--plot", str(plot), "--json")
    assert result.returncode == 0, result.stderr
    assert result.json()["plot"] == str(plot)
    with Image.open(plot) as image:
        assert image.format == "PNG" and image.size[0] >= 400
    assert plot.stat().st_size > 10_000
