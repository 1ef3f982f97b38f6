#!/usr/bin/env bash
# Run the distributed tests that `make test` runs (not those marked slow) RUNS times in a
# row next to BUSY busy-looping processes, stopping at the first failure (its full log is
# printed).
#
#   scripts/stress_distributed.sh [RUNS] [BUSY]      defaults: 20 runs, 2 busy processes
#
# Run from the repository root; PYTHON overrides the interpreter (default .venv/bin/python).
set -u
runs=${1:-20}
busy=${2:-2}
python=${PYTHON:-.venv/bin/python}

pids=()
for _ in $(seq "$busy"); do
    ( while :; do :; done ) &
    pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
trap 'exit 130' INT TERM

echo "$(nproc) cores, load before: $(cut -d' ' -f1-3 /proc/loadavg), $busy busy processes"
log=$(mktemp)
for i in $(seq "$runs"); do
    start=$SECONDS
    if PYTHONPATH=src "$python" -m pytest -q -p no:cacheprovider --timeout=600 -m "not slow" tests/flex/parallel >"$log" 2>&1; then
        echo "run $i/$runs: $(tail -n 1 "$log") (wall $((SECONDS - start)) s, load $(cut -d' ' -f1 /proc/loadavg))"
    else
        echo "run $i/$runs: FAILED"
        cat "$log"
        rm -f "$log"
        exit 1
    fi
done
rm -f "$log"
echo "$runs/$runs runs passed in a row with $busy busy processes"
