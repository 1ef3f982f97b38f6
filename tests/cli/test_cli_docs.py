"""docs/cli.md: its --json examples have exactly the fields the commands print."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

DOC = Path(__file__).parents[2] / "docs" / "cli.md"


def _examples() -> dict[str, Any]:
    blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)]
    return {b["command"]: b for b in blocks}


def _shape(value: Any) -> Any:
    """The fields of a document, recursively (lists by their first item)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value and isinstance(value[0], dict) else "list"
    return "value"


def test_the_doc_has_an_example_per_command() -> None:
    assert set(_examples()) == {"inspect", "run", "trace"}


def test_examples_match_real_output(call: Callable[..., Any], tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         vocab_size=256, max_position_embeddings=64)).save_pretrained(tmp_path / "bert")
    examples = _examples()
    outputs = {
        "inspect": call("inspect", "tiny-gpt2", "--depth", "1", "--json"),
        "run": call("run", "tiny-llama", "--storage-dtype", "bf16", "--json"),
        "trace": call("trace", str(tmp_path / "bert"), "--hook", "encoder.layer.*", "--text", "hello",
                      "--out", str(tmp_path / "t.safetensors"), "--storage", "--json"),
    }
    for command, result in outputs.items():
        assert result.returncode == 0, result.stderr
        assert _shape(json.loads(result.stdout)) == _shape(examples[command]), command


def _readme_sessions() -> list[tuple[str, str]]:
    """The ``$ command`` / output pairs of docs/cli.md."""
    sessions = []
    for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL):
        for chunk in block.split("$ ")[1:]:
            command, _, output = chunk.partition("\n")
            sessions.append((command, output))
    return sessions


def test_readme_pipe_and_json_examples_are_true(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    sessions = _readme_sessions()
    assert len(sessions) == 2
    (pipe, pipe_output), (as_json, json_output) = sessions
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2] / "src"))
    program = f"{sys.executable} -m torchsurgery"
    done = subprocess.run(pipe.replace("torchsurgery", program, 1), shell=True, capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert done.stdout == pipe_output
    command = as_json.split(" | jq ")[0].replace("torchsurgery", program, 1)
    done = subprocess.run(command, shell=True, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    shown = json.loads(json_output)
    offloaded = json.loads(done.stdout)["offload"]
    assert {k: offloaded[k] for k in shown} == shown
