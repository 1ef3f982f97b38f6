"""Editing functions that fail on purpose, and what a failing call left behind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MESSAGE = "boom on purpose"


def raises_on(rank: int | None) -> Callable[[nn.Module, torch.Tensor, Any, Any], torch.Tensor]:
    """An editing function that raises ``ValueError`` on ``rank`` (every rank for ``None``)."""

    def edit(module: nn.Module, t: torch.Tensor, ctx: Any, modules: Any) -> torch.Tensor:
        if rank is None or dist.get_rank() == rank:
            raise ValueError(MESSAGE)
        return t

    return edit


def outcome(call: Callable[[], Any]) -> str:
    """``"no error"``, or the exception's type, message and notes."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the message is what the tests check
        notes = " ".join(getattr(exc, "__notes__", []))
        return f"{type(exc).__name__}: {exc} {notes}".strip()
    return "no error"
