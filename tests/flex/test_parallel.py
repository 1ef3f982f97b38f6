"""ParallelRequest: flex_model's parallel arguments, checked, and whether they stay in one process."""

from __future__ import annotations

import pytest

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
