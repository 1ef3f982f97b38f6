"""Tests of torchsurgery.tensors: convert_, load_, skeleton and swap_on_conversion.

Behaviours follow PyTorch's own conformance tests (test_to / test_to_empty over many
module types, load_state_dict with assign and meta tensors, optimizers kept across
loading, tensor-subclass module_load, AccumulateGrad poisoning), written for our API.
"""

from __future__ import annotations

import copy
import json
import os
import struct
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import torchsurgery
from torchsurgery import CheckpointError, convert_, load_, skeleton, swap_on_conversion

MODULES = {
    "linear": (lambda: nn.Linear(4, 3), lambda: torch.randn(2, 4)),
    "conv": (lambda: nn.Conv2d(2, 3, 3), lambda: torch.randn(1, 2, 5, 5)),
    "batchnorm": (lambda: nn.BatchNorm1d(4), lambda: torch.randn(3, 4)),
    "lstm": (lambda: nn.LSTM(4, 3, num_layers=2), lambda: torch.randn(5, 1, 4)),
    "embedding": (lambda: nn.Embedding(10, 4), lambda: torch.tensor([1, 2, 3])),
    "mha": (lambda: nn.MultiheadAttention(4, 2), lambda: torch.randn(3, 1, 4)),
    "encoder": (lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0), lambda: torch.randn(3, 1, 4)),
}


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _call(module: nn.Module, x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "mha":
        return _first(module(x, x, x))
    return _first(module(x))


def _ids(module: nn.Module) -> dict[str, int]:
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers())
    return {name: id(t) for name, t in named}


# ---------------------------------------------------------------------------
# swap_on_conversion


def test_swap_on_conversion_sets_and_restores_the_flag() -> None:
    assert not torch.__future__.get_swap_module_params_on_conversion()
    with swap_on_conversion():
        assert torch.__future__.get_swap_module_params_on_conversion()
        with swap_on_conversion():
            pass
        assert torch.__future__.get_swap_module_params_on_conversion()  # still inside the outer block
    assert not torch.__future__.get_swap_module_params_on_conversion()
    with pytest.raises(KeyError):
        with swap_on_conversion():
            raise KeyError
    assert not torch.__future__.get_swap_module_params_on_conversion()


def test_swap_on_conversion_keeps_parameters_through_module_to() -> None:
    layer = nn.Linear(2, 2)
    weight = layer.weight
    with swap_on_conversion():
        layer.double()
    assert layer.weight is weight and weight.dtype == torch.float64


# ---------------------------------------------------------------------------
# convert_


