"""The documentation's Python examples run as written, page by page.

Every fenced ``python`` block in ``docs/`` is executed: the blocks of one page in order,
in one fresh module, in a temporary working directory. A block that must not run (it
needs ``torchrun`` or a GPU) is preceded by a line ``<!-- not run: REASON -->``; the
reason is required, and other fences (``bash``, ``json``, ``text``) are never run.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

DOCS = Path(__file__).parent.parent / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
NOT_RUN = re.compile(r"<!-- not run: (\S.*?) -->\n\Z")


def blocks(page: Path) -> tuple[list[str], list[str]]:
    """The page's runnable blocks, and the reasons given for those that are not run."""
    text = page.read_text(encoding="utf-8")
    run, skipped = [], []
    for match in FENCE.finditer(text):
        marker = NOT_RUN.search(text, 0, match.start())
        if marker:
            skipped.append(marker.group(1))
        else:
            run.append(match.group(1))
    return run, skipped


PAGES = sorted(page for page in DOCS.rglob("*.md") if blocks(page)[0])


def test_pages_have_examples() -> None:
    names = {page.stem for page in PAGES}
    assert {"index", "patching", "tensors", "offload", "flex", "undo"} <= names, names


def test_blocks_not_run_are_few() -> None:
    skipped = [reason for page in DOCS.rglob("*.md") for reason in blocks(page)[1]]
    ran = sum(len(blocks(page)[0]) for page in PAGES)
    assert len(skipped) <= max(2, ran // 5), skipped


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(DOCS)))
def test_page_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    # A module of its own, importable while the page runs, so that classes the page
    # defines pickle as they would in a script.
    module = types.ModuleType(f"docs_{page.stem}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for index, code in enumerate(blocks(page)[0]):
        exec(compile(code, f"{page.name} (python block {index + 1})", "exec"), module.__dict__)
