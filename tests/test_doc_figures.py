"""Every measured figure quoted outside the benchmark pages is one those pages give.

Speeds, times and ratios (``0.53x``, ``14-17 ms``, ``20.5 GB/s``) are measured by the
scripts in ``benchmarks/`` and written, with the command and the host, in
``docs/benchmarks.md`` and ``docs/hardware.md``. The README, the other docs pages and the
package's docstrings and comments may quote them, but only as those pages give them: a
figure found nowhere there is stale or unmeasured, and fails here. Dimensions written with a
spaced ``x`` (``4 x 512``) are not figures.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLES = [ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "hardware.md"]
FIGURE = re.compile(
    r"(?<![\w.\-])(\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?)"  # a number or a range
    r"(?:x(?![\w(])|\s?(?:ms|µs|us|GB/s|GiB/s)(?!\w))"  # a ratio, a time or a bandwidth
)


def _figures(text: str) -> list[str]:
    text = text.replace("–", "-").replace("\u2009", " ")
    return [m.group(0).replace(" ", "") for m in FIGURE.finditer(text)]


def _quoting() -> list[Path]:
    docs = [p for p in sorted((ROOT / "docs").glob("*.md")) if p not in TABLES]
    return [ROOT / "README.md", *docs, *sorted((ROOT / "src").rglob("*.py"))]


MEASURED = {f for page in TABLES for f in _figures(page.read_text(encoding="utf-8"))}


@pytest.mark.parametrize("path", _quoting(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_quoted_figures_are_the_benchmark_pages_own(path: Path) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    stray = [(n, f) for n, line in enumerate(lines, 1) for f in _figures(line) if f not in MEASURED]
    assert stray == [], (
        f"{path.name}: figures that docs/benchmarks.md and docs/hardware.md do not give: {stray}"
    )


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("bf16 0.53x the fp32 step, 14-17 ms", ["0.53x", "14-17ms"]),
        ("0.87–1.14x bf16's time at 20.5 GB/s", ["0.87-1.14x", "20.5GB/s"]),
        ("4 x 512 x 5120, 300 x up to 20, fp8x4, 2x4", []),
        ("a 3 KiB prefetch, 2 threads, 5 us a call", ["5us"]),
    ],
)
def test_what_counts_as_a_figure(text: str, found: list[str]) -> None:
    assert _figures(text) == found
