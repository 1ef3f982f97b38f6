"""``torchsurgery inspect``: the module tree with sizes, dtypes, devices and surgery."""

from __future__ import annotations

from typing import Any

from torch import nn

from torchsurgery import _undo
from torchsurgery._format import human_bytes
from torchsurgery._names import glob_match, no_match_message
from torchsurgery.cli.errors import CliError

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def module_rows(model: nn.Module, depth: int | None, pattern: str | None) -> list[dict[str, Any]]:
    """One row per module: name, type, parameters, bytes, dtypes, devices, surgery.

    Example:
        >>> from torch import nn
        >>> [r["name"] for r in module_rows(nn.Sequential(nn.Linear(2, 2)), None, None)]
        ['<root>', '0']
    """
    rows = []
    named = list(model.named_modules())
    if pattern is not None and not any(glob_match(pattern, n) for n, _ in named):
        raise CliError(no_match_message("--filter", pattern, [n for n, _ in named if n]))
    for name, module in named:
        level = 0 if not name else name.count(".") + 1
        if depth is not None and level > depth:
            continue
        if pattern is not None and not glob_match(pattern, name):
            continue
        tensors = list(module.parameters()) + list(module.buffers())
        surgery = [r.describe() for r in _undo.records(module) if not r.internal]
        hooks = sum(len(getattr(module, k)) for k in _HOOK_DICTS)
        if hooks:
            surgery.append(f"{hooks} hook{'s' if hooks > 1 else ''}")
        rows.append(
            {
                "name": name or "<root>",
                "level": level,
                "type": type(module).__name__,
                "params": sum(p.numel() for p in module.parameters()),
                "bytes": human_bytes(sum(t.numel() * t.element_size() for t in tensors), binary=True),
                "dtype": ",".join(sorted({str(t.dtype).replace("torch.", "") for t in tensors})) or "-",
                "device": ",".join(sorted({str(t.device) for t in tensors})) or "-",
                "surgery": "; ".join(surgery) or "",
            }
        )
    return rows
