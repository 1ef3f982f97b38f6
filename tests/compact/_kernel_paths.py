"""Every path the narrow-weight kernel can take on this host, for the tests of bitwise promises.

The kernel is compiled for the CPU at hand (``-march=native``): AVX-512 code on a host that has
it, AVX2 code on one that has only that, and portable vector code elsewhere; ``generic`` sends
every call down the portable code. A promise such as "compiled equals eager bit for bit" must
hold on every path, not only on the one this host takes, so the tests that make one run on each
path this host can run:

* ``native``: the build the library loads here;
* ``generic``: the same build, every call down the portable code;
* ``avx2``, ``avx``, ``x86-64``: the builds for an AVX2 host without AVX-512 (``haswell``), an AVX
  host without AVX2 (``ivybridge``) and the x86-64 baseline, on an x86-64 host with AVX2.

Each build is made once per machine, named by :func:`~torchsurgery.compact.native_build.library_name`
(a digest of the source, the flags and the machine) in the folder where builds at first use go,
so a run reuses the builds of the runs before it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
from collections.abc import Iterator

import pytest
import torch

from torchsurgery.compact import narrow_matvec as module
from torchsurgery.compact import native_build

ARCHS = {"avx2": "haswell", "avx": "ivybridge", "x86-64": "x86-64"}
"""The builds for other CPUs, by the name the tests give them: their ``-march``."""


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2 " in f" {line.split(':', 1)[1]} " for line in f)
    except OSError:
        return False


PATHS = ["native", "generic", *(ARCHS if _has_avx2() else ())]
"""The paths this host can run."""


@functools.cache
def libraries(arch: str) -> dict[torch.dtype, str]:
    """The library of every weight dtype built for ``-march=arch``: built where missing (AssertionError if a build fails)."""
    paths = {
        dtype: os.path.join(native_build.cache_dir(), native_build.library_name(kind, arch))
        for dtype, kind in module._KINDS.items()
    }
    missing = [(module._KINDS[dtype], path) for dtype, path in paths.items() if not os.path.exists(path)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        why = list(pool.map(lambda job: native_build.build(*job, yielding=False, arch=arch), missing))
    assert not any(why), f"the kernel for -march={arch} did not build: {why}"
    return paths


@contextlib.contextmanager
def use(path: str) -> Iterator[None]:
    """Every narrow product inside the block takes ``path`` (one of :data:`PATHS`)."""
    kernel = module.narrow_matvec
    if path == "native":  # as this host runs it: the kernel, or (none built) the fallbacks
        yield
        return
    if not kernel.wait():
        pytest.skip(f"no native kernel here ({kernel.unavailable}): only the fallbacks run")
    saved = ({dtype: library.fn for dtype, library in kernel._libraries.items()}, kernel.generic)
    try:
        if path in ARCHS:
            for dtype, file in libraries(ARCHS[path]).items():
                kernel._libraries[dtype].fn = module._load(file)
        kernel.generic = path == "generic"
        yield
    finally:
        fns, kernel.generic = saved
        for dtype, fn in fns.items():
            kernel._libraries[dtype].fn = fn
