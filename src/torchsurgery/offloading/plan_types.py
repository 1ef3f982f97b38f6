"""The entries of an offload plan: each parameter's, each group's, where values live, and the checked arguments.

:func:`~torchsurgery.plan_offload` fills them in (:mod:`torchsurgery.offloading.plan`); the
modules after it only read them. Everything is keyed by qualified names: a parameter shared
by several modules (tied weights) is listed under each name, and every occurrence after the
first names the first one in ``tied_to``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from torchsurgery._device import OffloadDevice
from torchsurgery.compact import Scaled

__all__ = ["Residency", "ParamPlan", "GroupPlan", "PlanOptions"]


class Residency(enum.Enum):
    """Where a parameter's values live while the model is offloaded.

    Example:
        >>> from torchsurgery.offloading import Residency
        >>> Residency.STREAMED.value
        'streamed'
    """

    RESIDENT = "resident"
    """On the device in its storage dtype (with a master: the master and its narrow copy) for as
    long as the offload lasts."""
    STREAMED = "streamed"
    """In its group's flat host buffer (storage dtype), copied in through the ring of device buffers."""
    FILE = "file"
    """In the checkpoint file (the parameter is ``meta``), read in through the ring."""
    NARROW = "narrow"
    """In host memory in the storage dtype; its CPU matmul layer reads it narrow."""
    CONVERTED = "converted"
    """In host memory; converted for each forward without the ring (a tensor subclass, or a
    weight tied to one whose host copy lives in an earlier group's buffer)."""
    IN_PLACE = "in place"
    """In host memory in its compute dtype, where a CPU computes with it directly: nothing is brought in."""


@dataclass
class ParamPlan:
    """One parameter under one qualified name.

    Attributes:
        name: qualified name (``"blocks.0.fc.weight"``).
        module: qualified name of the module holding it.
        attr: its name in that module.
        storage_dtype: the dtype it is kept in while offloaded, resident or not (read from the
            file: the file's, or the ``storage_dtype`` it is converted to as it is read).
        compute_dtype: the dtype its group computes with.
        shadow_dtype: with a ``master_dtype``: the dtype of the narrow copy that serves
            forwards without gradients (``None``: no copy).
        residency: where its values live while offloaded.
        file_key: its key in the checkpoint file, where it is read from there.
        tied_to: the name of the first occurrence of the same parameter, if this is not it.
        nbytes: its bytes in the compute dtype (what a read of it widens to).
        scaled: the scaled format its values are kept in (``storage_dtype`` is then the
            format's narrow dtype; :mod:`torchsurgery.compact.scaled`), or ``None``.
        file_scale: the key of the scale its values in the checkpoint file are multiplied by
            (ComfyUI's scaled fp8 layout: ``<prefix>.scale_weight``), or ``None``.
        scale_nbytes: the bytes of its fp32 scale, kept and moved next to its values (0 unscaled).
        reads_narrow: read from the checkpoint file with a ``storage_dtype``: on a CPU its matmul
            layer computes from its stored values, as from a :attr:`Residency.NARROW` weight's.
        converts: read from the checkpoint file and kept in another format than the file's
            (converted as it is read).
        file_dtype: read from the checkpoint file: the dtype the file stores it in (else ``None``).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> layer = nn.Sequential(nn.Linear(2, 2))
        >>> p = torchsurgery.plan_offload(layer, storage_dtype=torch.float16, dtype=torch.float32).params[0]
        >>> p.name, p.storage_dtype, p.compute_dtype, p.lookup(layer) is layer[0].weight
        ('0.weight', torch.float16, torch.float32, True)
    """

    name: str
    module: str
    attr: str
    storage_dtype: torch.dtype
    compute_dtype: torch.dtype
    shadow_dtype: torch.dtype | None
    residency: Residency
    file_key: str | None
    tied_to: str | None
    nbytes: int
    scaled: Scaled | None = None
    file_scale: str | None = None
    scale_nbytes: int = 0
    reads_narrow: bool = False
    converts: bool = False
    file_dtype: torch.dtype | None = None

    def lookup(self, model: nn.Module) -> nn.Parameter:
        """The parameter in ``model`` (the object itself, not what attribute access returns)."""
        param = model.get_submodule(self.module)._parameters[self.attr]
        assert param is not None
        return param

    def lookup_in(self, named: Mapping[str, nn.Module]) -> nn.Parameter:
        """The parameter among the model's modules by qualified name (``dict(model.named_modules())``):
        :meth:`lookup` without walking the model again, for code that looks up many."""
        param = named[self.module]._parameters[self.attr]
        assert param is not None
        return param

    def reads_as_computed(self) -> bool:
        """Whether it becomes an :class:`~torchsurgery.compact.tensor.OffloadedTensor` (under its first name).

        Weights kept in another dtype than they compute in (or next to a narrow shadow), in host
        memory or resident on the device, do, so that they read as the compute dtype and their
        values are those of the storage dtype wherever they live; the others already do.
        """
        return (
            self.tied_to is None
            and self.residency in (Residency.NARROW, Residency.STREAMED, Residency.RESIDENT)
            and (self.storage_dtype != self.compute_dtype or self.shadow_dtype is not None)
        )

    def reads_elsewhere(self, device: torch.device) -> bool:
        """Whether it keeps its values in host memory (or its file) while it computes on the accelerator ``device``.

        It then becomes an :class:`~torchsurgery.compact.tensor.OffloadedTensor` reading as a
        tensor on ``device`` (under its first name): the model reads as a model there
        (``model.device``, ``next(model.parameters()).device``), as the dtype rule makes it read
        as its compute dtype.
        """
        return self.tied_to is None and device.type != "cpu" and self.residency in (Residency.STREAMED, Residency.FILE)


@dataclass
class GroupPlan:
    """A group of modules whose weights move together.

    Attributes:
        name: qualified name of the group's root module (``""``: the model).
        resident: kept on the device from the start (more may follow from measurements).
        nbytes: its parameters' bytes as they are held on the device when resident: in
            their storage dtype, and a master's narrow copy besides (tied ones counted
            once, in the first group holding them; see
            :func:`~torchsurgery.offloading.budgets.held_bytes`).
        params: its parameters, in module order.
        tier: where its weights are kept between runs: ``"device"`` (resident), ``"host"``
            (host memory; from a checkpoint file: read once, then kept within ``host_budget``),
            ``"disk"`` (read from the checkpoint file on every forward) or ``"split"`` (its
            first ``host_bytes`` kept in host memory, the rest read on every forward).
        host_bytes: of a group streamed from a checkpoint file, the bytes of it (as the file
            holds them) the host tier keeps.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> [(g.name, g.nbytes) for g in torchsurgery.plan_offload(model, groups="leaves").groups]
        [('0', 24), ('1', 24)]
        >>> plan = torchsurgery.plan_offload(model, groups="leaves", storage_dtype=torch.bfloat16, dtype=torch.float32)
        >>> [(g.name, g.nbytes) for g in plan.groups]  # held in bf16
        [('0', 12), ('1', 12)]
    """

    name: str
    resident: bool
    nbytes: int
    params: list[ParamPlan] = field(default_factory=list)
    tier: str = "host"
    host_bytes: int = 0


@dataclass(frozen=True)
class PlanOptions:
    """The checked arguments of one plan."""

    device: OffloadDevice
    dtype: torch.dtype | None
    storage_dtype: torch.dtype | Scaled | None
    master_dtype: torch.dtype | None
    budget: int | None
    prefetch: int
    pin: bool
    skip: Callable[[nn.Module, str], bool] | None
    finer_groups: bool  # whether groups finer than the chosen ones exist (not 'leaves' already)
