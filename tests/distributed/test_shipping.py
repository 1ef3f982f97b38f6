"""Captures shipped to rank 0 from three data-parallel replicas on gloo, pass after pass,
bigger and smaller than the negotiated capacity, and a failed sender named."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _faults import outcome
from _spawn import spawn

from torchsurgery.distributed import make_layout
from torchsurgery.distributed.shipping import CaptureShipping
from torchsurgery.flex import Binding, HookFunction, HookType
from torchsurgery.flex.captures import Captures

pytestmark = pytest.mark.distributed

ROWS = [2, 1, 3]
WIDTHS = [4, 4000, 3, 8]  # the second pass outgrows the capacity learnt in the first


def _rows(rank: int, width: int) -> torch.Tensor:
    return torch.arange(ROWS[rank] * width, dtype=torch.float32).reshape(ROWS[rank], width) + 100 * rank


def _binding(key: str, hook_type: HookType) -> Binding:
    return Binding(HookFunction(key), hook_type, key, key)


def _keep_pass(shipping: CaptureShipping, captures: Captures, rank: int, width: int) -> None:
    shipping.keep(captures, _binding("act", "forward"), _rows(rank, width))
    shipping.keep(captures, _binding("act", "forward"), _rows(rank, width) * -1)  # a second call
    shipping.keep(captures, _binding("fc.weight", "tensor"), torch.full((width,), float(rank)))
    shipping.keep(captures, _binding("fc", "full_backward"), _rows(rank, width))


def _worker(rank: int, world: int) -> dict[str, Any]:
    layout = make_layout(data_parallel_size=world)
    shipping = CaptureShipping(layout)
    passes = []
    for width in WIDTHS:
        out: dict[str, list[torch.Tensor]] = {}
        captures = Captures(out)
        _keep_pass(shipping, captures, rank, width)
        shipping.ship(out, failed=False)
        passes.append(out)
    out = {}
    captures = Captures(out)
    _keep_pass(shipping, captures, rank, 5)
    failure = outcome(lambda: shipping.ship(out, failed=rank == 2))
    _keep_pass(shipping, captures, rank, 6)
    shipping.ship(out, failed=False)
    shipping.settle()
    return {"passes": passes, "failure": failure, "after_failure": out}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_worker, 3)


def _expected(width: int) -> dict[str, list[torch.Tensor]]:
    batch = torch.cat([_rows(r, width) for r in range(3)])
    return {
        "act": [batch, -batch],  # the replicas' rows, in rank order, per call
        "fc.weight": [torch.full((width,), 1.0)],  # a parameter's gradient: the replicas' mean
        "fc": [batch / 3],  # an activation gradient: of the mean of the replicas' losses
    }


def test_rank0_gets_every_pass_whole_whatever_its_size(results: list[dict[str, Any]]) -> None:
    for width, got in zip(WIDTHS, results[0]["passes"], strict=True):
        expected = _expected(width)
        assert list(got) == list(expected)
        for key, values in expected.items():
            assert len(got[key]) == len(values), key
            for a, b in zip(got[key], values, strict=True):
                torch.testing.assert_close(a, b, msg=f"{key} at width {width}")
    for r in results[1:]:
        assert all(p == {} for p in r["passes"])


def test_a_failed_sender_is_named_on_rank0_and_the_next_pass_is_whole(results: list[dict[str, Any]]) -> None:
    assert results[0]["failure"].startswith("RuntimeError: torchsurgery.FlexModel: rank(s) [2] failed in this pass")
    assert results[1]["failure"] == results[2]["failure"] == "no error"
    got = results[0]["after_failure"]
    expected = _expected(6)
    assert list(got) == list(expected)  # nothing of the failed pass is left in it
    for key, values in expected.items():
        for a, b in zip(got[key], values, strict=True):
            torch.testing.assert_close(a, b, msg=key)
