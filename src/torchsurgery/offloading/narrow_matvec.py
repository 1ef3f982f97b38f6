"""A native CPU kernel for few-row matmuls against a weight stored narrower than fp32.

``y = x @ W.T + b`` (or ``x @ W + b`` for a weight stored ``[in, out]``) with ``x`` of 1 to
8 rows in fp32 and ``W`` in bf16, fp16 or fp8 (e4m3fn, e5m2): each weight element is
widened in registers and accumulated in fp32, so a step reads the narrow bytes once and
writes nothing weight-sized. torch's CPU matmuls take only one dtype, so this is the
one way to read a narrow weight at memory speed without a compiled graph per shape.

The source is ``narrow_matvec.cpp``, next to this module. It is compiled for this machine's
instruction set with the C++ compiler torch's extensions use and cached by torch in its
extensions directory (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``):
one build per machine and source, shared by every process after it.

No call waits for the build. The first call (or :meth:`_NarrowMatvec.start`, which
``offload`` calls when it stores weights narrow) starts it in the background, in a child
process at a lower priority, so that it takes little from the forwards running meanwhile;
until it is done every call answers None and the caller takes its fallback (a cast through
a cache-sized buffer, see :mod:`torchsurgery.offloading.narrow`). A cached build loads in
well under a second. Where no compiler is found or the build fails, one warning says so
and every call answers None; a call that fails for one (layout, rows, dtype, shape) is
remembered and answered None from then on, the other shapes keep the kernel.

Why a background build rather than one at install time: the kernel is compiled against the
torch that is installed and for the machine it runs on (``-march=native``); an install-time
build would tie the package to one torch build and one instruction set, and pip would need
torch inside its isolated build environment (several GB of wheels where a CUDA build is the
default).

Layouts, both read as contiguous streams:

* weight ``[out, in]`` (``nn.Linear``): one output after the other, each a pass over its
  weight row with 16 accumulator chains in all;
* weight ``[in, out]`` (transformers' ``Conv1D``): ``y[r, :] += x[r, i] * W[i, :]`` over
  the weight's rows, the partial sums of a block of columns kept in the first-level cache.

Threads: the output columns are split by ``at::parallel_for`` (torch's thread count);
concurrent calls from several Python threads share nothing but the read-only weight.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

NATIVE_MAX_ROWS = 8
NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)



def _cpu_features() -> str:
    """What the build targets: the build is for this machine's instruction set."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _flags() -> list[str]:
    """Compiler flags: this machine's vector units, and OpenMP on Linux, where torch's
    ``at::parallel_for`` is OpenMP inlined into the extension (the library is the one
    torch has loaded already); elsewhere the kernel runs on one thread."""
    machine = platform.machine().lower()
    arch = ["-march=native"] if machine in ("x86_64", "amd64") else ["-mcpu=native"] if machine in ("aarch64", "arm64") else []
    openmp = ["-fopenmp"] if platform.system() == "Linux" else []
    return ["-O3", "-fno-math-errno", *arch, *openmp]


_Key = tuple[bool, int, torch.dtype, tuple[int, ...]]

# Run in a child process: build (or find cached) the extension described by argv[1].
# Run in a child process at a lower priority (inherited by the compiler it runs), so that
# the forwards running meanwhile keep the cores: build, or find cached, the extension. A
# build killed outright leaves torch's lock file behind, on which every later build would
# wait forever; one older than any build takes is removed first.
_CHILD = (
    "import json, os, sys, time\n"
    "if hasattr(os, 'nice'): os.nice(10)\n"
    "from torch.utils.cpp_extension import load\n"
    "spec, lock = json.loads(sys.argv[1]), sys.argv[2]\n"
    "if lock and os.path.exists(lock) and time.time() - os.path.getmtime(lock) > float(sys.argv[3]):\n"
    "    os.remove(lock)\n"
    "load(**spec)\n"
)
_STALE_LOCK_S = 300.0  # a lock file older than this is left by a build that was killed
_BUILD_TIMEOUT_S = 480.0  # a build still running after this is given up on


def _source_path() -> str:
    return str(importlib.resources.files("torchsurgery.offloading").joinpath("narrow_matvec.cpp"))


def _spec() -> dict[str, Any]:
    """``torch.utils.cpp_extension.load``'s arguments for this machine, source and torch."""
    path = _source_path()
    with open(path, encoding="utf-8") as f:
        source = f.read()
    flags = _flags()
    digest = hashlib.sha256("\0".join([source, *flags, _cpu_features(), torch.__version__]).encode()).hexdigest()[:16]
    name = f"torchsurgery_narrow_{digest}"
    return {
        "name": name, "sources": [path], "extra_cflags": [*flags, f"-DTS_NAMESPACE={name}"],
        "extra_ldflags": [f for f in flags if f == "-fopenmp"], "is_python_module": False,
    }


def _no_compiler() -> str | None:
    """Why no build can run here (no C++ compiler, no ninja), or None."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler {compiler!r} found (install g++ or clang++, or set CXX)"
    try:
        import ninja  # noqa: F401  (torch's extension builder runs it)
    except ImportError:
        if shutil.which("ninja") is None:
            return "ninja is not installed (pip install ninja)"
    return None


def _built_library(name: str) -> tuple[str, str] | None:
    """Where torch's extensions directory keeps ``name``: (the library, the build lock), or None."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        directory = _get_build_directory(name, False)
    except Exception:  # another torch: the child finds the cache itself, load() then loads it
        return None
    return os.path.join(directory, f"{name}.so"), os.path.join(directory, "lock")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


