"""Finding the sharded dimension: from expected_shape, and from torch's parallel plans."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchsurgery.flex.parallel.sharding import dim_from_expected_shape, dim_from_plan


def test_expected_shape_names_the_one_sharded_dimension() -> None:
    local = torch.zeros(2, 5, 4)
    assert dim_from_expected_shape(local, (None, None, 8), "fc1", 2) == 2
    assert dim_from_expected_shape(local, (2, 10, None), "fc1", 2) == 1
    assert dim_from_expected_shape(local, (None, 5, 4), "fc1", 2) is None  # whole
    assert dim_from_expected_shape(local, None, "fc1", 2) is None
    # a hint that names no sharded dimension implies none, whatever its length (flex_model's zip)
    assert dim_from_expected_shape(local, (None, None, None, None), "fc1", 2) is None
    assert dim_from_expected_shape(local, (2,), "fc1", 2) is None


@pytest.mark.parametrize(
    ("expected", "message"),
    [
        ((None, 8), "has 2 dimensions"),
        ((4, 10, 8), "dimensions \\[0, 1, 2\\]"),
        ((None, None, 12), "tensor_parallel_size 2"),
    ],
)
def test_bad_expected_shapes_are_explained(expected: tuple[int | None, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dim_from_expected_shape(torch.zeros(2, 5, 4), expected, "fc1", 2)


@pytest.mark.usefixtures("one_rank")
def test_parallel_plans_say_how_outputs_leave() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    model = nn.ModuleDict({
        "col": nn.Linear(4, 4), "row": nn.Linear(4, 4), "col_dtensor": nn.Linear(4, 4),
        "norm": nn.LayerNorm(4), "plain": nn.Linear(4, 4),
    })
    parallelize_module(model, mesh, {
        "col": ColwiseParallel(), "row": RowwiseParallel(),
        "col_dtensor": ColwiseParallel(use_local_output=False), "norm": SequenceParallel(use_local_output=True),
    })
    assert dim_from_plan(model["col"], 3) == 2  # Shard(-1), normalised
    assert dim_from_plan(model["row"], 3) is None  # replicated
    assert dim_from_plan(model["col_dtensor"], 3) is None  # a DTensor carries its placements
    assert dim_from_plan(model["norm"], 3) == 1  # the sequence dimension
    assert dim_from_plan(model["plain"], 3) is None
