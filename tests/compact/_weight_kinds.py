"""Every kind of offloaded weight, made the way programs make it, next to its plain oracle.

A kind is one way torchsurgery keeps a weight that computes in fp32: narrow storage (bf16,
fp16, fp8 e4m3fn, fp8 e5m2), a master copy with a narrow shadow, groups streamed from host
under a budget, groups streamed from a safetensors file, and ``DynamicSwapInstaller``
given a ``dtype``; and every scaled format (``SCALED_KINDS``: fp8 e4m3fn and e5m2 per
tensor and per channel, int8 per channel). The oracle of an offloaded weight is a plain
``nn.Parameter`` holding the same values, rounded to the storage dtype first (a scaled
weight's: the dequantised values ``q.float() * scale`` it was stored as), so that both hold
exactly the same numbers; whatever PyTorch does with the one it must do with the other.
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
from torchsurgery.compact import Scaled, offloaded_like, own_scale


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
    scaled: Scaled | None = None
    """The scaled format it is stored in (``storage`` is its narrow dtype)."""

    def kept(self, values: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
        """What the weight ``like`` keeps (``stored``) after ``values`` are written into it.

        A scaled weight keeps its scale: the values are rounded to its grid, saturating at
        the format's largest value (int8: to the nearest integer, half to even).
        """
        if self.scaled is not None:
            assert like is not None, "a scaled weight's rounding needs the weight (its scale)"
            largest = 127.0 if self.storage == torch.int8 else float(torch.finfo(self.storage).max)
            ratio = (values.detach().float() / _scale_of(like)).clamp(-largest, largest)
            return (ratio.round() if self.storage == torch.int8 else ratio).to(self.storage)
        return values.detach().clone() if self.master else values.detach().to(self.storage)

    def read(self, values: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
        """What the weight ``like`` reads as (fp32) after ``values`` are written into it.

        Forwards that record gradients compute with these; so do those without, except with
        a master copy, whose shadow (``storage``-rounded) serves them.
        """
        if self.scaled is not None:
            return self.kept(values, like).float() * _scale_of(like)
        return self.kept(values).to(torch.float32)


def _scale_of(weight: torch.Tensor | None) -> torch.Tensor:
    scale = own_scale(weight) if weight is not None else None
    assert scale is not None, f"not a scaled weight: {type(weight).__name__}"
    return scale


def dequantised(weight: torch.Tensor) -> torch.Tensor:
    """What a weight reads as, from what it keeps: a scaled weight's ``q.float() * scale``, else its values."""
    if own_scale(weight) is None:
        return weight.detach().clone()
    return weight.stored.float() * _scale_of(weight)


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
SCALED_KINDS = [
    Kind(f"{str(dtype).removeprefix('torch.')}-{per}", dtype, {"storage_dtype": Scaled(dtype, per=per)}, scaled=Scaled(dtype, per=per))
    for dtype, per in [
        (torch.float8_e4m3fn, "channel"), (torch.float8_e4m3fn, "tensor"), (torch.float8_e5m2, "channel"),
        (torch.float8_e5m2, "tensor"), (torch.int8, "channel"),  # int8 is per channel only (Scaled refuses per tensor)
    ]
]


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
    model = build() if kind.scaled else round_(build(), kind.storage)
    plain = copy.deepcopy(model)
    undo = offloaded(kind, model, tmp_path)
    if kind.scaled:  # the plain model holds what each weight was stored as, dequantised
        with torch.no_grad():
            for p, q in zip(plain.parameters(), model.parameters(), strict=True):
                p.copy_(dequantised(q))
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
    if kind.scaled is not None:
        return _scaled_weight_like(kind.scaled, values, tmp_path)
    rounded = values.detach().to(kind.storage).to(torch.float32)
    oracle = nn.Parameter(rounded.clone(), requires_grad=False)
    if kind.master:
        weight = offloaded_like(oracle, rounded.clone(), torch.float32, shadow_dtype=kind.storage)
        return weight, oracle
    holder = round_(Holder(rounded), kind.storage)
    offloaded(kind, holder, tmp_path)
    return holder.held.weight, oracle


def _scaled_weight_like(fmt: Scaled, values: torch.Tensor, tmp_path: Path) -> tuple[torch.Tensor, nn.Parameter]:
    """A weight stored in ``fmt`` holding ``values`` and its oracle, the plain parameter holding its dequantised values.

    The offload stores weights of two or more dimensions in a scaled format (a bias keeps the
    compute dtype): those are made by it, in a model; one of fewer dimensions as the engine
    makes a scaled weight (``offloaded_like`` with the scale it chooses: one for the tensor).
    """
    if values.dim() >= 2:
        holder = Holder(values.detach().float())
        torchsurgery.offload(holder, storage_dtype=fmt, dtype=torch.float32, skip=None)
        weight: torch.Tensor = holder.held.weight
    else:
        plain = nn.Parameter(values.detach().float().clone(), requires_grad=False)
        q, scale = fmt.quantize(plain)
        weight = offloaded_like(plain, q, torch.float32, scale=scale)
    assert own_scale(weight) is not None, f"{fmt} did not store a weight of shape {list(values.shape)} scaled"
    return weight, nn.Parameter(dequantised(weight), requires_grad=False)
