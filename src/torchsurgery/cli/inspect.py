"""``torchsurgery inspect``: the module tree with sizes, dtypes, where tensors are, and surgery."""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

import torchsurgery
from torchsurgery._names import glob_match, no_match
from torchsurgery._validate import dtype_name
from torchsurgery.cli import models
from torchsurgery.cli.errors import CliError
from torchsurgery.cli.output import Table, emit, human_bytes
from torchsurgery.offloading import stored_values

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def command(model: str | None, depth: int | None, pattern: str | None, as_json: bool) -> None:
    """``torchsurgery inspect``: load MODEL and print its module tree (``--filter`` is ``pattern``)."""
    if depth is not None and depth < 0:
        raise CliError(f"--depth: {depth} is below 0; give 0 for the model alone, 1 for its children...")
    loaded = models.load(model)
    rows = module_rows(loaded.model, depth, pattern)
    kind = type(loaded.model).__name__
    document = {"command": "inspect", "model": loaded.name, "class": kind,
                "modules": [{k: v for k, v in row.items() if k != "level"} for row in rows]}
    emit(table(f"{loaded.name}: {kind}", rows, indent=sys.stdout.isatty()), document, as_json)


def module_rows(model: nn.Module, depth: int | None, pattern: str | None) -> list[dict[str, Any]]:
    """One row per module: name, type, parameters, bytes, dtypes, where its tensors are, surgery.

    Example:
        >>> from torch import nn
        >>> [r["name"] for r in module_rows(nn.Sequential(nn.Linear(2, 2)), None, None)]
        ['', '0']
    """
    rows = []
    named = list(model.named_modules())
    if pattern is not None and not any(glob_match(pattern, n) for n, _ in named):
        raise CliError(str(no_match("--filter", pattern, [n for n, _ in named if n])))
    surgery: dict[str, list[str]] = {}
    for entry in torchsurgery.surgery_log(model):
        surgery.setdefault(entry.module_name, []).append(entry.description)
    for name, module in named:
        level = 0 if not name else name.count(".") + 1
        if depth is not None and level > depth:
            continue
        if pattern is not None and not glob_match(pattern, name):
            continue
        tensors = list(module.parameters()) + list(module.buffers())
        done = list(surgery.get(name, []))
        hooks = sum(len(getattr(module, k)) for k in _HOOK_DICTS)
        if hooks:
            done.append(f"{hooks} hook{'s' if hooks > 1 else ''}")
        rows.append(
            {
                "name": name,
                "level": level,
                "type": type(module).__name__,
                "params": sum(p.numel() for p in module.parameters()),
                "bytes": sum(stored_values(t).nbytes for t in tensors),
                "dtypes": sorted({dtype_name(t.dtype) for t in tensors}),
                "where": sorted({str(t.device) for t in tensors}),
                "surgery": done,
            }
        )
    return rows


def table(title: str, rows: list[dict[str, Any]], indent: bool) -> Table:
    """The rows as a table; ``indent`` shows the tree by indentation (full names either way)."""
    out = Table(title, [("module", "left"), ("type", "left"), ("params", "right"), ("bytes", "right"),
                        ("dtype", "left"), ("where", "left"), ("surgery", "left")])
    for row in rows:
        name = row["name"] or "<root>"
        out.add(f"{'  ' * row['level'] if indent else ''}{name}", row["type"], f"{row['params']:,}",
                human_bytes(row["bytes"]), ",".join(row["dtypes"]) or "-", ",".join(row["where"]) or "-",
                "; ".join(row["surgery"]))
    return out
