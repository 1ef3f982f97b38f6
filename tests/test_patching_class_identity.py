"""Tests of what a patched module's class looks like to torch and to libraries.

Containers build new instances of their own class (slicing calls ``type(self)(...)``);
transformers looks classes up by name. Both must see the original class.
"""

from __future__ import annotations

import copy
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import torchsurgery
from torchsurgery import DynamicSwapInstaller, FlexModel, HookFunction, Patch

transformers = pytest.importorskip("transformers")


class Tag(Patch, nn.Module):
    """A patch that changes nothing but the class."""


class Counted(Patch, nn.Module):
    def __patch_init__(self) -> None:
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().forward(*args, **kwargs)


# ---------------------------------------------------------------------------
# containers


def _children() -> list[nn.Module]:
    return [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)]


CONTAINERS: dict[str, Callable[[], nn.Module]] = {
    "Sequential": lambda: nn.Sequential(*_children()),
    "ModuleList": lambda: nn.ModuleList(_children()),
    "ModuleDict": lambda: nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.ReLU()}),
}


@pytest.mark.parametrize("kind", [nn.Sequential, nn.ModuleList])
def test_slicing_a_patched_container_gives_an_unpatched_container_of_the_same_children(kind: type) -> None:
    container = kind(_children()) if kind is nn.ModuleList else kind(*_children())
    torchsurgery.patch(container[0], Tag)
    torchsurgery.patch(container, Counted)
    part = container[1:]
    assert type(part) is kind and not torchsurgery.is_patched(part)
    assert list(part) == list(container)[1:]  # the same objects
    assert torchsurgery.surgery_log(part) == []
    assert torchsurgery.patches(container) == [Counted]  # the sliced container is untouched
    head = container[:1]
    assert head[0] is container[0] and torchsurgery.patches(head[0]) == [Tag]


def test_a_patched_sequential_slice_runs_like_the_plain_slice() -> None:
    model = nn.Sequential(*_children())
    x = torch.randn(3, 2)
    expected = model[:2](x)
    torchsurgery.patch(model, Counted)
    torch.testing.assert_close(model[:2](x), expected)
    model(x)
    assert model.calls == 1


def test_a_patched_parameter_list_slices() -> None:
    params = nn.ParameterList([nn.Parameter(torch.randn(2)) for _ in range(3)])
    torchsurgery.patch(params, Tag)
    part = params[:2]
    assert type(part) is nn.ParameterList and part[0] is params[0]


@pytest.mark.parametrize("name", sorted(CONTAINERS))
def test_type_of_a_patched_container_builds_the_original_class(name: str) -> None:
    container = CONTAINERS[name]()
    original = type(container)
    torchsurgery.patch(container, Tag)
    fresh = type(container)()
    assert type(fresh) is original and not torchsurgery.is_patched(fresh)
    assert len(fresh) == 0 and fresh.training


@pytest.mark.parametrize("name", sorted(CONTAINERS))
def test_copies_of_a_patched_container_keep_the_patch_and_unpatch_on_their_own(name: str) -> None:
    container = CONTAINERS[name]()
    original = type(container)
    torchsurgery.patch(container, Counted)
    for copy_ in (copy.copy(container), copy.deepcopy(container), pickle.loads(pickle.dumps(container))):
        assert type(copy_) is type(container) and torchsurgery.patches(copy_) == [Counted]
        torchsurgery.unpatch(copy_)
        assert type(copy_) is original and not hasattr(copy_, "calls")
        assert torchsurgery.patches(container) == [Counted] and container.calls == 0
    torchsurgery.unpatch(container)
    assert type(container) is original


def test_a_patch_class_itself_is_still_not_constructed() -> None:
    with pytest.raises(TypeError, match="is a patch and is not constructed directly"):
        Counted()


def test_the_patched_class_carries_the_original_names() -> None:
    layer = torchsurgery.patch(nn.Linear(2, 2), Counted)
    cls = type(layer)
    assert (cls.__name__, cls.__qualname__, cls.__module__) == ("Linear", "Linear", nn.Linear.__module__)
    assert str(cls) == str(nn.Linear) and isinstance(layer, Counted) and cls is not nn.Linear


# ---------------------------------------------------------------------------
# transformers models under every surgery that changes classes


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=64, max_position_embeddings=32, attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config)


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32, attn_implementation="eager"
    )
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=64,
        max_position_embeddings=32, attn_implementation="eager",
    )
    return transformers.BertModel(config)


def _clip_text() -> nn.Module:
    config = transformers.CLIPTextConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=64,
        max_position_embeddings=32, attn_implementation="eager",
    )
    return transformers.CLIPTextModel(config)


def _t5_encoder() -> nn.Module:
    config = transformers.T5Config(
        d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, vocab_size=64, attn_implementation="eager"
    )
    return transformers.T5EncoderModel(config)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": _llama, "gpt2": _gpt2, "bert": _bert, "clip_text": _clip_text, "t5_encoder": _t5_encoder,
}
IDS = torch.tensor([[1, 5, 9, 3, 7, 2]])


def _patch_root(model: nn.Module) -> Callable[[], None]:
    torchsurgery.patch(model, Counted)
    return lambda: torchsurgery.unpatch(model)


