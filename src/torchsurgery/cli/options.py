"""The options ``run`` and ``trace`` share: where and in what dtype to compute, and how to offload.

Each option is checked before any model is loaded, and every error names the option and
what it accepts. ``--budget``, ``--storage-dtype``, ``--groups``, ``--prefetch`` and
``--storage`` each imply ``--offload``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import torchsurgery
from torchsurgery._names import glob_match, no_match
from torchsurgery._validate import DTYPES, STORAGE_DTYPES, check_device, dtype_from_name, dtype_name
from torchsurgery.cli.errors import CliError, parse_size
from torchsurgery.errors import ArgumentError, BudgetError, NoMatchError, Setting

STORAGE_NAMES = tuple(n for row in DTYPES if row.dtype in STORAGE_DTYPES for n in (row.short, row.name) if n is not None)
"""What ``--storage-dtype`` accepts: the short and full names of the dtypes ``offload`` stores weights in."""
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")

OPTIONS = {
    "device": "--device", "dtype": "--dtype", "storage_dtype": "--storage-dtype", "budget": "--budget",
    "groups": "--groups", "prefetch": "--prefetch",
}
"""The option of each ``torchsurgery.offload`` argument the command lets the user set."""


def as_option(setting: Setting) -> str:
    """An argument setting as the command line writes it.

    Example:
        >>> as_option(Setting("groups", "leaves"))
        '--groups leaves'
    """
    return f"{OPTIONS.get(setting.arg, setting.arg)} {setting.value}"


def parse_dtype(name: str, option: str, accepted: tuple[str, ...] = STORAGE_NAMES) -> torch.dtype:
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

    The library's own device check decides; the error lists what :func:`devices` offers.

    Example:
        >>> parse_device("cpu")
        device(type='cpu')
    """
    try:
        device = check_device(name.lower(), "--device")
    except ArgumentError:
        device = None
    if device is None or device.type == "meta":  # (meta holds no values: nothing to compute with)
        raise CliError(f"--device: {name!r} is not a device of this machine; use one of {', '.join(devices())}")
    return device


def parse_common(
    device: str,
    dtype: str | None,
    offload: bool,
    storage_dtype: str | None,
    budget: str | None,
    groups: str | None,
    prefetch: int | None,
    storage: bool = False,
) -> tuple[torch.device, torch.dtype | None, OffloadOptions]:
    """``--device``, ``--dtype`` and the offload options ``run`` and ``trace`` share, checked in that order.

    Example:
        >>> where, dtype, options = parse_common("cpu", "bf16", False, None, "1MB", None, None)
        >>> where, dtype, options.enabled, options.budget
        (device(type='cpu'), torch.bfloat16, True, 1000000)
    """
    where = parse_device(device)
    compute = parse_dtype(dtype, "--dtype", COMPUTE_DTYPES) if dtype is not None else None
    return where, compute, OffloadOptions.parse(offload, storage_dtype, budget, groups, prefetch, storage)


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
        except (ArgumentError, NoMatchError) as exc:
            raise CliError(self.refusal(exc, device)) from exc
        except (ValueError, TypeError) as exc:
            raise CliError(str(exc)) from exc

    def refusal(self, exc: ArgumentError | NoMatchError, device: torch.device) -> str:
        """A refusal of ``torchsurgery.offload``, written from its fields in this command's options.

        Example:
            >>> from torchsurgery.errors import BudgetError
            >>> options = OffloadOptions.parse(False, None, "1KB", None, None)
            >>> options.refusal(BudgetError("torchsurgery.offload", 1000, 4096, "layers.0"), torch.device("cpu"))
            "--budget 1KB (1,000 bytes) cannot hold the largest group 'layers.0' (4,096 bytes); give at least that, or smaller groups (--groups leaves)"
        """
        if isinstance(exc, NoMatchError):
            return exc.render(OPTIONS.get(exc.arg))
        if isinstance(exc, BudgetError):
            given = f"--budget {self.budget_text}" if self.budget_text is not None else f"the free memory of {device}"
            holding = exc.holding or f"the largest group {exc.group or '<root>'!r} ({exc.needed:,} bytes)"
            return f"{given} ({exc.budget:,} bytes) cannot hold {holding}; {exc.fix_in(as_option)}"
        option = OPTIONS.get(exc.arg)
        if option is None:  # an argument the command always sets itself
            return str(exc)
        fix = exc.fix_in(as_option)
        return f"{option}: {exc.problem}" + (f"; {fix}" if fix else "")
