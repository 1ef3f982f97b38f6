"""The README is what a newcomer reads first: its code runs, its commands and links exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torchsurgery

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
SNIPPETS = re.findall(r"^```python\n(.*?)^```", README, flags=re.DOTALL | re.MULTILINE)
SHELL = "\n".join(re.findall(r"^```bash\n(.*?)^```", README, flags=re.DOTALL | re.MULTILINE))
LINKS = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)


def test_the_readme_stays_short() -> None:
    assert len(README) < 6000, "the reference belongs in docs/; the README is the first page"


def test_there_are_snippets() -> None:
    assert len(SNIPPETS) >= 3


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs(index: int, tmp_path: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", SNIPPETS[index]], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_make_targets_named_exist() -> None:
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE))
    named = set(re.findall(r"`make (\w+)`|^make (\w+)", README + "\n" + SHELL, flags=re.MULTILINE))
    named_targets = {a or b for a, b in named}
    assert {"demo", "test"} <= named_targets
    assert named_targets <= targets, named_targets - targets


def test_commands_named_exist(tmp_path: Path) -> None:
    named = set(re.findall(r"^torchsurgery (\w+)", SHELL, flags=re.MULTILINE))
    result = subprocess.run(
        [sys.executable, "-m", "torchsurgery", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    commands = result.stdout[result.stdout.index("Commands") :]
    listed = set(re.findall(r"^\W*(\w+)\s", commands, flags=re.MULTILINE))
    assert named and named <= listed, (named - listed, result.stdout)


def test_public_names_mentioned_exist() -> None:
    mentioned = set(re.findall(r"`(?:torchsurgery\.)?([A-Za-z_]\w*)`", README)) - {"torchsurgery"}
    assert mentioned and mentioned <= set(torchsurgery.__all__), mentioned - set(torchsurgery.__all__)


@pytest.mark.parametrize("link", LINKS)
def test_links_resolve(link: str) -> None:
    assert not link.startswith("/"), "links are relative, so they work on GitHub and in a clone"
    if re.match(r"https?://", link):
        return
    assert (ROOT / link).exists(), link