@pytest.mark.parametrize("kind", sorted(MODULES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_convert_keeps_identity_of_parameters_and_buffers(kind: str, dtype: torch.dtype) -> None:
    make, make_input = MODULES[kind]
    module = make().eval()
    reference = copy.deepcopy(module).to(dtype)  # PyTorch's own conversion, for the values
    ids = _ids(module)
    convert_(module, dtype=dtype)
    assert _ids(module) == ids
    for (name, t), (_, r) in zip(module.state_dict().items(), reference.state_dict().items(), strict=True):
        assert t.dtype == r.dtype, name
        assert torch.equal(t, r), name
    x = make_input()
    if x.is_floating_point():
        x = x.to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(_call(module, x, kind), _call(reference, x, kind), rtol=0, atol=0)


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_convert_from_meta_allocates_like_to_empty_keeping_identity(kind: str) -> None:
    make, _ = MODULES[kind]
    with skeleton(include_buffers=True):
        module = make()
    reference = make().to_empty(device="cpu")  # PyTorch's own, for the layout
    ids = _ids(module)
    convert_(module, device="cpu")
    assert _ids(module) == ids
    for (name, t), (_, r) in zip(module.state_dict().items(), reference.state_dict().items(), strict=True):
        assert not t.is_meta and t.shape == r.shape and t.dtype == r.dtype, name


def test_convert_only_changes_floating_tensors() -> None:
    bn = nn.BatchNorm1d(3)
    convert_(bn, dtype=torch.float16)
    assert bn.num_batches_tracked.dtype == torch.int64
    assert bn.running_var.dtype == torch.float16


def test_convert_converts_grads_and_keeps_tied_weights_tied() -> None:
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    model(torch.tensor([1, 2])).sum().backward()
    grad = emb.weight.grad.clone()
    convert_(model, dtype=torch.float64)
    assert model[0].weight is model[1].weight
    assert emb.weight.grad.dtype == torch.float64
    torch.testing.assert_close(emb.weight.grad, grad.double())


def test_optimizer_state_follows_and_training_continues_like_a_reference() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def train(m: nn.Module, opt: torch.optim.Optimizer, steps: int, dtype: torch.dtype) -> list[float]:
        losses = []
        for _ in range(steps):
            loss = F.mse_loss(m(x.to(dtype)), y.to(dtype))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    ours = train(model, opt, 3, torch.float32)
    convert_(model, dtype=torch.float64, optimizer=opt)  # the same optimizer object goes on
    ours += train(model, opt, 3, torch.float64)

    # reference: PyTorch's documented path (convert, rebuild the optimizer, reload its state)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    theirs = train(reference, ref_opt, 3, torch.float32)
    saved = ref_opt.state_dict()
    reference.double()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    ref_opt.load_state_dict(saved)
    theirs += train(reference, ref_opt, 3, torch.float64)

    assert ours == pytest.approx(theirs, rel=1e-6)
    assert all(v.dtype == torch.float64 for s in opt.state.values() for k, v in s.items() if k != "step")


def test_convert_refuses_a_pending_backward_and_changes_nothing() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    loss = model(torch.randn(2, 3)).sum()
    with pytest.raises(RuntimeError, match=r"'0.weight'.*backward has not run"):
        convert_(model, dtype=torch.float64)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    loss.backward()  # the graph was not poisoned: backward still works
    del loss  # the graph keeps its AccumulateGrad nodes (holders of the weights) while alive
    convert_(model, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())


def test_plain_swap_tensors_would_have_poisoned_the_graph() -> None:
    # Why the pre-flight check matters: PyTorch's own path converts and fails only later.
    layer = nn.Linear(2, 2)
    loss = layer(torch.randn(1, 2)).sum()
    with swap_on_conversion():
        layer.double()
    with pytest.raises(RuntimeError, match="poisoned"):
        loss.backward()


def test_convert_refuses_weakrefs_and_views_naming_the_tensor() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    ref = weakref.ref(model[1].bias)
    with pytest.raises(RuntimeError, match=r"'1.bias'.*weak references"):
        convert_(model, dtype=torch.float64)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    del ref
    view = model[0].weight[0]
    with pytest.raises(RuntimeError, match=r"'0.weight'.*view"):
        convert_(model, dtype=torch.float64)
    del view
    convert_(model, dtype=torch.float64)


def test_convert_bad_arguments() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="floating point"):
        convert_(layer, dtype=torch.int32)
    with pytest.raises(ValueError, match="not a device"):
        convert_(layer, device="nowhere")
    with pytest.raises(TypeError, match="optimizer"):
        convert_(layer, dtype=torch.float64, optimizer=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nn.Module"):
        convert_("layer", dtype=torch.float64)  # type: ignore[type-var]
    for device in ("mps", "xpu"):  # devices this build has no backend for
        with pytest.raises(ValueError, match=f"convert_: device '{device}' is not available: this PyTorch reports"):
            convert_(layer, device=device)
    assert layer.weight.dtype == torch.float32 and layer.weight.device.type == "cpu"


def test_convert_undoes_swaps_done_before_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    ids, values = _ids(model), {k: v.clone() for k, v in model.state_dict().items()}
    real_swap = torch.utils.swap_tensors
    calls = 0

    def flaky(a: torch.Tensor, b: torch.Tensor) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected")
        real_swap(a, b)

    monkeypatch.setattr(torch.utils, "swap_tensors", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        convert_(model, dtype=torch.float64)
    monkeypatch.setattr(torch.utils, "swap_tensors", real_swap)
    assert _ids(model) == ids
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, values[k])


def test_parameter_subclass_keeps_its_class() -> None:
    class Tagged(nn.Parameter):
        pass

    layer = nn.Linear(2, 2)
    layer.weight = Tagged(layer.weight.detach().clone())
    layer.weight.note = "kept"  # type: ignore[attr-defined]
    convert_(layer, dtype=torch.float64)
    assert type(layer.weight) is Tagged and layer.weight.note == "kept"  # type: ignore[attr-defined]
    assert layer.weight.dtype == torch.float64


# ---------------------------------------------------------------------------
# Tensor subclasses: module_load decides (the recipe's quantized-weight example)


class ScaledWeight(torch.Tensor):
    """A wrapper subclass holding ``elem`` and a ``scale``, as in PyTorch's swap recipe."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor, scale: float) -> ScaledWeight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, elem.shape, dtype=elem.dtype, device=elem.device, requires_grad=elem.requires_grad
        )

    def __init__(self, elem: torch.Tensor, scale: float) -> None:
        self.elem = elem
        self.scale = scale

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.module_load:
            dest, src = args[0], args[1]
            if type(src) is torch.Tensor:  # plain checkpoint value: quantise it into our class
                return ScaledWeight(src.detach(), dest.scale)
            return src.detach()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten._to_copy.default):
            return ScaledWeight(func(args[0].elem, *args[1:], **kwargs), args[0].scale)
        raise NotImplementedError(f"{func} is not supported by ScaledWeight")  # test helper only


def test_module_load_keeps_the_modules_subclass_unless_assign() -> None:
    layer = nn.Linear(3, 2)
    layer.weight = nn.Parameter(ScaledWeight(layer.weight.detach(), 0.5), requires_grad=False)
    weight = layer.weight
    values = torch.randn(2, 3)
    load_(layer, {"weight": values, "bias": torch.zeros(2)}, assign=False)
    assert layer.weight is weight
    assert type(layer.weight) is ScaledWeight and layer.weight.scale == 0.5
    assert torch.equal(layer.weight.elem, values)

    other = ScaledWeight(torch.ones(2, 3), 2.0)
    load_(layer, {"weight": other, "bias": torch.zeros(2)}, assign=True)
    assert layer.weight is weight and layer.weight.scale == 2.0  # the checkpoint's tensor was taken


def test_convert_casts_the_payload_of_a_subclass() -> None:
    layer = nn.Linear(3, 2)
    layer.weight = nn.Parameter(ScaledWeight(layer.weight.detach(), 0.5), requires_grad=False)
    weight = layer.weight
    convert_(layer, dtype=torch.bfloat16)
    assert layer.weight is weight and type(weight) is ScaledWeight
    assert weight.elem.dtype == torch.bfloat16 and weight.scale == 0.5


# ---------------------------------------------------------------------------
# skeleton


def test_skeleton_keeps_buffers_real_and_is_undone_on_exception() -> None:
    with skeleton():
        bn = nn.BatchNorm1d(4)
    assert bn.weight.is_meta and not bn.running_mean.is_meta
    with skeleton(include_buffers=True):
        bn2 = nn.BatchNorm1d(4)
    assert bn2.running_mean.is_meta
    with pytest.raises(ValueError, match="inside"):
        with skeleton():
            raise ValueError("inside")
    assert not nn.Linear(2, 2).weight.is_meta  # nothing left behind


def test_skeleton_then_load_equals_the_reference_model() -> None:
    reference = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    with skeleton():
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    ids = _ids(model)
    assert load_(model, reference.state_dict()) == ([], [])
    assert _ids(model) == ids
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------
# load_


def test_load_in_place_keeps_identity_and_storage_and_optimizers_work() -> None:
    # PyTorch's test_load_state_dict_assign_with_optimizer, for load_
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    source = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    load_(model, source.state_dict())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    x = torch.randn(4, 3)
    model(x).sum().backward()
    opt.step()  # the optimizer made before loading still updates the model
    source(x).sum().backward()
    with torch.no_grad():
        for p in source.parameters():
            p -= 0.1 * p.grad
    for a, b in zip(model.parameters(), source.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_assign_meta_keeps_identity_and_materialises() -> None:
    # PyTorch's test_load_state_dict_assign_meta: assign into a meta model
    with skeleton():
        model = nn.Linear(3, 2)
    weight = model.weight
    state = nn.Linear(3, 2, dtype=torch.float64).state_dict()
    load_(model, state, assign=True)
    assert model.weight is weight and model.weight.dtype == torch.float64  # the checkpoint's dtype
    assert torch.equal(model.weight, state["weight"])


def test_load_with_device_and_dtype() -> None:
    with skeleton():
        model = nn.Linear(3, 2)
    load_(model, nn.Linear(3, 2).state_dict(), dtype=torch.bfloat16, device="cpu")
    assert model.weight.dtype == torch.bfloat16 and model.weight.device.type == "cpu"


def test_tied_weights_stay_tied_with_one_or_both_names() -> None:
    def make() -> nn.Module:
        emb, head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
        head.weight = emb.weight
        return nn.Sequential(emb, head)

    source = make()
    full = source.state_dict()
    for state in (full, {"0.weight": full["0.weight"]}, {"1.weight": full["1.weight"]}):
        with skeleton():
            model = make()
        result = load_(model, dict(state))
        assert result == ([], [])
        assert model[0].weight is model[1].weight
        assert torch.equal(model[0].weight, source[0].weight)


def test_errors_list_every_problem_at_once_with_suggestions_and_load_nothing() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 4)).state_dict()
    bad["0.wieght"] = bad.pop("0.weight")
    bad["extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as info:
        load_(model, bad)
    message = str(info.value)
    assert "missing: '0.weight' (did you mean '0.wieght'?)" in message
    assert "unexpected: 'extra'" in message
    assert "shape of '1.weight': checkpoint [4, 3], module [2, 3]" in message
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    # non-strict: keys are reported, not raised, but shapes still are
    result = load_(model, {"0.bias": torch.ones(3), "junk": torch.ones(1)}, strict=False)
    assert result.unexpected_keys == ["junk"] and "0.weight" in result.missing_keys
    assert torch.equal(model[0].bias, torch.ones(3))


def test_failure_half_way_puts_back_what_was_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchsurgery import _checkpoint

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    real_read = _checkpoint.DictSource.read
    calls = 0

    def flaky(self: Any, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError("disk went away")
        return real_read(self, key, out)

    monkeypatch.setattr(_checkpoint.DictSource, "read", flaky)
    with pytest.raises(OSError, match="disk went away"):
        load_(model, nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)).state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# ---------------------------------------------------------------------------
# Files


def test_safetensors_file_and_sharded_index(tmp_path: Path) -> None:
    source = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    state = source.state_dict()
    single = tmp_path / "model.safetensors"
    save_file(state, single)
    keys = sorted(state)
    save_file({k: state[k] for k in keys[:2]}, tmp_path / "a.safetensors")
    save_file({k: state[k] for k in keys[2:]}, tmp_path / "b.safetensors")
    weight_map = {k: ("a.safetensors" if k in keys[:2] else "b.safetensors") for k in keys}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    x = torch.randn(2, 4)
    for src in (single, index, str(tmp_path)):
        with skeleton():
            model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        load_(model, src)
        torch.testing.assert_close(model(x), source(x), rtol=0, atol=0)


def test_safetensors_with_scalar_buffers(tmp_path: Path) -> None:
    source = nn.BatchNorm1d(3)
    source(torch.randn(4, 3))  # running stats and the 0-dim num_batches_tracked change
    save_file(source.state_dict(), tmp_path / "bn.safetensors")
    model = nn.BatchNorm1d(3)
    load_(model, tmp_path / "bn.safetensors")
    for k, v in source.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_pt_files_are_read_without_unpickling_objects(tmp_path: Path) -> None:
    source = nn.Linear(2, 2)
    good = tmp_path / "good.pt"
    torch.save(source.state_dict(), good)
    model = nn.Linear(2, 2)
    load_(model, good)
    assert torch.equal(model.weight, source.weight)

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (print, ("this must never run",))

    evil = tmp_path / "evil.pt"
    torch.save({"weight": source.weight, "payload": Evil()}, evil)
    with pytest.raises(CheckpointError, match="weights_only"):
        load_(model, evil)


def _write_raw_safetensors(path: Path, header: dict[str, Any], data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    "case",
    ["truncated", "huge_size", "overlap", "bad_dtype", "not_utf8", "huge_header", "size_mismatch", "deep_nesting"],
)
def test_crafted_or_damaged_safetensors_is_rejected_and_module_untouched(tmp_path: Path, case: str) -> None:
    path = tmp_path / f"{case}.safetensors"
    good = {"weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "bias": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}
    data = bytes(24)
    if case == "truncated":
        save_file(nn.Linear(2, 2).state_dict(), path)
        path.write_bytes(path.read_bytes()[:-5])
    elif case == "huge_size":
        good["weight"] = {"dtype": "F32", "shape": [2**31, 2**31], "data_offsets": [0, 2**62]}
        _write_raw_safetensors(path, good, data)
    elif case == "overlap":
        good["bias"]["data_offsets"] = [8, 16]
        _write_raw_safetensors(path, good, data)
    elif case == "bad_dtype":
        good["bias"]["dtype"] = "F128"
        _write_raw_safetensors(path, good, data)
    elif case == "not_utf8":
        raw = b'{"w\xff\xfe": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4))
    elif case == "huge_header":
        path.write_bytes(struct.pack("<Q", 2**60) + b"{}")
    elif case == "size_mismatch":
        good["bias"]["shape"] = [3]
        _write_raw_safetensors(path, good, data)
    elif case == "deep_nesting":  # deeper than Python's JSON parser recurses
        raw = b'{"w":' * 100_000 + b"1" + b"}" * 100_000
        path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with skeleton():
        meta = nn.Linear(2, 2)
    for model in (nn.Linear(2, 2), meta):  # read in place, or mapped / copied into a skeleton
        for copy_ in (False, True):
            snapshot = _snapshot(model)
            with pytest.raises(CheckpointError):
                load_(model, path, copy=copy_)
            _unchanged(model, snapshot)


def test_unknown_sources_are_refused(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        load_(model, tmp_path / "absent.safetensors")
    (tmp_path / "weights.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="unsupported checkpoint file"):
        load_(model, tmp_path / "weights.npz")
    with pytest.raises(TypeError, match="state dict"):
        load_(model, 42)
    with pytest.raises(TypeError, match="names \\(str\\) to tensors"):
        load_(model, {"weight": [1.0]})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="load_: .*pipe.safetensors is not a regular file"):
        load_(model, fifo)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"weight": 5, "bias": 5}}))
    with pytest.raises(CheckpointError, match="shard 5 is not a file next to the index"):
        load_(model, tmp_path / "model.safetensors.index.json")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


# ---------------------------------------------------------------------------
# File-backed loading, bulk reads and crash safety


class _Mixed(nn.Module):
    """Parameters and buffers of every stored kind: fp32, bf16, fp8, int, bool, 0-dim."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(64, 64)
        self.low = nn.Parameter(torch.randn(16, 8).bfloat16())
        self.fp8 = nn.Parameter(torch.randn(32).to(torch.float8_e4m3fn), requires_grad=False)
        self.register_buffer("ids", torch.arange(12, dtype=torch.int64))
        self.register_buffer("mask", torch.rand(9) > 0.5)
        self.register_buffer("count", torch.tensor(7, dtype=torch.int32))


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _storages(model: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in model.state_dict().values()}


@pytest.mark.parametrize("copy", [False, True])
def test_skeleton_loads_every_dtype_file_backed_or_copied(tmp_path: Path, copy: bool) -> None:
    reference = _Mixed()
    path = tmp_path / "m.safetensors"
    save_file(reference.state_dict(), path)
    with skeleton(include_buffers=True):
        model = _Mixed()
    ids = _ids(model)
    assert load_(model, path, copy=copy) == ([], [])
    assert _ids(model) == ids
    for k, v in reference.state_dict().items():
        assert _same_bytes(model.state_dict()[k], v), k
    sizes = {t.untyped_storage().nbytes() for t in model.state_dict().values()}
    if copy:  # memory of their own, one storage each
        assert len(_storages(model)) == len(reference.state_dict())
        assert path.stat().st_size not in sizes
    else:  # views of one map of the whole file
        assert len(_storages(model)) == 1 and sizes == {path.stat().st_size}
    x = torch.randn(3, 64)
    torch.testing.assert_close(model.dense(x), reference.dense(x), rtol=0, atol=0)


def test_file_backed_weights_train_without_touching_the_file(tmp_path: Path) -> None:
    reference = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    path = tmp_path / "m.safetensors"
    save_file(reference.state_dict(), path)
    on_disk = path.read_bytes()
    with skeleton():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    load_(model, path)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert not torch.equal(model[0].weight, reference[0].weight)  # trained
    assert path.read_bytes() == on_disk  # writes went to private pages


def test_a_file_changed_after_a_file_backed_load(tmp_path: Path) -> None:
    """What the docs say: replacing the file is safe, rewriting it in place shows through
    where the model has not written, and copy=True is immune to both."""
    path = tmp_path / "m.safetensors"
    first = {"a": torch.randn(4096), "b": torch.randn(4096)}  # 16 KiB each: whole pages of their own
    save_file(first, path)

    def loaded(copy: bool) -> nn.Module:
        with skeleton():
            model = nn.ParameterDict({"a": nn.Parameter(torch.empty(4096)), "b": nn.Parameter(torch.empty(4096))})
        load_(model, path, copy=copy)
        return model

    mapped, copied = loaded(False), loaded(True)
    path.unlink()  # replaced by a new file: the map keeps the old one alive
    save_file({"a": torch.zeros(4096), "b": torch.zeros(4096)}, path)
    assert torch.equal(mapped["a"], first["a"]) and torch.equal(mapped["b"], first["b"])

    mapped = loaded(False)
    with torch.no_grad():
        mapped["a"][:] = 1.0  # the model's own pages now
    on_disk = bytearray(path.read_bytes())
    data_start = 8 + int.from_bytes(on_disk[:8], "little")
    on_disk[data_start:] = torch.full((8192,), 5.0).numpy().tobytes()
    with open(path, "r+b") as f:  # rewritten in place, same length
        f.write(on_disk)
    assert torch.equal(mapped["a"], torch.ones(4096))  # written pages are private
    assert torch.equal(mapped["b"][1024:3072], torch.full((2048,), 5.0))  # the rest shows the file
    assert torch.equal(copied["b"], first["b"])


def test_conversions_and_misalignment_fall_back_to_copies(tmp_path: Path) -> None:
    reference = nn.Linear(4, 4)
    path = tmp_path / "m.safetensors"
    save_file({k: v.bfloat16() for k, v in reference.state_dict().items()}, path)
    with skeleton():
        model = nn.Linear(4, 4)
    load_(model, path)  # a bf16 file into an fp32 skeleton: cast, so copied
    assert model.weight.dtype == torch.float32
    assert model.weight.untyped_storage().nbytes() == model.weight.nbytes
    torch.testing.assert_close(model.weight, reference.weight.bfloat16().float(), rtol=0, atol=0)
    with skeleton():
        model = nn.Linear(4, 4)
    load_(model, path, dtype=torch.bfloat16)  # asked for the file's dtype: mapped
    assert model.weight.untyped_storage().nbytes() == path.stat().st_size


def test_sharded_checkpoint_maps_each_shard_and_keeps_ties(tmp_path: Path) -> None:
    def make() -> nn.Module:
        emb, head = nn.Embedding(50, 16), nn.Linear(16, 50, bias=False)
        head.weight = emb.weight
        return nn.Sequential(emb, nn.Linear(16, 16), head)

    reference = make()
    state = reference.state_dict()
    save_file({"0.weight": state["0.weight"]}, tmp_path / "a.safetensors")
    save_file({"1.weight": state["1.weight"], "1.bias": state["1.bias"]}, tmp_path / "b.safetensors")
    weight_map = {"0.weight": "a.safetensors", "1.weight": "b.safetensors", "1.bias": "b.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for copied in (False, True):
        with skeleton():
            model = make()
        assert load_(model, tmp_path, copy=copied) == ([], [])
        assert model[0].weight is model[2].weight
        assert len(_storages(model)) == (3 if copied else 2)
        ids = torch.tensor([[1, 7, 49]])
        torch.testing.assert_close(model(ids), reference(ids), rtol=0, atol=0)


def _failing_at(monkeypatch: pytest.MonkeyPatch, name: str, at: int, error: BaseException) -> list[int]:
    """Make the ``at``-th call of ``os.<name>`` in the reader raise ``error``; count the calls."""
    from torchsurgery import _checkpoint

    real = getattr(os, name)
    calls = [0]

    def call(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            raise error
        return real(*args)

    monkeypatch.setattr(_checkpoint.os, name, call)
    return calls


def _in_place() -> nn.Module:
    return _Mixed()


def _half_skeleton() -> nn.Module:
    with skeleton():
        return _Mixed()  # meta parameters (mapped or read), real buffers (read in place)


LOADS = {"in place": (_in_place, False), "skeleton": (_half_skeleton, False), "skeleton, copy": (_half_skeleton, True)}


def _snapshot(model: nn.Module) -> dict[str, Any]:
    state = model.state_dict(keep_vars=True)
    return {k: (id(v), v.data_ptr(), v.dtype, v.is_meta, None if v.is_meta else v.detach().clone()) for k, v in state.items()}


def _unchanged(model: nn.Module, snapshot: dict[str, Any]) -> None:
    for k, v in model.state_dict(keep_vars=True).items():
        ident, ptr, dtype, meta, values = snapshot[k]
        assert (id(v), v.data_ptr(), v.dtype, v.is_meta) == (ident, ptr, dtype, meta), k
        assert meta or _same_bytes(v.detach(), values), k


def _saved_for_many_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> Path:
    """A saved ``_Mixed`` whose load takes many system calls (many points to fail at) on ``threads`` threads."""
    from torchsurgery import _checkpoint

    monkeypatch.setattr(_checkpoint, "_CHUNK", 512)
    monkeypatch.setattr(_checkpoint, "_THREADS", threads)
    monkeypatch.setattr(_checkpoint, "_PARALLEL_BYTES", 0)
    path = tmp_path / "m.safetensors"
    save_file(_Mixed().state_dict(), path)
    return path


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), KeyboardInterrupt()], ids=["eio", "interrupt"])
@pytest.mark.parametrize("load", sorted(LOADS))
def test_a_read_failing_at_any_point_leaves_every_tensor_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int, error: BaseException, load: str
) -> None:
    path = _saved_for_many_reads(tmp_path, monkeypatch, threads)
    make, copy = LOADS[load]
    calls = _failing_at(monkeypatch, "preadv", 0, error)
    load_(make(), path, copy=copy)
    assert calls[0] >= 3  # buffers only, when the parameters are mapped
    for name, total in (("preadv", calls[0]), ("pwritev", 1)):  # every read, and keeping values aside
        for at in range(1, total + 1):
            model = make()
            snapshot = _snapshot(model)
            _failing_at(monkeypatch, name, at, error)
            with pytest.raises(type(error)):
                load_(model, path, copy=copy)
            _unchanged(model, snapshot)
        monkeypatch.setattr(f"torchsurgery._checkpoint.os.{name}", getattr(os, name))


