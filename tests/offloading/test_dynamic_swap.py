"""Tests of DynamicSwapInstaller: the seed's call surface, without its bugs."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _offload_models import least_budget
from torch import nn

import torchsurgery
from torchsurgery import DynamicSwapInstaller
from torchsurgery.offloading import OffloadedTensor, stored_values


def model_() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def test_outputs_equal_the_converted_model_and_storage_is_untouched() -> None:
    model = model_().eval().to(torch.bfloat16)
    reference = copy.deepcopy(model).float()
    stored = {n: (id(t), t.dtype) for n, t in model.state_dict(keep_vars=True).items()}
    DynamicSwapInstaller.install_model(model, dtype=torch.float32)
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    # the same objects, their values kept as stored, reading as the dtype they compute in
    assert {n: (id(t), stored_values(t).dtype) for n, t in model.state_dict(keep_vars=True).items()} == stored
    assert all(p.dtype == torch.float32 for p in model.parameters())
    floating = [b for b in model.buffers() if b.is_floating_point()]
    assert floating and all(b.dtype == torch.float32 and b.stored.dtype == torch.bfloat16 for b in floating)
    assert {k: v.dtype for k, v in model.state_dict().items()} == {k: d for k, (_, d) in stored.items()}
    DynamicSwapInstaller.uninstall_model(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in model_().modules()]


def test_training_through_it_updates_the_stored_weights() -> None:
    model = model_().double()
    reference = copy.deepcopy(model).float()
    DynamicSwapInstaller.install_model(model, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for m, o in ((model, opt), (reference, ref_opt)):
        loss = F.mse_loss(m(x), y)
        o.zero_grad()
        loss.backward()
        o.step()
    DynamicSwapInstaller.uninstall_model(model)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert a.dtype == torch.float64 and a.grad is not None
        torch.testing.assert_close(a.float(), b, rtol=1e-5, atol=1e-6)


def test_each_weight_is_converted_once_per_forward() -> None:
    class TwiceRead(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.weight) + F.linear(x, self.weight)

    layer = TwiceRead(3, 3, bias=False).to(torch.float16)
    DynamicSwapInstaller.install_model(layer, dtype=torch.float32)
    conversions = []
    real_to = torch.Tensor.to
    inside = []

    def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not inside:  # a tensor subclass's __torch_function__ calls it again, within the same call
            conversions.append(self.shape)
        inside.append(True)
        try:
            return real_to(self, *args, **kwargs)
        finally:
            inside.pop()

    torch.Tensor.to = counting  # type: ignore[method-assign]
    try:
        layer(torch.randn(1, 3))
    finally:
        torch.Tensor.to = real_to  # type: ignore[method-assign]
    assert conversions == [torch.Size([3, 3])]


def test_install_twice_and_on_patched_modules_then_uninstall() -> None:
    class Tag(torchsurgery.Patch, nn.Linear):
        pass

    model = model_()
    torchsurgery.patch(model[0], Tag)
    DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    DynamicSwapInstaller.install_model(model, dtype=torch.float32)  # replaces, keeps the original class
    assert model[3].weight.dtype == torch.float32
    DynamicSwapInstaller.uninstall_model(model)
    assert type(model[3]) is nn.Linear and torchsurgery.patches(model[0]) == [Tag]
    assert isinstance(model[0], Tag) and type(model[0]).__name__ == "Linear"


def test_one_class_per_original_class_and_pickling() -> None:
    model = model_().eval()
    DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    assert type(model[0]) is type(model[3])
    copy_ = pickle.loads(pickle.dumps(model))
    x = torch.randn(2, 4)
    torch.testing.assert_close(copy_(x.double()), model(x.double()))
    DynamicSwapInstaller.uninstall_model(copy_)
    assert type(copy_[0]) is nn.Linear


def test_attribute_errors_are_plain_attribute_errors() -> None:
    layer = nn.Linear(2, 2)
    DynamicSwapInstaller._install_module(layer, dtype=torch.float64)
    with pytest.raises(AttributeError, match="no_such"):
        layer.no_such  # noqa: B018
    assert not hasattr(layer, "no_such")
    with pytest.raises(ValueError, match="give the conversion"):
        DynamicSwapInstaller._install_module(layer)
    with pytest.raises(TypeError, match="install_model: expected an nn.Module, got NoneType"):
        DynamicSwapInstaller.install_model(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype=torch.int8 would turn weights into integers"):
        DynamicSwapInstaller.install_model(nn.Sequential(nn.Linear(2, 2)), dtype=torch.int8)
    with pytest.raises(ValueError, match="is not one Tensor.to can do here"):
        DynamicSwapInstaller.install_model(nn.Sequential(nn.Linear(2, 2)), device="xpu")
    DynamicSwapInstaller._uninstall_module(layer)
    DynamicSwapInstaller._uninstall_module(layer)  # a no-op when not installed
    assert type(layer) is nn.Linear


@pytest.mark.parametrize("without_graph", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_a_read_under_no_grad_first_does_not_cost_the_weight_its_gradient(without_graph: Any) -> None:
    class NormedFirst(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with without_graph():
                scale = self.weight.norm().item()  # a statistic read first, without a graph
            return F.linear(x, self.weight, self.bias) / scale

    layer = NormedFirst(3, 2).double()
    reference = copy.deepcopy(layer).float()
    DynamicSwapInstaller.install_model(layer, dtype=torch.float32)
    x = torch.randn(4, 3)
    layer(x).sum().backward()
    reference(x).sum().backward()
    stored = dict(layer.named_parameters())  # attribute reads give the converted copies
    for name, ref in reference.named_parameters():
        mine = stored[name]
        assert mine.grad is not None, name
        torch.testing.assert_close(mine.grad.float(), ref.grad, rtol=1e-5, atol=1e-6)


def test_a_weight_read_under_no_grad_and_used_with_grad_gets_its_gradient() -> None:
    class ReadWithoutGraph(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                weight = self.weight  # read once, without gradients (the plain weight: the parameter itself)
            return F.linear(x, weight, self.bias) * weight.sum()  # used with them

    layer = ReadWithoutGraph(3, 2).double()
    reference = copy.deepcopy(layer).float()
    DynamicSwapInstaller.install_model(layer, dtype=torch.float32)
    x = torch.randn(4, 3)
    layer(x).square().sum().backward()
    reference(x).square().sum().backward()
    stored = dict(layer.named_parameters())
    for name, ref in reference.named_parameters():
        assert stored[name].grad is not None, name
        torch.testing.assert_close(stored[name].grad.float(), ref.grad, rtol=1e-5, atol=1e-6)


def test_a_dtype_converts_floating_tensors_only() -> None:
    layer = nn.Linear(2, 2).double()
    layer.register_buffer("positions", torch.arange(4))
    DynamicSwapInstaller._install_module(layer, dtype=torch.float32)
    assert layer.positions.dtype == torch.int64 and layer.weight.dtype == torch.float32


@pytest.mark.parametrize("dtype", [None, torch.float32], ids=["no-dtype", "fp32"])
def test_an_installed_model_takes_dtype_conversions_as_the_plain_model(dtype: Any) -> None:
    model = model_().eval().to(torch.bfloat16)
    plain = copy.deepcopy(model)
    if dtype is not None:
        plain.to(dtype)
    DynamicSwapInstaller.install_model(model, device="cpu", **({"dtype": dtype} if dtype else {}))
    ids = {n: id(p) for n, p in model.named_parameters()}
    x = torch.randn(2, 4)
    for convert in (lambda m: m.to(torch.float64), lambda m: m.half(), lambda m: m.float()):
        convert(model)
        convert(plain)
        assert {n: id(p) for n, p in model.named_parameters()} == ids
        assert [p.dtype for p in model.parameters()] == [p.dtype for p in plain.parameters()]
        first = next(plain.parameters()).dtype
        got, want = model(x.to(first)), plain(x.to(first))
        assert got.dtype == want.dtype and torch.equal(got, want)
    model.to("cpu")  # changes nothing
    DynamicSwapInstaller.uninstall_model(model)  # the conversions are the user's: they stay
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))


def _installs(model: nn.Module) -> list[tuple[str, str]]:
    return [(e.module_name, e.description) for e in torchsurgery.surgery_log(model)]


def test_a_reinstall_refused_by_a_pending_backward_keeps_the_installation_it_replaces() -> None:
    model = model_().eval()
    reference = copy.deepcopy(model).double()
    DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    x = torch.randn(3, 4)
    loss = model(x.double()).sum()  # its graph holds the weights the installation reads as fp64
    DynamicSwapInstaller.uninstall_model(model)  # an undo does not wait for it
    DynamicSwapInstaller.install_model(model, device="cpu")
    before = _installs(model)
    loss = model(x).sum()  # holds the plain weights now
    with pytest.raises(RuntimeError, match=r"cannot swap 'weight': it is held elsewhere"):
        DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    assert _installs(model) == before  # every module keeps the installation it had
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in model.parameters())
    loss.backward()  # not poisoned
    del loss
    DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    torch.testing.assert_close(model(x.double()), reference(x.double()), rtol=0, atol=0)


def test_uninstall_and_reinstall_refused_while_an_offload_holds_the_converted_weights() -> None:
    model = model_().eval()
    reference = copy.deepcopy(model)
    DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    torchsurgery.offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, groups="leaves")
    before = _installs(model)
    for again in ({}, {"dtype": torch.float32}):
        with pytest.raises(ValueError, match="an active offload now depends on"):
            if again:
                DynamicSwapInstaller.install_model(model, **again)
            else:
                DynamicSwapInstaller.uninstall_model(model)
        assert _installs(model) == before  # no module changed, the root no more than the others
    torchsurgery.restore(model)  # the offload first, newest first
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True))


@pytest.mark.accelerator
def test_an_installation_under_an_offload_made_since_is_not_removed(accelerator: torch.device) -> None:
    # offloaded, installed over the offload, the offload made again over the installation: the
    # new offload planned the weights as the installation reads them (fp64); uninstalling under
    # it left its forwards mixing the device and the host (found by the stateful test)
    model = model_().eval()
    reference = copy.deepcopy(model).to(accelerator)
    options: dict[str, Any] = {"dtype": torch.float32, "groups": "leaves"}
    handle = torchsurgery.offload(model, accelerator, budget=least_budget(model, accelerator, **options), **options)
    DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    handle.remove()
    handle = torchsurgery.offload(model, accelerator, budget=least_budget(model, accelerator, **options), **options)
    before = _installs(model)
    with pytest.raises(ValueError, match="uninstall_model: .* under an active offload made since"):
        DynamicSwapInstaller.uninstall_model(model)
    assert _installs(model) == before
    handle.remove()  # in the order the fix names
    DynamicSwapInstaller.uninstall_model(model)
    x = torch.randn(3, 4, device=accelerator)
    with torch.no_grad():
        torch.testing.assert_close(model.to(accelerator)(x), reference(x), rtol=0, atol=0)


def test_over_weights_an_offload_streams_from_a_file_a_dtype_is_refused_and_a_device_reads_them_as_meta(
    tmp_path: Any,
) -> None:
    from safetensors.torch import save_file

    model = model_().eval()
    reference = copy.deepcopy(model)
    path = tmp_path / "model.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path))
    handle = torchsurgery.offload(model, storage=path, groups="leaves")
    with pytest.raises(RuntimeError, match="cannot make 'weight' of this Linear read as torch.float64 on meta: an active offload"):
        DynamicSwapInstaller.install_model(model, dtype=torch.float64)  # the offload streams into these objects
    assert [e.kind for e in torchsurgery.surgery_log(model)] == ["offload"]
    DynamicSwapInstaller.install_model(model, device="cpu")
    assert model[0].weight.is_meta  # no values to move outside the forwards, which stream them in
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    handle.remove()
    DynamicSwapInstaller.uninstall_model(model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True))


def test_an_offload_over_an_installation_gives_back_the_weights_as_installed() -> None:
    # the installer's weights read as fp64 while kept in fp32; an offload over them, removed,
    # gives back that very representation (not plain fp64 values), and uninstalling then the model
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    weight = model[0]._parameters["weight"]
    handle = torchsurgery.offload(model, storage_dtype=torch.float32, dtype=torch.float64, groups="leaves")
    handle.remove()
    assert model[0]._parameters["weight"] is weight and isinstance(weight, OffloadedTensor)
    assert (weight.dtype, weight.stored.dtype) == (torch.float64, torch.float32)
    DynamicSwapInstaller.uninstall_model(model)
    for ours, theirs in zip(model.state_dict().values(), reference.state_dict().values(), strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


class _Sealed(nn.Linear):
    """A layer whose class refuses subclasses: no patch can apply to it."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise TypeError("_Sealed cannot be subclassed")


