"""``torchsurgery run``: run a model plainly and with the offload engine, side by side."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from torchsurgery.cli.errors import CliError
from torchsurgery.cli.models import LoadedModel

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
}


def parse_dtype(name: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16`` and so on.

    Example:
        >>> parse_dtype("bf16")
        torch.bfloat16
    """
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise CliError(f"unknown dtype {name!r}; use one of {', '.join(sorted(DTYPES))}") from None


def _main_tensor(output: Any) -> torch.Tensor:
    for attr in ("last_hidden_state", "logits"):
        if hasattr(output, attr):
            return getattr(output, attr)
    if isinstance(output, torch.Tensor):
        return output
    return output[0]


def _timed(loaded: LoadedModel, inputs: dict[str, torch.Tensor], repeats: int = 3) -> tuple[torch.Tensor, float]:
    times, out = [], None
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            out = _main_tensor(loaded.model(**inputs))
            times.append(time.perf_counter() - start)
    assert out is not None
    return out, statistics.median(times)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights as stored."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def compare(
    loaded: LoadedModel, text: str, offload: bool, budget: int | None, storage_dtype: torch.dtype | None
) -> dict[str, Any]:
    """Run plainly, then (optionally) offloaded; return figures for both."""
    import torchsurgery

    inputs = loaded.encode([text], max_length=64)
    plain, plain_s = _timed(loaded, inputs)
    result: dict[str, Any] = {
        "shape": list(plain.shape), "plain_seconds": plain_s, "plain_bytes": weight_bytes(loaded.model),
        "norm": float(plain.float().norm()),
    }
    if not offload:
        return result
    compute = next(loaded.model.parameters()).dtype
    try:
        handle = torchsurgery.offload(loaded.model, "cpu", dtype=compute, storage_dtype=storage_dtype, budget=budget)
    except ValueError as exc:
        raise CliError(str(exc).replace("torchsurgery.offload: ", "")) from exc
    try:
        result["offload_bytes"] = weight_bytes(loaded.model)
        out, result["offload_seconds"] = _timed(loaded, inputs)
        result["max_abs_diff"] = float((out.float() - plain.float()).abs().max())
        stats = handle.stats()
        result["streamed"] = len(stats.streamed_groups)
        result["resident"] = len(stats.resident_groups)
        result["peak_device_bytes"] = stats.peak_device_bytes
    finally:
        handle.remove()
    return result
