"""A native CPU kernel for few-row matmuls against a weight stored narrower than fp32.

``y = (x @ W.T) * s + b`` (or ``x @ W`` for a weight stored ``[in, out]``) with ``x`` of 1 to
8 rows in fp32, ``W`` in bf16, fp16, fp8 (e4m3fn, e5m2) or int8, and ``s`` an optional scale
per output or per tensor (the scaled formats of :mod:`torchsurgery.compact.scaled`): each
weight element is widened in registers and accumulated in fp32, each sum scaled as it is
written, so a step reads the narrow bytes once and writes nothing weight-sized. torch's CPU matmuls take only one dtype, so this is the
one way to read a narrow weight at memory speed without a compiled graph per shape.

The source is ``narrow_matvec.cpp``, next to this module: a plain shared library with one C
entry point, called through :mod:`ctypes` (which lets go of the GIL during the call). It
includes no torch header, so it needs nothing but a C++ compiler, does not depend on
torch's version, and builds in about 3 seconds per dtype (a torch extension took 16-18 s,
most of it in torch's headers). It is compiled for this machine's instruction set, one
library per weight dtype; :mod:`torchsurgery.compact.native_build` builds it and names it.

When it is built:

* **at install time**, where pip installs torchsurgery from source (a regular or an editable
  install) on a machine with a C++ compiler: ``setup.py`` builds every dtype's library into
  ``_kernels/`` beside this module, so the first forward after ``offload`` already has the
  kernel.
  The build runs on the machine that will run it, so ``-march=native`` is right; a library
  that came from elsewhere carries another machine's digest in its name and is not loaded.
* **at first use** otherwise (no compiler during the install, a wheel built on another
  machine, an edited source): ``offload`` (through :meth:`_NarrowMatvec.start`) starts the
  build for the dtype it stores in the background, the compiler at the lowest priority so
  that it takes little from the forwards running meanwhile, into ``torchsurgery/`` under
  torch's extensions directory (``TORCH_EXTENSIONS_DIR``, by default
  ``~/.cache/torch_extensions``), where every process after it finds it. No call waits for
  it: until it is done every call answers None and the caller takes its fallback (a cast
  through a cache-sized buffer, see :mod:`torchsurgery.compact.narrow`).

Where no compiler is found or the build fails, one warning says so and every call answers
None; a call that fails for one (layout, rows, dtype, shape) is remembered and answered None
from then on, the other shapes keep the kernel.

Layouts, both read as contiguous streams:

* weight ``[out, in]`` (``nn.Linear``): one output after the other, each a pass over its
  weight row with 8 to 16 accumulator chains in all;
* weight ``[in, out]`` (transformers' ``Conv1D``): ``y[r, :] += x[r, i] * W[i, :]`` over
  the weight's rows, the partial sums of a block of columns kept in the first-level cache.

Paths: where the CPU has AVX-512 VBMI, fp8 rows of a weight ``[out, in]`` at least 64 long
are widened 64 bytes at a time by table lookups (1 to 4 rows of ``x``); everything else takes
the generic path, 16 elements at a time in portable vector code (an e4m3fn row scanned for its
NaN pattern first), and tails one element at a time. ``narrow_matvec.generic = True`` (or the
environment variable ``TORCHSURGERY_NARROW_GENERIC=1`` at import) sends every call down the
generic path, so that the tests reach it on every CPU, as a machine without VBMI runs.

Reading at the memory's speed: each thread reads its weight rows front to back and asks
for the bytes :attr:`_NarrowMatvec.ahead` ahead of the sums, and four times as far into the
second-level cache (software prefetch; measured on an Intel Xeon with AVX-512, one stream per
thread otherwise reads at two thirds of the memory's speed). ``TORCHSURGERY_NARROW_AHEAD`` sets the distance at import (0: none);
``benchmarks/narrow_kernel.py`` sweeps it on the host at hand.

Threads: the output columns are split over torch's thread count (OpenMP: the runtime torch
has loaded); concurrent calls from several Python threads share nothing but the read-only
weight.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torchsurgery.compact import native_build

NATIVE_MAX_ROWS = 8
NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
_KINDS = {dtype: native_build.KINDS[str(dtype).removeprefix("torch.")] for dtype in NATIVE_DTYPES}  # the source's enum Kind
_ARGTYPES: list[Any] = [
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
]
# Bytes of a weight row asked for ahead of the sums (into the first-level cache; four times as
# far into the second). Measured on an Intel Xeon (AVX-512, 2 threads, 2048x2048 bf16 weights out
# of cache): 0.67x the memory's read bandwidth without, 0.97x at 3 KiB, where torch's own fp32
# matmul reads at 1.00x; ``benchmarks/narrow_kernel.py`` sweeps it on the host at hand. It is
# not measured at start-up: the sweep must read more than the last-level cache (300 MiB on that
# host) to mean anything.
_AHEAD = 3072
_ERRORS = {1: "no kernel for this dtype", 2: "1 to 8 rows only", 3: "an empty shape"}


_INSTALLED_DIR: str | None = native_build.installed_dir()  # where an install-time build is


def _ahead_from_environment() -> int:
    """``TORCHSURGERY_NARROW_AHEAD`` (bytes, 0 to 65536) where it is set, or the measured default."""
    text = os.environ.get("TORCHSURGERY_NARROW_AHEAD", "")
    try:
        value = int(text) if text else _AHEAD
    except ValueError:
        value = -1
    if not 0 <= value <= 65536:
        warnings.warn(
            f"torchsurgery.compact.narrow_matvec: TORCHSURGERY_NARROW_AHEAD={text!r} is not a byte count "
            f"from 0 to 65536; using {_AHEAD}", stacklevel=2,
        )
        return _AHEAD
    return value


def _load(path: str) -> Callable[..., int] | None:
    """The entry point of the library at ``path``, or None where there is none (or it is damaged)."""
    if not os.path.exists(path):
        return None
    try:
        fn = ctypes.CDLL(path).ts_narrow_matvec
    except (OSError, AttributeError):  # damaged: built again over it
        return None
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return fn


def _installed(name: str) -> Callable[..., int] | None:
    """The library named ``name`` that the install built next to the package's modules, or None."""
    return None if _INSTALLED_DIR is None else _load(os.path.join(_INSTALLED_DIR, name))


