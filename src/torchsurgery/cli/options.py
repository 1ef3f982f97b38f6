"""The options ``run`` and ``trace`` share: where and in what dtype to compute, and how to offload.

Each option is checked before any model is loaded, and every error names the option and
what it accepts. ``--budget``, ``--storage-dtype``, ``--groups``, ``--prefetch`` and
``--storage`` each imply ``--offload``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

import torchsurgery
from torchsurgery._names import glob_match, no_match
from torchsurgery._validate import dtype_from_name, dtype_name
from torchsurgery.cli.errors import CliError, parse_size

STORAGE_DTYPES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16", "fp8", "float8_e4m3fn")
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")


def parse_dtype(name: str, option: str, accepted: tuple[str, ...] = STORAGE_DTYPES) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``, for the names in ``accepted``.

    Example:
        >>> parse_dtype("bf16", "--dtype")
        torch.bfloat16
    """
    key = name.lower()
    if key not in accepted:
        raise CliError(f"{option}: unknown dtype {name!r}; use one of {', '.join(accepted)}")
    dtype = dtype_from_name(key)
    assert dtype is not None, key
    return dtype


def devices() -> list[str]:
    """What ``--device`` accepts here: ``cpu``, then each accelerator PyTorch reports.

    Example:
        >>> devices()[0]
        'cpu'
    """
    found = ["cpu"]
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is not None:
        count = torch.accelerator.device_count()
        found += [accelerator.type] + [f"{accelerator.type}:{i}" for i in range(count)]
    return found


def parse_device(name: str) -> torch.device:
    """``--device``: ``cpu`` or an accelerator of this machine (``cuda``, ``cuda:1``, ``mps``...).

    Example:
        >>> parse_device("cpu")
        device(type='cpu')
    """
    accepted = devices()
    if name.lower() not in accepted:
        raise CliError(f"--device: {name!r} is not a device of this machine; use one of {', '.join(accepted)}")
    return torch.device(name.lower())


@dataclass
class OffloadOptions:
    """What ``--offload`` and its companions asked for (``enabled`` when any was given)."""

    enabled: bool = False
    storage_dtype: torch.dtype | None = None
    budget: int | None = None
    budget_text: str | None = None
    groups: str = "blocks"
    prefetch: int = 1
    storage: bool = False

    @classmethod
    def parse(
        cls,
        offload: bool,
        storage_dtype: str | None,
        budget: str | None,
        groups: str | None,
        prefetch: int | None,
        storage: bool = False,
    ) -> OffloadOptions:
        """Check the options' values; any of them turns offloading on."""
        if prefetch is not None and prefetch < 0:
            raise CliError(f"--prefetch: {prefetch} is below 0; give how many groups to bring in ahead (0, 1, 2...)")
        if storage and storage_dtype is not None:
            raise CliError("--storage-dtype does not apply with --storage: the weights are read from the file in "
                           "its own dtype; leave out --storage-dtype (--dtype sets the compute dtype)")
        if groups is not None and not [g for g in groups.split(",") if g.strip()]:
            raise CliError("--groups: empty; give blocks, leaves, or module names or globs separated by commas")
        return cls(
            enabled=offload or any(v is not None for v in (storage_dtype, budget, groups, prefetch)) or storage,
            storage_dtype=parse_dtype(storage_dtype, "--storage-dtype") if storage_dtype is not None else None,
            budget=parse_size(budget, "--budget") if budget is not None else None,
            budget_text=budget,
            groups=groups if groups is not None else "blocks",
            prefetch=prefetch if prefetch is not None else 1,
            storage=storage,
        )

    def group_names(self, model: nn.Module) -> str | list[str]:
        """``blocks``/``leaves`` as they are; names and globs resolved to module names."""
        if self.groups in ("blocks", "leaves"):
            return self.groups
        named = [name for name, _ in model.named_modules() if name]
        found: list[str] = []
        for pattern in (g.strip() for g in self.groups.split(",")):
            if not pattern:
                continue
            matches = [name for name in named if glob_match(pattern, name)]
            if not matches:
                raise CliError(str(no_match("--groups", pattern, named, advice="or use blocks or leaves")))
            found += [name for name in matches if name not in found]
        return found

    def describe(self) -> dict[str, object]:
        """The options as JSON values."""
        return {
            "storage_dtype": dtype_name(self.storage_dtype) if self.storage_dtype is not None else None,
            "budget_bytes": self.budget,
            "groups": self.groups,
            "prefetch": self.prefetch,
        }

    def apply(
        self, model: nn.Module, device: torch.device, dtype: torch.dtype | None, storage: str | None = None
    ) -> torchsurgery.OffloadHandle:
        """``torchsurgery.offload`` with these options; its refusals become ``error:`` lines."""
        groups = self.group_names(model)
        try:
            return torchsurgery.offload(
                model, device, dtype=dtype, storage_dtype=self.storage_dtype, budget=self.budget,
                groups=groups, prefetch=self.prefetch, storage=storage,
            )
        except (ValueError, TypeError) as exc:
            raise CliError(self._in_command_terms(str(exc), device)) from exc

    def _in_command_terms(self, message: str, device: torch.device) -> str:
        """The library's refusal, reworded to name this command's options instead of arguments."""
        message = re.sub(r"^torchsurgery\.offload( \([^)]*\))?: ", "", message.splitlines()[0])
        message = re.sub(
            r"budget=(\d+) bytes", lambda m: f"--budget {self.budget_text} ({int(m.group(1)):,} bytes)", message
        )
        if self.groups == "leaves":
            message = message.replace(", or smaller groups (groups='leaves')", "")
        message = message.replace("smaller groups (groups='leaves')", "--groups leaves")
        message = re.sub(r"^groups ", "--groups: ", message)
        if "device" in message.split(";")[0]:
            message = f"--device {device}: the offload engine cannot run there ({message}); use --device cpu"
        return message
