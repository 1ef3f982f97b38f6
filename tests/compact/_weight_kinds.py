"""Every kind of offloaded weight, made the way programs make it, next to its plain oracle.

A kind is one way torchsurgery keeps a weight that computes in fp32: narrow storage (bf16,
fp16, fp8 e4m3fn, fp8 e5m2), a master copy with a narrow shadow, groups streamed from host
under a budget, groups streamed from a safetensors file, and ``DynamicSwapInstaller``
given a ``dtype``. The oracle of an offloaded weight is a plain ``nn.Parameter`` holding
the same values, rounded to the storage dtype first, so that both hold exactly the same
numbers; whatever PyTorch does with the one it must do with the other.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import torchsurgery
from torchsurgery.compact import offloaded_like


@dataclass(frozen=True)
class Kind:
    """One way of offloading a weight that computes in fp32."""

    name: str
    storage: torch.dtype
    """What the weight's values are rounded to (with a master copy: the shadow's dtype)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Further ``offload`` keyword arguments."""
    master: bool = False
    """Writes land unrounded in an fp32 master; forwards without gradients read the shadow."""
    file: bool = False
    """The values stay in a safetensors file (inference only)."""
    installer: bool = False
    """``DynamicSwapInstaller.install_model(model, dtype=torch.float32)`` of a model stored in ``storage``."""
    control: bool = False
    """Not offloaded at all: every check holds for it, so a failure elsewhere is the offloaded weight's."""

    def kept(self, values: torch.Tensor) -> torch.Tensor:
        """What the weight keeps (``stored``) after ``values`` are written into it."""
        return values.detach().clone() if self.master else values.detach().to(self.storage)

    def read(self, values: torch.Tensor) -> torch.Tensor:
        """What the weight reads as (fp32) after ``values`` are written into it.

        Forwards that record gradients compute with these; so do those without, except with
        a master copy, whose shadow (``storage``-rounded) serves them.
        """
        return self.kept(values).to(torch.float32)


KINDS = [
    Kind("control", torch.float32, control=True),
    Kind("bf16", torch.bfloat16),
    Kind("fp16", torch.float16),
    Kind("fp8_e4m3fn", torch.float8_e4m3fn),
    Kind("fp8_e5m2", torch.float8_e5m2),
    Kind("master", torch.bfloat16, {"master_dtype": torch.float32}, master=True),
    Kind("streamed", torch.bfloat16, {"groups": "leaves"}),  # with a budget: see offloaded
    Kind("file", torch.bfloat16, file=True),
    Kind("installer", torch.bfloat16, installer=True),
]
_FILES = itertools.count()  # names of the files weights are streamed from
KIND_IDS = [k.name for k in KINDS]
WRITABLE = [k for k in KINDS if not k.file]


def round_(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` with every parameter's values rounded to ``dtype`` (still in its own dtype)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(dtype).to(p.dtype))
    return module


def offloaded(kind: Kind, module: nn.Module, tmp_path: Path) -> Callable[[], None]:
    """Apply ``kind`` to ``module`` (values already rounded to ``kind.storage``); returns its undo."""
    if kind.control:
        return lambda: None
    if kind.installer:
        module.to(kind.storage)
        torchsurgery.DynamicSwapInstaller.install_model(module, dtype=torch.float32)
        return lambda: torchsurgery.DynamicSwapInstaller.uninstall_model(module)
    options: dict[str, Any] = {"storage_dtype": kind.storage, "dtype": torch.float32, "skip": None, **kind.options}
    if kind.file:
        from safetensors.torch import save_file

        path = tmp_path / f"weights-{next(_FILES)}.safetensors"
        save_file({k: v.to(kind.storage).contiguous() for k, v in module.state_dict().items()}, path)
        module.to("meta")  # a skeleton: its values are in the file only
        options["storage"] = path
        del options["storage_dtype"]  # the file's own dtype is what is streamed
    if options.get("groups") == "leaves":
        # a budget below the model's fp32 size (at least its largest leaf): its leaves stream through the
        # engine's ring; where the ring's slots and a run's casts take more than the whole model (the
        # smallest samples), the least budget the offload accepts, which keeps the model whole
        leaves = [sum(p.numel() * 4 for p in m.parameters()) for m in module.modules() if not list(m.children())]
        options["budget"] = max(sum(p.numel() * 4 for p in module.parameters()) - 1, *leaves)
        try:
            torchsurgery.plan_offload(module, **options)
        except torchsurgery.BudgetError as refused:
            options["budget"] = refused.needed
    handle = torchsurgery.offload(module, **options)
    return lambda: handle.remove() if handle.active else None


def tiny() -> nn.Sequential:
    """The model of the conformance tests: its ``[2].weight`` is the weight under test, ``[4].bias`` has one element.

    The norm's weights are not a matmul layer's: the engine packs them into one buffer per
    group (what the checks of memory identity must see apart).
    """
    model = nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.1, 0.1)
    return model


@dataclass
class Case:
    """A model offloaded one way, and its plain oracle: the same model with the same rounded values."""

    kind: Kind
    model: nn.Module
    plain: nn.Module
    undo: Callable[[], None]

    @property
    def weight(self) -> torch.Tensor:
        """The offloaded weight under test (the middle Linear's)."""
        w: torch.Tensor = self.model[2].weight
        return w

    @property
    def oracle(self) -> nn.Parameter:
        """The plain parameter holding the same values."""
        w: nn.Parameter = self.plain[2].weight
        return w


def make_case(kind: Kind, tmp_path: Path, build: Callable[[], nn.Module] = tiny) -> Case:
    """``build()`` with values rounded to the kind's storage, offloaded that way, and its plain copy."""
    model = round_(build(), kind.storage)
    plain = copy.deepcopy(model)
    undo = offloaded(kind, model, tmp_path)
    return Case(kind, model, plain, undo)


class Holder(nn.Module):
    """One tensor of any shape as a weight, behind another leaf, as weights sit in a model."""

    def __init__(self, values: torch.Tensor) -> None:
        super().__init__()
        self.first = nn.Linear(2, 2)  # another leaf, so that the held weight sits after other values
        self.held = nn.Module()
        self.held.weight = nn.Parameter(values.detach().clone(), requires_grad=False)
        self.first.requires_grad_(False)


def weight_like(kind: Kind, values: torch.Tensor, tmp_path: Path) -> tuple[torch.Tensor, nn.Parameter]:
    """An offloaded weight of ``kind`` holding ``values`` (rounded) and its oracle.

    Both need no gradient: in-place ops apply to them as to frozen weights. The engine keeps a
    master copy for the weights of matmul layers only, whose shape is fixed: a master weight
    of any shape is made as the engine makes it, through ``offloaded_like``. The module that
    held the weight is dropped with its offload (nothing outside it changed), so a failed
    test's views of the weight need no undo.
    """
    rounded = values.detach().to(kind.storage).to(torch.float32)
    oracle = nn.Parameter(rounded.clone(), requires_grad=False)
    if kind.master:
        weight = offloaded_like(oracle, rounded.clone(), torch.float32, shadow_dtype=kind.storage)
        return weight, oracle
    holder = round_(Holder(rounded), kind.storage)
    offloaded(kind, holder, tmp_path)
    return holder.held.weight, oracle
