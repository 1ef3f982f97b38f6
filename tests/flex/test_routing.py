"""Routing: one process moves nothing; a routing registered for parallel arguments is the
one a FlexModel uses, else flex's own parallel backend, imported only then."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchsurgery
from torchsurgery import FlexModel, HookFunction, ShapeHintWarning
from torchsurgery.flex import (
    Binding,
    HookType,
    LocalRouting,
    ParallelRequest,
    ParallelSizes,
    register_parallel_routing,
)
from torchsurgery.flex.captures import Captures
from torchsurgery.flex.hook_function import Shape
from torchsurgery.flex.routing import Edit, routing_for

FLEX = Path(torchsurgery.__file__).parent / "flex"


class CountingRouting:
    """A routing in one process that claims a tensor-parallel size and counts its calls."""

    def __init__(self, request: ParallelRequest) -> None:
        self.request = request
        self.sizes = ParallelSizes(tensor=request.sizes.tensor)
        self.local = LocalRouting()
        self.calls: list[str] = []

    def route(
        self, binding: Binding, module: nn.Module | None, local: torch.Tensor, edit: Edit | None, captures: Captures
    ) -> torch.Tensor | None:
        self.calls.append(f"route {binding.key}")
        return self.local.route(binding, module, local, edit, captures)

    def forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.calls.append("forward")
        return module(*args, **kwargs)

    def end_forward(self, captures: Captures, *, failed: bool = False) -> None:
        self.calls.append(f"end_forward failed={failed}")

    def backward(self, captures: Captures, loss: torch.Tensor | None) -> None:
        self.calls.append("backward")
        self.local.backward(captures, loss)

    def matched_anywhere(self, found: bool, hook_type: HookType, name: str) -> bool:
        return found

    def gather_parameter(self, local: torch.Tensor, name: str, expected_shape: Shape | None) -> torch.Tensor:
        self.calls.append(f"gather_parameter {name}")
        return local

    def prepare_trainable(self, module: nn.Module) -> None:
        self.calls.append("prepare_trainable")

    def close(self) -> None:
        self.calls.append("close")


@pytest.fixture
def counting() -> Iterator[list[CountingRouting]]:
    made: list[CountingRouting] = []

    def factory(request: ParallelRequest) -> CountingRouting:
        made.append(CountingRouting(request))
        return made[-1]

    previous = register_parallel_routing(factory)
    try:
        yield made
    finally:
        register_parallel_routing(previous)  # None: flex's own routing again


def test_a_registered_routing_serves_wrappers_given_parallel_sizes(counting: list[CountingRouting]) -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    x = torch.randn(4, 2)
    expected = model(x) * 2
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out, tensor_parallel_size=2)
    (routing,) = counting
    assert routing.request == ParallelRequest.of(tensor_parallel_size=2)
    assert (flex.tp_size, flex.pp_size, flex.dp_size) == (2, 1, 1)  # the routing's sizes
    flex.register_forward_hook(HookFunction("1", editing_function=lambda m, t, c, mods: t * 2))
    flex.register_trainable_module("probe", nn.Linear(1, 1))
    torch.testing.assert_close(flex(x), expected)
    flex.get_module_parameter("0.weight")
    flex.restore()
    assert routing.calls == [
        "prepare_trainable", "forward", "route 1", "end_forward failed=False", "gather_parameter 0.weight", "close",
    ]
    assert torch.equal(out["1"][0], expected / 2)


def test_a_wrapper_in_one_process_never_asks_the_registered_routing(counting: list[CountingRouting]) -> None:
    flex = FlexModel(nn.Linear(2, 2), {})
    assert counting == [] and (flex.tp_size, flex.pp_size, flex.dp_size) == (1, 1, 1)
    flex.restore()


def test_registering_something_not_callable_is_refused() -> None:
    with pytest.raises(TypeError, match="register_parallel_routing: expected a callable"):
        register_parallel_routing("torchsurgery.flex.parallel")  # type: ignore[arg-type]


def test_local_routing_captures_before_the_edit_and_returns_the_edit() -> None:
    out: dict[str, list[torch.Tensor]] = {}
    binding = Binding(HookFunction("fc", (2, None)), "forward", "fc", "fc")
    local = torch.arange(4.0).reshape(2, 2)
    edited = LocalRouting().route(binding, None, local, lambda t: t + 1, Captures(out))
    assert edited is not None and edited.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert out["fc"][0].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert LocalRouting().route(binding, None, local, None, Captures(out)) is None  # capture only
    # one process shards nothing: a hint that does not fit is told, and the capture still made
    with pytest.warns(ShapeHintWarning, match=r"expected_shape \[2, None\] of 'fc' does not match its shape \[3\]"):
        LocalRouting().route(binding, None, torch.zeros(3), None, Captures(out))
    assert out["fc"][-1].shape == (3,)


def _imported_modules(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _backend(names: set[str]) -> list[str]:
    """The modules of flex's parallel backend among ``names`` (the request types are light)."""
    light = {"torchsurgery.flex.parallel", "torchsurgery.flex.parallel.request"}
    return sorted(n for n in names if n.startswith("torchsurgery.flex.parallel") and n not in light)


def test_flex_imports_its_parallel_backend_only_inside_routing_for() -> None:
    trees = {path.name: ast.parse(path.read_text()) for path in sorted(FLEX.glob("*.py"))}
    found = {name: _backend(_imported_modules(tree)) for name, tree in trees.items()}
    assert {name: mods for name, mods in found.items() if mods} == {"routing.py": ["torchsurgery.flex.parallel.routing"]}
    (routing_for,) = (
        node for node in trees["routing.py"].body if isinstance(node, ast.FunctionDef) and node.name == "routing_for"
    )
    assert _backend(_imported_modules(routing_for)) == ["torchsurgery.flex.parallel.routing"]
    package = ast.parse((FLEX / "parallel" / "__init__.py").read_text())
    eager = (node for node in package.body if isinstance(node, (ast.Import, ast.ImportFrom)))  # not TYPE_CHECKING's
    assert _backend({n for node in eager for n in _imported_modules(node)}) == []


def test_importing_torchsurgery_and_wrapping_in_one_process_loads_no_parallel_backend() -> None:
    code = (
        "import sys, torch, torchsurgery\n"
        "flex = torchsurgery.FlexModel(torch.nn.Sequential(torch.nn.Linear(2, 2)), {})\n"
        "flex.register_forward_hook(torchsurgery.HookFunction('*'))\n"
        "flex(torch.ones(1, 2)); flex.restore()\n"
        "print(sorted(m for m in sys.modules if m.startswith('torchsurgery.flex.parallel')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "['torchsurgery.flex.parallel', 'torchsurgery.flex.parallel.request']"


def test_with_no_factory_registered_a_parallel_wrapper_gets_flex_own_distributed_routing(tmp_path: Path) -> None:
    from torchsurgery.flex.parallel import DistributedRouting

    store = dist.FileStore(str(tmp_path / "store"), 1)  # a file, not a port another run may take
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert register_parallel_routing(None) is None  # none was registered
        routing = routing_for(ParallelRequest.of(process_group=dist.group.WORLD))
        assert isinstance(routing, DistributedRouting) and routing.sizes == ParallelSizes()
        routing.close()
        model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        x = torch.randn(4, 2)
        out: dict[str, list[torch.Tensor]] = {}
        flex = FlexModel(model, out, process_group=dist.group.WORLD)
        flex.register_forward_hook(HookFunction("0"))
        torch.testing.assert_close(flex(x), model(x))
        torch.testing.assert_close(out["0"][0], model[0](x))
        flex.restore()
    finally:
        dist.destroy_process_group()
