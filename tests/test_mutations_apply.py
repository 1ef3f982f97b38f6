"""scripts/mutate.py (its mutations in scripts/mutations/) stays runnable: every mutation still finds the one line it takes out.

The mutation check itself runs the named tests and takes minutes, so it is not part of the
suite; but a line that moved would leave its feature unguarded without anyone noticing, so
the suite checks that each mutation's source occurs exactly once and its tests exist.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutations() -> list:  # type: ignore[type-arg]
    # as scripts/mutate.py finds them, run as a script (its folder first on the path)
    scripts = str(ROOT / "scripts")
    sys.path.insert(0, scripts)
    try:
        spec = importlib.util.spec_from_file_location("_mutate", ROOT / "scripts" / "mutate.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(scripts)
    return list(module.MUTATIONS)


@pytest.mark.parametrize("mutation", _mutations(), ids=lambda m: m.name[:60])
def test_each_mutation_applies_and_names_tests_that_exist(mutation) -> None:  # type: ignore[no-untyped-def]
    source = (ROOT / mutation.path).read_text()
    assert source.count(mutation.old) == 1, f"{mutation.name}: its line moved; update scripts/mutations/"
    for test in mutation.tests:
        path, _, name = test.partition("::")
        assert f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), f"{mutation.name}: no test {test}"
