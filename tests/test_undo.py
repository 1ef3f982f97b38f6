"""One undo log for every kind of surgery: surgery_log, restore, and random stacks of operations.

The state machine builds a random module tree (nested Sequential / ModuleList / ModuleDict,
tied weights, buffers, a Parameter subclass, modules returning tuples and dicts; the weights
are bf16 values, so that offloads storing them in bf16 are exact), applies random surgery to
it (patches, one adding a parameter that graphs save, offload with wide or narrow storage
and with an fp32 master, offload streamed from a checkpoint file, FlexModel, dynamic swap
with and without a dtype, conversions there and back, loads; on the suite's accelerator: an
offload with a budget, the budget changed, an out-of-memory error inside a forward, a
``DevicePool`` loading and unloading the model, an installation failing half-way), runs forwards with gradients
whose outputs and graphs stay alive across the later steps, undos included (surgery that
would poison such a graph is refused, changing nothing), checks after every step that the model
computes what the applied surgery should give (against an independent reference forward),
copies the model as it stands (``deepcopy``, ``pickle``, ``torch.save``/``torch.load`` with
the original dropped) and checks that the copy computes the same and restores to the
model's start, and at the end undoes everything with ``torchsurgery.restore`` and compares
with a snapshot taken at the start, bitwise.

100 examples run by default (about 20 s), the same 100 every run (derandomised: the
suite must pass every time, so it explores nothing new by itself); ``make soak`` is the long
run (5,000, ``TORCHSURGERY_HYPOTHESIS_EXAMPLES=5000``), with examples drawn afresh each time.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import pickle
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn

import tardy
import torchsurgery
from torchsurgery import Patch
from torchsurgery.offloading.dynamic_swap import _DynamicSwap

EXAMPLES = int(os.environ.get("TORCHSURGERY_HYPOTHESIS_EXAMPLES", "100"))
DIM = 4


class TaggedParameter(nn.Parameter):
    """A Parameter subclass: surgery must keep its class."""


def _bf16_values(*shape: int) -> torch.Tensor:
    """Random fp32 values that bf16 holds exactly: an offload storing them in bf16 gives them back bitwise."""
    return torch.randn(*shape).bfloat16().float()


class Leaf(nn.Module):
    """y = (x @ W.T + b + offset) * gain, with W possibly shared with another leaf."""

    def __init__(self, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight if weight is not None else nn.Parameter(_bf16_values(DIM, DIM) / DIM)
        self.bias = TaggedParameter(_bf16_values(DIM) / DIM)
        self.register_buffer("offset", _bf16_values(DIM) / 16)
        self.gain = nn.Parameter((1 + torch.randn(DIM) / 4).bfloat16().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the gain as a norm's weight: the graph of a forward saves the parameter object itself
        # (read from the dict, as a kernel or hook would: not the copy an installer's read converts)
        return (F.linear(x, self.weight, self.bias) + self.offset) * self._parameters["gain"]


class TupleOut(nn.Module):
    """Returns a tuple; its parent uses the first element."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = _first(self.inner(x))
        return y, y.sum()


class DictOut(nn.Module):
    """Children in a ModuleDict; returns a dict of their outputs."""

    def __init__(self, children: dict[str, nn.Module]) -> None:
        super().__init__()
        self.branches = nn.ModuleDict(children)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: m(x) for k, m in self.branches.items()}


class ListSum(nn.Module):
    """Children in a ModuleList applied in turn."""

    def __init__(self, children: list[nn.Module]) -> None:
        super().__init__()
        self.items = nn.ModuleList(children)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.items:
            x = _first(m(x))
        return x


def _first(out: Any) -> torch.Tensor:
    if isinstance(out, tuple):
        return _first(out[0])
    if isinstance(out, dict):
        return torch.stack([_first(v) for v in out.values()]).sum(0)
    return out