def _as_it_is(model: nn.Module) -> tuple[Any, ...]:
    """What an all-or-nothing change must leave as it was: classes, installations, tensor objects, state_dict."""
    state = {k: (v.dtype, v.clone()) for k, v in model.state_dict().items()}
    tensors = [(n, id(t), type(t), t.dtype) for n, t in [*model.named_parameters(), *model.named_buffers()]]
    return [type(m) for m in model.modules()], sorted(_installs(model)), tensors, state


def _same(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    *rest, state = before
    *rest_after, state_after = after
    return rest == rest_after and state.keys() == state_after.keys() and all(
        state[k][0] == state_after[k][0] and torch.equal(state[k][1], state_after[k][1]) for k in state
    )


@pytest.mark.parametrize("installed", [False, True], ids=["plain", "installed"])
@pytest.mark.parametrize("failure", ["sealed-class", "injected-third-module"])
def test_install_model_failing_half_way_leaves_the_model_as_it_was(
    failure: str, installed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a failure the checks before the first change cannot foresee: the modules installed
    # before it go back to what they were (not installed, or installed as they were)
    torch.manual_seed(0)
    last: nn.Module = _Sealed(4, 2) if failure == "sealed-class" else nn.Linear(4, 2)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 4), last).eval()
    if installed:  # kept in fp64, read as fp32 (the last layer, which may refuse patches, plain fp32)
        model[:-1].double()
        for module in list(model.modules())[:-1]:
            DynamicSwapInstaller._install_module(module, dtype=torch.float32)
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
    before = _as_it_is(model)
    if failure == "injected-third-module":
        from torchsurgery.offloading.dynamic_swap import _DynamicSwap

        real, calls = _DynamicSwap.__patch_init__, []

        def failing(self: nn.Module, **kwargs: Any) -> None:
            calls.append(self)
            if len(calls) == 3:
                raise RuntimeError("injected failure")
            real(self, **kwargs)

        monkeypatch.setattr(_DynamicSwap, "__patch_init__", failing)
    with pytest.raises((TypeError, RuntimeError), match="cannot be subclassed|injected failure"):
        DynamicSwapInstaller.install_model(model, dtype=torch.bfloat16)
    monkeypatch.undo()
    assert _same(before, _as_it_is(model))
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def _log(model: nn.Module) -> list[tuple[str, str, int]]:
    return [(e.module_name, e.description, e.seq) for e in torchsurgery.surgery_log(model)]


