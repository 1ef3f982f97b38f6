"""flatten: the tensor leaves of any output structure, and the same structure rebuilt."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch

from torchsurgery.flex.pytree import flatten

Pair = namedtuple("Pair", ["first", "second"])


class Batch(dict):  # a dict subclass nobody registers with torch.utils._pytree
    pass


class Row(list):
    pass


@dataclasses.dataclass
class Hidden:
    states: torch.Tensor
    mask: torch.Tensor | None
    note: str = "kept"


def _structures() -> dict[str, tuple[Any, list[torch.Tensor]]]:
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    return {
        "tensor": (a, [a]),
        "tuple": ((a, "text", b), [a, b]),
        "list": ([a, 3, b], [a, b]),
        "dict": ({"x": a, "y": {"z": b}}, [a, b]),
        "ordered": (OrderedDict(x=a, y=b), [a, b]),
        "namedtuple": (Pair(a, (b, c)), [a, b, c]),
        "dataclass": (Hidden(a, None), [a]),
        "nested": ((Pair(a, [b]), {"k": Hidden(c, b)}), [a, b, c, b]),
        "none": ((None, "no tensor"), []),
        "dict subclass": (Batch(x=a, y=Row([b, c])), [a, b, c]),
    }


@pytest.mark.parametrize("kind", list(_structures()))
def test_leaves_come_depth_first_and_rebuild_keeps_types_and_other_values(kind: str) -> None:
    obj, expected = _structures()[kind]
    leaves, rebuild = flatten(obj)
    assert [id(t) for t in leaves] == [id(t) for t in expected]
    same = rebuild(list(leaves))
    assert type(same) is type(obj)
    # rebuilt from the same leaves, the structure compares equal to the original, leaf by leaf
    again, _ = flatten(same)
    assert [id(t) for t in again] == [id(t) for t in expected]
    if kind == "dataclass":
        assert same.note == "kept" and same.mask is None


def test_rebuild_puts_new_leaves_in_their_places() -> None:
    a, b = torch.zeros(2), torch.ones(2)
    leaves, rebuild = flatten({"pair": Pair(a, b), "rest": [b, "s"]})
    new = [t + 10 for t in leaves]
    out = rebuild(new)
    assert out["pair"].first is new[0] and out["pair"].second is new[1]
    assert out["rest"][0] is new[2] and out["rest"][1] == "s"
    assert out["pair"].first.tolist() == [10.0, 10.0]


def test_model_output_objects_rebuild_as_their_class() -> None:
    transformers = pytest.importorskip("transformers")
    logits, hidden = torch.randn(1, 2, 3), torch.randn(1, 2, 4)
    output = transformers.modeling_outputs.CausalLMOutput(logits=logits, hidden_states=(hidden,))
    leaves, rebuild = flatten(output)
    assert [id(t) for t in leaves] == [id(logits), id(hidden)]
    rebuilt = rebuild([logits * 2, hidden])
    assert type(rebuilt) is type(output)
    torch.testing.assert_close(rebuilt.logits, logits * 2)
    assert rebuilt.hidden_states[0] is hidden
