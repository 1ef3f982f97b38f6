"""torchsurgery: live, reversible surgery on PyTorch models.

Four pillars, each with an exact undo:

* patch: change what a module instance does (:class:`Patch`, :func:`patch`, ...).
* tensors: convert and load the tensors a module holds without breaking references.
* offload: keep weights in host memory or a compact dtype, bring them in just before use.
* flex: capture and edit what flows through a model, by module name, in groups.
"""

from torchsurgery._undo import SurgeryEntry, restore, surgery_log
from torchsurgery.errors import (
    ArgumentError,
    ArgumentTypeError,
    ArgumentValueError,
    BudgetError,
    NoMatchError,
    Setting,
)
from torchsurgery.flex import DummyModule, FlexModel, HookFunction
from torchsurgery.flex.parallel import ParallelRequest
from torchsurgery.flex.routing import Routing, register_parallel_routing
from torchsurgery.offloading import (
    DEFAULT_SKIP,
    DevicePool,
    DynamicSwapInstaller,
    OffloadDevice,
    OffloadHandle,
    OffloadStats,
    PoolStats,
    offload,
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


def _distributed_routing(request: ParallelRequest) -> Routing:
    # imported by the first distributed wrapper: torch.distributed.tensor is slow to import
    from torchsurgery.distributed import distributed_routing

    return distributed_routing(request)


register_parallel_routing(_distributed_routing)

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
    # errors: refusals that carry their facts as fields
    "ArgumentError",
    "ArgumentValueError",
    "ArgumentTypeError",
    "BudgetError",
    "NoMatchError",
    "Setting",
]