class Chain(nn.Sequential):
    """A Sequential whose children may return tuples or dicts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self:
            x = _first(m(x))
        return x


class Root(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _first(self.body(x))


# --- patches whose effect the reference forward reproduces -----------------------


class Scale(Patch, Leaf):
    """Adds a parameter that the graph of a forward saves itself (``y * factor``), not a copy."""

    def __patch_init__(self) -> None:
        self.factor = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # read from the parameter dict: the object itself (a live graph saves it), not the
        # copy an installer's attribute read converts it to
        return super().forward(x) * self._parameters["factor"]


class Shift(Patch, Leaf):
    def __patch_init__(self) -> None:
        self.register_buffer("shift", torch.full((DIM,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shift


class Freeze(Patch, nn.Module):
    def __patch_init__(self) -> None:
        self.requires_grad_(False)


class Broken(Patch, nn.Module):
    """Changes its whole subtree (values, hooks, buffers, grad flags), then fails."""

    def __patch_init__(self) -> None:
        self.half_done = nn.Parameter(torch.zeros(1))
        for module in self.modules():
            module.register_forward_hook(lambda m, args, out: out)
            module.register_buffer("stray", torch.ones(1))
        with torch.no_grad():
            for p in self.parameters():
                p.mul_(3.0)
        self.requires_grad_(False)
        raise RuntimeError("injected failure in __patch_init__")


EFFECTS = {Scale: lambda y: y * 1.5, Shift: lambda y: y + 0.25, Freeze: lambda y: y}


def reference_forward(module: nn.Module, x: torch.Tensor, in_file: dict[int, torch.Tensor] | None = None) -> Any:
    """The model's forward written independently of any surgery, applying patch effects.

    ``in_file``: the values of weights an offload streams from a file (they are ``meta``), by object.
    """
    if isinstance(module, Leaf):
        # the tensors themselves, not what an installer's attribute reads convert them to; they
        # may sit in another storage dtype while offloaded: compute in x's dtype
        tensors = (*(module._parameters[k] for k in ("weight", "bias", "gain")), module._buffers["offset"])
        # (a Parameter subclass streamed to an accelerator reads as the host outside forwards: to x's device)
        weight, bias, gain, offset = ((in_file or {}).get(id(t), t).to(x.device, x.dtype) for t in tensors)  # type: ignore[union-attr]
        y = (F.linear(x, weight, bias) + offset) * gain
        for p in torchsurgery.patches(module):
            y = EFFECTS.get(p, lambda t: t)(y)  # patches of other pillars change no values
        return y
    if isinstance(module, TupleOut):
        y = _first(reference_forward(module.inner, x, in_file))
        return y, y.sum()
    if isinstance(module, DictOut):
        return {k: reference_forward(m, x, in_file) for k, m in module.branches.items()}
    if isinstance(module, ListSum):
        for m in module.items:
            x = _first(reference_forward(m, x, in_file))
        return x
    if isinstance(module, nn.Sequential):
        for m in module:
            x = _first(reference_forward(m, x, in_file))
        return x
    if isinstance(module, Root):
        return _first(reference_forward(module.body, x, in_file))
    raise AssertionError(f"unknown module {type(module)}")


def build(draw: st.DrawFn, depth: int, leaves: list[Leaf]) -> nn.Module:
    kinds = ["leaf", "seq", "list", "dict", "tuple"] if depth < 3 else ["leaf"]
    kind = draw(st.sampled_from(kinds))
    if kind == "leaf":
        tie = leaves and draw(st.booleans())
        leaf = Leaf(leaves[draw(st.integers(0, len(leaves) - 1))].weight if tie else None)
        leaves.append(leaf)
        return leaf
    n = draw(st.integers(1, 3))
    children = [build(draw, depth + 1, leaves) for _ in range(n)]
    if kind == "seq":
        return Chain(*children)
    if kind == "list":
        return ListSum(children)
    if kind == "dict":
        return DictOut({f"b{i}": c for i, c in enumerate(children)})
    return TupleOut(children[0])


def fingerprint(model: nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        out[name] = (
            type(m),
            sorted(m.__dict__),
            {k: (id(p), type(p), p.requires_grad) for k, p in m._parameters.items() if p is not None},
            {k: id(b) for k, b in m._buffers.items() if b is not None},
            {k: id(c) for k, c in m._modules.items()},
            tuple(len(getattr(m, h)) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")),
        )
    return out


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, or both without values (weights an offload streams from a file are meta)."""
    if a.is_meta or b.is_meta:
        return a.is_meta and b.is_meta and (a.shape, a.dtype) == (b.shape, b.dtype)
    return torch.equal(a, b)


def state_values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


