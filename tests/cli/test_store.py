"""The streaming safetensors writer: the file equals safetensors' own of the concatenated batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from torchsurgery.cli.store import StreamingWriter

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.uint8, torch.bool]


def _batch(dtype: torch.dtype, rows: int) -> torch.Tensor:
    values = torch.randn(rows, 3, 2) * 4
    return values > 0 if dtype == torch.bool else values.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batches_appended_equal_one_saved_concatenation(tmp_path: Path, dtype: torch.dtype) -> None:
    batches = {"a": [_batch(dtype, 2), _batch(dtype, 3), _batch(dtype, 1)], "mask": [torch.ones(2, 4, dtype=torch.long)]}
    writer = StreamingWriter(tmp_path / "out.safetensors", {"model": "demo"})
    for first in range(3):
        for key, values in batches.items():
            if first < len(values):
                writer.append(key, values[first])
    assert writer.close() == {"a": [6, 3, 2], "mask": [2, 4]}
    expected = {key: torch.cat(values) for key, values in batches.items()}
    save_file(expected, tmp_path / "reference.safetensors")
    ours, theirs = load_file(tmp_path / "out.safetensors"), load_file(tmp_path / "reference.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key].view(torch.uint8), theirs[key].view(torch.uint8))
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        assert f.metadata() == {"model": "demo"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors", "reference.safetensors"]  # no spill left


def test_mismatched_batches_and_unstorable_dtypes_are_refused(tmp_path: Path) -> None:
    writer = StreamingWriter(tmp_path / "out.safetensors", {})
    writer.append("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="share trailing shape and dtype"):
        writer.append("a", torch.zeros(2, 4))
    with pytest.raises(ValueError, match="share trailing shape and dtype"):
        writer.append("a", torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="complex128 has no safetensors name"):
        writer.append("c", torch.zeros(2, dtype=torch.complex128))
    writer.abort()
    assert list(tmp_path.iterdir()) == []  # abort leaves nothing, not even the output


def test_a_zero_dim_value_is_stored_as_one_row(tmp_path: Path) -> None:
    writer = StreamingWriter(tmp_path / "out.safetensors", {})
    writer.append("s", torch.tensor(1.5))
    writer.append("s", torch.tensor(2.5))
    assert writer.close() == {"s": [2]}
    assert load_file(tmp_path / "out.safetensors")["s"].tolist() == [1.5, 2.5]