class _NarrowMatvec:
    """The kernel, built in the background; per-(layout, rows, dtype, shape) failures remembered.

    Example:
        >>> import torch
        >>> from torchsurgery.offloading.narrow_matvec import narrow_matvec
        >>> narrow_matvec.start()  # returns at once; calls answer None until the kernel is ready
        >>> if narrow_matvec.wait():
        ...     w = torch.eye(2, dtype=torch.bfloat16)
        ...     print(narrow_matvec(torch.ones(1, 2), w, None, False).tolist())
        ... else:
        ...     print([[1.0, 1.0]])
        [[1.0, 1.0]]
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._op: Callable[..., torch.Tensor] | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False
        self.unavailable: str | None = None  # why the kernel could not be built
        self.failed: set[_Key] = set()

    @property
    def pending(self) -> bool:
        """True while a build runs (calls answer None, but the kernel may come)."""
        return self._thread is not None and not self._done.is_set()

    def start(self) -> None:
        """Load the cached build now, or start building in the background; once, returns at once.

        A cached build is loaded in the calling thread (a fraction of a second, spent by
        ``offload`` rather than by the first forward, which a load in the background would
        hold up while it registers the kernel).
        """
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._build, name="torchsurgery-narrow-kernel", daemon=True)
            if self._load_cached():
                self._done.set()
                return
            self._thread.start()

    def _load_cached(self) -> bool:
        """Load the build from torch's extensions directory if it is there; whether it was."""
        try:
            spec = _spec()
            paths = _built_library(spec["name"])
            if paths is None or not os.path.exists(paths[0]):
                return False
            torch.ops.load_library(paths[0])
            self._op = getattr(torch.ops, spec["name"]).matvec
            return True
        except Exception:  # a damaged cache: the background build says what is wrong
            return False

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the build (starting it if needed); whether the kernel is available.

        Args:
            timeout: seconds to wait at most; None waits for the build to end.
        """
        self.start()
        self._done.wait(timeout)
        self._tell()
        return self._op is not None

    def _build(self) -> None:
        try:
            why = _no_compiler()
            spec = _spec() if why is None else None
            if spec is not None:
                # the compiler runs in a child; this process then loads what it left in the
                # cache (or finds it there already)
                paths = _built_library(spec["name"])
                if paths is None or not os.path.exists(paths[0]):
                    child = subprocess.run(
                        [sys.executable, "-c", _CHILD, json.dumps(spec), paths[1] if paths else "", str(_STALE_LOCK_S)],
                        capture_output=True, text=True, check=False, timeout=_BUILD_TIMEOUT_S,
                    )
                    if child.returncode != 0:
                        why = f"the build failed: {_last_line(child.stderr or child.stdout)}"
                if why is None and not self._load_cached():  # no build lock taken in this process
                    from torch.utils.cpp_extension import load

                    load(**spec)  # another torch, whose cache we cannot find: it loads what it built
                    self._op = getattr(torch.ops, spec["name"]).matvec
        except subprocess.TimeoutExpired:
            why = f"the build did not finish in {_BUILD_TIMEOUT_S:.0f} s"
        except Exception as exc:  # anything else: the callers take another path
            why = f"{type(exc).__name__}: {_last_line(str(exc))}"
        if self._op is None:
            self.unavailable = (why or "unknown")[:300]
        self._done.set()

    def _tell(self) -> None:
        """The one warning that the kernel is unavailable, in the caller's thread."""
        if self.unavailable is None or self._warned:
            return
        with self._lock:
            if self._warned:
                return
            self._warned = True
        warnings.warn(
            f"torchsurgery.offload: the native narrow-weight CPU kernel could not be built "
            f"({self.unavailable}); narrow weights take the compiled or the cast path",
            stacklevel=4,
        )

    @staticmethod
    def _key(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> _Key:
        return (transposed, x.numel() // max(1, x.shape[-1]), weight.dtype, tuple(weight.shape))

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool
    ) -> torch.Tensor | None:
        """``x @ weight.T + bias`` (``x @ weight + bias`` when ``transposed``) in fp32, or None.

        ``x`` is a contiguous fp32 ``[..., in]`` tensor of 1 to :data:`NATIVE_MAX_ROWS` rows
        (the leading dimensions together), the result ``[..., out]``; ``weight`` a contiguous
        2-d tensor of one of :data:`NATIVE_DTYPES`, ``bias`` None or ``out`` elements in fp32
        or the weight's dtype; none of them needs a gradient. None means: no kernel for this
        call (not yet, or not at all), take another path.
        """
        op = self._op
        if op is None:
            if self._thread is None:
                self.start()
            elif self._done.is_set():
                self._tell()
            return None
        if self.failed and self._key(x, weight, transposed) in self.failed:
            return None
        try:
            result: torch.Tensor = op(x, weight, bias, transposed)
            return result
        except Exception as exc:  # remembered for this shape only
            with self._lock:
                self.failed.add(self._key(x, weight, transposed))
            warnings.warn(
                f"torchsurgery.offload: the native kernel failed for a {weight.dtype} weight of shape "
                f"{list(weight.shape)} and an input of shape {list(x.shape)} ({type(exc).__name__}: {exc}); "
                "that shape takes another path",
                stacklevel=3,
            )
            return None


narrow_matvec = _NarrowMatvec()
