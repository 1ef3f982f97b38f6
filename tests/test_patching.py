"""Tests of torchsurgery.patching: class patching of live module instances, and its undo."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import torchsurgery
from torchsurgery import Patch

# ---------------------------------------------------------------------------
# Patches used across the tests (module level, so they pickle by reference).


class MostlyFrozenEmbedding(Patch, nn.Embedding):
    """The seed's example: learn a delta for a few tokens of a frozen embedding."""

    def __patch_init__(self, trainable_token_ids: list[int]) -> None:
        for p in self.parameters():
            p.requires_grad_(False)
        self.delta = nn.Parameter(torch.zeros(len(trainable_token_ids), self.embedding_dim))
        ids = torch.tensor(trainable_token_ids).reshape(-1, 1).repeat(1, self.embedding_dim)
        self.register_buffer("trainable_token_ids", ids)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = torch.scatter_add(self.weight, 0, self.trainable_token_ids, self.delta)
        return F.embedding(input, weight, self.padding_idx, self.max_norm)


class Scaled(Patch, nn.Linear):
    """Multiply a Linear's output by a learnable scale."""

    def __patch_init__(self, scale: float = 2.0) -> None:
        self.scale = nn.Parameter(torch.tensor(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class Shifted(Patch, nn.Linear):
    """Add a constant buffer to a Linear's output."""

    def __patch_init__(self, shift: float = 1.0) -> None:
        self.register_buffer("shift", torch.tensor(shift))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shift


class Clamped(Patch, nn.Module):
    """Works on any module: clamp whatever forward returns; counts calls."""

    def __patch_init__(self, limit: float = 0.5) -> None:
        self.limit = limit
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return super().forward(*args, **kwargs).clamp(-self.limit, self.limit)


class Frozen(Patch, nn.Module):
    """Freeze everything below the module."""

    def __patch_init__(self) -> None:
        self.requires_grad_(False)


class Failing(Patch, nn.Linear):
    """Changes many things, then fails half-way."""

    def __patch_init__(self) -> None:
        self.extra = nn.Parameter(torch.ones(2))
        self.register_buffer("buf", torch.zeros(1))
        self.weight.requires_grad_(False)
        self.register_forward_hook(lambda m, i, o: o)
        self.note = "half-way"
        self.bias = None
        raise KeyError("boom")


class Hooked(Patch, nn.Linear):
    """Registers hooks of several kinds on itself."""

    def __patch_init__(self) -> None:
        self.seen: list[int] = []
        self.register_forward_pre_hook(lambda m, args: None)
        self.register_forward_hook(lambda m, args, out: self.seen.append(out.shape[0]))
        self.register_full_backward_hook(lambda m, gi, go: None)


class MyLinear(nn.Linear):
    """A user subclass: patches declared for nn.Linear must apply to it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) - 1.0


# ---------------------------------------------------------------------------
# Helpers


def fingerprint(model: nn.Module) -> dict[str, Any]:
    """Everything the undo promise covers, per submodule."""
    out: dict[str, Any] = {}
    for name, m in model.named_modules():
        out[name] = {
            "class": type(m),
            "dict_keys": sorted(m.__dict__),
            "params": {k: (id(p), p.data_ptr(), p.requires_grad) for k, p in m._parameters.items() if p is not None},
            "param_keys": sorted(m._parameters),
            "buffers": {k: id(b) for k, b in m._buffers.items() if b is not None},
            "buffer_keys": sorted(m._buffers),
            "modules": {k: id(c) for k, c in m._modules.items()},
            "hooks": [
                len(m._forward_hooks),
                len(m._forward_pre_hooks),
                len(m._backward_hooks),
                len(m._backward_pre_hooks),
                len(m._state_dict_hooks),
                len(m._load_state_dict_pre_hooks),
            ],
            "training": m.training,
        }
    return out


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


MODULE_FACTORIES = {
    "linear": lambda: nn.Linear(4, 3),
    "linear_subclass": lambda: MyLinear(4, 3),
    "embedding": lambda: nn.Embedding(10, 4),
    "conv": lambda: nn.Conv2d(2, 3, 3),
    "layernorm": lambda: nn.LayerNorm(4),
    "batchnorm": lambda: nn.BatchNorm1d(4),
}


# ---------------------------------------------------------------------------
# The seed's seven requirements


def test_from_existing_returns_the_same_object_typed_as_the_patch() -> None:
    emb = nn.Embedding(16, 32)
    patched = MostlyFrozenEmbedding.from_existing(emb, trainable_token_ids=[1, 2])
    assert patched is emb
    assert isinstance(patched, MostlyFrozenEmbedding)
    assert isinstance(patched, nn.Embedding)  # requirement 2
    assert torchsurgery.is_patched(emb) and torchsurgery.is_patched(emb, MostlyFrozenEmbedding)
    assert not torchsurgery.is_patched(emb, Scaled)
    assert torchsurgery.patches(emb) == [MostlyFrozenEmbedding]
    assert torchsurgery.original_class(emb) is nn.Embedding


@pytest.mark.parametrize("kind", sorted(MODULE_FACTORIES))
def test_nothing_is_copied_and_undo_is_exact(kind: str) -> None:
    module = MODULE_FACTORIES[kind]().eval()  # eval: BatchNorm's forward must not move its stats
    before, values = fingerprint(module), state(module)
    x_like = {"embedding": torch.tensor([1, 2, 3]), "conv": torch.randn(1, 2, 5, 5)}.get(kind, torch.randn(5, 4))
    expected = module(x_like)

    torchsurgery.patch(module, Clamped, limit=0.1)
    torchsurgery.patch(module, Frozen)
    after = fingerprint(module)
    for name, params in before[""]["params"].items():
        assert after[""]["params"][name][:2] == params[:2]  # same id and data_ptr
    assert all(not p.requires_grad for p in module.parameters())
    torch.testing.assert_close(module(x_like), expected.clamp(-0.1, 0.1))

    torchsurgery.unpatch(module)
    torchsurgery.unpatch(module)
    assert fingerprint(module) == before
    assert_same_state(state(module), values)
    torch.testing.assert_close(module(x_like), expected)


def test_patch_for_a_base_class_applies_to_subclass_instances() -> None:
    layer = MyLinear(3, 3)
    x = torch.randn(2, 3)
    plain = layer(x)
    Scaled.from_existing(layer, scale=3.0)
    assert isinstance(layer, MyLinear) and isinstance(layer, Scaled)
    # the patch's super().forward reaches MyLinear.forward, not nn.Linear.forward
    torch.testing.assert_close(layer(x), plain * 3.0)
    assert type(torchsurgery.unpatch(layer)) is MyLinear


def test_incompatible_class_is_refused_naming_both_classes() -> None:
    conv = nn.Conv1d(2, 2, 1)
    before = fingerprint(conv)
    with pytest.raises(TypeError, match=r"Scaled.*Linear.*Conv1d"):
        torchsurgery.patch(conv, Scaled)
    assert fingerprint(conv) == before


def test_extra_parameters_buffers_and_attributes_are_added_and_removed() -> None:
    emb = nn.Embedding(8, 4)
    keys = sorted(emb.state_dict())
    MostlyFrozenEmbedding.from_existing(emb, trainable_token_ids=[3])
    assert sorted(emb.state_dict()) == sorted(keys + ["delta", "trainable_token_ids"])
    assert [n for n, p in emb.named_parameters() if p.requires_grad] == ["delta"]
    torchsurgery.unpatch(emb)
    assert sorted(emb.state_dict()) == keys
    assert emb.weight.requires_grad
    assert not hasattr(emb, "delta") and not hasattr(emb, "trainable_token_ids")


def test_seed_example_trains_only_the_delta_end_to_end() -> None:
    emb = nn.Embedding(16, 32)
    original_weight = emb.weight.detach().clone()
    weight_id = id(emb.weight)
    MostlyFrozenEmbedding.from_existing(emb, trainable_token_ids=[1, 2])
    opt = torch.optim.Adam([p for p in emb.parameters() if p.requires_grad], lr=0.1)
    tokens = torch.tensor([[1, 2, 5], [2, 7, 1]])
    target = torch.randn(2, 3, 32)
    losses = []
    for _ in range(5):
        loss = F.mse_loss(emb(tokens), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert emb.delta.abs().sum() > 0  # the delta learned
    assert torch.equal(emb.weight, original_weight)  # the original weight did not
    # the patched forward is the embedding with the delta added to the chosen rows only
    reference = original_weight.clone()
    reference[[1, 2]] += emb.delta.detach()
    torch.testing.assert_close(emb(tokens), F.embedding(tokens, reference))
    torchsurgery.unpatch(emb)
    assert type(emb) is nn.Embedding and id(emb.weight) == weight_id
    torch.testing.assert_close(emb(tokens), F.embedding(tokens, original_weight))


# ---------------------------------------------------------------------------
# All or nothing


def test_failing_patch_init_leaves_the_module_exactly_as_it_was() -> None:
    layer = nn.Linear(3, 2)
    before, values = fingerprint(layer), state(layer)
    with pytest.raises(KeyError, match="boom"):
        torchsurgery.patch(layer, Failing)
    assert fingerprint(layer) == before
    assert_same_state(state(layer), values)
    assert not torchsurgery.is_patched(layer)


def test_failing_patch_on_top_of_a_stack_keeps_the_stack() -> None:
    layer = Scaled.from_existing(nn.Linear(3, 2))
    before = fingerprint(layer)
    with pytest.raises(KeyError):
        torchsurgery.patch(layer, Failing)
    assert fingerprint(layer) == before
    assert torchsurgery.patches(layer) == [Scaled]


# ---------------------------------------------------------------------------
# Stacking


def test_removing_a_patch_from_the_middle_keeps_the_others_working() -> None:
    layer = nn.Linear(3, 3)
    x = torch.randn(4, 3)
    base = layer(x)
    Scaled.from_existing(layer, scale=2.0)
    Shifted.from_existing(layer, shift=1.0)
    torchsurgery.patch(layer, Clamped, limit=1.5)
    torch.testing.assert_close(layer(x), (base * 2.0 + 1.0).clamp(-1.5, 1.5))

    torchsurgery.unpatch(layer, Shifted)
    assert torchsurgery.patches(layer) == [Scaled, Clamped]
    assert not hasattr(layer, "shift")
    torch.testing.assert_close(layer(x), (base * 2.0).clamp(-1.5, 1.5))

    torchsurgery.unpatch(layer, Scaled)
    torch.testing.assert_close(layer(x), base.clamp(-1.5, 1.5))
    torchsurgery.unpatch(layer)
    assert type(layer) is nn.Linear
    torch.testing.assert_close(layer(x), base)


def test_middle_removal_refused_when_a_later_patch_changed_the_same_thing() -> None:
    class Rescaled(Patch, nn.Linear):
        def __patch_init__(self) -> None:
            self.scale = nn.Parameter(torch.tensor(5.0))  # replaces Scaled's parameter

    layer = Scaled.from_existing(nn.Linear(2, 2))
    Rescaled.from_existing(layer)
    before = fingerprint(layer)
    with pytest.raises(ValueError, match="Rescaled.*unpatch it first"):
        torchsurgery.unpatch(layer, Scaled)
    assert fingerprint(layer) == before
    torchsurgery.unpatch(layer)
    assert layer.scale.item() == 2.0  # Scaled's parameter is back
    torchsurgery.unpatch(layer)
    assert not hasattr(layer, "scale")


def test_one_class_per_patch_and_original_class() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    c, d = MyLinear(2, 2), MyLinear(2, 2)
    for m in (a, b, c, d):
        Scaled.from_existing(m)
        Clamped.from_existing(m)
    assert type(a) is type(b)
    assert type(c) is type(d)
    assert type(a) is not type(c)


def test_hooks_registered_by_the_patch_are_removed() -> None:
    layer = nn.Linear(2, 2)
    before = fingerprint(layer)
    Hooked.from_existing(layer)
    layer(torch.randn(3, 2, requires_grad=True)).sum().backward()
    assert layer.seen == [3]
    torchsurgery.unpatch(layer)
    assert fingerprint(layer) == before


def test_patching_twice_with_the_same_patch_is_refused() -> None:
    layer = Scaled.from_existing(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already patched with Scaled"):
        torchsurgery.patch(layer, Scaled)


def test_class_changed_by_another_tool_is_detected() -> None:
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2

    layer = Scaled.from_existing(nn.Linear(2, 2))
    parametrize.register_parametrization(layer, "weight", Double())
    with pytest.raises(RuntimeError, match="another tool changed its class"):
        torchsurgery.unpatch(layer)
    parametrize.remove_parametrizations(layer, "weight")
    # parametrize restores the class it found, so our patch is intact again
    assert type(torchsurgery.unpatch(layer)) is nn.Linear


def test_patching_a_parametrized_module_and_unpatching_restores_it() -> None:
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2

    layer = nn.Linear(2, 2)
    parametrize.register_parametrization(layer, "weight", Double())
    cls = type(layer)
    x = torch.randn(1, 2)
    Scaled.from_existing(layer, scale=3.0)
    torch.testing.assert_close(layer(x), F.linear(x, layer.parametrizations.weight.original * 2, layer.bias) * 3)
    assert type(torchsurgery.unpatch(layer)) is cls


# ---------------------------------------------------------------------------
# Serialisation


def _round_trips(module: nn.Module) -> list[nn.Module]:
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return [
        pickle.loads(pickle.dumps(module)),
        copy.deepcopy(module),
        torch.load(buf, weights_only=False),
    ]


def test_pickle_deepcopy_and_torch_save_round_trip() -> None:
    model = nn.Sequential(nn.Embedding(8, 4), MyLinear(4, 4))
    MostlyFrozenEmbedding.from_existing(model[0], trainable_token_ids=[1])
    Scaled.from_existing(model[1], scale=1.5)
    Clamped.from_existing(model[1], limit=0.3)
    with torch.no_grad():
        model[0].delta.fill_(0.25)
    x = torch.tensor([[1, 2, 3]])
    expected = model(x)
    for copy_ in _round_trips(model):
        assert type(copy_[1]) is type(model[1])  # the same cached class is rebuilt
        assert torchsurgery.patches(copy_[1]) == [Scaled, Clamped]
        torch.testing.assert_close(copy_(x), expected)
        assert copy_[0].delta.data_ptr() != model[0].delta.data_ptr()
        torchsurgery.unpatch(copy_[1])
        torchsurgery.unpatch(copy_[1])
        torchsurgery.unpatch(copy_[0])
        assert type(copy_[0]) is nn.Embedding and type(copy_[1]) is MyLinear
        assert sorted(copy_.state_dict()) == ["0.weight", "1.bias", "1.weight"]


def test_state_dict_round_trip_between_patched_modules() -> None:
    src = MostlyFrozenEmbedding.from_existing(nn.Embedding(8, 4), trainable_token_ids=[1, 2])
    with torch.no_grad():
        src.delta.normal_()
    dst = MostlyFrozenEmbedding.from_existing(nn.Embedding(8, 4), trainable_token_ids=[1, 2])
    result = dst.load_state_dict(src.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    tokens = torch.tensor([1, 2, 3])
    torch.testing.assert_close(dst(tokens), src(tokens))
    # the plain class refuses the patch's extra keys, as it should
    with pytest.raises(RuntimeError, match="delta"):
        nn.Embedding(8, 4).load_state_dict(src.state_dict())


# ---------------------------------------------------------------------------
# torch.compile


def test_n_patched_layers_compile_once_and_fullgraph() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    compiles = 0

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        nonlocal compiles
        compiles += 1
        return gm.forward

    layers = [Scaled.from_existing(nn.Linear(4, 4), scale=float(i)) for i in range(4)]
    x = torch.randn(2, 4)
    for layer in layers:
        compiled = torch.compile(layer, backend=counting_backend, fullgraph=True)
        torch.testing.assert_close(compiled(x), layer(x))
    assert compiles == 1


def test_patching_inside_a_compiled_region_is_refused() -> None:
    layer = nn.Linear(2, 2)

    @torch.compile(backend="eager", fullgraph=True)
    def surgery_in_graph(x: torch.Tensor) -> torch.Tensor:
        torchsurgery.patch(layer, Scaled)
        return x + 1

    with pytest.raises(Exception, match="torchsurgery.patch was called inside a torch.compile"):
        surgery_in_graph(torch.ones(1))
    assert type(layer) is nn.Linear


# ---------------------------------------------------------------------------
# Hot path


def test_no_attribute_hooks_on_the_hot_path() -> None:
    layer = Clamped.from_existing(Scaled.from_existing(nn.Linear(2, 2)))
    cls = type(layer)
    assert cls.__getattr__ is nn.Module.__getattr__
    assert cls.__getattribute__ is object.__getattribute__
    assert cls.__setattr__ is nn.Module.__setattr__


# ---------------------------------------------------------------------------
# Bad input


def test_bad_input_is_refused_clearly() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="expected an nn.Module"):
        torchsurgery.patch("not a module", Scaled)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="subclass of torchsurgery.Patch"):
        torchsurgery.patch(layer, nn.Linear)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="subclass of torchsurgery.Patch"):
        torchsurgery.patch(layer, Patch)
    with pytest.raises(ValueError, match="is not patched"):
        torchsurgery.unpatch(layer)
    Scaled.from_existing(layer)
    with pytest.raises(ValueError, match="not patched with Shifted.*Scaled"):
        torchsurgery.unpatch(layer, Shifted)
    with pytest.raises(TypeError, match="from_existing"):
        Scaled(2, 2)
    for fn in (torchsurgery.is_patched, torchsurgery.patches, torchsurgery.original_class):
        with pytest.raises(TypeError, match=f"torchsurgery.{fn.__name__}: expected an nn.Module, got NoneType"):
            fn(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="is_patched: expected a subclass of torchsurgery.Patch"):
        torchsurgery.is_patched(layer, nn.Linear)  # type: ignore[arg-type]
    model = nn.Sequential(nn.Linear(2, 2))
    before = fingerprint(model)
    with pytest.raises(TypeError, match="patched: targets must map selectors to patch classes.*got a list"):
        with torchsurgery.patched(model, [Scaled]):  # type: ignore[arg-type]
            pass
    assert fingerprint(model) == before


def test_patched_context_manager_by_glob_filter_and_name() -> None:
    model = nn.Sequential(
        nn.ModuleDict({"mlp": nn.Linear(3, 3), "attn": nn.Linear(3, 3)}),
        nn.ModuleDict({"mlp": nn.Linear(3, 3), "attn": nn.Linear(3, 3)}),
    )
    before = fingerprint(model)
    x = torch.randn(1, 3)
    plain = model[1]["mlp"](x)
    with torchsurgery.patched(model, {"*.mlp": Scaled, "1.attn": Scaled}, scale=2.0):
        assert torchsurgery.patches(model[0]["mlp"]) == [Scaled]
        assert torchsurgery.patches(model[1]["mlp"]) == [Scaled]
        assert torchsurgery.patches(model[1]["attn"]) == [Scaled]
        assert not torchsurgery.is_patched(model[0]["attn"])
        torch.testing.assert_close(model[1]["mlp"](x), plain * 2.0)
    assert fingerprint(model) == before

    def only_attn(module: nn.Module, name: str) -> bool:
        return name.endswith("attn")

    with pytest.raises(RuntimeError, match="inside"):
        with torchsurgery.patched(model, {only_attn: Scaled}, scale=1.0):
            assert torchsurgery.is_patched(model[0]["attn"])
            raise RuntimeError("inside")
    assert fingerprint(model) == before


def test_patched_errors_before_changing_anything() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    before = fingerprint(model)
    with pytest.raises(ValueError, match=r"'2'.*did you mean|matches no submodule"):
        with torchsurgery.patched(model, {"0": Scaled, "2": Shifted}):
            pass
    with pytest.raises(ValueError, match="layers.*matches no submodule"):
        with torchsurgery.patched(model, {"layers.*": Scaled}):
            pass
    with pytest.raises(TypeError, match="1 is a ReLU"):
        with torchsurgery.patched(model, {"0": Shifted, "*": Scaled}):
            pass
    assert fingerprint(model) == before


def test_patched_unwinds_when_one_patch_init_fails() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    before = fingerprint(model)
    with pytest.raises(KeyError):
        with torchsurgery.patched(model, {"0": Scaled, "1": Failing}):
            pass
    assert fingerprint(model) == before


def test_near_matches_are_suggested() -> None:
    model = nn.Sequential()
    model.add_module("encoder", nn.Linear(2, 2))
    with pytest.raises(ValueError, match="did you mean 'encoder'"):
        with torchsurgery.patched(model, {"encodr": Scaled}):
            pass


# ---------------------------------------------------------------------------
# Random stacks on random trees: undoing everything gives back the start


def _random_tree(draw: st.DrawFn, depth: int = 0) -> nn.Module:
    kind = draw(st.sampled_from(["linear", "seq", "list", "dict"] if depth < 2 else ["linear"]))
    if kind == "linear":
        return nn.Linear(3, 3)
    children = [_random_tree(draw, depth + 1) for _ in range(draw(st.integers(1, 3)))]
    if kind == "seq":
        return nn.Sequential(*children)
    if kind == "list":
        holder = nn.Module()
        holder.items = nn.ModuleList(children)
        return holder
    return nn.ModuleDict({f"k{i}": c for i, c in enumerate(children)})


@st.composite
def trees(draw: st.DrawFn) -> nn.Module:
    return _random_tree(draw)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tree=trees(),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 50), st.integers(0, 4)), max_size=25),
)
def test_random_patch_and_unpatch_sequences_undo_exactly(
    tree: nn.Module, ops: list[tuple[bool, int, int]]
) -> None:
    kinds: list[type[Patch]] = [Scaled, Shifted, Clamped, Frozen, Failing]
    linears = _linears(tree)
    start, values = fingerprint(tree), state(tree)
    x = torch.randn(2, 3)
    reference = {id(m): m(x) for m in linears}
    for do_patch, which, kind in ops:
        layer = linears[which % len(linears)]
        if do_patch:
            try:
                torchsurgery.patch(layer, kinds[kind])
            except (ValueError, KeyError):
                pass  # already carries it, or the failing patch: must have changed nothing
        elif torchsurgery.is_patched(layer):
            stack = torchsurgery.patches(layer)
            try:
                torchsurgery.unpatch(layer, stack[kind % len(stack)])
            except ValueError:
                pass  # refused for overlap; nothing changed
    for layer in linears:
        while torchsurgery.is_patched(layer):
            torchsurgery.unpatch(layer)
    assert fingerprint(tree) == start
    assert_same_state(state(tree), values)
    for m in linears:
        torch.testing.assert_close(m(x), reference[id(m)])


# ---------------------------------------------------------------------------
# A patch's change set covers its whole subtree


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.norm = nn.LayerNorm(3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x)) * self.scale


class ReachesBelow(Patch, Block):
    """Changes children's hooks, parameters, buffers, values and storage, then maybe fails."""

    def __patch_init__(self, fail: bool = False) -> None:
        self.fc.register_forward_hook(lambda m, i, o: o * 0)
        self.fc.weight.register_hook(lambda g: g * 0)
        self.norm.bias = nn.Parameter(torch.full((3,), 5.0))
        self.norm.register_buffer("extra", torch.zeros(1))
        with torch.no_grad():
            self.fc.weight.mul_(3)        # in place, seen by autograd's version counter
            self.fc.bias.data.fill_(7.0)  # through .data, which the version counter misses
            self.scale[0] = -1.0          # through a view
        self.norm.weight.data = torch.zeros(3)  # the storage itself replaced
        self.fc.training = False
        if fail:
            raise KeyError("boom below")


def _block_state(block: nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[int]]:
    hooks = [len(p._backward_hooks or {}) for p in block.parameters()]
    return fingerprint(block), state(block), hooks


@pytest.mark.parametrize("how", ["fails", "unpatched", "restored"])
def test_changes_below_the_patched_module_are_undone(how: str) -> None:
    torch.manual_seed(0)
    block, x = Block(), torch.randn(2, 3)
    before, expected = _block_state(block), block(x)
    if how == "fails":
        with pytest.raises(KeyError, match="boom below"):
            torchsurgery.patch(block, ReachesBelow, fail=True)
    else:
        torchsurgery.patch(block, ReachesBelow)
        assert float(block.fc.bias[0].detach()) == 7.0 and len(block.fc._forward_hooks) == 1
        if how == "unpatched":
            torchsurgery.unpatch(block)
        else:
            torchsurgery.restore(block)
    after = _block_state(block)
    assert after[0] == before[0] and after[2] == before[2]
    assert_same_state(after[1], before[1])
    torch.testing.assert_close(block(x), expected, rtol=0, atol=0)


class ChangesClass(Patch, nn.Linear):
    def __patch_init__(self) -> None:
        self.__class__ = nn.Linear


class ChangesChildClass(Patch, Block):
    def __patch_init__(self) -> None:
        self.fc.__class__ = MyLinear


class PatchesChild(Patch, Block):
    def __patch_init__(self) -> None:
        Scaled.from_existing(self.fc)


@pytest.mark.parametrize(
    ("factory", "patch_cls", "message"),
    [
        (lambda: nn.Linear(2, 2), ChangesClass, "changed the module's class to Linear; a patch never changes"),
        (Block, ChangesChildClass, "changed the class of 'fc' from Linear to MyLinear"),
        (Block, PatchesChild, "applied patch Scaled to a module below it"),
    ],
)
def test_what_a_patch_cannot_undo_is_refused_and_left_as_it_was(factory: Any, patch_cls: Any, message: str) -> None:
    module = factory()
    before, values = fingerprint(module), state(module)
    with pytest.raises(RuntimeError, match=message):
        torchsurgery.patch(module, patch_cls)
    assert fingerprint(module) == before
    assert_same_state(state(module), values)
    assert torchsurgery.surgery_log(module) == []
    torchsurgery.restore(module)  # nothing stuck in the log


class PatchesItself(Patch, nn.Linear):
    def __patch_init__(self) -> None:
        Shifted.from_existing(self)


def test_a_patch_applying_another_patch_to_its_own_module_is_refused() -> None:
    layer = Scaled.from_existing(nn.Linear(2, 2))
    before = fingerprint(layer)
    with pytest.raises(RuntimeError, match="torchsurgery.patch: the module's class is PatchesItself"):
        torchsurgery.patch(layer, PatchesItself)
    assert fingerprint(layer) == before and torchsurgery.patches(layer) == [Scaled]
    assert type(torchsurgery.unpatch(layer)) is nn.Linear


def test_unpatch_while_another_thread_runs_the_patched_forward_is_refused_and_that_forward_completes() -> None:
    import threading

    class Slow(Patch, nn.Linear):
        def __patch_init__(self) -> None:
            self.inside, self.go = threading.Event(), threading.Event()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.inside.set()
            assert self.go.wait(timeout=60)
            return super().forward(x) * 2  # super() needs the patch still in place

    layer = nn.Linear(3, 3)
    x = torch.randn(1, 3)
    expected = layer(x) * 2
    torchsurgery.patch(layer, Slow)
    results: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: results.append(layer(x)))
    thread.start()
    try:
        assert layer.inside.wait(timeout=60)
        for attempt in (lambda: torchsurgery.unpatch(layer), lambda: torchsurgery.patch(layer, Frozen)):
            with pytest.raises(RuntimeError, match=r"<root> \(Linear, in thread .*\) is running a forward now"):
                attempt()
        assert torchsurgery.patches(layer) == [Slow]  # nothing changed under the running forward
    finally:
        layer.go.set()
        thread.join(timeout=60)
    torch.testing.assert_close(results[0], expected)
    torchsurgery.unpatch(layer)  # once it returned
    assert type(layer) is nn.Linear
