"""Captures: per forward, published when it returns, dropped when it fails, kept apart
between threads."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from _flex_models import IDS, pristine, tiny_gpt2
from torch import nn

import tardy
from torchsurgery import FlexModel, HookFunction
from torchsurgery.flex.captures import Captures


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


@pytest.mark.accelerator
def test_accelerator_captures_are_pinned_and_finished_when_forward_returns(accelerator: torch.device) -> None:
    model = tiny_gpt2().to(accelerator)
    ids = IDS.to(accelerator)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.register_forward_hook(HookFunction("transformer.h.*.mlp"))
    flex.register_forward_hook(HookFunction("lm_head"))  # the last computation: no later one runs its copy
    # on the test device the copies into pinned memory run only when waited for
    with tardy.settings(lazy=True) if tardy.registered() else contextlib.nullcontext():
        result = flex(ids)
        # read on the host before anything else calls into the device (which would run the copies)
        landed = {name: values[0].clone() for name, values in out.items()}
    reference = {}
    flex.restore()
    for i in range(2):
        model.transformer.h[i].mlp.register_forward_hook(
            lambda m, a, o, i=i: reference.__setitem__(i, o.detach().cpu())
        )
    torch.testing.assert_close(model(ids).logits, result.logits)
    torch.testing.assert_close(landed["lm_head"], result.logits.cpu(), rtol=0, atol=0)
    for i in range(2):
        captured = out[f"transformer.h.{i}.mlp"][0]
        assert captured.device.type == "cpu" and captured.is_pinned()
        torch.testing.assert_close(landed[f"transformer.h.{i}.mlp"], reference[i], rtol=0, atol=0)
        torch.testing.assert_close(captured, reference[i])


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


def test_captures_are_copies_taken_before_later_in_place_changes() -> None:
    out: dict[str, list[torch.Tensor]] = {}
    captures = Captures(out)
    value = torch.ones(3)
    call, token = captures.begin(None)
    captures.capture("x", value)
    value.mul_(5)  # a later in-place edit must not reach the capture
    captures.end(call, token)
    assert out == {}  # nothing before the forward is published
    captures.publish(call)
    assert out["x"][0].tolist() == [1.0, 1.0, 1.0]
    captures.capture("x", value)  # outside a forward: straight into output_ptr
    assert [t.tolist() for t in out["x"]] == [[1.0, 1.0, 1.0], [5.0, 5.0, 5.0]]


def test_a_forward_runs_only_the_hooks_it_chose() -> None:
    chosen, other = HookFunction("a"), HookFunction("b")
    captures = Captures({})
    assert captures.runs(chosen) and captures.runs(other)  # outside a forward every hook runs
    call, token = captures.begin({chosen})
    assert captures.runs(chosen) and not captures.runs(other)
    captures.end(call, token)
    assert captures.runs(other)
