#!/usr/bin/env bash
# The accelerator checks on a machine with a GPU, as one command (about 5 minutes on an H100/H200):
#   1. the test suite's accelerator tests (`pytest -m accelerator`), on the GPU instead of tardy;
#   2. benchmarks/offload_cuda.py: streaming against the link floor and the peers;
#   3. benchmarks/generate_cuda.py: generate() and a 128-token forward under a quarter-model
#      budget against the link floor, tokens against the resident model;
#   4. benchmarks/scaled_cuda.py: every storage format (bf16, fp8 unscaled, fp8 and int8 with
#      scales) streamed under a quarter budget: link bytes, time, logits against the resident model.
# Then a summary. Logs go to $OUT (or out/gpu_check). Packages the machine lacks (diffusers,
# for the tests that use it) install from wheels in .whl/ when it is there; without them
# those tests skip.
#
# Run: scripts/gpu_check.sh     (PYTHON=... to choose the interpreter; default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-out/gpu_check}
mkdir -p "$LOGS"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no GPU here'; print('GPU:', torch.cuda.get_device_name(), '| torch', torch.__version__)" \
    || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$LOGS/gpu.txt"

status=0
timeout 200 "$PY" -m pytest -q -p no:cacheprovider -m accelerator --timeout=120 tests 2>&1 \
    | tee "$LOGS/accelerator_tests.txt" | tail -25
tests=${PIPESTATUS[0]}
[ "$tests" -eq 0 ] || status=1

timeout 100 "$PY" benchmarks/offload_cuda.py --blocks 8 --d 4096 --tokens 512 --repeats 3 2>&1 | tee "$LOGS/offload_cuda.txt"
bench=${PIPESTATUS[0]}
[ "$bench" -eq 0 ] || status=1

timeout 120 "$PY" benchmarks/generate_cuda.py --layers 16 --hidden 2048 --tokens 32 --repeats 3 2>&1 \
    | grep -v '^\[transformers\]' | tee "$LOGS/generate_cuda.txt"
generate=${PIPESTATUS[0]}
[ "$generate" -eq 0 ] || status=1

timeout 150 "$PY" benchmarks/scaled_cuda.py --layers 16 --hidden 2048 --repeats 3 2>&1 \
    | grep -v '^\[transformers\]' | tee "$LOGS/scaled_cuda.txt"
scaled=${PIPESTATUS[0]}
[ "$scaled" -eq 0 ] || status=1

echo
echo "=== summary ($(date -u +%FT%TZ)) ==="
echo "accelerator tests: exit $tests; $(grep -E '(passed|failed)' "$LOGS/accelerator_tests.txt" | tail -1)"
echo "offload_cuda.py: exit $bench"
grep -E '^(floor|torchsurgery|diffusers|accelerate|access)' "$LOGS/offload_cuda.txt" || true
echo "generate_cuda.py: exit $generate"
grep -E '^summary' "$LOGS/generate_cuda.txt" || true
echo "scaled_cuda.py: exit $scaled"
grep -E -A6 '^format' "$LOGS/scaled_cuda.txt" || true
exit $status