class _Doubled(torchsurgery.Patch, nn.Linear):
    """A patch of the user's own, applied over the installation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_a_reinstallation_failing_half_way_keeps_each_modules_stack_and_log(monkeypatch: pytest.MonkeyPatch) -> None:
    # installed, then patched by the user (their patch on top of the installation), then
    # installed again with a failure on the third module: each module keeps its class (the
    # patches in their order) and its log (the same records, in place, same order numbers)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Linear(8, 8))
    DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    torchsurgery.patch(model[0], _Doubled)
    torchsurgery.patch(model[2], _Doubled)
    x = torch.randn(2, 8, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
    classes, log = [type(m) for m in model.modules()], _log(model)
    real = DynamicSwapInstaller._install_module
    calls = []

    def failing(module: nn.Module, **kwargs: Any) -> None:
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        calls.append(module)
        real(module, **kwargs)

    monkeypatch.setattr(DynamicSwapInstaller, "_install_module", staticmethod(failing))
    with pytest.raises(RuntimeError, match="injected failure"):
        DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    monkeypatch.undo()
    assert [type(m) for m in model.modules()] == classes
    assert _log(model) == log
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    torchsurgery.restore(model)


class _Offset(nn.Linear):
    """A linear layer with a buffer added to its output."""

    def __init__(self) -> None:
        super().__init__(8, 8)
        self.register_buffer("offset", torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.offset


@pytest.mark.accelerator
def test_an_installation_over_a_loaded_model_undone_after_its_unload_gives_back_host_buffers(
    accelerator: torch.device,
) -> None:
    # out of order: the pool's load (below) is undone before the installation (above); the
    # installation then gives back the model as it is without the load (on the host), not the
    # device copies of the buffers it saw when it was installed
    model = nn.Sequential(_Offset(), nn.Linear(8, 8), _Offset())
    reference = copy.deepcopy(model)
    pool = torchsurgery.DevicePool(accelerator, budget=1 << 20)
    pool.add(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
    pool.load(model)
    DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    pool.close()
    torchsurgery.restore(model)
    assert torchsurgery.surgery_log(model) == []
    for (name, t), r in zip(model.state_dict(keep_vars=True).items(), reference.state_dict().values(), strict=True):
        assert t.device.type == "cpu" and type(t) in (torch.Tensor, nn.Parameter), name
        expected = r.bfloat16().float() if t.is_floating_point() and name.endswith(("weight", "bias")) else r
        torch.testing.assert_close(t.detach(), expected, rtol=0, atol=0, msg=name)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), copy.deepcopy(model)(x), rtol=0, atol=0)


@pytest.mark.accelerator
def test_an_installation_under_an_offload_made_since_is_not_replaced(accelerator: torch.device) -> None:
    # installed while an offload held the weights (it wrapped none), the offload made again over
    # the installation, then installed again: refused, nothing changed, and the model computes
    # as before (replacing the installation under the offload left its forwards mixing the host
    # and the device)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    least = _least(model, accelerator)
    handle = torchsurgery.offload(model, accelerator, budget=least, groups="leaves", dtype=torch.float32)
    DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    handle.remove()
    handle = torchsurgery.offload(model, accelerator, budget=least, groups="leaves", dtype=torch.float32)
    x = torch.randn(2, 8, device=accelerator, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
    classes, log = [type(m) for m in model.modules()], _log(model)
    with pytest.raises(ValueError, match=r"install_model: the installation on .* is under an active offload made since"):
        DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    assert [type(m) for m in model.modules()] == classes and _log(model) == log
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    handle.remove()
    DynamicSwapInstaller.install_model(model, dtype=torch.float64)  # with the offload gone: replaced
    torchsurgery.restore(model)


def _least(model: nn.Module, device: torch.device) -> int:
    with pytest.raises(torchsurgery.BudgetError) as refused:
        torchsurgery.plan_offload(model, device, budget=1, groups="leaves", dtype=torch.float32)
    return refused.value.needed


def test_install_module_failing_keeps_the_installation_it_replaces(monkeypatch: pytest.MonkeyPatch) -> None:
    # FramePack's per-module call: the old installation comes off, the new one fails to go on;
    # the module keeps the old one, as it was (class, log, weights, outputs)
    from torchsurgery.offloading import dynamic_swap

    layer = nn.Linear(8, 8)
    DynamicSwapInstaller._install_module(layer, dtype=torch.float64)
    x = torch.randn(2, 8, dtype=torch.float64)
    with torch.no_grad():
        expected = layer(x)
    cls, log, weight = type(layer), _log(layer), layer.weight

    def failing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(dynamic_swap, "patch", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        DynamicSwapInstaller._install_module(layer, dtype=torch.float32)
    monkeypatch.undo()
    assert type(layer) is cls and _log(layer) == log and layer.weight is weight
    assert type(weight) is OffloadedTensor and weight.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    DynamicSwapInstaller._uninstall_module(layer)
    assert type(layer) is nn.Linear and type(layer.weight) is nn.Parameter and layer.weight.dtype == torch.float32
