"""Building the native narrow-weight kernel: at install time, or at first use in the background.

This module needs nothing but the standard library: ``setup.py`` loads it by its path to
build the kernel while pip installs torchsurgery from source, before torch can be imported,
and :mod:`torchsurgery.compact.narrow_matvec` uses it to find a library or build one.

A library is compiled for the machine it runs on (``-march=native``), one per weight dtype.
Its file name is a digest of everything the build depends on: the source, the flags, the
compiler and this machine's CPU features. A library built elsewhere (a wheel made on another
machine, a home directory shared between machines) has another name and is never loaded
here, so no instruction this CPU lacks can run.

Where libraries are looked for, in order:

* in ``_kernels/`` next to the package's modules, where the install put them
  (:func:`build_all`, called by ``setup.py``: a regular or an editable install from
  source, with a C++ compiler; a folder that is not a package, so nothing takes the
  libraries for Python modules);
* ``torchsurgery/`` under torch's extensions directory (``TORCH_EXTENSIONS_DIR``, by default
  ``~/.cache/torch_extensions``), where the build at first use writes them.

Example:
    >>> from torchsurgery.compact import native_build
    >>> name = native_build.library_name(native_build.KINDS["bfloat16"])
    >>> name.startswith("narrow_matvec_0_") and name.endswith(".so")
    True
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

__all__ = ["KINDS", "build", "build_all", "cache_dir", "installed_dir", "last_line", "library_name", "no_compiler",
           "source_path"]

KINDS = {"bfloat16": 0, "float16": 1, "float8_e4m3fn": 2, "float8_e5m2": 3, "int8": 4}
"""The weight dtypes the kernel reads, by torch's name, and the source's ``enum Kind`` for each."""

BUILD_TIMEOUT_S = 480.0  # a build still running after this is given up on
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "narrow_matvec.cpp")


def source_path() -> str:
    """The kernel's C++ source, shipped next to this module."""
    return _SOURCE


def _cpu_features() -> str:
    """This machine's instruction set, as the build targets it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _flags() -> list[str]:
    """Compiler flags: this machine's vector units, and OpenMP on Linux (the ``libgomp`` that
    torch has loaded already answers to the same name); elsewhere the kernel runs on one thread."""
    machine = platform.machine().lower()
    arch = ["-march=native"] if machine in ("x86_64", "amd64") else ["-mcpu=native"] if machine in ("aarch64", "arm64") else []
    openmp = ["-fopenmp"] if platform.system() == "Linux" else []
    return ["-O3", "-fno-math-errno", "-shared", "-fPIC", *arch, *openmp]


def _flags_for(arch: str | None) -> list[str]:
    """:func:`_flags`, for ``-march=arch`` where ``arch`` is given."""
    if arch is None:
        return _flags()
    return [flag for flag in _flags() if not flag.startswith(("-march", "-mcpu"))] + [f"-march={arch}"]


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def library_name(kind: int, arch: str | None = None) -> str:
    """The file name of the library for ``kind``: a digest of its source, flags, compiler and machine.

    Args:
        kind: the weight dtype's entry in :data:`KINDS`.
        arch: the ``-march`` of a build for another CPU (see :func:`build`), part of the digest;
            None: this machine's own build.

    Raises:
        OSError: the source is missing from the install.
    """
    with open(source_path(), encoding="utf-8") as f:
        source = f.read()
    parts = [source, *_flags_for(arch), _compiler(), _cpu_features(), str(kind)]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return f"narrow_matvec_{kind}_{digest}.so"


def installed_dir(package_dir: str | None = None) -> str:
    """Where the install-time build puts the libraries: ``_kernels/`` in the package's folder
    (``package_dir``, by default this module's folder)."""
    return os.path.join(package_dir or os.path.dirname(source_path()), "_kernels")


def cache_dir() -> str:
    """Where builds at first use are kept: ``torchsurgery/`` under torch's extensions directory."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    return os.path.join(root, "torchsurgery")


def no_compiler() -> str | None:
    """Why no build can run here (no C++ compiler), or None."""
    if shutil.which(_compiler()) is None:
        return f"no C++ compiler {_compiler()!r} found (install g++ or clang++, or set CXX)"
    return None


def last_line(text: str) -> str:
    """The last non-blank line of a compiler's (or an exception's) text: what went wrong, in one line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def build(kind: int, path: str, *, yielding: bool = True, arch: str | None = None) -> str | None:
    """Compile the library for ``kind`` into ``path``; why not, or None once it is there.

    The library is written under a temporary name in ``path``'s directory and renamed into
    place, so a build killed half-way leaves nothing that is loaded, and builds need no lock.

    Args:
        kind: the weight dtype's entry in :data:`KINDS`.
        path: the library's path, named by :func:`library_name` (or, with ``arch``, by the
            caller: such a library is for another CPU, and never loaded as this machine's).
        yielding: run the compiler at the lowest priority (a build at first use: the
            forwards running meanwhile come first).
        arch: build for this ``-march`` in place of this machine's own, for example
            ``"haswell"`` (an AVX2 host without AVX-512, as AMD's before Zen 4) or
            ``"x86-64"`` (the baseline): how the tests and ``benchmarks/narrow_kernel.py``
            run those builds on a host that has their instructions too.
    """
    why = no_compiler()
    if why is not None:
        return why
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, temporary = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path) or ".")
    os.close(fd)
    nice = ["nice", "-n", "19"] if yielding and shutil.which("nice") else []
    try:
        done = subprocess.run(
            [*nice, _compiler(), *_flags_for(arch), f"-DTS_KIND={kind}", source_path(), "-o", temporary],
            capture_output=True, text=True, check=False, timeout=BUILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            return f"the build failed: {last_line(done.stderr or done.stdout)}"
        os.replace(temporary, path)
        return None
    except subprocess.TimeoutExpired:
        return f"the build did not finish in {BUILD_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return f"the build could not run: {exc}"
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def build_all(directory: str, kinds: list[int] | None = None) -> dict[int, str | None]:
    """Build the library of every kind (or of ``kinds``) into ``directory``, in parallel.

    This is the install-time build: ``setup.py`` calls it with :func:`installed_dir`. Libraries
    left in ``directory`` by an earlier source or machine are removed.

    Returns:
        For each kind, why its library was not built, or None where it was.
    """
    todo = sorted(KINDS.values()) if kinds is None else kinds
    keep = {library_name(kind) for kind in KINDS.values()}
    if os.path.isdir(directory):  # libraries of an earlier source or machine: never loaded again
        for stale in os.listdir(directory):
            if stale.startswith("narrow_matvec_") and stale.endswith(".so") and stale not in keep:
                os.remove(os.path.join(directory, stale))
    workers = max(1, min(len(todo), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = pool.map(lambda kind: build(kind, os.path.join(directory, library_name(kind)), yielding=False), todo)
        return dict(zip(todo, results, strict=True))
