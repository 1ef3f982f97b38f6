"""Hooks and ``torch.compile``: code compiled before a hook change must not outlive it.

Dynamo does not guard on module hooks, so code compiled before a hook was added (or
removed) would keep running without it (or with it). Every registration and every
restore therefore drops the compiled code of the model's ``forward`` methods.
"""

from __future__ import annotations

import sys
import types

from torch import nn

__all__ = ["invalidate_compiled"]


def invalidate_compiled(model: nn.Module) -> None:
    """Drop the code ``torch.compile`` made for ``model``, so hook changes take effect.

    The compiled frames are the ``forward`` of the model's module classes, or the
    wrapper Dynamo puts around a ``torch.nn`` container; each recompiles on its next call.
    Nothing happens (and nothing is imported) when nothing was ever compiled.

    Example:
        >>> invalidate_compiled(nn.Linear(1, 1))  # nothing compiled: no effect
    """
    if sys.modules.get("torch._dynamo") is None:
        return  # nothing was ever compiled in this process
    from torch._dynamo import eval_frame, external_utils

    codes = {f.__code__ for m in model.modules() if hasattr(f := type(m).forward, "__code__")}
    codes.update(c for c in external_utils.wrap_inline.__code__.co_consts if isinstance(c, types.CodeType))
    for code in codes:
        eval_frame.reset_code(code)
