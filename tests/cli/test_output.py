"""Output that survives pipes (plain text, --json) and rich tables on a real terminal (tmux)."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from torchsurgery.cli.output import Table, human_bytes

transformers = pytest.importorskip("transformers")

BOX = set("│┃─━┏┓┗┛┡┩└┘┌┐╇╋")


def _tiny_llama() -> object:
    from torchsurgery.cli.models import _tiny

    return _tiny("tiny-llama")


def test_plain_table_pads_and_never_cuts() -> None:
    long = "model.layers.17.self_attention.rotary_embedding.inverse_frequencies" * 3
    table = Table("title", [("module", "left"), ("bytes", "right"), ("note", "left")])
    table.add(long, "1.0 KiB", "")
    table.add("x", "12 B", "two words")
    table.notes.append("a note")
    out = io.StringIO()
    table.write_plain(out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "title" and lines[-1] == "a note"
    assert lines[2] == f"{long}  1.0 KiB"  # trailing empty cell: no trailing spaces
    assert lines[3] == "x".ljust(len(long)) + "     12 B  two words"
    assert lines[1].startswith("module".ljust(len(long)) + "    bytes  note")


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 5 * 2**20, 2**40)] == ["0 B", "1023 B", "1.0 KiB", "5.0 MiB",
                                                                            "1.0 TiB"]


def test_inspect_in_a_pipe_keeps_every_full_name_on_a_narrow_screen(cli: Callable[..., object]) -> None:
    # COLUMNS=40 would squeeze a drawn table to 40 characters; plain text ignores it
    result = cli("inspect", "tiny-llama", env={"COLUMNS": "40"})
    assert result.returncode == 0, result.stderr  # type: ignore[attr-defined]
    lines = result.stdout.splitlines()  # type: ignore[attr-defined]
    assert not BOX & set(result.stdout) and "…" not in result.stdout  # type: ignore[attr-defined]
    assert lines[0] == "tiny-llama: LlamaModel"
    assert lines[1].split() == ["module", "type", "params", "bytes", "dtype", "where", "surgery"]
    model = _tiny_llama()
    expected = [(name or "<root>", type(m).__name__) for name, m in model.named_modules()]  # type: ignore[attr-defined]
    assert [tuple(line.split()[:2]) for line in lines[2:]] == expected
    assert max(len(line) for line in lines) > 40


def test_inspect_json_is_the_model(call: Callable[..., object]) -> None:
    import json

    result = call("inspect", "tiny-llama", "--json")
    document = json.loads(result.stdout)  # type: ignore[attr-defined]
    model = _tiny_llama()
    assert document["command"] == "inspect" and document["model"] == "tiny-llama" and document["class"] == "LlamaModel"
    named = dict(model.named_modules())  # type: ignore[attr-defined]
    assert [m["name"] for m in document["modules"]] == list(named)
    for row in document["modules"]:
        module = named[row["name"]]
        tensors = list(module.parameters()) + list(module.buffers())
        assert row["params"] == sum(p.numel() for p in module.parameters())
        assert row["bytes"] == sum(t.numel() * t.element_size() for t in tensors)
        assert row["dtypes"] == sorted({str(t.dtype)[6:] for t in tensors})
        assert row["where"] == (["cpu"] if tensors else [])
        assert row["type"] == type(module).__name__ and row["surgery"] == []


def test_run_in_a_pipe_uses_words_that_hold_on_a_cpu(cli: Callable[..., object]) -> None:
    result = cli("run", "tiny-llama", "--storage-dtype", "bf16", env={"COLUMNS": "60"})
    assert result.returncode == 0, result.stderr  # type: ignore[attr-defined]
    lines = result.stdout.splitlines()  # type: ignore[attr-defined]
    assert lines[1].split() == ["run", "time", "vs", "plain", "max", "|diff|", "held", "resident", "streamed",
                                "moved/forward"]
    assert lines[2].startswith("plain ") and lines[3].startswith("offload ")  # one line per run
    assert lines[4] == "offload: 6 groups (blocks), prefetch 1"
    assert "device" not in result.stdout  # type: ignore[attr-defined]


# ---------------------------------------------------------------- a real terminal


@pytest.fixture
def tmux() -> Iterator[Callable[[str, int], str]]:
    """Run a command in a detached tmux window of a given width; return the screen's text."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    socket = f"torchsurgery-test-{uuid.uuid4().hex[:8]}"

    def screen(command: str, width: int) -> str:
        session = uuid.uuid4().hex[:8]
        subprocess.run(["tmux", "-L", socket, "new-session", "-d", "-s", session, "-x", str(width), "-y", "200",
                        f"{command}; echo __done__; sleep 600"], check=True, env={"PATH": "/usr/bin:/bin",
                                                                                    "TERM": "xterm-256color",
                                                                                    "HF_HUB_OFFLINE": "1",
                                                                                    "TRANSFORMERS_OFFLINE": "1"})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            text = subprocess.run(["tmux", "-L", socket, "capture-pane", "-p", "-t", session, "-S", "-", "-E", "-"],
                                  capture_output=True, text=True, check=True).stdout
            if "__done__" in text:
                return text
            time.sleep(0.5)
        raise AssertionError(f"the command did not finish in the terminal: {text[-2000:]}")

    yield screen
    subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)


def _command(*args: str) -> str:
    root = Path(__file__).parents[2]
    return f"cd {root} && PYTHONPATH=src {sys.executable} -m torchsurgery " + " ".join(args)


def test_inspect_on_a_terminal_draws_a_table_with_whole_names(tmux: Callable[[str, int], str]) -> None:
    text = tmux(_command("inspect", "tiny-llama"), 120)
    assert BOX & set(text), text
    model = _tiny_llama()
    rows = [line for line in text.splitlines() if line.startswith("│")]
    names = [line.strip("│ ").split()[0] for line in rows]
    expected = [name or "<root>" for name, _ in model.named_modules()]  # type: ignore[attr-defined]
    assert names == expected  # every name whole, one row each, in order
    # the tree shows as indentation on a terminal
    assert any(line.startswith("│" + " " * 9 + "layers.0.self_attn.q_proj ") for line in rows), text


def test_run_on_a_narrow_terminal_keeps_one_line_per_run(tmux: Callable[[str, int], str]) -> None:
    text = tmux(_command("run", "tiny-llama", "--storage-dtype", "bf16"), 80)
    assert BOX & set(text), text
    firsts = [line.strip("│ ").split(" ")[0] for line in text.splitlines() if line.startswith("│")]
    assert "plain" in firsts and "offload" in firsts, text
    assert max(len(line) for line in text.splitlines()) <= 80
