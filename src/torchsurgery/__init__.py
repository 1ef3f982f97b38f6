"""torchsurgery: live, reversible surgery on PyTorch models.

Four pillars, each with an exact undo:

* patch: change what a module instance does (:class:`Patch`, :func:`patch`, ...).
* tensors: convert and load the tensors a module holds without breaking references.
* offload: keep weights in host memory or a compact dtype, bring them in just before use.
* flex: capture and edit what flows through a model, by module name, in groups.
"""

from torchsurgery._undo import SurgeryEntry, restore, surgery_log
from torchsurgery.flex import DummyModule, FlexModel, HookFunction
from torchsurgery.offloading import (
    DEFAULT_SKIP,
    DevicePool,
    DynamicSwapInstaller,
    GroupPlan,
    OffloadDevice,
    OffloadHandle,
    OffloadPlan,
    OffloadStats,
    ParamPlan,
    PoolStats,
    Residency,
    offload,
    plan_offload,
)
from torchsurgery.patching import (
    Patch,
    is_patched,
    original_class,
    patch,
    patched,
    patches,
    unpatch,
)
from torchsurgery.tensors import (
    CheckpointError,
    LoadResult,
    convert_,
    load_,
    skeleton,
    swap_on_conversion,
)

__version__ = "0.1.0"

__all__ = [
    # undo: one log for every kind of surgery
    "surgery_log",
    "restore",
    "SurgeryEntry",
    # patch: what a module instance does
    "Patch",
    "patch",
    "unpatch",
    "is_patched",
    "patches",
    "original_class",
    "patched",
    # tensors: which tensors a module holds
    "swap_on_conversion",
    "convert_",
    "load_",
    "LoadResult",
    "skeleton",
    "CheckpointError",
    # offload: where and in what dtype weights live
    "DynamicSwapInstaller",
    "offload",
    "plan_offload",
    "OffloadPlan",
    "GroupPlan",
    "ParamPlan",
    "Residency",
    "OffloadHandle",
    "OffloadStats",
    "OffloadDevice",
    "DEFAULT_SKIP",
    "DevicePool",
    "PoolStats",
    # flex: what flows through a model
    "FlexModel",
    "HookFunction",
    "DummyModule",
]