class SurgeryMachine(RuleBasedStateMachine):
    """Random surgery on a random tree; the reference forward is the oracle."""

    @initialize(data=st.data())
    def build_model(self, data: st.DataObject) -> None:
        leaves: list[Leaf] = []
        self.model = Root(build(data.draw, 0, leaves))
        self.leaves = [m for m in self.model.modules() if isinstance(m, Leaf)]
        self.x = torch.randn(2, DIM)
        self.handle: Any = None
        self.from_file = False
        self.in_file: dict[int, torch.Tensor] = {}
        self.flex: Any = None
        self.captured: dict[str, list[torch.Tensor]] = {}
        self.alive: list[torch.Tensor] = []  # outputs of forwards with grad, their graphs alive to the end
        self.wide = False  # installed with dtype=torch.float64: the forwards take fp64 inputs
        self.on_device = False  # offloaded to the accelerator: the forwards take inputs there
        self.installed_on: torch.device | None = None  # DynamicSwapInstaller with device= only: reads go there
        self.pool: Any = None  # the DevicePool the model was added to
        self.start = fingerprint(self.model)
        self.values = state_values(self.model)
        self.expected_output = self.model(self.x).detach()

    # not on a model offloaded to the device: the patches make their tensors on the host, as they
    # would next to a plain model moved there (the other steps run on models patched before)
    @precondition(lambda self: not self.on_device)
    @rule(which=st.integers(0, 100), kind=st.sampled_from([Scale, Shift, Freeze]))
    def apply_patch(self, which: int, kind: type[Patch]) -> None:
        leaf = self.leaves[which % len(self.leaves)]
        if torchsurgery.is_patched(leaf, kind):
            with pytest.raises(ValueError):
                torchsurgery.patch(leaf, kind)
        else:
            torchsurgery.patch(leaf, kind)

    @rule(which=st.integers(0, 100))
    def failing_patch_changes_nothing(self, which: int) -> None:
        modules = list(self.model.modules())  # containers too: the failure reaches below them
        module = modules[which % len(modules)]
        before, values = fingerprint(self.model), state_values(self.model)
        with pytest.raises(RuntimeError, match="injected failure"):
            torchsurgery.patch(module, Broken)
        assert fingerprint(self.model) == before
        now = state_values(self.model)
        assert now.keys() == values.keys()
        for k in now:
            assert same_values(now[k], values[k]), k

    @precondition(lambda self: any(torchsurgery.is_patched(m) for m in self.leaves))
    @rule(which=st.integers(0, 100), pick=st.integers(0, 3))
    def remove_a_patch(self, which: int, pick: int) -> None:
        patched = [m for m in self.leaves if torchsurgery.is_patched(m)]
        leaf = patched[which % len(patched)]
        # not the fp64 installation of one leaf alone: the model could not compute in one dtype
        # nor of a leaf of a model installed to read its weights on a device (the inputs are there)
        stack = [p for p in torchsurgery.patches(leaf) if not ((self.wide or self.installed_on) and p is _DynamicSwap)]
        if not stack:
            return
        chosen = stack[pick % len(stack)]
        before = fingerprint(self.model)
        try:
            torchsurgery.unpatch(leaf, chosen)
        except ValueError as exc:
            # refused, changing nothing: the patch belongs to an offload, or an offload
            # now streams the parameters it added
            assert "part of a larger surgery" in str(exc) or "depends on" in str(exc)
            assert fingerprint(self.model) == before

    @precondition(lambda self: self.handle is None and self.pool is None)
    @rule(
        groups=st.sampled_from(["leaves", "blocks"]),
        budget=st.sampled_from([None, 0]),
        storage=st.sampled_from([(torch.float64, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32)]),
    )
    def offload_model(self, groups: str, budget: int | None, storage: tuple[torch.dtype, torch.dtype | None]) -> None:
        # wider storage (fp64), or narrow (bf16: the weights are bf16 values), alone or beside an
        # fp32 master copy, computing in fp32: exact, so the oracle stays exact
        storage_dtype, master_dtype = storage
        before = fingerprint(self.model)
        with self.refused_cleanly():
            try:
                self.handle = torchsurgery.offload(
                    self.model, storage_dtype=storage_dtype, dtype=torch.float32, groups=groups, budget=budget,
                    master_dtype=master_dtype,
                )
            except ValueError:
                assert fingerprint(self.model) == before  # refused (e.g. budget 0): nothing changed

    @precondition(lambda self: self.handle is not None and self.pool is None and not self.reads_on_device)
    @rule()
    def remove_offload(self) -> None:
        assert self.handle is not None
        with self.refused_cleanly():  # refused while a kept output's backward runs through its weights
            self.handle.remove()
            self.handle = None
            self.from_file = False
            self.in_file = {}
            self.on_device = False

    # --- on the suite's accelerator (tardy in CI) ---------------------------------------

    @precondition(lambda self: self.handle is None and self.pool is None and not self.reads_on_host)
    @rule(budget=st.sampled_from(["least", "below", "roomy"]), storage=st.sampled_from([None, torch.bfloat16]))
    def offload_to_the_device(self, budget: str, storage: torch.dtype | None) -> None:
        options: dict[str, Any] = {"storage_dtype": storage, "dtype": torch.float32, "groups": "leaves"}
        before, values = fingerprint(self.model), state_values(self.model)
        with self.refused_cleanly():
            least = _least_budget(self.model, ACCELERATOR, **options)
            if budget == "below":  # refused with the least budget accepted, changing nothing
                with pytest.raises(torchsurgery.BudgetError) as refused:
                    torchsurgery.offload(self.model, ACCELERATOR, budget=least - 1, **options)
                assert refused.value.needed == least
                assert fingerprint(self.model) == before
                assert all(same_values(v, values[k]) for k, v in state_values(self.model).items())
                return
            self.handle = torchsurgery.offload(
                self.model, ACCELERATOR, budget=least if budget == "least" else 4 * least, **options
            )
            self.on_device = True

    @precondition(lambda self: self.on_device and self.pool is None and not self.alive)
    @rule(grow=st.booleans())
    def change_the_budget(self, grow: bool) -> None:
        # an offload's budget is set when it is made: changed by removing it and offloading again,
        # the model computing the same before and after (the invariant checks each step)
        assert self.handle is not None
        options: dict[str, Any] = {"dtype": torch.float32, "groups": "leaves"}
        given = self.handle.plan.budget
        with self.refused_cleanly():
            self.handle.remove()
            self.handle, self.on_device = None, False
            budget = 2 * given if grow else _least_budget(self.model, ACCELERATOR, **options)
            self.handle = torchsurgery.offload(self.model, ACCELERATOR, budget=budget, **options)
            self.on_device = True

    @precondition(lambda self: self.on_device and ON_TARDY)
    @rule()
    def out_of_memory_in_a_forward(self) -> None:
        # the device full: the forward raises, and the model goes on computing what it did
        x = self.inputs()
        with tardy.settings(capacity=torch.accelerator.memory_reserved()):
            with pytest.raises(torch.OutOfMemoryError), torch.no_grad():
                (self.flex or self.model)(x)

    @precondition(lambda self: self.handle is None and self.pool is None and not self.wide and not self.reads_on_host)
    @rule(room=st.sampled_from(["whole", "partial"]), storage=st.sampled_from([None, torch.bfloat16]))
    def add_to_a_pool_and_load(self, room: str, storage: torch.dtype | None) -> None:
        options: dict[str, Any] = {"storage_dtype": storage, "dtype": torch.float32, "groups": "leaves"}
        least = _least_budget(self.model, ACCELERATOR, **options)
        plan = torchsurgery.plan_offload(self.model, ACCELERATOR, **options)
        whole = plan.device_bytes([g.name for g in plan.groups])
        pool = torchsurgery.DevicePool(ACCELERATOR, budget=4 * whole if room == "whole" else max(least, whole - 1))
        pool.add(self.model, **options)  # on the host: a hook that marks uses, an undo record
        self.pool = pool
        with self.refused_cleanly():
            self.handle = pool.load(self.model)
            self.on_device = True

    @precondition(lambda self: self.pool is not None and self.handle is not None and not self.reads_on_device)
    @rule()
    def shrink_in_the_pool(self) -> None:
        # take back half of what the model holds: fewer groups resident, or back on the host
        free = torch.accelerator.get_memory_info(ACCELERATOR)[0] if ON_TARDY else 0
        held = self.handle.plan.budget
        with self.refused_cleanly():
            self.handle = self.pool.shrink(self.model, keep_free=free + held // 2)
            self.on_device = self.handle is not None

    @precondition(lambda self: self.pool is not None and not self.reads_on_device)
    @rule(close=st.booleans())
    def unload_from_the_pool(self, close: bool) -> None:
        with self.refused_cleanly():
            if close:
                self.pool.close()  # every model back on the host, the pool empty
            else:
                self.pool.discard(self.model)
            self.pool = self.handle = None
            self.on_device = False

    @precondition(lambda self: self.pool is not None and self.handle is None and not self.reads_on_host)
    @rule()
    def load_again(self) -> None:
        before = fingerprint(self.model)
        with self.refused_cleanly():
            try:
                self.handle = self.pool.load(self.model)
                self.on_device = True
            except RuntimeError as exc:  # surgery since it was added made it larger than the pool's budget
                if "can be made free" not in str(exc):
                    raise
                assert fingerprint(self.model) == before

    @rule(at=st.integers(0, 100))
    def installation_failing_half_way_changes_nothing(self, at: int) -> None:
        # the k-th module's installation fails: the modules installed before it come off again
        modules = list(self.model.modules())
        k = at % len(modules)
        real = torchsurgery.DynamicSwapInstaller._install_module
        calls = 0

        def failing(module: nn.Module, **kwargs: Any) -> None:
            nonlocal calls
            if calls == k:
                raise RuntimeError("injected failure in an installation")
            calls += 1
            real(module, **kwargs)

        before, values = fingerprint(self.model), state_values(self.model)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_replaced(torchsurgery.DynamicSwapInstaller, "_install_module", staticmethod(failing)))
            try:
                torchsurgery.DynamicSwapInstaller.install_model(self.model, dtype=torch.float64)
            except (RuntimeError, ValueError) as exc:
                if "injected failure" not in str(exc):
                    assert fingerprint(self.model) == before  # refused up front (an offload holds the weights)
                    return
            else:
                raise AssertionError("the installation did not reach the failing module")
        assert fingerprint(self.model) == before
        now = state_values(self.model)
        assert now.keys() == values.keys() and all(same_values(now[k], values[k]) for k in now)

    @precondition(lambda self: self.flex is None)
    @rule(pattern=st.sampled_from(["**", "body.*", "body"]), fail=st.booleans())
    def wrap_with_flex(self, pattern: str, fail: bool) -> None:
        self.captured = {}
        self.flex = torchsurgery.FlexModel(self.model, self.captured)
        try:
            self.flex.register_forward_hook(torchsurgery.HookFunction(pattern))
        except ValueError:
            pass  # the glob matched nothing in this tree
        if fail:

            def broken(module: nn.Module, x: torch.Tensor, ctx: Any, mods: nn.ModuleDict) -> torch.Tensor:
                raise RuntimeError("injected failure in an editing function")

            self.flex.register_forward_hook(torchsurgery.HookFunction("body", editing_function=broken))
            before = fingerprint(self.model)
            with pytest.raises(RuntimeError, match="injected failure"), torch.no_grad():
                self.flex(self.inputs())
            assert fingerprint(self.model) == before
            self.flex.restore()
            self.flex = None

    @precondition(lambda self: self.flex is not None)
    @rule()
    def unwrap_flex(self) -> None:
        assert self.flex is not None
        self.flex.restore()
        self.flex = None

    @rule(dtype=st.sampled_from([None, torch.float32, torch.float64, torch.float64]))
    def install_dynamic_swap(self, dtype: torch.dtype | None) -> None:
        # fp64 (drawn twice as often): the weights become OffloadedTensors reading as fp64, the
        # forwards then take fp64 inputs; fp32 changes no weight of this fp32 model; None: reads
        # on the device the model computes on (FramePack's device=gpu over an offload or a pool)
        where = ACCELERATOR if self.on_device else torch.device("cpu")
        kwargs: dict[str, Any] = {"device": where} if dtype is None else {"dtype": dtype}
        with self.refused_cleanly():
            torchsurgery.DynamicSwapInstaller.install_model(self.model, **kwargs)
            self.wide = dtype is torch.float64
            self.installed_on = where if dtype is None else None

    @precondition(lambda self: any(torchsurgery.is_patched(m, _DynamicSwap) for m in self.model.modules()))
    @rule()
    def uninstall_dynamic_swap(self) -> None:
        with self.refused_cleanly():
            torchsurgery.DynamicSwapInstaller.uninstall_model(self.model)
            self.wide = False
            self.installed_on = None

    @rule()
    def forward_kept_alive(self) -> None:
        # with grad: the output's graph holds the weights (AccumulateGrad nodes, and saved leaves
        # such as Scale's factor) through every later step, the undos included
        if self.from_file:
            with pytest.raises(RuntimeError, match="serves inference only"):
                (self.flex or self.model)(self.inputs())
            return
        self.alive.append(_first((self.flex or self.model)(self.inputs())))

    @precondition(lambda self: self.alive)
    @rule()
    def drop_kept_outputs(self) -> None:
        self.alive.clear()  # conversions and loads, refused while the graphs held the weights, can go on

    @precondition(lambda self: self.handle is None and self.pool is None)
    @rule(there=st.sampled_from([torch.float8_e4m3fn, torch.bfloat16, torch.float64]))
    def convert_there_and_back(self, there: torch.dtype) -> None:
        if self.wide and there is torch.float64:
            # only the tensors the installation does not keep (the TaggedParameter) would go to fp64,
            # and the way back would be refused (see refused_cleanly): the model in two dtypes
            return
        # fp8 rounds (the first conversion keeps the originals), bf16 and fp64 do not; back in fp32,
        # the model runs on the same inputs, and restore must undo both exactly
        ids = {n: id(t) for n, t in self.model.state_dict(keep_vars=True).items()}
        with self.refused_cleanly():
            torchsurgery.convert_(self.model, dtype=there)
            torchsurgery.convert_(self.model, dtype=torch.float32)
        assert {n: id(t) for n, t in self.model.state_dict(keep_vars=True).items()} == ids

    @rule()
    def load_own_state(self) -> None:
        ids = {n: id(t) for n, t in self.model.state_dict(keep_vars=True).items()}
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.from_file:
            # the weights are streamed from the file: a load would not reach the forwards
            with pytest.raises(RuntimeError, match="streamed by an active offload from its checkpoint file"):
                torchsurgery.load_(self.model, state)
        else:
            with self.refused_cleanly():
                torchsurgery.load_(self.model, state)
        assert {n: id(t) for n, t in self.model.state_dict(keep_vars=True).items()} == ids

    @precondition(lambda self: self.handle is None and self.pool is None)
    @rule(stale=st.booleans())
    def offload_from_a_checkpoint_file(self, stale: bool) -> None:
        # the model's own weights saved to a file, then streamed from it (they become meta)
        path = Path(tempfile.mkdtemp()) / "model.safetensors"
        state = {k: v.detach().clone().contiguous() for k, v in self.model.state_dict().items()}
        if stale:  # another file: refused, since remove() would give its values back instead
            state = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
        from safetensors.torch import save_file

        save_file(state, str(path))
        before = fingerprint(self.model)
        if stale:
            with pytest.raises(ValueError, match="holds other values than the model"):
                torchsurgery.offload(self.model, storage=path, groups="leaves")
            assert fingerprint(self.model) == before
            return
        tensors = dict(self.model.state_dict(keep_vars=True))
        with self.refused_cleanly():
            self.handle = torchsurgery.offload(self.model, storage=path, groups="leaves")
            self.from_file = True
            self.in_file = {id(tensors[k]): state[k] for k in state if tensors[k].is_meta}

    @rule(kind=st.sampled_from(["deepcopy", "pickle", "torch.save"]))
    def copies_compute_the_same_and_restore_to_the_start(self, kind: str) -> None:
        x = self.inputs()
        with torch.no_grad():
            expected = self.model(x)
        if kind == "deepcopy":
            twin = copy.deepcopy(self.model)
        elif kind == "pickle":
            twin = pickle.loads(pickle.dumps(self.model))
        else:
            buffer = io.BytesIO()
            torch.save(self.model, buffer)
            twin = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
        with torch.no_grad():
            torch.testing.assert_close(twin(x), expected, rtol=0, atol=0)
        assert [e.kind for e in torchsurgery.surgery_log(twin)] == [e.kind for e in torchsurgery.surgery_log(self.model)]
        torchsurgery.restore(twin)
        assert torchsurgery.surgery_log(twin) == []
        assert {n: (type(m), sorted(m.__dict__)) for n, m in twin.named_modules()} == {
            n: (cls, keys) for n, (cls, keys, *_) in self.start.items()
        }
        now = state_values(twin)
        for k in now:
            assert torch.equal(now[k], self.values[k]), k  # bitwise what the original restores to
        with torch.no_grad():
            torch.testing.assert_close(twin(self.x), self.expected_output, rtol=0, atol=0)
        with torch.no_grad():  # the original is untouched by its copy's restore
            torch.testing.assert_close(self.model(x), expected, rtol=0, atol=0)

    def restore(self) -> None:
        """``torchsurgery.restore``: it does not wait for the graphs of kept outputs (an offload's
        removal hands their gradients on to the weights it gives back)."""
        torchsurgery.restore(self.model)
        self.pool = None
        self.on_device = False
        self.installed_on = None

    @rule()
    def restore_everything(self) -> None:
        self.restore()
        self.handle = self.flex = None
        self.wide = False
        self.from_file = False
        self.in_file = {}
        self.check_pristine()

    @invariant()
    def computes_what_the_surgery_says(self) -> None:
        if not hasattr(self, "model"):
            return
        x = self.inputs()
        with torch.no_grad():
            torch.testing.assert_close(self.model(x), reference_forward(self.model, x, self.in_file))
        log = torchsurgery.surgery_log(self.model)
        assert [e.seq for e in log] == sorted(e.seq for e in log)
        kinds = [e.kind for e in log]
        assert kinds.count("offload") == (self.handle is not None)
        assert kinds.count("flex") == (self.flex is not None)
        assert kinds.count("pool") == (self.pool is not None)

    @contextlib.contextmanager
    def refused_cleanly(self) -> Iterator[None]:
        """The surgery in the block is done, or refused for a reason the state gives, changing nothing.

        Surgery that swaps a weight refuses while the graph of a kept output holds it (the
        swap would poison that graph; its undo does not wait for the outputs to go, and a
        backward through them then raises); the installer refuses to convert or to give back
        weights an active offload holds; ``convert_`` refuses weights an installation reads
        as another dtype than they are kept in.
        """
        reasons = [
            reason
            for reason, now in (
                ("held elsewhere", bool(self.alive)),
                ("an active offload", self.handle is not None),
                ("uninstall_model() first", self.wide),
            )
            if now
        ]
        before, values = fingerprint(self.model), state_values(self.model)
        try:
            yield
        except (RuntimeError, ValueError) as exc:
            if not any(reason in str(exc) for reason in reasons):
                raise
            assert fingerprint(self.model) == before
            now = state_values(self.model)
            assert now.keys() == values.keys() and all(same_values(now[k], values[k]) for k in now)

    @property
    def reads_on_host(self) -> bool:
        """Installed to read its weights on the host: an offload to the device would contradict it."""
        return self.installed_on is not None and self.installed_on.type == "cpu"

    @property
    def reads_on_device(self) -> bool:
        """Installed to read its weights on the device: the model stays offloaded there (back on
        the host, the leaves' direct reads of ``_parameters`` would give host tensors, as for
        the plain model moved back under such an installation)."""
        return self.installed_on == ACCELERATOR

    def inputs(self) -> torch.Tensor:
        """The inputs in the dtype the model computes in (fp64 where an installer reads its weights so),
        on the device it computes on."""
        there = self.on_device or self.reads_on_device
        return self.x.to(self.leaves[0].weight.dtype).to(ACCELERATOR if there else "cpu")

    def check_pristine(self) -> None:
        assert torchsurgery.surgery_log(self.model) == []
        assert fingerprint(self.model) == self.start
        now = state_values(self.model)
        assert now.keys() == self.values.keys()
        for k in now:
            assert torch.equal(now[k], self.values[k]), k
        with torch.no_grad():
            torch.testing.assert_close(self.model(self.x), self.expected_output, rtol=0, atol=0)

    def teardown(self) -> None:
        if hasattr(self, "model"):
            self.restore()
            self.handle = self.flex = None
            self.from_file = False
            self.in_file = {}
            self.check_pristine()


