"""The forward lock: forwards and conversions of an offloaded model serialise, and a lock never
outlives its holder. Each compares with the plain model converted the same way."""

from __future__ import annotations

import copy
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tardy
from torchsurgery import offload
from torchsurgery.offloading import engine

X = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
_JOIN_S = 60.0  # only a deadlock waits this long


class _Net(nn.Module):
    """Six groups of leaves (a norm, four linears, a head) reading the input in the dtype of their weights."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.LayerNorm(64), *[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)], nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.to(self.layers[0].weight.dtype))


class _Parks(nn.Module):
    """A layer whose forward, when told to, says it is inside and waits for ``go``, or raises ``error``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.inside, self.go = threading.Event(), threading.Event()
        self.park = False
        self.error: BaseException | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.error is not None:
            raise self.error
        if self.park:
            self.inside.set()
            assert self.go.wait(_JOIN_S)
        return self.linear(x.to(self.linear.weight.dtype))


def _parking_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Parks(), nn.ReLU(), nn.Linear(64, 8))


def _in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any], list[BaseException]]:
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(target())
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out, errors


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


# ---------------------------------------------------------------------- a lock never outlives its holder


@pytest.mark.parametrize("error", [SystemExit(), KeyboardInterrupt(), ValueError("in the forward")], ids=["exit", "interrupt", "error"])
def test_a_forward_that_ended_its_thread_or_raised_does_not_keep_the_next_forwards_waiting(error: BaseException) -> None:
    # SystemExit and KeyboardInterrupt skip the hook that gives the lock back (torch runs
    # always_call hooks on an Exception only), and the thread ends holding it
    model = _parking_model()
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
    expected = _forward(model, X)
    model[0].error = error
    thread = threading.Thread(target=_ends_by, args=(model, error), daemon=True)
    thread.start()
    thread.join(_JOIN_S)
    assert not thread.is_alive()
    model[0].error = None
    later, out, errors = _in_thread(lambda: _forward(model, X))
    later.join(_JOIN_S)
    assert not later.is_alive(), "the next forward waits for a lock held by a thread that ended"
    assert not errors, errors
    torch.testing.assert_close(out[0], expected, rtol=0, atol=0)
    handle.remove()


def _ends_by(model: nn.Module, error: BaseException) -> None:
    """A forward of ``model`` raising ``error``, which ends the thread (quietly)."""
    try:
        _forward(model, X)
    except type(error):
        if not isinstance(error, Exception):
            raise SystemExit from None  # ends the thread as the interrupt would, without a report


def test_a_forward_interrupted_in_a_thread_that_goes_on_does_not_keep_the_next_forwards_waiting() -> None:
    # the thread caught the interrupt outside the model and waits for something else: it is no
    # longer inside the forward it took the lock for
    model = _parking_model()
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
    with torch.no_grad():
        expected = model(X)
    model[0].error = KeyboardInterrupt()
    interrupted, carry_on = threading.Event(), threading.Event()

    def run() -> None:
        try:
            _forward(model, X)
        except KeyboardInterrupt:
            interrupted.set()
        carry_on.wait(_JOIN_S)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert interrupted.wait(_JOIN_S)
        model[0].error = None
        later, out, errors = _in_thread(lambda: _forward(model, X))
        later.join(_JOIN_S)
        assert not later.is_alive(), "the next forward waits for a lock its holder left"
        assert not errors, errors
        torch.testing.assert_close(out[0], expected, rtol=0, atol=0)
        # the thread that was interrupted runs the model again, after the other
        torch.testing.assert_close(_forward(model, X), expected, rtol=0, atol=0)
    finally:
        carry_on.set()
        thread.join(_JOIN_S)
    handle.remove()


# ---------------------------------------------------------------------- conversions wait for forwards


@pytest.mark.accelerator
def test_a_conversion_waits_for_the_forward_running_in_another_thread(accelerator: torch.device) -> None:
    model, plain = _parking_model(), _parking_model().to(accelerator)  # equal weights
    x = X.to(accelerator)
    before, after = _forward(plain, x), _forward(plain.double(), x)
    handle = offload(model, accelerator, groups="leaves", budget=1 << 20)
    model[0].park = True
    running, out, errors = _in_thread(lambda: _forward(model, x))
    try:
        assert model[0].inside.wait(_JOIN_S)
        model[0].park = False
        converting, _, refused = _in_thread(lambda: model.double())
        converting.join(0.2)  # were it not waiting, it would have converted (or been refused) here
        assert converting.is_alive() and not refused
        assert {p.dtype for p in model.parameters()} == {torch.float32}  # nothing changed under the forward
    finally:
        model[0].go.set()
        running.join(_JOIN_S)
    converting.join(_JOIN_S)
    assert not running.is_alive() and not converting.is_alive()
    assert not errors and not refused, (errors, refused)
    torch.testing.assert_close(out[0], before, rtol=0, atol=0)  # the forward ran whole before it
    assert handle.active and {(p.dtype, p.device) for p in model.parameters()} == {(torch.float64, accelerator)}
    torch.testing.assert_close(_forward(model, x), after, rtol=0, atol=0)
    handle.remove()


