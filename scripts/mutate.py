"""Mutation check: take out what makes a feature work, one line at a time, and see a named test fail.

Each mutation replaces one exact piece of source (it must occur exactly once) and names the
tests that must then fail. For each, the script edits the file in the working tree, runs
those tests, and puts the file back (also on Ctrl-C). It prints one row per mutation and
exits 1 if any mutation survives (its tests still pass) or no longer applies (the source
moved: update the mutation).

The mutations named "sync: ..." take out the synchronisation points of streaming to an
accelerator (each wait, record and synchronize, the temporary and staging buffers, copies
from pageable memory); their tests run on the suite's test device (tests/tardy) where no
GPU is present. docs/hardware.md has the table (``--only sync:``).

Run: .venv/bin/python scripts/mutate.py [--only SUBSTRING] [--list]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from mutations import MUTATIONS, Mutation

ROOT = Path(__file__).resolve().parents[1]


def run(mutation: Mutation) -> tuple[str, float]:
    """Apply, test, restore: 'caught', 'SURVIVED' or 'STALE' (the source no longer matches)."""
    path = ROOT / mutation.path
    source = path.read_text(encoding="utf-8")
    if source.count(mutation.old) != 1:
        return "STALE", 0.0
    start = time.perf_counter()
    try:
        path.write_text(source.replace(mutation.old, mutation.new), encoding="utf-8")
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests],
            cwd=ROOT, capture_output=True, text=True,
        )
    finally:
        path.write_text(source, encoding="utf-8")
    return ("caught" if done.returncode != 0 else "SURVIVED"), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="run the mutations whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.only in m.name]
    failed = False
    for m in chosen:
        if args.list:
            print(f"{m.name}: {m.path} -> {', '.join(m.tests)}")
            continue
        verdict, seconds = run(m)
        failed |= verdict != "caught"
        print(f"{verdict:9} {seconds:6.1f}s  {m.name}  ({m.path}; {', '.join(t.rsplit('::', 1)[-1] for t in m.tests)})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