ACCELERATOR = torch.device(torch.accelerator.current_accelerator().type, 0)  # type: ignore[union-attr]
ON_TARDY = ACCELERATOR.type == tardy.NAME  # only the test device can be made to run out of memory


def _least_budget(model: nn.Module, device: torch.device, **options: Any) -> int:
    """The least budget ``offload(model, device, **options)`` accepts."""
    try:
        torchsurgery.plan_offload(model, device, budget=1, **options)
    except torchsurgery.BudgetError as refused:
        return refused.needed
    raise AssertionError("a budget of one byte was accepted")


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    saved = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


SurgeryMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    derandomize="TORCHSURGERY_HYPOTHESIS_EXAMPLES" not in os.environ,  # the suite's run: the same examples each time
    # TORCHSURGERY_HYPOTHESIS_SHRINK=0: report a failing case as found (a long soak's shrinking can take hours)
    phases=[p for p in Phase if p is not Phase.shrink or os.environ.get("TORCHSURGERY_HYPOTHESIS_SHRINK", "1") != "0"],
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSurgeryMachine = SurgeryMachine.TestCase


def test_restore_refuses_and_names_what_blocks_it() -> None:
    from torch.nn.utils import parametrize

    leaf = Leaf()
    model = Root(Chain(leaf))
    torchsurgery.patch(leaf, Scale)
    parametrize.register_parametrization(leaf, "weight", nn.Identity())
    with pytest.raises(RuntimeError, match=r"could not undo patch Scale on body\.0.*another tool"):
        torchsurgery.restore(model)
    assert torchsurgery.is_patched(leaf, Scale)  # nothing half-undone
    parametrize.remove_parametrizations(leaf, "weight")
    torchsurgery.restore(model)
    assert type(leaf) is Leaf


