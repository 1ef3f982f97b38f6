"""ParallelRequest: flex_model's parallel arguments, checked, and whether they stay in one process."""

from __future__ import annotations

import pytest
from torch import nn

from torchsurgery import FlexModel
from torchsurgery.flex import ParallelRequest, ParallelSizes


def test_no_parallel_argument_is_local_and_any_one_is_not() -> None:
    assert ParallelRequest.of().is_local
    assert ParallelRequest.of().sizes == ParallelSizes(1, 1, 1)
    assert not ParallelRequest.of(tensor_parallel_size=2).is_local
    assert not ParallelRequest.of(pipeline_parallel_size=2).is_local
    assert not ParallelRequest.of(data_parallel_size=3).is_local
    assert not ParallelRequest.of(process_group=object()).is_local  # type: ignore[arg-type]
    assert not ParallelRequest.of(device_mesh=object()).is_local  # type: ignore[arg-type]


def test_sizes_keep_their_names_and_multiply_to_the_world() -> None:
    request = ParallelRequest.of(tensor_parallel_size=2, pipeline_parallel_size=3, data_parallel_size=4)
    assert request.sizes == ParallelSizes(tensor=2, pipeline=3, data=4)
    assert request.sizes.world == 24


@pytest.mark.parametrize("key", ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "2", None])
def test_a_size_that_is_not_a_positive_int_is_named_in_the_error(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"torchsurgery.FlexModel: {key} must be a positive int, got {value!r}"):
        ParallelRequest.of(**{key: value})  # type: ignore[arg-type]


def test_captures_go_to_every_rank_unless_asked_for_the_first_alone() -> None:
    assert ParallelRequest.of().captures_on == "every_rank"  # where flex_model puts them
    assert ParallelRequest.of(data_parallel_size=2, captures_on="first_rank").captures_on == "first_rank"
    assert ParallelRequest.of(captures_on="first_rank").is_local  # one process: nothing to choose


@pytest.mark.parametrize("value", ["rank0", "all", None])
def test_an_unknown_captures_on_is_named_with_the_choices(value: object) -> None:
    with pytest.raises(ValueError, match=f"captures_on must be one of \\('every_rank', 'first_rank'\\).*got {value!r}"):
        ParallelRequest.of(captures_on=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="captures_on must be one of"):
        FlexModel(nn.Linear(1, 1), {}, captures_on=value)  # type: ignore[arg-type]
