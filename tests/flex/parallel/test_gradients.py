"""Trainable modules on two data-parallel replicas (gloo): rank 0's values everywhere, and
the gradient one process computes for the mean of the replicas' losses."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _spawn import spawn
from torch import nn

from torchsurgery.flex.parallel import make_layout
from torchsurgery.flex.parallel.gradients import TrainableGradients

pytestmark = pytest.mark.distributed


def _probe(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def _rows(rank: int) -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).reshape(4, 3).chunk(2)[rank]


def _worker(rank: int, world: int) -> dict[str, Any]:
    layout = make_layout(data_parallel_size=world)
    probe = _probe(seed=rank)  # each rank starts from other values
    gradients = TrainableGradients(layout)
    gradients.prepare(probe)
    values = {n: p.detach().clone() for n, p in probe.named_parameters()}
    probe(_rows(rank)).pow(2).sum().backward()
    synced = {n: p.grad.clone() for n, p in probe.named_parameters()}
    gradients.close()
    probe.zero_grad()
    probe(_rows(rank)).pow(2).sum().backward()
    alone = {n: p.grad.clone() for n, p in probe.named_parameters()}
    return {"values": values, "synced": synced, "alone": alone}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_worker, 2)


def test_every_rank_starts_from_rank0s_values(results: list[dict[str, Any]]) -> None:
    reference = _probe(seed=0)
    for r in results:
        for name, p in reference.named_parameters():
            torch.testing.assert_close(r["values"][name], p.detach(), msg=name)


def test_gradients_are_one_process_gradients_until_closed(results: list[dict[str, Any]]) -> None:
    reference = _probe(seed=0)
    (sum(reference(_rows(r)).pow(2).sum() for r in range(2)) / 2).backward()  # the replicas' mean loss
    for rank, r in enumerate(results):
        for name, p in reference.named_parameters():
            torch.testing.assert_close(r["synced"][name], p.grad, msg=name)
        own = _probe(seed=0)
        own(_rows(rank)).pow(2).sum().backward()
        for name, p in own.named_parameters():
            torch.testing.assert_close(r["alone"][name], p.grad, msg=name)  # no longer summed