def test_surgery_log_lists_surgery_in_applied_order() -> None:
    a, b = Leaf(), Leaf()
    model = Root(Chain(a, b))
    torchsurgery.patch(b, Scale)
    torchsurgery.patch(a, Shift)
    torchsurgery.patch(b, Freeze)
    log = torchsurgery.surgery_log(model)
    assert [(e.module_name, e.description) for e in log] == [
        ("body.1", "patch Scale"),
        ("body.0", "patch Shift"),
        ("body.1", "patch Freeze"),
    ]
    with pytest.raises(TypeError, match="expected an nn.Module"):
        torchsurgery.surgery_log("model")  # type: ignore[arg-type]


def test_soak_thousand_forwards_with_hooks_and_offload_stay_flat() -> None:
    import gc

    import psutil

    model = Root(Chain(*[Chain(Leaf(), Leaf()) for _ in range(4)]))
    before = fingerprint(model)
    handle = torchsurgery.offload(model, storage_dtype=torch.float64, dtype=torch.float32, groups="leaves")
    out: dict[str, list[torch.Tensor]] = {}
    flex = torchsurgery.FlexModel(model, out)
    flex.register_forward_hook(torchsurgery.HookFunction("body.*.0"))
    x = torch.randn(8, DIM)
    proc = psutil.Process()

    def live_tensors() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    with torch.no_grad():
        for _ in range(50):
            flex(x)
        out.clear()
        tensors, rss = live_tensors(), proc.memory_info().rss
        for step in range(1000):
            flex(x)
            if step % 100 == 99:
                assert all(len(v) == 100 for v in out.values()) and len(out) == 4
                out.clear()
        assert live_tensors() <= tensors  # nothing retained by hooks, handles or transfers
        assert proc.memory_info().rss - rss < 8 * 2**20
    stats = handle.stats()
    assert stats.transfers == 1050 * len(stats.streamed_groups)
    torchsurgery.restore(model)
    assert fingerprint(model) == before


