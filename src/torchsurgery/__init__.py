"""torchsurgery: live, reversible surgery on PyTorch models.

Four pillars, all recording what they do in one undo log per module: :func:`surgery_log`
lists it and :func:`restore` undoes it, newest first, into the same module, parameter and
buffer objects.

* patch: change what a module instance does (:class:`Patch`, :func:`patch`, ...);
  undone exactly, also from the middle of a stack (:func:`unpatch`).
* tensors: convert and load the tensors a module holds without breaking references
  (:func:`convert_`, :func:`load_`); undone exactly: a conversion is converted back (one
  that loses information keeps the original values in host memory for that), and a load
  gives back what it overwrote. ``undoable=False`` records and keeps nothing.
* offload: keep weights in host memory or a compact dtype, bring them in just before use
  (:func:`offload`); undone by putting every weight back on its device in its dtype (the
  rounding of a narrower ``storage_dtype`` stays, unless ``master_dtype`` keeps the originals).
* flex: capture and edit what flows through a model, by module name, in groups
  (:class:`FlexModel`); undone by taking every hook off.
"""

# `python -m torchsurgery`: Ctrl-C is the command's from here on, before torch is imported
from _torchsurgery_interrupt import install_if_run_as_module as _command_start

_command_start()

from torchsurgery._undo import SurgeryEntry, restore, surgery_log
from torchsurgery.errors import (
    ArgumentError,
    ArgumentTypeError,
    ArgumentValueError,
    BudgetError,
    NoMatchError,
    Setting,
)
from torchsurgery.flex import DummyModule, FlexModel, HookFunction, ShapeHintWarning
from torchsurgery.offloading import (
    DEFAULT_SKIP,
    DevicePool,
    DynamicSwapInstaller,
    GroupPlan,
    OffloadDevice,
    OffloadedTensor,
    OffloadHandle,
    OffloadPlan,
    OffloadStats,
    ParamPlan,
    PoolStats,
    Residency,
    from_pretrained,
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
    "from_pretrained",
    "OffloadPlan",
    "GroupPlan",
    "ParamPlan",
    "Residency",
    "OffloadHandle",
    "OffloadStats",
    "OffloadDevice",
    "OffloadedTensor",
    "DEFAULT_SKIP",
    "DevicePool",
    "PoolStats",
    # flex: what flows through a model
    "FlexModel",
    "HookFunction",
    "DummyModule",
    "ShapeHintWarning",
    # errors: refusals that carry their facts as fields
    "ArgumentError",
    "ArgumentValueError",
    "ArgumentTypeError",
    "BudgetError",
    "NoMatchError",
    "Setting",
]
