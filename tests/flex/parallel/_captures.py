"""Comparing what ranks captured with what one process captured."""

from __future__ import annotations

import torch

Captured = dict[str, list[torch.Tensor]]


def assert_captured(got: Captured, expected: Captured, *, prefix: str = "") -> None:
    """``got`` holds ``expected``'s keys (each under ``prefix``), in order, with the same tensors."""
    assert list(got) == [prefix + key for key in expected]
    for key, values in expected.items():
        assert len(got[prefix + key]) == len(values), key
        for a, b in zip(got[prefix + key], values, strict=True):
            torch.testing.assert_close(a, b, msg=key)