@pytest.mark.parametrize("when", ["converting", "removing"])
def test_a_conversion_of_another_thread_waits_while_one_installs_the_offload_again(
    monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    # between taking the offload off and installing it again, the weights are the plain module's:
    # a conversion starting then in another thread (as the values are converted, or as the offload
    # comes off: its own stand-ins go) must wait, then go through the new installation
    model, plain = _parking_model(), _parking_model()
    expected = _forward(plain.double().bfloat16(), X)
    handle = offload(model, groups="leaves", budget="least")
    late: list[tuple[threading.Thread, list[Any], list[BaseException]]] = []

    def then_race(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            done = real(*args)
            if not late:
                late.append(_in_thread(lambda: model.bfloat16()))
                late[0][0].join(0.5)  # were it not waiting, it would have converted the plain weights here
            return done
        return call

    if when == "converting":
        monkeypatch.setattr(engine, "convert_values", then_race(engine.convert_values))
    else:
        monkeypatch.setattr(engine.Attachments, "release_conversions", then_race(engine.Attachments.release_conversions))
    model.double()
    thread, _, errors = late[0]
    thread.join(_JOIN_S)
    assert not thread.is_alive() and not errors, errors
    assert handle.active and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(_forward(model, X), expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="while it is offloaded"):  # the new installation guards its conversions
        model.to("meta")
    handle.remove()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q)


@pytest.mark.parametrize("where", ["install", "plan"])
def test_a_conversion_failing_half_way_leaves_the_model_as_it_was_offloaded_and_working(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    model, plain = _parking_model(), _parking_model()
    handle = offload(model, groups="leaves", budget="least")
    expected = _forward(model, X)
    weights = list(model.parameters())
    install, planned = engine.Installer.install, engine.plan_converted
    calls = []

    def fails_once(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(real)
            if where == "plan" and "offloaded_ok" in kwargs:
                return real(*args, **kwargs)  # the check before anything changes passes
            if calls.count(real) == (2 if where == "plan" else 1):
                raise MemoryError("out of memory, half-way")
            return real(*args, **kwargs)
        return call

    if where == "install":
        monkeypatch.setattr(engine.Installer, "install", fails_once(install))
    else:
        monkeypatch.setattr(engine, "plan_converted", fails_once(planned))
    with pytest.raises(MemoryError, match="half-way"):
        model.bfloat16()  # narrowing: values that stayed converted would round
    monkeypatch.undo()
    assert handle.active and list(model.parameters()) == weights
    assert {(p.dtype, p.device.type) for p in model.parameters()} == {(torch.float32, "cpu")}
    torch.testing.assert_close(_forward(model, X), expected, rtol=0, atol=0)
    model.double()  # and it converts as before
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    handle.remove()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):  # the values it had, converted
        assert p.dtype == torch.float64 and torch.equal(p, q.double())


# ---------------------------------------------------------------------- the stress test

_ROUNDS = 200  # per number of converters
# every way to convert that the offload takes: to each dtype, by each call (a device it is on already changes nothing)
_TO: dict[torch.dtype, list[Callable[[nn.Module, torch.device], nn.Module]]] = {
    torch.float32: [lambda m, d: m.float(), lambda m, d: m.to(torch.float32), lambda m, d: m.to(d, torch.float32),
                    lambda m, d: m.to(dtype=torch.float32), lambda m, d: m.type(torch.float32)],
    torch.float64: [lambda m, d: m.double(), lambda m, d: m.to(torch.float64), lambda m, d: m.to(d, dtype=torch.float64),
                    lambda m, d: m.to(torch.zeros((), dtype=torch.float64, device=d)), lambda m, d: m.type(torch.float64)],
}


def _round(
    model: nn.Module, device: torch.device, x: torch.Tensor, rng: random.Random, to: torch.dtype, converters: int = 1
) -> list[torch.Tensor]:
    """``converters`` threads converting ``model`` to ``to`` (each by its own call) race three threads
    running two forwards each, every thread after a random delay; the forwards' outputs."""
    outputs: list[torch.Tensor] = []
    errors: list[BaseException] = []
    count = converters + 3
    start = threading.Barrier(count)
    delays = [rng.uniform(0, 0.002) for _ in range(count)]
    calls = [rng.choice(_TO[to]) for _ in range(converters)]

    def act(i: int) -> None:
        try:
            start.wait(_JOIN_S)
            time.sleep(delays[i])
            if i < converters:
                calls[i](model, device)
            else:
                outputs.extend(_forward(model, x) for _ in range(2))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=act, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(_JOIN_S)
    assert not any(t.is_alive() for t in threads), "deadlock: a conversion or a forward never ended"
    assert not errors, errors
    return outputs


@pytest.mark.accelerator
@pytest.mark.parametrize("converters", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_conversions_racing_forwards_in_threads_never_half_change_the_model(on_tardy: torch.device, converters: int) -> None:
    torch.manual_seed(0)
    model = _Net()
    x = X.to(on_tardy)
    plain = {torch.float32: copy.deepcopy(model).to(on_tardy), torch.float64: copy.deepcopy(model).to(on_tardy).double()}
    expected = {dtype: _forward(m, x) for dtype, m in plain.items()}  # exact: f32 -> f64 -> f32 changes no value
    # the budget streams groups in both dtypes (the model whole does not fit in fp32)
    handle = offload(model, on_tardy, groups="leaves", budget=68_000)
    assert handle.stats().streamed_groups
    rng = random.Random(48)
    now = torch.float32
    with tardy.settings(delay=(0.0, 0.0005), seed=48):  # copies land after random delays
        for _ in range(_ROUNDS):
            to = rng.choice([torch.float32, torch.float64])
            for out in _round(model, on_tardy, x, rng, to, converters):  # each forward ran whole before or after the conversion
                assert any(out.dtype == expected[d].dtype and torch.equal(out, expected[d]) for d in (now, to))
            now = to
            assert handle.active
            assert {(p.dtype, p.device) for p in model.parameters()} == {(to, on_tardy)}
            assert torch.equal(_forward(model, x), expected[to])
    handle.remove()
    assert {(p.dtype, p.device.type) for p in model.parameters()} == {(now, "cpu")}
    for p, q in zip(model.parameters(), plain[now].parameters(), strict=True):
        assert torch.equal(p, q.cpu())