_Key = tuple[bool, int, torch.dtype, tuple[int, ...]]


class _Library:
    """The kernel for one weight dtype: loaded, being built, or unavailable (and why)."""

    def __init__(self) -> None:
        self.fn: Callable[..., int] | None = None
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.unavailable: str | None = None


class _NarrowMatvec:
    """The kernel, one library per weight dtype, built in the background; failures remembered per shape.

    Example:
        >>> import torch
        >>> from torchsurgery.compact.narrow_matvec import narrow_matvec
        >>> narrow_matvec.start(torch.bfloat16)  # returns at once; calls answer None until the kernel is ready
        >>> if narrow_matvec.wait():
        ...     w = torch.eye(2, dtype=torch.bfloat16)
        ...     print(narrow_matvec(torch.ones(1, 2), w, None, False).tolist())
        ... else:
        ...     print([[1.0, 1.0]])
        [[1.0, 1.0]]
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._libraries: dict[torch.dtype, _Library] = {}
        self._warned = False
        self.failed: set[_Key] = set()
        # every call down the generic path (no fp8 blocks of 64 where AVX-512 VBMI has them)
        self.generic: bool = os.environ.get("TORCHSURGERY_NARROW_GENERIC", "") not in ("", "0")
        # bytes of a weight row asked for ahead of the sums (0: none); TORCHSURGERY_NARROW_AHEAD at import
        self.ahead: int = _ahead_from_environment()

    @property
    def unavailable(self) -> str | None:
        """Why the kernel could not be built (for the first dtype that could not), or None."""
        for library in list(self._libraries.values()):
            if library.unavailable is not None:
                return library.unavailable
        return None

    @property
    def pending(self) -> bool:
        """True while a build runs (calls for its dtype answer None, but the kernel may come)."""
        return any(lib.thread is not None and not lib.done.is_set() for lib in list(self._libraries.values()))

    def start(self, dtype: torch.dtype | None = None) -> None:
        """Load the library for ``dtype`` (every native dtype when None) now, or start its build; returns at once.

        The library the install built, or else one cached by an earlier build, is loaded in
        the calling thread (a few milliseconds, spent by ``offload`` rather than by the first
        forward).
        """
        for each in NATIVE_DTYPES if dtype is None else (dtype,):
            if each not in _KINDS:
                continue
            with self._lock:
                if each in self._libraries:
                    continue
                library = self._libraries[each] = _Library()
                try:
                    name = native_build.library_name(_KINDS[each])
                except OSError as exc:  # the source is missing from the install
                    library.unavailable = f"{type(exc).__name__}: {exc}"
                    library.done.set()
                    continue
                path = os.path.join(native_build.cache_dir(), name)
                library.fn = _installed(name) or _load(path)
                if library.fn is not None:
                    library.done.set()
                    continue
                library.thread = threading.Thread(
                    target=self._build, args=(library, _KINDS[each], path), name="torchsurgery-narrow-kernel", daemon=True
                )
                library.thread.start()

    @staticmethod
    def _build(library: _Library, kind: int, path: str) -> None:
        try:
            why = native_build.build(kind, path)
            if why is None:
                library.fn = _load(path)
                why = None if library.fn is not None else "the library built could not be loaded"
        except Exception as exc:  # anything else: the callers take another path
            why = f"{type(exc).__name__}: {native_build.last_line(str(exc))}"
        if library.fn is None:
            library.unavailable = (why or "unknown")[:300]
        library.done.set()

    def wait(self, timeout: float | None = None, dtype: torch.dtype | None = None) -> bool:
        """Wait for the build for ``dtype`` (every native dtype when None), starting it if needed; whether it is available.

        Args:
            timeout: seconds to wait at most (for each build); None waits for the builds to end.
            dtype: the weight dtype whose kernel is waited for; None: all of them.
        """
        self.start(dtype)
        libraries = [self._libraries[d] for d in (NATIVE_DTYPES if dtype is None else (dtype,)) if d in self._libraries]
        for library in libraries:
            library.done.wait(timeout)
        self._tell()
        return bool(libraries) and all(library.fn is not None for library in libraries)

    def _tell(self) -> None:
        """The one warning that the kernel is unavailable, in the caller's thread."""
        why = self.unavailable
        if why is None or self._warned:
            return
        with self._lock:
            if self._warned:
                return
            self._warned = True
        warnings.warn(
            f"torchsurgery.offload: the native narrow-weight CPU kernel could not be built "
            f"({why}); narrow weights take the compiled or the cast path",
            stacklevel=4,
        )

    @staticmethod
    def _key(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> _Key:
        return (transposed, x.numel() // max(1, x.shape[-1]), weight.dtype, tuple(weight.shape))

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``(x @ weight.T) * scale + bias`` (``x @ weight`` when ``transposed``) in fp32, or None.

        ``x`` is a contiguous fp32 ``[..., in]`` tensor of 1 to :data:`NATIVE_MAX_ROWS` rows
        (the leading dimensions together), the result ``[..., out]``; ``weight`` a contiguous
        2-d CPU tensor of one of :data:`NATIVE_DTYPES`, ``bias`` None or ``out`` elements in fp32
        or the weight's dtype, ``scale`` None or fp32, one value per output (a 1-d tensor of
        ``out`` elements, contiguous or a broadcast scalar) or one for all (0-d), applied to
        the sums before the bias; none of them needs a gradient. None means: no kernel for this
        call (not yet, or not at all), take another path.
        """
        library = self._libraries.get(weight.dtype)
        fn = library.fn if library is not None else None
        if fn is None:
            if library is None:
                self.start(weight.dtype)
            elif library.done.is_set():
                self._tell()
            return None
        if self.failed and self._key(x, weight, transposed) in self.failed:
            return None
        try:
            return self._run(fn, x, weight, bias, transposed, scale, (self.generic, self.ahead))
        except ValueError as exc:  # remembered for this shape only
            with self._lock:
                self.failed.add(self._key(x, weight, transposed))
            warnings.warn(
                f"torchsurgery.offload: the native kernel failed for a {weight.dtype} weight of shape "
                f"{list(weight.shape)} and an input of shape {list(x.shape)} ({exc}); "
                "that shape takes another path",
                stacklevel=3,
            )
            return None

    @staticmethod
    def _run(
        fn: Callable[..., int], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
        scale: torch.Tensor | None, tuning: tuple[bool, int],
    ) -> torch.Tensor:
        """The call itself, after the checks the library leaves to its caller (ValueError)."""
        if not (x.is_cpu and weight.is_cpu):
            raise ValueError("CPU tensors only")
        if x.dtype != torch.float32 or x.dim() < 1 or not x.is_contiguous():
            raise ValueError("x must be a contiguous float32 tensor")
        shape = weight.shape
        if len(shape) != 2 or not weight.is_contiguous():
            raise ValueError("the weight must be contiguous and 2-d")
        inp, out = (shape[0], shape[1]) if transposed else (shape[1], shape[0])
        leading = x.shape[:-1]
        if x.shape[-1] != inp:
            raise ValueError(f"x has {x.shape[-1]} columns, the weight takes {inp}")
        narrow_bias = 0
        if bias is not None:
            if not (bias.dtype in (torch.float32, weight.dtype) and bias.is_cpu and bias.is_contiguous() and bias.numel() == out):
                raise ValueError(
                    f"the bias must be a contiguous CPU tensor of {out} elements, in float32 or the weight's dtype"
                )
            narrow_bias = int(bias.dtype != torch.float32)
        scale_step = _scale_step(scale, out)
        generic, ahead = tuning
        y = torch.empty((*leading, out))
        code = fn(
            x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), narrow_bias,
            None if scale is None else scale.data_ptr(), scale_step, y.data_ptr(),
            x.numel() // inp if inp else 0, inp, out, _KINDS[weight.dtype], transposed, torch.get_num_threads(),
            int(generic), ahead,
        )
        if code != 0:
            raise ValueError(_ERRORS.get(code, f"error {code}"))
        return y


def _scale_step(scale: torch.Tensor | None, out: int) -> int:
    """How far apart the scales of consecutive outputs lie (0: one for all), after the checks (ValueError)."""
    if scale is None:
        return 0
    if scale.dtype != torch.float32 or not scale.is_cpu:
        raise ValueError("the scale must be a float32 CPU tensor")
    if scale.dim() == 0 or (scale.dim() == 1 and scale.numel() == out and scale.stride(0) == 0):
        return 0
    if scale.dim() == 1 and scale.numel() == out and (scale.stride(0) == 1 or out == 1):
        return 1
    raise ValueError(f"the scale must hold one value or one per output ({out}), contiguous or broadcast")


narrow_matvec = _NarrowMatvec()


def kernel_at(path: str) -> Callable[..., torch.Tensor] | None:
    """The kernel of the library at ``path``, as a function, or None where none loads from there.

    For a library built for another CPU (:func:`torchsurgery.compact.native_build.build` with
    ``arch=``): the tests run such builds on this host, and ``benchmarks/narrow_kernel.py``
    measures them. The function takes ``(x, weight, bias, transposed, scale)`` as
    :data:`narrow_matvec` does, and raises ValueError for operands the kernel does not take.

    Example:
        >>> from torchsurgery.compact.narrow_matvec import kernel_at
        >>> kernel_at("/nonexistent/library.so") is None
        True
    """
    fn = _load(path)
    if fn is None:
        return None
    loaded = fn

    def call(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return _NarrowMatvec._run(loaded, x, weight, bias, transposed, scale, (False, narrow_matvec.ahead))

    return call
