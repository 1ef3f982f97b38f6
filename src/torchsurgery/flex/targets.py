"""What a hook's ``module_name`` names: modules or parameters, through wrappers, by glob.

DDP, DataParallel, FSDP1 and ``torch.compile`` put the model inside a wrapper whose names
carry a prefix (``module.``, ``_orig_mod.``); flex_model's users write names either way.
FSDP2 (``fully_shard``) swaps classes in place and adds no prefix, so it needs nothing
here. A name is exact or a glob; with pipeline stages it may name a module another stage
holds, which the routing decides (``matched_anywhere``).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from torchsurgery._names import glob_match, is_glob, no_match
from torchsurgery.flex.hook_function import HookType
from torchsurgery.flex.routing import Routing

__all__ = ["Target", "unwrap", "unwrap_with_prefixes", "split_prefix", "find_targets"]

Target = tuple[str, nn.Module | torch.Tensor, nn.Module | None]
"""``(name as the hook names it, module or parameter, the parameter's module)``."""


def _fsdp1_class() -> type | None:
    # an FSDP1 model exists only once its module has been imported
    if "torch.distributed.fsdp" not in sys.modules:
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _is_fully_sharded(model: nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def unwrap_with_prefixes(module: nn.Module) -> tuple[nn.Module, list[str]]:
    """The model inside DDP, DataParallel, FSDP1 and ``torch.compile`` wrappers, and the
    prefixes their names put before the model's own (longest first).

    Example:
        >>> m = nn.Linear(1, 1)
        >>> root, prefixes = unwrap_with_prefixes(nn.DataParallel(m))
        >>> root is m, prefixes
        (True, ['module.'])
    """
    fsdp1 = _fsdp1_class()
    prefixes = [""]
    steps: tuple[str, ...]
    while True:
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            module, steps = module.module, ("module.",)
        elif fsdp1 is not None and isinstance(module, fsdp1):
            # named_modules() says _fsdp_wrapped_module; flex_model's users write module.
            module, steps = module._fsdp_wrapped_module, ("_fsdp_wrapped_module.", "module.")  # type: ignore[assignment]
        elif isinstance(getattr(module, "_orig_mod", None), nn.Module):
            module, steps = module._orig_mod, ("_orig_mod.",)  # type: ignore[assignment]
        else:
            return module, sorted((p for p in prefixes if p), key=len, reverse=True)
        prefixes = [p + step for p in prefixes for step in steps]


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside DDP, DataParallel, FSDP1 and ``torch.compile`` wrappers.

    Example:
        >>> m = nn.Linear(1, 1)
        >>> unwrap(nn.DataParallel(m)) is m
        True
    """
    return unwrap_with_prefixes(module)[0]


def split_prefix(name: str, prefixes: list[str]) -> tuple[str, str]:
    """``(prefix, bare name)``: both name forms (``module.fc1`` and ``fc1``) are accepted.

    Example:
        >>> split_prefix("module.fc1", ["module."]), split_prefix("fc1", ["module."])
        (('module.', 'fc1'), ('', 'fc1'))
    """
    for prefix in prefixes:
        if name.startswith(prefix):
            return prefix, name[len(prefix) :]
    return "", name


def find_targets(
    model: nn.Module, name: str, hook_type: HookType, routing: Routing, *, local: bool = False
) -> list[Target]:
    """What a hook named ``name`` binds to in ``model``, named as the hook names it.

    Args:
        model: the wrapped model (maybe inside DDP/FSDP1/compile wrappers).
        name: the hook's ``module_name``: a qualified name or a glob.
        hook_type: ``tensor`` names parameters; every other type names modules.
        routing: says whether another pipeline stage holds the target.
        local: a name this process already matched (no question to the other stages).

    Raises:
        ValueError: nothing matches anywhere (near names listed), or a gradient hook on
            an FSDP2 parameter, which never runs.

    Example:
        >>> from torchsurgery.flex.routing import LocalRouting
        >>> model = nn.Sequential(nn.Linear(1, 1), nn.ReLU())
        >>> [t[0] for t in find_targets(nn.DataParallel(model), "module.*", "forward", LocalRouting())]
        ['module.0', 'module.1']
    """
    what = f"torchsurgery.FlexModel ({hook_type} hook)"
    root, prefixes = unwrap_with_prefixes(model)
    prefix, pattern = split_prefix(name, prefixes)
    if hook_type == "tensor":
        if _is_fully_sharded(root):
            raise ValueError(
                f"{what}: {pattern!r}: FSDP2 hands each parameter its reduced gradient directly, "
                "so a gradient hook on it never runs; read param.grad.full_tensor() after backward"
            )
        params = dict(root.named_parameters())
        names = [n for n in params if glob_match(pattern, n)] if is_glob(pattern) else [n for n in params if n == pattern]
        if not local and not routing.matched_anywhere(bool(names), hook_type, pattern):
            raise no_match(what, pattern, list(params), kind="parameter")
        return [(prefix + n, params[n], root.get_submodule(n.rpartition(".")[0])) for n in names]
    modules = dict(root.named_modules())
    names = [n for n in modules if glob_match(pattern, n)]
    if not local and not routing.matched_anywhere(bool(names), hook_type, pattern):
        raise no_match(what, pattern, [n for n in modules if n])
    return [(prefix + n, modules[n], None) for n in names]  # none here: another pipeline stage holds it
