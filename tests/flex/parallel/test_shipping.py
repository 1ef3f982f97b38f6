"""Captures shipped from four data-parallel replicas on gloo, to every rank and to rank 0
alone, pass after pass, bigger and smaller than the negotiated capacity; a failed sender
named; a parameter's gradient averaged where only another stage knows it is one."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _captures import assert_captured
from _faults import outcome
from _spawn import spawn

from torchsurgery.flex import Binding, HookFunction, HookType
from torchsurgery.flex.captures import Captures
from torchsurgery.flex.parallel import make_layout
from torchsurgery.flex.parallel.shipping import CaptureShipping

pytestmark = pytest.mark.distributed

ROWS = [2, 1, 3, 2]
WIDTHS = [4, 4000, 3, 8]  # the second pass outgrows the capacity learnt in the first
MODES = {"every_rank": True, "first_rank": False}


def _rows(rank: int, width: int) -> torch.Tensor:
    return torch.arange(ROWS[rank] * width, dtype=torch.float32).reshape(ROWS[rank], width) + 100 * rank


def _binding(key: str, hook_type: HookType) -> Binding:
    return Binding(HookFunction(key), hook_type, key, key)


def _keep_pass(shipping: CaptureShipping, captures: Captures, rank: int, width: int) -> None:
    shipping.keep(captures, _binding("act", "forward"), _rows(rank, width))
    shipping.keep(captures, _binding("act", "forward"), _rows(rank, width) * -1)  # a second call
    shipping.keep(captures, _binding("fc.weight", "tensor"), torch.full((width,), float(rank)))
    shipping.keep(captures, _binding("fc", "full_backward"), _rows(rank, width))


def _passes(every_rank: bool, rank: int) -> dict[str, Any]:
    shipping = CaptureShipping(make_layout(data_parallel_size=len(ROWS)), every_rank=every_rank)
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


def _stages(every_rank: bool, rank: int) -> dict[str, list[torch.Tensor]]:
    # 2 stages x 2 replicas: only the second stage holds the parameter
    shipping = CaptureShipping(make_layout(pipeline_parallel_size=2, data_parallel_size=2), every_rank=every_rank)
    out: dict[str, list[torch.Tensor]] = {}
    captures = Captures(out)
    if rank >= 2:
        shipping.keep(captures, _binding("head.weight", "tensor"), torch.full((3,), float(rank)))
    else:
        shipping.keep(captures, _binding("act", "forward"), _rows(rank, 2))
    shipping.ship(out, failed=False)
    shipping.settle()
    return out


def _worker(rank: int, world: int) -> dict[str, Any]:
    return {mode: {**_passes(every, rank), "stages": _stages(every, rank)} for mode, every in MODES.items()}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_worker, len(ROWS))


def _expected(width: int) -> dict[str, list[torch.Tensor]]:
    batch = torch.cat([_rows(r, width) for r in range(len(ROWS))])
    return {
        "act": [batch, -batch],  # the replicas' rows, in rank order, per call
        "fc.weight": [torch.full((width,), 1.5)],  # a parameter's gradient: the replicas' mean
        "fc": [batch / len(ROWS)],  # an activation gradient: of the mean of the replicas' losses
    }


def _holders(results: list[dict[str, Any]], mode: str) -> list[int]:
    return list(range(len(results))) if mode == "every_rank" else [0]


@pytest.mark.parametrize("mode", MODES)
def test_every_pass_arrives_whole_whatever_its_size(results: list[dict[str, Any]], mode: str) -> None:
    holders = _holders(results, mode)
    for rank, r in enumerate(results):
        for width, got in zip(WIDTHS, r[mode]["passes"], strict=True):
            if rank in holders:
                assert_captured(got, _expected(width))
            else:
                assert got == {}


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_sender_is_named_and_the_next_pass_is_whole(results: list[dict[str, Any]], mode: str) -> None:
    holders = _holders(results, mode)
    for rank, r in enumerate(results):
        failure = r[mode]["failure"]
        if rank in holders and rank != 2:
            assert failure.startswith("RuntimeError: torchsurgery.FlexModel: rank(s) [2] failed in this pass")
        else:
            assert failure == "no error"  # the failed rank raises its own error, not this one
        if rank in holders:
            assert_captured(r[mode]["after_failure"], _expected(6))  # nothing of the failed pass is left


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_gradient_of_another_stage_is_averaged(results: list[dict[str, Any]], mode: str) -> None:
    expected = {"act": [torch.cat([_rows(0, 2), _rows(1, 2)])], "head.weight": [torch.full((3,), 2.5)]}
    for rank in _holders(results, mode):
        assert_captured(results[rank][mode]["stages"], expected)
