"""The documentation's Python examples run as written, page by page.

Every fenced ``python`` block in ``docs/`` is executed: the blocks of one page in order,
in one fresh module, in a temporary working directory. A block that must not run (it
needs ``torchrun`` or a GPU) is preceded by a line ``<!-- not run: REASON -->``; the
reason is required, and other fences (``bash``, ``json``, ``text``) are never run.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
import types
from pathlib import Path

import pytest

import torchsurgery

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


def _documented() -> set[str]:
    """The objects the API reference pages render (their ``::: path`` lines).

    The package itself is left out: its page shows the package docstring, not its members.
    """
    text = "\n".join(page.read_text(encoding="utf-8") for page in (DOCS / "api").glob("*.md"))
    return set(re.findall(r"^::: ([\w.]+)", text, flags=re.MULTILINE)) - {"torchsurgery"}


_NAMES = {f"torchsurgery.{name}" for name in torchsurgery.__all__}


def test_every_public_name_is_in_the_api_reference() -> None:
    documented = _documented()
    missing = []
    for name in torchsurgery.__all__:
        obj = getattr(torchsurgery, name)
        exported = any(
            name in getattr(module, "__all__", ()) and getattr(module, name) is obj
            for module in map(importlib.import_module, (path for path in documented if path not in _NAMES))
        )
        if f"torchsurgery.{name}" not in documented and not exported:
            missing.append(name)
    assert not missing, f"add a '::: ...' line for these to a page under docs/api/: {missing}"


def test_every_public_module_is_in_the_api_reference() -> None:
    documented = _documented()
    public = [
        info.name
        for info in pkgutil.walk_packages(torchsurgery.__path__, prefix="torchsurgery.")
        if not any(part.startswith("_") for part in info.name.split("."))
        and not info.name.startswith("torchsurgery.cli")  # the command: docs/cli.md
    ]
    missing = [
        name
        for name in public
        if not any(name == path or name.startswith(path + ".") for path in documented)
        and getattr(importlib.import_module(name), "__all__", None) is not None
    ]
    assert not missing, f"add a '::: ...' line for these to a page under docs/api/: {missing}"
