"""Builds the native narrow-weight kernel while pip installs torchsurgery from source.

Everything else about the package is in ``pyproject.toml``. The kernel is compiled here for
the machine that installs it (see ``src/torchsurgery/compact/native_build.py``), so the
first forward after ``offload`` has it; a machine without a C++ compiler still installs, is
told so, and builds the kernel at first use or runs without it.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = "torchsurgery.compact"


def _native_build():  # type: ignore[no-untyped-def]
    """``torchsurgery.compact.native_build``, loaded by its path: the package imports torch."""
    path = os.path.join(_HERE, "src", "torchsurgery", "compact", "native_build.py")
    spec = importlib.util.spec_from_file_location("_torchsurgery_native_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildNarrowKernels(build_ext):
    """One library per weight dtype, named for this machine, put next to the package's modules."""

    def run(self) -> None:
        native = _native_build()
        if self.inplace:  # an editable install: into the source tree, which is what gets imported
            package = self.get_finalized_command("build_py").get_package_dir(_PACKAGE)
        else:
            package = os.path.join(self.build_lib, *_PACKAGE.split("."))
        directory = native.installed_dir(package)
        self._built: list[str] = []
        failed: dict[str, list[int]] = {}
        for kind, why in native.build_all(directory).items():
            if why is None:
                self._built.append(os.path.join(directory, native.library_name(kind)))
            else:
                failed.setdefault(why, []).append(kind)
        for why, kinds in failed.items():  # one line, however many dtypes it stopped
            names = ", ".join(name for name, kind in native.KINDS.items() if kind in kinds)
            print(
                f"torchsurgery: the native narrow-weight kernel ({names}) was not built at install time "
                f"({why}); it is built at first use where a compiler is found",
                file=sys.stderr,
            )

    def get_outputs(self) -> list[str]:
        return list(getattr(self, "_built", []))

    def get_output_mapping(self) -> dict[str, str]:
        return {}


setup(
    # A placeholder the build above replaces: it makes the wheel this machine's, and runs build_ext.
    ext_modules=[Extension(f"{_PACKAGE}._narrow_matvec", sources=[], optional=True)],
    cmdclass={"build_ext": BuildNarrowKernels},
)