def test_a_file_that_cannot_be_mapped_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchsurgery import _checkpoint

    path = tmp_path / "m.safetensors"
    save_file(_Mixed().state_dict(), path)

    def no_map(*args: Any, **kwargs: Any) -> Any:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(_checkpoint.mmap, "mmap", no_map)
    model = _half_skeleton()
    snapshot = _snapshot(model)
    with pytest.raises(CheckpointError, match="cannot be memory-mapped"):
        load_(model, path)
    _unchanged(model, snapshot)
    load_(model, path, copy=True)  # the way out the message points to
    assert not model.dense.weight.is_meta


@pytest.mark.parametrize("load", sorted(LOADS))
def test_a_file_cut_short_between_header_check_and_read_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, load: str
) -> None:
    from torchsurgery import _checkpoint

    path = tmp_path / "m.safetensors"
    save_file(_Mixed().state_dict(), path)
    real_entries = _checkpoint.SafetensorsSource.entries

    def entries_then_truncate(self: Any) -> Any:
        found = real_entries(self)
        with open(path, "r+b") as f:  # another process rewrites the file right after the check
            f.truncate(path.stat().st_size - 3)
        return found

    monkeypatch.setattr(_checkpoint.SafetensorsSource, "entries", entries_then_truncate)
    make, copy = LOADS[load]
    model = make()
    snapshot = _snapshot(model)
    # a read coming short ("ends early"), or one that does not reach the cut, then the check after it
    with pytest.raises(CheckpointError, match=r"its size went from \d+ to \d+ bytes"):
        load_(model, path, copy=copy)
    _unchanged(model, snapshot)


