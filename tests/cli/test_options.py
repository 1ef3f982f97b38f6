"""The options run and trace share, and every mistake a user can make with them."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from torchsurgery.cli.errors import CliError
from torchsurgery.cli.options import (
    STORAGE_NAMES,
    OffloadOptions,
    devices,
    parse_device,
    parse_dtype,
)

pytest.importorskip("transformers")


def test_devices_are_cpu_and_what_the_accelerator_api_reports() -> None:
    expected = ["cpu"]
    if torch.accelerator.is_available():
        kind = torch.accelerator.current_accelerator()
        assert kind is not None
        expected += [kind.type] + [f"{kind.type}:{i}" for i in range(torch.accelerator.device_count())]
    assert devices() == expected
    for name in expected:
        assert parse_device(name) == torch.device(name)


def test_dtype_names() -> None:
    assert parse_dtype("BF16", "--dtype") is torch.bfloat16
    assert parse_dtype("float16", "--dtype") is torch.float16
    assert parse_dtype("fp8", "--storage-dtype") is torch.float8_e4m3fn
    with pytest.raises(CliError, match="--dtype: unknown dtype 'fp8'; use one of fp32, bf16, fp16"):
        parse_dtype("fp8", "--dtype", ("fp32", "bf16", "fp16"))


def test_storage_dtype_names_are_those_of_the_dtypes_offload_stores_weights_in() -> None:
    # the library's check decides: every name it accepts here, offload accepts, and the reverse
    storable = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}
    for name, dtype in [("fp64", torch.float64), ("float64", torch.float64), ("fp8_e5m2", torch.float8_e5m2),
                        ("float8_e5m2", torch.float8_e5m2), ("fp8", torch.float8_e4m3fn), ("BF16", torch.bfloat16)]:
        assert OffloadOptions.parse(False, name, None, None, None).storage_dtype is dtype
    assert {parse_dtype(n, "--storage-dtype") for n in STORAGE_NAMES} == storable
    for name in ("float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz", "int8", "complex64"):
        with pytest.raises(CliError, match=rf"--storage-dtype: unknown dtype '{name}'; use one of fp64, float64, fp32, "):
            OffloadOptions.parse(False, name, None, None, None)


def test_any_offload_option_turns_offloading_on() -> None:
    assert not OffloadOptions.parse(False, None, None, None, None).enabled
    assert OffloadOptions.parse(True, None, None, None, None).enabled
    for options in (
        OffloadOptions.parse(False, "bf16", None, None, None),
        OffloadOptions.parse(False, None, "1MB", None, None),
        OffloadOptions.parse(False, None, None, "leaves", None),
        OffloadOptions.parse(False, None, None, None, 0),
        OffloadOptions.parse(False, None, None, None, None, storage=True),
    ):
        assert options.enabled
    parsed = OffloadOptions.parse(False, "fp8", "2GiB", "leaves", 3)
    assert parsed.describe() == {"storage_dtype": "float8_e4m3fn", "budget_bytes": 2 * 2**30, "groups": "leaves",
                                 "prefetch": 3}


def test_groups_resolve_names_and_globs_in_model_order() -> None:
    from torch import nn

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert OffloadOptions.parse(False, None, None, "1.*,0", None).group_names(model) == ["1.0", "1.1", "0"]
    assert OffloadOptions.parse(False, None, None, "blocks", None).group_names(model) == "blocks"
    with pytest.raises(CliError, match=r"--groups: '2' matches no submodule"):
        OffloadOptions.parse(False, None, None, "2", None).group_names(model)


def _accepted(call: Callable[..., object], command: str) -> set[str]:
    result = call(command, "--help")
    assert result.returncode == 0  # type: ignore[attr-defined]
    return set(re.findall(r"--[a-z][a-z-]*", result.stdout))  # type: ignore[attr-defined]


MISTAKES = [
    (["run", "tiny-llama", "--device", "tpu9"], "--device: 'tpu9' is not a device of this machine; use one of cpu"),
    (["run", "tiny-llama", "--dtype", "fp8"], "--dtype: unknown dtype 'fp8'; use one of fp32, bf16, fp16"),
    (["run", "tiny-llama", "--storage-dtype", "int4"], "--storage-dtype: unknown dtype 'int4'"),
    (["run", "tiny-llama", "--budget", "lots"], "--budget: cannot read the size 'lots'"),
    (["run", "tiny-llama", "--budget", "1KB"], "--budget 1KB (1,000 bytes) cannot hold the largest group 'layers.0'"),
    (["run", "tiny-llama", "--budget", "1KB", "--groups", "leaves"], "cannot hold the largest group"),
    (["run", "tiny-llama", "--groups", "layrs.*"], "--groups: 'layrs.*' matches no submodule of the model; did you mean"),
    (["run", "tiny-llama", "--groups", "layers.0,layers.0.mlp"], "--groups: 'layers.0' and 'layers.0.mlp' overlap"),
    (["run", "tiny-llama", "--groups", ","], "--groups: empty"),
    (["run", "tiny-llama", "--prefetch", "-1"], "--prefetch: -1 is below 0"),
    (["run", "tiny-llama", "--prefetch", "two"], "Invalid value for '--prefetch'"),
    (["run", "tiny-llama", "--stream"], "No such option: --stream"),
    (["run", "/no/such/model"], "no such model: '/no/such/model'"),
    (["inspect", "tiny-gpt2", "--depth", "-1"], "--depth: -1 is below 0"),
    (["inspect", "tiny-gpt2", "--filter", "h.*.mpl"], "did you mean"),
    (["trace", "tiny-bert", "--hook", "encoder.layr.*", "--text", "x", "--out", "{tmp}/a.safetensors"], "did you mean"),
    (["trace", "tiny-bert", "--hook", "encoder.*", "--input-file", "{tmp}/missing.txt", "--out", "{tmp}/a.safetensors"],
     "cannot read the input file"),
    (["trace", "tiny-bert", "--hook", "encoder.*", "--text", "x", "--out", "{tmp}/nope/a.safetensors"], "does not exist"),
    (["trace", "tiny-bert", "--hook", "encoder.*", "--text", "x", "--out", "{tmp}/a.safetensors", "--batch-size", "0"],
     "--batch-size: 0 is below 1"),
    (["trace", "tiny-bert", "--hook", "encoder.*", "--text", "x", "--out", "{tmp}/a.safetensors", "--device", "cuda:7"],
     "--device: 'cuda:7' is not a device of this machine"),
    (["trace", "tiny-bert", "--hook", "encoder.*", "--text", "x", "--out", "{tmp}/a.safetensors", "--storage"],
     "--storage streams weights from a file, and tiny-bert has none"),
    (["trace", "{model}", "--hook", "encoder.*", "--text", "x", "--out", "{tmp}/a.safetensors", "--storage",
      "--storage-dtype", "bf16"], "--storage-dtype does not apply with --storage"),
    (["trace", "tiny-bert", "--hook", "encoder.*", "--text", "x", "--out", "{tmp}/a.safetensors", "--budget", "1KB"],
     "cannot hold the largest group"),
]


@pytest.mark.parametrize(("args", "message"), MISTAKES, ids=[" ".join(a[:4]) for a, _ in MISTAKES])
def test_each_mistake_is_one_error_line_exit_2_and_nothing_written(
    call: Callable[..., object], tmp_path: Path, args: list[str], message: str
) -> None:
    model = tmp_path.parent / f"{tmp_path.name}-model"  # outside the folder that must stay empty
    if "{model}" in args:
        from transformers import BertConfig, BertModel

        BertModel(BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             vocab_size=256, max_position_embeddings=64)).save_pretrained(model)
    accepted = _accepted(call, args[0])
    result = call(*[a.replace("{tmp}", str(tmp_path)).replace("{model}", str(model)) for a in args])
    assert result.returncode == 2, result.stderr  # type: ignore[attr-defined]
    lines = result.stderr.splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr  # type: ignore[attr-defined]
    assert message in lines[0]
    assert result.stdout == ""  # type: ignore[attr-defined]
    assert list(tmp_path.iterdir()) == []  # nothing written
    # it speaks the command's language: options it has, no Python keyword arguments or internals
    named = set(re.findall(r"--[a-z][a-z-]*", lines[0])) - set(args)  # (echoing the wrong option is fine)
    assert named <= accepted | {"--help"}, lines[0]
    assert not re.search(r"\b[a-z_]+=", lines[0]) and "torchsurgery." not in lines[0], lines[0]


def test_offload_refusals_are_written_from_their_fields_in_option_terms() -> None:
    from torchsurgery.errors import ArgumentValueError, BudgetError, NoMatchError, Setting

    cpu = torch.device("cpu")
    given = OffloadOptions.parse(False, None, "1KB", None, None)
    assert given.refusal(BudgetError("torchsurgery.offload", 1000, 5000, "layers.0"), cpu) == (
        "--budget 1KB (1,000 bytes) cannot hold the largest group 'layers.0' (5,000 bytes); "
        "give at least that, or smaller groups (--groups leaves)"
    )
    leaves = OffloadOptions.parse(False, None, "1KB", "leaves", None)
    assert leaves.refusal(BudgetError("torchsurgery.offload", 1000, 5000, "", finer=False), cpu).endswith(
        "the largest group '<root>' (5,000 bytes); give at least that"
    )
    # no --budget: the engine sized it from free memory, and says so
    assert OffloadOptions.parse(True, None, None, None, None).refusal(
        BudgetError("torchsurgery.offload", 10**9, 2 * 10**9, "h.0"), cpu
    ).startswith("the free memory of cpu (1,000,000,000 bytes) cannot hold")
    device = ArgumentValueError("torchsurgery.offload", "device", "xpu", "'xpu' is not available",
                                "use {} or an available accelerator", Setting("device", "cpu"))
    assert given.refusal(device, cpu) == "--device: 'xpu' is not available; use --device cpu or an available accelerator"
    overlap = ArgumentValueError("torchsurgery.offload", "groups", ["a", "a.b"], "'a' and 'a.b' overlap",
                                 "give disjoint subtrees")
    assert given.refusal(overlap, cpu) == "--groups: 'a' and 'a.b' overlap; give disjoint subtrees"
    missing = NoMatchError("torchsurgery.offload", "blok", ["block"], arg="groups")
    assert given.refusal(missing, cpu) == "--groups: 'blok' matches no submodule of the model; did you mean 'block'?"
    # an argument the command has no option for keeps the library's own words
    pinned = ArgumentValueError("torchsurgery.offload", "pin_memory", True, "cannot be True here")
    assert given.refusal(pinned, cpu) == str(pinned)