class _Gain(Patch, nn.Linear):
    """Adds a parameter and multiplies by it: the graph of a forward saves the parameter itself."""

    def __patch_init__(self) -> None:
        self.gain = nn.Parameter(torch.full((DIM,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # read from the parameter dict: the object itself, not the installer's converted copy
        return super().forward(x) * self._parameters["gain"]


def _as_it_was(model: nn.Module, reference: nn.Module, ids: dict[str, int]) -> None:
    """``model`` restored is ``reference`` (its deepcopy from before the surgery): bitwise, same objects."""
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]
    assert [sorted(m.__dict__) for m in model.modules()] == [sorted(m.__dict__) for m in reference.modules()]
    assert {n: id(t) for n, t in model.state_dict(keep_vars=True).items()} == ids
    assert {n: type(t) for n, t in model.state_dict(keep_vars=True).items()} == {
        n: type(t) for n, t in reference.state_dict(keep_vars=True).items()
    }
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]), k
    for m, r in zip(model.modules(), reference.modules(), strict=True):
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_state_dict_hooks"):
            assert len(getattr(m, hooks)) == len(getattr(r, hooks)), hooks
    x = torch.randn(3, DIM)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_uninstall_after_a_patch_and_a_flex_model_while_an_output_lives() -> None:
    # The added parameter, swapped into an OffloadedTensor by the installer, is saved by the live
    # output's graph (y * gain: use count 3); unpatching _Gain takes it out of the module; the
    # uninstall must still give it back its class, as `.data =` would for a plain one
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM))
    reference = copy.deepcopy(model)
    ids = {n: id(t) for n, t in model.state_dict(keep_vars=True).items()}
    torchsurgery.patch(model[0], _Gain)
    gain = model[0].gain
    torchsurgery.DynamicSwapInstaller.install_model(model, dtype=torch.float64)
    captured: dict[str, list[torch.Tensor]] = {}
    flex = torchsurgery.FlexModel(model, captured)
    flex.register_forward_hook(torchsurgery.HookFunction("0"))
    out = flex(torch.randn(2, DIM, dtype=torch.float64))
    assert out.grad_fn is not None and gain._use_count() == 3
    flex.restore()
    torchsurgery.unpatch(model[0], _Gain)
    torchsurgery.DynamicSwapInstaller.uninstall_model(model)
    _as_it_was(model, reference, ids)
    assert type(gain) is nn.Parameter and gain.dtype == torch.float32  # given back, though no longer in the model
    with pytest.raises(RuntimeError, match="recorded before an undo"):
        out.sum().backward()  # its gradients have no parameter to go to: refused, not lost
    model(torch.randn(2, DIM)).sum().backward()  # new forwards train the restored weights
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
