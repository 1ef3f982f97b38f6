"""Tests of torchsurgery.compact.narrow: narrow-weight layers against plain fp32, and threads.

Every test that runs a kernel runs twice: with the native kernel, and with it unavailable
(no compiler), where the compiled kernels serve up to 4 rows.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from torchsurgery import offload
from torchsurgery.compact import narrow, native_build
from torchsurgery.compact.narrow import (
    _FUSED_MAX_ROWS,
    _FUSED_MIN_WEIGHT,
    _fused,
    _rows_from_narrow,
)
from torchsurgery.compact.narrow_matvec import NATIVE_MAX_ROWS, _NarrowMatvec, narrow_matvec

transformers = pytest.importorskip("transformers")

# 14 weight shapes, each just big enough for the fused path: more than the compiler's
# recompile limit (8), so a per-shape compilation would fall off it
SHAPES = [(out, _FUSED_MIN_WEIGHT // out + k) for k, out in enumerate(
    [256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960, 1024, 1088]
)]


@pytest.fixture(params=["native", "compiled"])
def tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> str:
    """Which kernel serves few rows: the native one, or (no compiler found) the compiled ones."""
    if request.param == "native":
        if not narrow_matvec.wait():  # builds it, or finds it built
            pytest.skip(f"no native kernel on this machine: {narrow_matvec.unavailable}")
    else:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
        monkeypatch.setenv("CXX", "/nonexistent/c++")
        monkeypatch.setattr(narrow, "narrow_matvec", _NarrowMatvec())
        with pytest.warns(UserWarning, match="could not be built"):
            narrow.narrow_matvec.wait()
    return str(request.param)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """Plain fp32: the narrow weight widened, then the usual matmul."""
    w = weight.float()
    out = x @ w if transposed else x @ w.t()
    return out if bias is None else out + bias.float()


def make_layer(out: int, inp: int, transposed: bool, bias: bool) -> nn.Module:
    if transposed:
        return transformers.pytorch_utils.Conv1D(out, inp)  # always with a bias (addmm needs one)
    return nn.Linear(inp, out, bias=bias)


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_narrow_path_matches_fp32_for_many_shapes_and_rows(transposed: bool, tier: str) -> None:
    kernel_rows = NATIVE_MAX_ROWS if tier == "native" else _FUSED_MAX_ROWS
    torch.manual_seed(0)
    for i, (out, inp) in enumerate(SHAPES):
        with_bias = i % 3 != 0
        layer = make_layer(out, inp, transposed, bias=with_bias)
        handle = offload(layer, storage_dtype=torch.bfloat16, dtype=torch.float32, groups=[""])
        weight, bias = layer.weight, layer.bias
        assert (weight.dtype, weight.stored.dtype) == (torch.float32, torch.bfloat16)
        # the compiled kernels: one compilation per (rows, bias or not); every row count, each with
        # a bias and without, takes eight of them; odd counts without and even ones with take four
        every = [r for r in range(1, 9) if tier == "native" or r > _FUSED_MAX_ROWS or transposed or r % 2 == int(not with_bias)]
        for rows in every:
            x = torch.randn(rows, inp)
            with torch.no_grad():
                got = layer(x)
            torch.testing.assert_close(got, reference(x, weight, bias, transposed), rtol=1e-4, atol=1e-4)
            if rows <= kernel_rows:  # served by a kernel, not by widening the weight
                assert handle.stats().widened_bytes == 0, (out, inp, rows)
        # every product read the narrow weight in place (counted where the layer's F.linear or
        # addmm was served), none went through a widened copy of it
        assert handle.stats().transfers == len(every) and handle.stats().bytes_moved == len(every) * weight.stored.nbytes
        handle.remove()
    assert not _fused.failed


def test_leading_dimensions_and_fp8_storage(tier: str) -> None:
    torch.manual_seed(1)
    for transposed in (False, True):
        for out, inp in SHAPES[:3]:
            layer = make_layer(out, inp, transposed, bias=True)
            handle = offload(layer, storage_dtype=torch.float8_e4m3fn, dtype=torch.float32, groups=[""])
            assert layer.weight.stored.dtype == torch.float8_e4m3fn
            for shape in [(1, 1, inp), (2, 2, inp), (3, 1, inp), (8, inp)]:
                x = torch.randn(*shape)
                with torch.no_grad():
                    got = layer(x)
                expected = reference(x.reshape(-1, inp), layer.weight, layer.bias, transposed)
                torch.testing.assert_close(got, expected.reshape(*shape[:-1], -1), rtol=1e-4, atol=1e-4)
            handle.remove()


def test_the_kernel_body_never_runs_uncompiled() -> None:
    # run eagerly, the body would build a rows x out x in temporary: it refuses instead
    with pytest.raises(narrow._RanEagerly):
        _rows_from_narrow(torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None)


def test_a_failing_compiled_shape_casts_and_the_others_stay_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(narrow, "narrow_matvec", lambda *args: None)  # only the compiled kernels
    bad_out, bad_in = SHAPES[-1]
    real_kernel = _fused._kernel

    def kernel(key: Any) -> Any:
        compiled = real_kernel(key)

        def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if tuple(weight.shape) == (bad_out, bad_in):
                raise RuntimeError("simulated compiler failure")
            return compiled(x, weight, bias)

        return run

    monkeypatch.setattr(_fused, "_kernel", kernel)
    monkeypatch.setattr(_fused, "failed", set())
    bad = nn.Linear(bad_in, bad_out)
    good = nn.Linear(SHAPES[0][1], SHAPES[0][0])
    bad_handle = offload(bad, storage_dtype=torch.bfloat16, dtype=torch.float32, groups=[""])
    good_handle = offload(good, storage_dtype=torch.bfloat16, dtype=torch.float32, groups=[""])
    x = torch.randn(1, bad_in)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = bad(x)
        again = bad(x)  # remembered: no second attempt, no second warning
    assert len([w for w in caught if "casts instead" in str(w.message)]) == 1
    torch.testing.assert_close(got, reference(x, bad.weight, bad.bias, False), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, got)
    assert bad_handle.stats().widened_bytes > 0  # the cast path served it
    y = torch.randn(1, SHAPES[0][1])
    with torch.no_grad():
        torch.testing.assert_close(good(y), reference(y, good.weight, good.bias, False), rtol=1e-4, atol=1e-4)
    assert good_handle.stats().widened_bytes == 0  # still fused
    bad_handle.remove()
    good_handle.remove()


def threaded_outputs(model: nn.Module, inputs: list[torch.Tensor], threads: int = 4) -> list[torch.Tensor]:
    """Every input run ``threads`` times at once, from as many threads."""
    results: list[list[torch.Tensor]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def work(slot: int) -> None:
        try:
            start.wait()
            with torch.no_grad():
                for i in range(len(inputs)):
                    results[slot].append(model(inputs[(i + slot) % len(inputs)]))
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(s,)) for s in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors
    # back in input order
    return [results[s][(i - s) % len(inputs)] for s in range(threads) for i in range(len(inputs))]


def block_model(d: int = 512, blocks: int = 3) -> nn.Module:
    layers = [nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(blocks)]
    return nn.Sequential(*layers).eval()


@pytest.mark.parametrize("setup", ["narrow", "master copies", "streamed groups"])
def test_concurrent_forwards_equal_sequential_ones(setup: str, tier: str) -> None:
    torch.manual_seed(2)
    model = block_model()
    kwargs: dict[str, Any] = {"storage_dtype": torch.bfloat16, "dtype": torch.float32}
    if setup == "master copies":
        kwargs["master_dtype"] = torch.float32
    if setup == "streamed groups":  # norms stored narrow too, nothing resident: every block streams
        kwargs.update(skip=None, budget=None, storage_dtype=torch.float16)
    handle = offload(model, **kwargs)
    if setup == "streamed groups":
        assert handle.stats().streamed_groups
    # rows 1-3 take a kernel, 6 the native kernel or a widened copy, 40 the per-thread widened copies
    inputs = [torch.randn(rows, 512) for rows in (1, 6, 2, 40, 3, 1, 6, 40)]
    with torch.no_grad():
        sequential = [model(x) for x in inputs]
    got = threaded_outputs(model, inputs)
    for i, out in enumerate(got):
        torch.testing.assert_close(out, sequential[i % len(inputs)], rtol=1e-6, atol=1e-6)
    handle.remove()


def test_scratch_is_per_thread_and_freed_on_remove() -> None:
    model = block_model(blocks=1)
    handle = offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
    widest = 2 * 512 * 512 * 4  # the largest weight, widened to fp32
    x = torch.randn(40, 512)
    with torch.no_grad():
        model(x)
        assert handle.stats().widened_bytes == widest  # one buffer, reused across shapes

        def step() -> None:
            with torch.no_grad():  # grad mode is per thread
                model(x)

        thread = threading.Thread(target=step)
        thread.start()
        thread.join()
    assert handle.stats().widened_bytes <= 2 * widest
    del thread  # a finished thread's buffer goes with it
    assert handle.stats().widened_bytes == widest
    handle.remove()
    assert handle.stats().widened_bytes == 0


def _building_kernel(monkeypatch: pytest.MonkeyPatch, extensions: Any) -> tuple[_NarrowMatvec, threading.Event]:
    """A kernel whose build is held until the event is set (it then finds no compiler)."""
    from torchsurgery.compact import narrow_matvec as module

    release = threading.Event()

    def held() -> str:
        release.wait(60)
        return "held by the test"

    monkeypatch.setattr(native_build, "no_compiler", held)
    monkeypatch.setattr(module, "_INSTALLED_DIR", None)  # no library from the install
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))  # and none cached to load at once
    fresh = _NarrowMatvec()
    monkeypatch.setattr(narrow, "narrow_matvec", fresh)
    return fresh, release


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_a_forward_does_not_wait_for_the_kernel_build(
    transposed: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # FramePack's users start a pipeline and run it: the first forward after offload must not
    # wait for a compiler. While the build runs, few rows are served a cache-sized slice at a
    # time, and nothing is handed to torch.compile (which would stall on its own compiler).
    fresh, release = _building_kernel(monkeypatch, tmp_path)
    compiled_before = dict(_fused.kernels)
    monkeypatch.setattr(narrow, "_SLICE_BYTES", 4096)  # several slices even for small layers
    torch.manual_seed(2)
    layer = make_layer(384, 700, transposed, bias=True)
    handle = offload(layer, storage_dtype=torch.bfloat16, dtype=torch.float32, groups=[""])
    assert fresh.pending  # offload started the build; it is still running
    try:
        for rows in (1, 3, 8):
            x = torch.randn(rows, 700)
            with torch.no_grad():
                got = layer(x)
            torch.testing.assert_close(got, reference(x, layer.weight, layer.bias, transposed), rtol=1e-5, atol=1e-4)
        assert fresh.pending and _fused.kernels == compiled_before
        assert handle.stats().transfers == 3  # each product read the narrow weight once
    finally:
        release.set()
    with pytest.warns(UserWarning, match="held by the test"):
        assert fresh.wait() is False  # told once, in the caller's thread, when it is known
    handle.remove()


def test_through_cache_matches_fp32_for_every_narrow_dtype() -> None:
    torch.manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        for transposed in (False, True):
            weight = (torch.randn(700, 333) * 0.5).to(dtype)
            bias = torch.randn(333 if transposed else 700).to(dtype)
            for rows in (1, 2, 8):
                x = torch.randn(rows, 700 if transposed else 333)
                for scratch in (None, narrow.Scratch()):
                    got = narrow.through_cache(x, weight, bias, transposed, scratch)
                    torch.testing.assert_close(got, reference(x, weight, bias, transposed), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_widens_exactly_for_every_bit_pattern(dtype: torch.dtype) -> None:
    # the cast path widens fp8 through fp16's conversion: every value, zeros' signs, NaNs and
    # (e5m2) infinities must come out as torch's own conversion gives them
    every = torch.arange(256, dtype=torch.uint8).view(dtype)
    finite = every[~every.float().isnan()].contiguous()
    for weight in (every, finite):
        expected = weight.float()
        got = narrow.widen_into(torch.empty(weight.shape), weight)
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))
        assert torch.equal(got.signbit(), expected.signbit())
        assert torch.equal(narrow.Scratch().widen(weight, torch.float32).nan_to_num(7.0), got.nan_to_num(7.0))


def test_a_cached_build_is_loaded_before_the_first_forward(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    # loading in the background would hold the first forward up while the kernel registers;
    # a build found in the cache is loaded by offload itself
    from torchsurgery.compact import narrow_matvec as module

    monkeypatch.setattr(module, "_INSTALLED_DIR", None)  # only what a build at first use cached
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    if not _NarrowMatvec().wait(dtype=torch.bfloat16):
        pytest.skip(f"no native kernel on this machine: {narrow_matvec.unavailable}")
    fresh = _NarrowMatvec()
    fresh.start(torch.bfloat16)
    assert not fresh.pending
    weight = torch.randn(64, 48).bfloat16()
    x = torch.randn(1, 48)
    got = fresh(x, weight, None, False)
    assert got is not None
    torch.testing.assert_close(got, reference(x, weight, None, False), rtol=1e-5, atol=1e-4)