@pytest.mark.parametrize("undoable", [True, False])
def test_a_load_in_place_writes_the_files_values_into_the_same_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, undoable: bool
) -> None:
    from torchsurgery import _checkpoint

    monkeypatch.setattr(_checkpoint, "_CHUNK", 1000)  # tensors split over several system calls
    monkeypatch.setattr("torchsurgery.tensors.loading._STAGE_BYTES", 4096)  # and the load over several runs
    path = tmp_path / "m.safetensors"
    save_file(_Mixed().state_dict(), path)
    expected = load_file(path)
    model = _Mixed()
    snapshot = _snapshot(model)
    assert load_(model, path, undoable=undoable) == ([], [])
    state = model.state_dict(keep_vars=True)
    assert sorted(state) == sorted(expected)
    for k, v in expected.items():
        ident, ptr, dtype, _, _ = snapshot[k]
        assert (id(state[k]), state[k].data_ptr(), state[k].dtype) == (ident, ptr, dtype), k
        assert _same_bytes(state[k].detach(), v), k
    assert len(torchsurgery.surgery_log(model)) == (1 if undoable else 0)
    torchsurgery.restore(model)
    if undoable:  # the values the load overwrote, bitwise, in the same memory
        _unchanged(model, snapshot)
    else:  # nothing was kept: the loaded values stay
        assert all(_same_bytes(state[k].detach(), v) for k, v in expected.items())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_read_failing_without_undo_says_the_module_is_partly_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    path = _saved_for_many_reads(tmp_path, monkeypatch, threads)
    expected = load_file(path)
    calls = _failing_at(monkeypatch, "preadv", 0, OSError(5, "Input/output error"))
    load_(_Mixed(), path, undoable=False)
    assert calls[0] >= 3
    for at in range(1, calls[0] + 1):
        model = _Mixed()
        objects = {k: (id(v), v.data_ptr()) for k, v in model.state_dict(keep_vars=True).items()}
        _failing_at(monkeypatch, "preadv", at, OSError(5, "Input/output error"))
        with pytest.raises(RuntimeError, match="undoable=False nothing was kept to put back") as info:
            load_(model, path, undoable=False)
        assert isinstance(info.value.__cause__, OSError)
        assert torchsurgery.surgery_log(model) == []
        assert {k: (id(v), v.data_ptr()) for k, v in model.state_dict(keep_vars=True).items()} == objects
        monkeypatch.setattr("torchsurgery._checkpoint.os.preadv", os.preadv)
        load_(model, path, undoable=False)  # what the message advises: every value then comes in
        assert all(_same_bytes(model.state_dict()[k], v) for k, v in expected.items())
    # an interrupt stays an interrupt; a checkpoint that does not fit is refused before any write
    _failing_at(monkeypatch, "preadv", 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        load_(_Mixed(), path, undoable=False)
    model = _Mixed()
    snapshot = _snapshot(model)
    with pytest.raises(RuntimeError, match="nothing was loaded"):
        load_(model, {**expected, "ids": torch.arange(3)}, undoable=False)
    _unchanged(model, snapshot)


# ---------------------------------------------------------------------------
# A checkpoint written by another library


def test_transformers_sharded_checkpoint_into_a_skeleton(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    original = transformers.LlamaForCausalLM(config).eval()
    original.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    expected = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()

    with skeleton():
        model = transformers.LlamaForCausalLM(config).eval()
    assert model.model.embed_tokens.weight.is_meta
    result = load_(model, tmp_path / "model.safetensors.index.json", strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected(ids).logits, rtol=0, atol=0)


def test_public_names() -> None:
    assert torchsurgery.load_ is load_ and torchsurgery.convert_ is convert_


def test_wrong_dtype_kind_and_missing_shard_are_refused(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"dtype of 'weight': checkpoint torch.int64, module torch.float32"):
        load_(model, {"weight": torch.ones(2, 2, dtype=torch.long), "bias": torch.zeros(2)})
    save_file({"weight": torch.zeros(2, 2)}, tmp_path / "a.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"weight": "a.safetensors", "bias": "b.safetensors"}}))
    with pytest.raises(CheckpointError, match="'b.safetensors' is missing"):
        load_(model, index)
    index.write_text(json.dumps({"weight_map": {"weight": "../outside.safetensors"}}))
    with pytest.raises(CheckpointError, match="not a file next to the index"):
        load_(model, index)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    # a float checkpoint into a float module of another width is a cast, as in PyTorch
    load_(model, {k: v.double() for k, v in before.items()})
    assert model.weight.dtype == torch.float32


# ---------------------------------------------------------------------------
# Undo: convert_ and load_ in the undo log, against a plain copy taken before the surgery


class _Tagged(nn.Parameter):
    """A Parameter subclass: undo must give back the same object, class kept."""


def _model() -> nn.Module:
    """Tied weights, a Parameter subclass, float and integer buffers."""
    emb, norm, head = nn.Embedding(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 6)
    head.weight = emb.weight
    norm.weight = _Tagged(norm.weight.detach().clone())
    model = nn.Sequential(emb, norm, head)
    with torch.no_grad():
        norm.running_mean.normal_()
        emb.weight.mul_(1 + 1e-3)  # values a narrow dtype cannot hold
    return model


def _objects(model: nn.Module) -> dict[str, tuple[torch.Tensor, type]]:
    return {name: (t, type(t)) for name, t in model.state_dict(keep_vars=True).items()}


def _assert_as_before(model: nn.Module, reference: nn.Module, objects: dict[str, tuple[torch.Tensor, type]]) -> None:
    """Bitwise the reference's state_dict, in the same objects of the same classes, with an empty log."""
    assert torchsurgery.surgery_log(model) == []
    assert _objects(model) == objects
    now = model.state_dict()
    assert now.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert _same_bytes(now[name], value), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_restore_after_convert_gives_back_the_model_bitwise(dtype: torch.dtype) -> None:
    model = _model()
    reference, objects = copy.deepcopy(model), _objects(model)
    convert_(model, dtype=dtype)
    assert model[1].running_mean.dtype == dtype and model[1].num_batches_tracked.dtype == torch.int64
    (entry,) = torchsurgery.surgery_log(model)
    assert entry.kind == "convert"
    # a widening conversion is undone by converting back; a narrowing one keeps the originals
    assert ("originals kept" in entry.description) == (dtype != torch.float64)
    torchsurgery.restore(model)
    _assert_as_before(model, reference, objects)


def test_restore_after_a_move_to_meta_and_from_meta() -> None:
    model = _model()
    reference, objects = copy.deepcopy(model), _objects(model)
    convert_(model, device="meta")
    assert model[0].weight.is_meta
    torchsurgery.restore(model)
    _assert_as_before(model, reference, objects)

    with skeleton(include_buffers=True):
        empty = nn.Linear(3, 3)
    weight = empty.weight
    convert_(empty, device="cpu")
    torchsurgery.restore(empty)
    assert empty.weight is weight and weight.is_meta and empty.bias.is_meta


def test_values_changed_after_a_lossy_convert_keep_the_change() -> None:
    layer = nn.Linear(4, 4)
    original = layer.weight.detach().clone()
    convert_(layer, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight[0] += 1.0  # training since the conversion
    trained_row = layer.weight[0].detach().float()
    torchsurgery.restore(layer)
    assert layer.weight.dtype == torch.float32
    assert torch.equal(layer.weight[1:], original[1:])  # untouched: the originals, exactly
    assert torch.equal(layer.weight[0], trained_row)  # changed: the change, cast back


def test_restore_moves_grads_and_optimizer_state_back_and_training_goes_on() -> None:
    torch.manual_seed(1)
    model, other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), nn.Linear(4, 1)
    reference = copy.deepcopy(model)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def step(m: nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype = torch.float32) -> None:
        opt.zero_grad()
        F.mse_loss(m(x.to(dtype)), y.to(dtype)).backward()
        opt.step()

    opt = torch.optim.Adam([*model.parameters(), *other.parameters()], lr=0.05)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    step(other, opt)
    step(model, opt)  # its gradients stay
    step(reference, ref_opt)
    other_state = {k: v for k, v in opt.state[other.weight].items()}
    convert_(model, dtype=torch.float64, optimizer=opt)
    assert all(v.dtype == torch.float64 for p in model.parameters() for k, v in opt.state[p].items() if k != "step")
    assert all(opt.state[other.weight][k] is v for k, v in other_state.items())  # not the module's: left alone
    torchsurgery.restore(model)
    for p in model.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32
        assert all(v.dtype == torch.float32 for k, v in opt.state[p].items() if k != "step")
    step(model, opt)
    step(reference, ref_opt)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name  # fp32 -> fp64 -> fp32 is exact


def test_undoable_false_records_and_keeps_nothing() -> None:
    model = _model()
    convert_(model, dtype=torch.bfloat16, undoable=False)
    load_(model, copy.deepcopy(model).state_dict(), undoable=False)
    assert torchsurgery.surgery_log(model) == []
    torchsurgery.restore(model)
    assert model[0].weight.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="convert_: undoable must be True or False, got 'yes'"):
        convert_(model, dtype=torch.float32, undoable="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="load_: undoable must be True or False, got 1"):
        load_(model, model.state_dict(), undoable=1)  # type: ignore[arg-type]


def test_nothing_to_convert_or_load_records_nothing() -> None:
    layer = nn.Linear(2, 2)
    convert_(layer, dtype=torch.float32, device="cpu")
    load_(layer, {}, strict=False)
    assert torchsurgery.surgery_log(layer) == []


class _Doubled(torchsurgery.Patch, nn.Linear):
    """Writes its weight in place and adds a parameter: both must come back."""

    def __patch_init__(self) -> None:
        with torch.no_grad():
            self.weight.mul_(2.0)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def test_patch_convert_offload_flex_load_then_restore_unwinds_all() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    reference, objects = copy.deepcopy(model), _objects(model)
    x = torch.randn(2, 4)
    torchsurgery.patch(model[0], _Doubled)
    convert_(model, dtype=torch.bfloat16)
    convert_(model, dtype=torch.float32)  # lossless back: the model runs in fp32 again
    expected = model(x).detach()
    handle = torchsurgery.offload(model, storage_dtype=torch.float64, dtype=torch.float32, groups="leaves")
    flex = torchsurgery.FlexModel(model, {})
    load_(model, {k: v.clone() for k, v in model.state_dict().items()})
    torch.testing.assert_close(model(x), expected)  # offloaded: fp64 storage, fp32 compute
    kinds = [e.kind for e in torchsurgery.surgery_log(model)]
    assert kinds == ["patch", "convert", "convert", "offload", "flex", "load"]
    torchsurgery.restore(model)
    assert not handle.active and not torchsurgery.is_patched(model[0]) and not hasattr(model[0], "scale")
    del flex
    _assert_as_before(model, reference, objects)


def test_restore_of_a_module_converted_then_patched() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference, objects = copy.deepcopy(model), _objects(model)
    convert_(model, dtype=torch.float16)
    torchsurgery.patch(model[1], _Doubled)  # its new parameter is fp32: not the conversion's
    assert model[1].weight.dtype == torch.float16 and model[1].scale.dtype == torch.float32
    torchsurgery.restore(model)
    assert not hasattr(model[1], "scale")
    _assert_as_before(model, reference, objects)


def test_a_conversion_under_an_offload_is_undone_with_it() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference, objects = copy.deepcopy(model), _objects(model)
    convert_(model, dtype=torch.float64)
    x = torch.randn(2, 4, dtype=torch.float64)
    expected = model(x).detach()
    with torchsurgery.offload(model, storage_dtype=torch.float64, groups="leaves"):
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    assert model[0].weight.dtype == torch.float64
    torchsurgery.restore(model)
    _assert_as_before(model, reference, objects)


def _duplicate(model: nn.Module, how: str) -> nn.Module:
    import io
    import pickle

    if how == "deepcopy":
        return copy.deepcopy(model)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_loaded_copy_is_restored_on_its_own(how: str) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    load_(model, _model().state_dict())  # in place
    load_(model, _model().state_dict(), assign=True, dtype=torch.float64)  # new memory
    duplicate = _duplicate(model, how)
    objects = _objects(duplicate)
    torchsurgery.restore(duplicate)
    _assert_as_before(duplicate, reference, objects)
    assert len(torchsurgery.surgery_log(model)) == 2
    torchsurgery.restore(model)
    assert all(_same_bytes(model.state_dict()[k], v) for k, v in reference.state_dict().items())


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_converted_copy_is_restored_on_its_own(how: str) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()
    reference_after_step = copy.deepcopy(model)
    convert_(model, dtype=torch.bfloat16, optimizer=opt)
    duplicate = _duplicate(model, how)
    objects = _objects(duplicate)
    torchsurgery.restore(duplicate)
    _assert_as_before(duplicate, reference_after_step, objects)
    assert model[0].weight.dtype == torch.bfloat16 and len(torchsurgery.surgery_log(model)) == 1
    assert all(v.dtype == torch.bfloat16 for s in opt.state.values() for v in s.values())  # the copy's undo left it
    torchsurgery.restore(model)
    assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values())
    assert not _same_bytes(model[0].weight.detach(), reference[0].weight.detach())  # it was trained a step


def test_bad_input_leaves_model_and_log_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    torchsurgery.patch(model[0], _Doubled)
    log, values = torchsurgery.surgery_log(model), copy.deepcopy(model.state_dict())

    def unchanged() -> None:
        assert torchsurgery.surgery_log(model) == log
        for name, value in values.items():
            assert _same_bytes(model.state_dict()[name], value), name

    for bad in ({"device": "nowhere"}, {"dtype": torch.int8}, {"optimizer": "adam"}):
        with pytest.raises((TypeError, ValueError)):
            convert_(model, **bad)  # type: ignore[arg-type]
        unchanged()
    with pytest.raises(RuntimeError, match="shape of '1.weight'"):
        load_(model, {**model.state_dict(), "1.weight": torch.ones(2, 2)})
    unchanged()
    real_swap, calls = torch.utils.swap_tensors, [0]

    def flaky(a: torch.Tensor, b: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected")
        real_swap(a, b)

    monkeypatch.setattr(torch.utils, "swap_tensors", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        convert_(model, dtype=torch.float64)
    unchanged()


def test_surgery_refused_while_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = nn.Linear(2, 2)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for call in (lambda: convert_(layer, dtype=torch.float64), lambda: load_(layer, layer.state_dict())):
        with pytest.raises(RuntimeError, match="inside a torch.compile'd region"):
            call()
    assert torchsurgery.surgery_log(layer) == [] and layer.weight.dtype == torch.float32


def test_restore_after_load_in_place_gives_back_values_in_the_same_memory() -> None:
    model = _model()
    reference, objects = copy.deepcopy(model), _objects(model)
    pointers = {k: t.data_ptr() for k, (t, _) in objects.items()}
    load_(model, _model().state_dict())
    assert not torch.equal(model[0].weight, reference[0].weight)
    (entry,) = torchsurgery.surgery_log(model)
    assert (entry.kind, entry.description) == ("load", "load 7 tensors from a state dict")
    torchsurgery.restore(model)
    _assert_as_before(model, reference, objects)
    assert {k: t.data_ptr() for k, (t, _) in _objects(model).items()} == pointers


@pytest.mark.parametrize("copy_", [False, True])
def test_restore_after_load_into_a_skeleton_gives_back_meta(tmp_path: Path, copy_: bool) -> None:
    path = tmp_path / "m.safetensors"
    save_file(_Mixed().state_dict(), path)
    with skeleton():
        model = _Mixed()
    objects = _objects(model)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    load_(model, path, copy=copy_)
    (entry,) = torchsurgery.surgery_log(model)
    assert entry.description == f"load 7 tensors from {path}"
    torchsurgery.restore(model)
    assert _objects(model) == objects
    assert all(p.is_meta for p in model.parameters())
    for name, value in buffers.items():
        assert _same_bytes(getattr(model, name), value), name  # real buffers: values back in place


def test_restore_after_load_with_dtype_device_or_assign() -> None:
    for options in ({"dtype": torch.float64}, {"assign": True}, {"assign": True, "dtype": torch.bfloat16}):
        model = _model()
        reference, objects = copy.deepcopy(model), _objects(model)
        source = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in _model().state_dict().items()}
        load_(model, source, **options)  # type: ignore[arg-type]
        torchsurgery.restore(model)
        _assert_as_before(model, reference, objects)


def test_loads_and_conversions_unwind_in_reverse_order() -> None:
    model = _model()
    reference, objects = copy.deepcopy(model), _objects(model)
    for _ in range(2):
        load_(model, _model().state_dict())
        convert_(model, dtype=torch.bfloat16)
        load_(model, _model().to(torch.bfloat16).state_dict())
        convert_(model, dtype=torch.float32)
    assert [e.kind for e in torchsurgery.surgery_log(model)] == ["load", "convert"] * 4
    torchsurgery.restore(model)
    _assert_as_before(model, reference, objects)


def test_loads_one_after_another_keep_one_copy_of_the_first_values() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference, objects = copy.deepcopy(model), _objects(model)
    for _ in range(3):  # checkpoints evaluated in a loop
        load_(model, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).state_dict())
    load_(model, {"0.weight": torch.ones(4, 4)}, strict=False)  # nothing new to keep
    (entry,) = torchsurgery.surgery_log(model)
    assert entry.description == "load 4 tensors from a state dict, then 3 more loads"
    assert len(model.__dict__["_torchsurgery_log"][0].overwritten) == 4
    torchsurgery.restore(model)
    _assert_as_before(model, reference, objects)


def test_loads_with_other_surgery_between_stay_apart() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference, objects = copy.deepcopy(model), _objects(model)
    load_(model, {"0.weight": torch.ones(4, 4)}, strict=False)
    torchsurgery.patch(model[1], _Doubled)
    load_(model, {"0.weight": torch.zeros(4, 4), "1.weight": torch.zeros(4, 4)}, strict=False)
    load_(model, {"1.bias": torch.zeros(4)}, strict=False)  # right after: taken in
    assert [e.description for e in torchsurgery.surgery_log(model)] == [
        "load 1 tensors from a state dict",
        "patch _Doubled",
        "load 3 tensors from a state dict, then 1 more loads",
    ]
    torchsurgery.restore(model)
    _assert_as_before(model, reference, objects)


def test_convert_refuses_weights_an_installation_reads_as_another_dtype() -> None:
    # its undo would give back plain fp64 tensors, not the fp32 values the installation keeps
    model = nn.Sequential(nn.Linear(3, 3))
    reference = copy.deepcopy(model)
    torchsurgery.DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"'0.weight' reads as torch.float64 while its values are kept in torch.float32"):
        convert_(model, dtype=torch.bfloat16)
    torchsurgery.DynamicSwapInstaller.uninstall_model(model)
    convert_(model, dtype=torch.bfloat16)
    torchsurgery.restore(model)
    for (name, ours), theirs in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name


def test_restore_goes_through_a_pending_backward_which_then_raises() -> None:
    # an undo does not wait for the outputs of earlier forwards to go; their backward cannot
    # reach the restored weights (the graph holds the converted ones), so it raises
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    reference = copy.deepcopy(model)
    convert_(model, dtype=torch.float64)
    loss = model(torch.randn(2, 3, dtype=torch.float64)).sum()
    torchsurgery.restore(model)
    assert torchsurgery.surgery_log(model) == []
    for (name, ours), theirs in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
    with pytest.raises(RuntimeError, match="recorded before an undo"):
        loss.backward()
    x = torch.randn(2, 3)
    model(x).sum().backward()
    reference(x).sum().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert ours.grad is not None and theirs.grad is not None and torch.equal(ours.grad, theirs.grad)


_FLOATS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _every_value(dtype: torch.dtype) -> torch.Tensor:
    """Every value of an 8- or 16-bit float dtype; for wider ones, the extremes and a sample."""
    if dtype.itemsize <= 2:
        bits = torch.arange(2 ** (8 * dtype.itemsize), dtype=torch.int32)
        return bits.to(torch.uint8 if dtype.itemsize == 1 else torch.int16).view(dtype)
    info = torch.finfo(dtype)
    edges = [info.max, -info.max, info.smallest_normal, info.smallest_normal * info.eps, 1 + info.eps, 0.0]
    return torch.cat([torch.tensor(edges, dtype=dtype), torch.randn(10_000, dtype=dtype) * 1e3])


@pytest.mark.parametrize("there", _FLOATS, ids=str)
@pytest.mark.parametrize("here", _FLOATS, ids=str)
def test_originals_are_kept_exactly_when_the_conversion_loses_values(here: torch.dtype, there: torch.dtype) -> None:
    if here == there:
        return
    values = _every_value(here)
    module = nn.Module()
    module.register_buffer("values", values.clone())
    convert_(module, dtype=there)
    back = values.to(there).to(here)
    exact = bool(((back == values) | (back.isnan() & values.isnan())).all())
    (entry,) = torchsurgery.surgery_log(module)
    assert ("originals kept" in entry.description) == (not exact)
    torchsurgery.restore(module)
    numbers = ~values.isnan()  # every number bitwise (signed zeros too); NaN stays NaN, payload aside
    assert module.values.dtype == here and bool(module.values.isnan().eq(~numbers).all())
    assert _same_bytes(module.values[numbers], values[numbers])


def test_convert_of_an_offloaded_model_is_refused_until_the_offload_is_removed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(2, 8)
    handle = torchsurgery.offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32, groups="leaves")
    with torch.no_grad():
        offloaded = model(x)
    log = torchsurgery.surgery_log(model)
    with pytest.raises(RuntimeError, match="convert_: the module's weights are held by an active offload"):
        torchsurgery.convert_(model, dtype=torch.float64)
    assert torchsurgery.surgery_log(model) == log and model[0].weight.stored.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(model(x), offloaded, rtol=0, atol=0)
    handle.remove()
    torchsurgery.convert_(model, dtype=torch.float64)  # the same model converts once it is back
    with torch.no_grad():
        assert model(x.double()).dtype == torch.float64


@pytest.mark.accelerator
def test_convert_and_load_onto_the_accelerator_keep_every_object(accelerator: torch.device, tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).eval()
    x = torch.randn(3, 4)
    expected = copy.deepcopy(model).to(accelerator)(x.to(accelerator))
    ids = {n: id(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_(model, device=accelerator, optimizer=opt)
    assert {n: id(t) for n, t in [*model.named_parameters(), *model.named_buffers()]} == ids
    assert all(t.device == accelerator for t in [*model.parameters(), *model.buffers()])
    torch.testing.assert_close(model(x.to(accelerator)), expected, rtol=0, atol=0)
    path = tmp_path / "model.safetensors"
    save_file({k: v.cpu().contiguous() for k, v in model.state_dict().items()}, path)
    with skeleton():
        fresh = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).eval()
    load_(fresh, path, device=accelerator)
    assert all(t.device == accelerator for t in [*fresh.parameters(), *fresh.buffers()])
    torch.testing.assert_close(fresh(x.to(accelerator)), expected, rtol=0, atol=0)
