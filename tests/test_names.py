"""Selecting submodules by exact name, glob or filter, and the errors for no match."""

from __future__ import annotations

import pytest
from torch import nn

from torchsurgery._names import glob_match, select


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("layers.*.mlp", "layers.0.mlp", True),
        ("layers.*.mlp", "layers.0.inner.mlp", False),  # * stays inside one component
        ("layers.**.mlp", "layers.0.inner.mlp", True),  # ** crosses components
        ("**.mlp", "mlp", True),  # ** may match nothing
        ("layers.?", "layers.7", True),
        ("layers.[0-1]", "layers.2", False),
        ("layers.0", "layers.0.mlp", False),  # no wildcard: exact
        ("", "", True),
        ("*", "", False),  # the root is only selected by its own (empty) name
    ],
)
def test_glob_rules(pattern: str, name: str, expected: bool) -> None:
    assert glob_match(pattern, name) is expected


def _model() -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(3))
    model.head = nn.Linear(2, 2)
    return model


def test_select_returns_matches_in_model_order() -> None:
    model = _model()
    assert [n for n, _ in select(model, "layers.*.0")] == ["layers.0.0", "layers.1.0", "layers.2.0"]
    assert [n for n, m in select(model, lambda m, n: isinstance(m, nn.ReLU))] == [f"layers.{i}.1" for i in range(3)]
    assert select(model, "head")[0][1] is model.head


def test_no_match_lists_near_names_and_bad_selectors_are_refused() -> None:
    model = _model()
    with pytest.raises(ValueError, match="did you mean 'head'"):
        select(model, "haed", what="x")
    with pytest.raises(ValueError, match="selects no submodule"):
        select(model, lambda m, n: False)
    with pytest.raises(TypeError, match="a module name, a glob or a filter"):
        select(model, 3)  # type: ignore[arg-type]
