"""PyTorch's ``module_db`` on the test device: every module, forward and backward, computes there
what it computes on the CPU, so that the accelerator tests see what a GPU would run.

tardy runs each operator as the CPU's kernel, so most modules agree bit for bit. Where PyTorch
gives every device but the CPU another kernel (RNN cells take a fused kernel, attention another
backend), they agree within fp32 rounding, as a GPU's would. What tardy cannot run as a GPU
does is marked strictly, with the reason.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_leaves, tree_map

from _torch_testing import internal

# .to(device) of a module keeps its parameter objects only where PyTorch's shallow-copy check
# counts the device as dense, which it does for CUDA but not for a PrivateUse1 backend: a lazy
# module's uninitialised parameters become plain empty ones on the way
_GAPS = {
    name: "PyTorch counts no PrivateUse1 backend as dense: Module.to() replaces a lazy module's uninitialised parameters"
    for name in ("nn.LazyConv1d", "nn.LazyConv2d", "nn.LazyConv3d", "nn.LazyConvTranspose1d", "nn.LazyConvTranspose2d",
                 "nn.LazyConvTranspose3d")
}
# modules whose kernels elsewhere than on the CPU are other ones (within fp32 rounding): the fused
# RNN cells (tardy composes them from its ops, tests/tardy/tardy.cpp) and attention's backends
_OTHER_KERNELS = {"nn.LSTM", "nn.LSTMCell", "nn.GRU", "nn.GRUCell", "nn.MultiheadAttention", "nn.Transformer",
                  "nn.TransformerEncoder", "nn.TransformerEncoderLayer", "nn.TransformerDecoderLayer"}
MODULES = internal("common_modules", "module_db")


def _cases() -> list[Any]:
    return [
        pytest.param(info, id=info.name, marks=[pytest.mark.xfail(strict=True, reason=_GAPS[info.name])] if info.name in _GAPS else [])
        for info in MODULES
    ]


def _run(module: torch.nn.Module, args: Any, kwargs: Any, seed: int) -> list[torch.Tensor]:
    """The outputs, then the gradients of the inputs and parameters, of one forward and backward."""
    torch.manual_seed(seed)
    out = module(*args, **kwargs)
    outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    differentiable = [t for t in outputs if t.requires_grad]
    if differentiable:
        sum(t.float().square().sum() for t in differentiable).backward()  # type: ignore[union-attr]
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = [t.grad for t in inputs + list(module.parameters()) if t.grad is not None]
    return [t.detach().cpu() for t in outputs + grads]


@pytest.mark.accelerator
@pytest.mark.parametrize("info", _cases())
def test_the_module_computes_on_the_device_what_it_computes_on_the_cpu(info: Any, on_tardy: torch.device) -> None:
    samples = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True, training=False)
    for index, sample in enumerate(samples[:2]):
        if sample.forward_input is None:
            continue
        torch.manual_seed(index)
        moved = lambda t: t.detach().to(on_tardy).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t  # noqa: E731
        cpu_args = tree_map(lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t,
                            (sample.forward_input.args, sample.forward_input.kwargs))
        ctor = sample.constructor_input
        # tensors given to the constructor in the inputs' dtype (module_db makes FractionalMaxPool's
        # samples in fp64 for every dtype, which the CPU's kernel alone lets through)
        as_inputs = lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        ctor_args, ctor_kwargs = tree_map(as_inputs, (ctor.args, ctor.kwargs))
        module = info.module_cls(*ctor_args, **ctor_kwargs).eval()
        on_device = info.module_cls(*tree_map(moved, ctor_args), **tree_map(moved, ctor_kwargs)).eval()
        on_device.load_state_dict(copy.deepcopy(module.state_dict()))
        on_device.to(on_tardy)
        want = _run(module, *cpu_args, seed=index)
        got = _run(on_device, *tree_map(moved, (sample.forward_input.args, sample.forward_input.kwargs)), seed=index)
        assert len(got) == len(want), f"sample {index}: {len(got)} outputs and gradients, the CPU's {len(want)}"
        exact = {} if info.name in _OTHER_KERNELS else {"rtol": 0.0, "atol": 0.0}
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, equal_nan=True, **exact, msg=lambda m, i=i, n=index: f"sample {n}, value {i}: {m}")