def _patch_everything(model: nn.Module) -> Callable[[], None]:
    # the root, the base model, the layer containers and the layers alike
    modules = list(model.modules())
    for module in modules:
        torchsurgery.patch(module, Tag)
    return lambda: [torchsurgery.unpatch(m) for m in modules] and None


def _dynamic_swap(model: nn.Module) -> Callable[[], None]:
    DynamicSwapInstaller.install_model(model, dtype=torch.float32)
    return lambda: DynamicSwapInstaller.uninstall_model(model)


def _offload(model: nn.Module) -> Callable[[], None]:
    # float64 storage of fp32 weights: the values are exact, every group streams
    handle = torchsurgery.offload(model, storage_dtype=torch.float64, dtype=torch.float32, skip=None)
    return lambda: handle.remove() and None


SURGERIES: dict[str, Callable[[nn.Module], Callable[[], None]]] = {
    "patch_root": _patch_root, "patch_everything": _patch_everything,
    "dynamic_swap": _dynamic_swap, "offload": _offload,
}


def _recorded(model: nn.Module, call: Callable[..., Any] | None = None) -> dict[str, Any]:
    out = (call or model)(IDS, output_hidden_states=True, output_attentions=True)
    first = out.last_hidden_state if "last_hidden_state" in out else out.logits
    return {"first": first, "hidden_states": out.hidden_states, "attentions": out.attentions}


def _assert_same(got: dict[str, Any], expected: dict[str, Any]) -> None:
    for key in ("hidden_states", "attentions"):
        assert expected[key] is not None and got[key] is not None, key
        assert len(got[key]) == len(expected[key]), key
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("surgery", sorted(SURGERIES))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_recorded_outputs_are_the_same_under_class_changing_surgery(name: str, surgery: str) -> None:
    model = MODELS[name]().eval()
    base = model.base_model  # the model itself for the encoders; called on its own too
    with torch.no_grad():
        expected, expected_base = _recorded(model), _recorded(base)
        undo = SURGERIES[surgery](model)
        got, got_base = _recorded(model), _recorded(base)
        undo()
        after = _recorded(model)
    _assert_same(got, expected)
    _assert_same(got_base, expected_base)
    _assert_same(after, expected)
    assert torchsurgery.surgery_log(model) == []


@pytest.mark.parametrize("name", sorted(MODELS))
def test_recorded_outputs_are_the_same_through_flex_model(name: str) -> None:
    model = MODELS[name]().eval()
    with torch.no_grad():
        expected = _recorded(model)
        captured: dict[str, Any] = {}
        flex = FlexModel(model, captured)
        layer = next(n for n, m in model.named_modules() if n and n.split(".")[-1] == "0")
        flex.register_forward_hook(HookFunction(layer))
        torchsurgery.patch(model, Counted)
        got = _recorded(model, flex)
        torchsurgery.unpatch(model)
        flex.restore()
    _assert_same(got, expected)
    assert list(captured) == [layer]


def _llama_base() -> nn.Module:
    return _llama().model


def _gpt2_base() -> nn.Module:
    return _gpt2().transformer


@pytest.mark.parametrize("make", [_llama_base, _gpt2_base, _bert], ids=["LlamaModel", "GPT2Model", "BertModel"])
@pytest.mark.parametrize("surgery", ["patch_everything", "dynamic_swap"])
def test_base_models_run_with_every_module_patched(make: Callable[[], nn.Module], surgery: str) -> None:
    model = make().eval()
    with torch.no_grad():
        expected = model(IDS).last_hidden_state
        undo = SURGERIES[surgery](model)
        got = model(IDS).last_hidden_state
        undo()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _bert_lm() -> nn.Module:
    config = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=64,
        max_position_embeddings=32, is_decoder=True,
    )
    return transformers.BertLMHeadModel(config)


@pytest.mark.parametrize("make", [_llama, _gpt2, _bert_lm], ids=["llama", "gpt2", "bert"])
@pytest.mark.parametrize("surgery", ["patch_everything", "dynamic_swap"])
def test_generate_is_the_same_under_patches(make: Callable[[], nn.Module], surgery: str) -> None:
    model = make().eval()
    kwargs: dict[str, Any] = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    expected = model.generate(IDS, **kwargs)
    undo = SURGERIES[surgery](model)
    got = model.generate(IDS, **kwargs)
    undo()
    assert torch.equal(got, expected)


def test_save_pretrained_writes_the_original_architecture(tmp_path: Any) -> None:
    model = _llama()
    torchsurgery.patch(model, Counted)
    model.save_pretrained(tmp_path)
    assert transformers.AutoConfig.from_pretrained(tmp_path).architectures == ["LlamaForCausalLM"]


def test_slices_that_transformers_takes_stay_plain_under_dynamic_swap() -> None:
    model = _llama().model.eval()
    DynamicSwapInstaller.install_model(model, dtype=torch.float32)
    part = model.layers[:1]
    assert type(part) is nn.ModuleList and not torchsurgery.is_patched(part)
    assert torchsurgery.is_patched(part[0])
    DynamicSwapInstaller.uninstall_model(model)


def test_an_ordered_dict_built_sequential_slice_keeps_names() -> None:
    model = nn.Sequential(OrderedDict(first=nn.Linear(2, 2), second=nn.ReLU()))
    torchsurgery.patch(model, Tag)
    assert list(dict(model[1:].named_children())) == ["second"]
