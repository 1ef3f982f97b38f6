"""Tests of torchsurgery.compact.narrow_matvec: the native kernel against plain fp32."""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import pytest
import torch
from _kernel_paths import ARCHS, PATHS, libraries

from torchsurgery.compact import native_build
from torchsurgery.compact.narrow_matvec import (
    NATIVE_DTYPES,
    NATIVE_MAX_ROWS,
    _NarrowMatvec,
    narrow_matvec,
)

# odd sizes (tails shorter than a vector), sizes above the kernel's column blocks, tiny ones
SHAPES = [(1, 1), (5, 3), (17, 33), (64, 48), (300, 257), (1000, 777), (129, 2100), (40, 4100), (2304, 96), (96, 9000)]


@pytest.fixture(scope="module")
def kernel() -> _NarrowMatvec:
    if not narrow_matvec.wait():  # builds it, or finds it built
        pytest.skip(f"no native kernel on this machine: {narrow_matvec.unavailable}")
    return narrow_matvec


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """Plain fp32: the narrow weight widened, then the usual matmul."""
    w = weight.float()
    out = x @ w if transposed else x @ w.t()
    return out if bias is None else out + bias.float()


@pytest.fixture(params=["dispatched", "generic"])
def each_path(kernel: _NarrowMatvec, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> _NarrowMatvec:
    """The kernel as it dispatches on this CPU (fp8 blocks of 64 where it has AVX-512 VBMI), and
    forced down the generic path that CPUs without VBMI take: both run on every host."""
    monkeypatch.setattr(kernel, "generic", request.param == "generic")
    return kernel


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
def test_outputs_match_fp32_for_many_shapes_rows_and_biases(kernel: _NarrowMatvec, dtype: torch.dtype, transposed: bool) -> None:
    torch.manual_seed(0)
    for i, (out, inp) in enumerate(SHAPES):
        weight = torch.randn(out, inp).to(dtype)
        if transposed:
            weight = weight.t().contiguous()
        biases = [None, torch.randn(out), torch.randn(out).to(dtype)]  # none, fp32, narrow
        for rows in range(1, NATIVE_MAX_ROWS + 1):
            x = torch.randn(rows, inp)
            bias = biases[(i + rows) % 3]
            got = kernel(x, weight, bias, transposed)
            assert got is not None and got.dtype == torch.float32 and got.shape == (rows, out)
            # fp32 sums in another order: error grows with the length of the dot products
            torch.testing.assert_close(got, reference(x, weight, bias, transposed), rtol=1e-5, atol=1e-5 * inp**0.5)
    assert not kernel.failed


def _narrow(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Random values in ``dtype``: int8 over its whole range, the floating ones around 1."""
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, dtype=torch.int8)
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16], ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
def test_the_scale_multiplies_each_sum_before_the_bias(each_path: _NarrowMatvec, dtype: torch.dtype, transposed: bool) -> None:
    # (x @ q.T) * scale + bias, the scale per output or one for all (0-d, or a broadcast scalar),
    # at rows with every kind of tail, against the plain product of the widened values
    torch.manual_seed(9)
    for i, (out, inp) in enumerate([(7, 5), (100, 149), (33, 200), (300, 257), (64, 1100)]):
        weight = _narrow((inp, out) if transposed else (out, inp), dtype)
        per_output = torch.rand(out) * 0.01 + 1e-4
        scales = [per_output, torch.tensor(0.003), torch.tensor(0.02).expand(out)]
        for rows in range(1, NATIVE_MAX_ROWS + 1):
            x, scale = torch.randn(rows, inp), scales[(i + rows) % 3]
            bias = None if rows % 2 else torch.randn(out)
            got = each_path(x, weight, bias, transposed, scale)
            sums = reference(x, weight, None, transposed)
            expected = sums * scale if bias is None else sums * scale + bias
            assert got is not None
            size = float(weight.float().abs().max() * scale.max())  # of one weight, scaled
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * inp**0.5 * size + 1e-6)
    assert not each_path.failed


def test_a_scale_of_another_kind_is_refused_for_its_shape_only(kernel: _NarrowMatvec) -> None:
    weight, x = _narrow((6, 40), torch.int8), torch.randn(1, 40)
    for bad in (torch.ones(5), torch.ones(6, dtype=torch.float64), torch.ones(12)[::2], torch.ones(6, 1)):
        fresh = _NarrowMatvec()
        fresh._libraries = kernel._libraries
        with pytest.warns(UserWarning, match="the scale must"):
            assert fresh(x, weight, None, False, bad) is None
        assert fresh.failed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8], ids=str)
def test_every_split_over_threads_gives_the_same_outputs(
    each_path: _NarrowMatvec, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # outputs split over 1 to 7 threads (more than this machine's cores where it has fewer): each
    # output computed once, by one thread, in the same order, so every split gives the same bits
    torch.manual_seed(10)
    for out, inp, transposed in [(1001, 64, False), (77, 2048, False), (129, 4100, True)]:
        weight = _narrow((out, inp), dtype)
        weight = weight.t().contiguous() if transposed else weight
        for rows in (1, 3, 8):
            x = torch.randn(rows, inp)
            results = []
            for threads in range(1, 8):
                monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
                results.append(each_path(x, weight, None, transposed))
            assert results[0] is not None
            size = float(weight.float().abs().max())
            torch.testing.assert_close(results[0], reference(x, weight, None, transposed), rtol=1e-5, atol=1e-5 * inp**0.5 * size)
            for got in results[1:]:
                assert got is not None and torch.equal(got, results[0])


@pytest.mark.parametrize("ahead", [0, 64, 4096, 65536])
def test_how_far_ahead_the_weight_is_asked_for_changes_no_output(
    each_path: _NarrowMatvec, ahead: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(11)
    cases = [(_narrow((300, 1100), dtype), torch.randn(rows, 1100)) for dtype in (torch.bfloat16, torch.float8_e5m2) for rows in (1, 4)]
    expected = [each_path(x, w, None, False) for w, x in cases]
    monkeypatch.setattr(each_path, "ahead", ahead)
    for (w, x), e in zip(cases, expected, strict=True):
        got = each_path(x, w, None, False)
        assert got is not None and e is not None and torch.equal(got, e)


def test_a_bad_distance_ahead_in_the_environment_warns_and_keeps_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchsurgery.compact import narrow_matvec as module

    for text in ("lots", "-5", "999999"):
        monkeypatch.setenv("TORCHSURGERY_NARROW_AHEAD", text)
        with pytest.warns(UserWarning, match="TORCHSURGERY_NARROW_AHEAD"):
            assert module._ahead_from_environment() == module._AHEAD
    monkeypatch.setenv("TORCHSURGERY_NARROW_AHEAD", "1024")
    assert module._ahead_from_environment() == 1024


def test_leading_dimensions_are_kept(kernel: _NarrowMatvec) -> None:
    torch.manual_seed(2)
    weight = torch.randn(300, 257).bfloat16()
    for shape in [(257,), (1, 1, 257), (2, 3, 257), (1, 2, 4, 257)]:
        x = torch.randn(*shape)
        for transposed, w in ((False, weight), (True, weight.t().contiguous())):
            got = kernel(x, w, None, transposed)
            assert got is not None and got.shape == (*shape[:-1], 300)
            expected = reference(x.reshape(-1, 257), w, None, transposed).reshape(*shape[:-1], 300)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
def test_every_bit_pattern_widens_exactly(kernel: _NarrowMatvec, dtype: torch.dtype) -> None:
    # a weight holding every value of the dtype (NaN, infinities, subnormals, -0), times 1
    if dtype.itemsize == 1:
        values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    else:
        values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    expected = values.float()
    one = torch.ones(1, 1)
    for transposed in (False, True):  # [n, 1] widens element by element, [1, n] a vector at a time
        weight = values.reshape(1, -1) if transposed else values.reshape(-1, 1)
        got = kernel(one, weight, None, transposed)
        assert got is not None
        got = got.reshape(-1)
        same = (got == expected) | (got.isnan() & expected.isnan())
        assert bool(same.all()), values[~same][:8]


def test_concurrent_calls_equal_sequential_ones(kernel: _NarrowMatvec) -> None:
    torch.manual_seed(1)
    cases = []
    for k, (out, inp) in enumerate(SHAPES[4:]):
        transposed = k % 2 == 1
        weight = torch.randn(out, inp).bfloat16()
        cases.append((torch.randn(1 + k % NATIVE_MAX_ROWS, inp), weight.t().contiguous() if transposed else weight, transposed))
    sequential = [kernel(x, w, None, t) for x, w, t in cases]
    results: list[list[torch.Tensor | None]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def work(slot: int) -> None:
        start.wait()
        for _ in range(5):
            results[slot] = [kernel(x, w, None, t) for x, w, t in cases]

    pool = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    for got in results:
        for a, b in zip(got, sequential, strict=True):
            assert a is not None and b is not None
            assert torch.equal(a, b)


def test_a_failing_call_is_remembered_for_its_shape_only(kernel: _NarrowMatvec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "failed", set())
    weight = torch.randn(64, 48).bfloat16()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernel(torch.randn(2, 47), weight, None, False) is None  # x does not fit: the kernel raises
        assert kernel(torch.randn(2, 48), weight, None, False) is None  # that (layout, rows, dtype, shape): remembered
    assert len([w for w in caught if "that shape takes another path" in str(w.message)]) == 1
    assert kernel.failed == {(False, 2, torch.bfloat16, (64, 48))}
    x = torch.randn(3, 48)  # other rows, and other shapes, keep the kernel
    torch.testing.assert_close(kernel(x, weight, None, False), reference(x, weight, None, False))
    other = torch.randn(64, 40).bfloat16()
    torch.testing.assert_close(kernel(x[:2, :40].contiguous(), other, None, False), reference(x[:2, :40], other, None, False))


def test_no_compiler_means_none_and_one_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    fresh = _NarrowMatvec()
    weight = torch.randn(8, 4).bfloat16()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fresh(torch.randn(1, 4), weight, None, False) is None  # starts the build, does not wait
        assert fresh.wait() is False
        assert fresh(torch.randn(3, 4), weight, None, True) is None  # no second build attempt
    assert fresh.unavailable is not None and "no C++ compiler" in fresh.unavailable
    assert len([w for w in caught if "could not be built" in str(w.message)]) == 1


def test_the_kernel_source_ships_with_the_package() -> None:
    # the kernel is built where it runs, so its C++ source must be in every install
    import fnmatch
    import importlib.resources
    import pathlib

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    source = importlib.resources.files("torchsurgery.compact").joinpath("narrow_matvec.cpp")
    assert source.is_file() and "ts_narrow_matvec" in source.read_text()
    pyproject = pathlib.Path(__file__).parents[2] / "pyproject.toml"
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["torchsurgery"]
    assert any(fnmatch.fnmatch("compact/narrow_matvec.cpp", p) for p in patterns), patterns


def test_a_damaged_library_in_the_cache_is_built_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    # a build is written under a temporary name and renamed, so a killed build leaves nothing
    # that loads; a library damaged some other way (a disk that filled up) is built again
    from torchsurgery.compact import narrow_matvec as module

    monkeypatch.setattr(module, "_INSTALLED_DIR", None)  # no library from the install either
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    path = os.path.join(native_build.cache_dir(), native_build.library_name(module._KINDS[torch.bfloat16]))
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"\x7fELF half a library")
    fresh = _NarrowMatvec()
    fresh.start(torch.bfloat16)
    assert fresh.pending  # the damaged library was not loaded: a build runs
    assert fresh.wait(dtype=torch.bfloat16), fresh.unavailable
    weight, x = torch.randn(64, 48).bfloat16(), torch.randn(2, 48)
    torch.testing.assert_close(fresh(x, weight, None, False), reference(x, weight, None, False))
    assert [name for name in os.listdir(os.path.dirname(path))] == [os.path.basename(path)]  # no temporary left
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_every_fp8_pattern_at_many_places_of_long_rows_is_exact(kernel: _NarrowMatvec, dtype: torch.dtype) -> None:
    # fp8 rows are widened 64 bytes at a time in an interleaved order with x laid out to
    # match: each of the 256 patterns alone in its row, at a column that moves through the
    # blocks and the tails (149 = 2 x 64 + 16 + 5), against an x of distinct powers of two per
    # column, so that a weight paired with the wrong x or widened inexactly shows
    inp = 149
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    raw = torch.zeros(256, inp, dtype=torch.uint8)
    cols = (torch.arange(256) * 37) % inp
    raw[torch.arange(256), cols] = patterns
    weight = raw.view(dtype)
    powers = torch.exp2(torch.arange(inp, dtype=torch.float32) % 64 - 32)
    for rows in range(1, NATIVE_MAX_ROWS + 1):
        x = powers * torch.arange(1, rows + 1, dtype=torch.float32)[:, None]
        got = kernel(x, weight, None, False)
        assert got is not None
        expected = patterns.view(dtype).float() * x[:, cols]  # one product per output: exact
        same = (got == expected) | (got.isnan() & expected.isnan())
        assert bool(same.all()), (rows, patterns[~same.all(0)][:8])


@pytest.mark.parametrize("dtype", [d for d in NATIVE_DTYPES if d.is_floating_point], ids=str)
def test_a_nan_weight_in_a_long_row_makes_its_outputs_nan_and_no_other(kernel: _NarrowMatvec, dtype: torch.dtype) -> None:
    # rows long enough for the vector loop (fp8's NaN is found there by its bit pattern)
    torch.manual_seed(4)
    for inp in (64, 200, 1024):
        weight = torch.randn(6, inp).to(dtype)
        nan_bits = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7F, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}[dtype]
        raw = weight.view(torch.uint8 if dtype.itemsize == 1 else torch.int16)
        raw[2, inp // 3] = nan_bits
        raw[4, inp - 20] = nan_bits | (0x80 if dtype.itemsize == 1 else -(1 << 15))  # negative NaN
        for rows in (1, 3, NATIVE_MAX_ROWS):
            x = torch.randn(rows, inp)
            got = kernel(x, weight, None, False)
            expected = reference(x, weight, None, False)
            assert got is not None and torch.equal(got.isnan(), expected.isnan())
            assert bool(got.isnan()[:, [2, 4]].all())
            torch.testing.assert_close(got.nan_to_num(0.0), expected.nan_to_num(0.0), rtol=1e-5, atol=1e-5 * inp**0.5)


def test_the_library_the_install_built_is_loaded_without_a_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    # pip installing from source builds the kernel next to the package's modules (setup.py):
    # the first forward after offload then has it, with nothing built and nothing cached
    from torchsurgery.compact import narrow_matvec as module

    installed, cache = tmp_path / "package", tmp_path / "cache"
    kind = module._KINDS[torch.float8_e4m3fn]
    installed.mkdir()
    (installed / f"narrow_matvec_{kind}_0123456789abcdef.so").write_bytes(b"an earlier source's build")
    assert native_build.build_all(str(installed), kinds=[kind]) == {kind: None}
    assert os.listdir(installed) == [native_build.library_name(kind)]  # the stale library went
    monkeypatch.setattr(module, "_INSTALLED_DIR", str(installed))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    fresh = _NarrowMatvec()
    fresh.start(torch.float8_e4m3fn)
    assert not fresh.pending and fresh._libraries[torch.float8_e4m3fn].thread is None  # loaded, no build started
    weight, x = torch.randn(64, 48).to(torch.float8_e4m3fn), torch.randn(2, 48)
    torch.testing.assert_close(fresh(x, weight, None, False), reference(x, weight, None, False))
    assert not cache.exists()


def test_a_library_built_on_another_machine_is_not_loaded(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    # a wheel built elsewhere, or a home directory shared between machines, may hold a library
    # compiled for instructions this CPU lacks: its name carries that machine's features
    from torchsurgery.compact import narrow_matvec as module

    installed, cache = tmp_path / "package", tmp_path / "cache"
    kind = module._KINDS[torch.bfloat16]
    with monkeypatch.context() as elsewhere:
        elsewhere.setattr(native_build, "_cpu_features", lambda: "flags\t\t: fpu sse2 avx512f avx512_fp16 amx_tile")
        assert native_build.build_all(str(installed), kinds=[kind]) == {kind: None}
    monkeypatch.setattr(module, "_INSTALLED_DIR", str(installed))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    fresh = _NarrowMatvec()
    fresh.start(torch.bfloat16)
    assert fresh._libraries[torch.bfloat16].thread is not None  # not loaded: this machine's library is built
    assert fresh.wait(dtype=torch.bfloat16), fresh.unavailable
    assert os.listdir(cache / "torchsurgery") == [native_build.library_name(kind)]


def test_setup_builds_the_kernels_at_install_and_installs_without_a_compiler(tmp_path: Any) -> None:
    # what `pip install` runs for build_ext: every dtype's library, named as offload looks for it;
    # with no compiler the install still succeeds and says so (the kernel then comes at first use)
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).parents[2]
    command = [sys.executable, str(root / "setup.py"), "-q", "build_ext"]
    built = subprocess.run([*command, "--build-lib", str(tmp_path / "built")], cwd=root, capture_output=True,
                           text=True, check=False)
    assert built.returncode == 0, built.stderr
    names = sorted(native_build.library_name(kind) for kind in native_build.KINDS.values())
    assert sorted(os.listdir(tmp_path / "built" / "torchsurgery" / "compact" / "_kernels")) == names
    env = {**os.environ, "CXX": "/nonexistent/c++"}
    without = subprocess.run([*command, "--build-lib", str(tmp_path / "without")], cwd=root, env=env,
                             capture_output=True, text=True, check=False)
    assert without.returncode == 0, without.stderr
    told = [line for line in without.stderr.splitlines() if "was not built at install time" in line]
    assert len(told) == 1 and "(no C++ compiler" in told[0], without.stderr  # one line for every dtype
    kernels = tmp_path / "without" / "torchsurgery" / "compact" / "_kernels"
    assert not kernels.exists() or not os.listdir(kernels)


# rows shorter than a vector, than the NaN scan's 64 bytes and than a VBMI block, and longer
# ones with every kind of tail (64 + 36, 2 x 64 + 16 + 5, 3 x 64 + 8)
ROW_LENGTHS = [1, 5, 16, 17, 40, 63, 64, 100, 149, 200]


def _e4m3_nan(raw: torch.Tensor, index: Any, negative: torch.Tensor) -> None:
    raw[index] = torch.where(negative, 0xFF, 0x7F).to(torch.uint8)  # e4m3fn's NaN, either sign


@pytest.mark.parametrize("inp", ROW_LENGTHS)
def test_an_e4m3fn_nan_at_every_place_of_a_row_makes_its_outputs_nan(each_path: _NarrowMatvec, inp: int) -> None:
    # weight row o < inp holds a NaN at column o; rows inp and inp + 1 none, and the narrow
    # bias a NaN at inp + 1 (widened one value at a time): against torch's own widening
    torch.manual_seed(5)
    weight = torch.randn(inp + 2, inp).to(torch.float8_e4m3fn)
    places = torch.arange(inp)
    _e4m3_nan(weight.view(torch.uint8), (places, places), places % 2 == 1)
    bias = torch.randn(inp + 2).to(torch.float8_e4m3fn)
    _e4m3_nan(bias.view(torch.uint8), inp + 1, torch.tensor(False))
    for rows in range(1, 7):
        x = torch.randn(rows, inp)
        got = each_path(x, weight, bias, False)
        expected = reference(x, weight, bias, False)
        assert got is not None
        assert torch.equal(got.isnan(), expected.isnan()), (rows, (got.isnan() != expected.isnan()).nonzero()[:4].tolist())
        assert not bool(expected[:, inp].isnan().any()) and bool(expected[:, :inp].isnan().all())
        torch.testing.assert_close(got.nan_to_num(0.0), expected.nan_to_num(0.0), rtol=1e-5, atol=1e-4 * inp**0.5)


@pytest.mark.parametrize(("inp", "out"), [(5, 37), (17, 149), (63, 100), (64, 16)])
def test_an_e4m3fn_nan_at_every_place_of_a_weight_stored_in_out_makes_its_column_nan(
    each_path: _NarrowMatvec, inp: int, out: int
) -> None:
    # a weight [in, out] is read along its rows: every third column holds one NaN, at a row that
    # moves through the rows, so that NaNs sit in the vector part and in both tails
    torch.manual_seed(6)
    weight = torch.randn(inp, out).to(torch.float8_e4m3fn)
    columns = torch.arange(0, out, 3)
    _e4m3_nan(weight.view(torch.uint8), ((columns // 3) % inp, columns), columns % 2 == 1)
    for rows in range(1, 7):
        x = torch.randn(rows, inp)
        got = each_path(x, weight, None, True)
        expected = reference(x, weight, None, True)
        assert got is not None
        assert torch.equal(got.isnan(), expected.isnan()), (rows, (got.isnan() != expected.isnan()).nonzero()[:4].tolist())
        torch.testing.assert_close(got.nan_to_num(0.0), expected.nan_to_num(0.0), rtol=1e-5, atol=1e-4 * inp**0.5)


@pytest.mark.skipif("avx2" not in PATHS, reason="an x86-64 CPU with AVX2 runs the builds for AVX2, AVX and the baseline")
@pytest.mark.parametrize("arch", list(ARCHS.values()))
def test_the_kernel_built_for_avx2_avx_or_the_x86_64_baseline_is_exact(arch: str) -> None:
    # the build for an AVX2 host without AVX-512 (most AMD CPUs before Zen 4, older Intel ones)
    # takes other intrinsics (8-lane vectors, F16C halves, fp8 widened 16 bytes at a time, its
    # own NaN scan), an AVX host without AVX2 (Ivy Bridge: 8 lanes, F16C halves, portable
    # conversions otherwise) and the x86-64 baseline (SSE2 alone) the portable vector code with
    # scalar halves: each built for such a host (once per machine, _kernel_paths), and run,
    # since this CPU has their instructions too; every dtype,
    # both layouts, row counts that take each widening (pairs of vectors for 1-4 rows, one
    # vector for more), and e4m3fn's NaN of either sign at places the vector loop reads
    from torchsurgery.compact import narrow_matvec as module

    built = libraries(arch)
    torch.manual_seed(12)
    cases = [((7, 5), False, 1), ((100, 149), True, 3), ((300, 1100), False, 8), ((33, 77), True, 5),
             ((40, 300), False, 2), ((24, 1024), False, 1), ((19, 250), False, 4), ((10, 130), False, 6)]
    for dtype, path in built.items():
        fn = module.kernel_at(path)
        assert fn is not None
        for (out, inp), transposed, rows in cases:
            weight = _narrow((inp, out) if transposed else (out, inp), dtype)
            if dtype == torch.float8_e4m3fn and not transposed:
                raw = weight.view(torch.uint8)
                raw[out // 2, inp // 3] = 0x7F
                raw[out - 1, inp - 1 - inp // 5] = 0xFF  # negative NaN
            x, scale = torch.randn(rows, inp), torch.rand(out)
            got = fn(x, weight, None, transposed, scale)
            expected = reference(x, weight, None, transposed) * scale
            assert torch.equal(got.isnan(), expected.isnan()), (dtype, rows, inp)
            size = float(weight.float().nan_to_num(0.0).abs().max())
            torch.testing.assert_close(got.nan_to_num(0.0), expected.nan_to_num(0.0), rtol=1e-5,
                                       atol=1e-5 * inp**0.5 * size)
