"""Selecting submodules by exact name, glob or filter, and the errors for no match."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchsurgery._names import glob_match, near_matches, no_match, select
from torchsurgery.errors import NoMatchError


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


def test_near_matches_rank_by_similarity_ignore_wildcards_and_fall_back_to_the_last_component() -> None:
    import difflib

    names = ["layers.0.mlp", "layers.1.mlp", "layers.0.attn", "head"]
    assert near_matches("layers.0.mpl", names)[0] == "layers.0.mlp"
    # the ranking is difflib's, with wildcards left out of the comparison
    assert near_matches("layers.*.attn", names) == difflib.get_close_matches("layers..attn", names, n=5, cutoff=0.5)
    deep = ["transformer.h.0.mlp", "transformer.h.1.mlp", "transformer.wte"]
    assert difflib.get_close_matches("x..mlp", deep, cutoff=0.5) == []
    assert near_matches("x.*.mlp", deep) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]  # same last part
    assert near_matches("zzz", names) == [] and len(near_matches("layers", names, n=2)) <= 2


def test_load_suggests_checkpoint_keys_with_the_same_helper() -> None:
    import torchsurgery

    model = nn.Sequential(nn.Linear(2, 2))
    state = {"0.wieght": torch.zeros(2, 2), "0.bias": torch.zeros(2)}
    with pytest.raises(RuntimeError) as refused:
        torchsurgery.load_(model, state)
    assert f"did you mean {near_matches('0.weight', list(state), n=1)[0]!r}" in str(refused.value)


def test_no_match_names_the_argument_that_held_the_name() -> None:
    error = no_match("torchsurgery.offload", "layrs.0", ["layers.0", "head"], arg="groups")
    assert isinstance(error, NoMatchError) and error.arg == "groups" and error.near == ("layers.0",)
    assert str(error).startswith("torchsurgery.offload (groups): 'layrs.0' matches no submodule")
