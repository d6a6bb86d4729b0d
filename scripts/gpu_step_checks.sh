#!/usr/bin/env bash
# The GPU step's checks on one CUDA GPU, in priority order, each under its own timeout, results in
# $OUT (default ./gpu_step_checks) as they come (docs/training_step.md, docs/bench_step.md):
#   1. tests/gpu/test_gpu_step.py: fused loss == chunked loss, compiled regions == eager, one
#      compilation per bucket in under a minute;
#   2. benchmarks.gpu --profile, gptoss120b and llama3_1_8b EAGLE-3: the default step (packed rows,
#      flex, fused loss, compiled layers) at the default length distribution, then the step the
#      first H200 measurement was of (sdpa, chunked loss, eager layers, unpacked);
#   3. draftsmith bench step's estimates of the same steps, to set beside them.
set -uo pipefail
OUT=${OUT:-gpu_step_checks}
mkdir -p "$OUT"
PY=${PYTHON:-python}
AS_MEASURED=(--set train.fused_loss=false --set train.compile=false --set train.packing=false)
timeout 420 $PY -m pytest -q -m gpu tests/gpu/test_gpu_step.py >"$OUT/1_gpu_step_tests.txt" 2>&1
echo "tests rc=$?" >>"$OUT/1_gpu_step_tests.txt"
timeout 600 $PY -m benchmarks.gpu --recipes gptoss120b llama3_1_8b --backends flex --steps 5 --warmup 3 \
    --no-capture --no-fake --profile --out "$OUT/2_default_step.json" >"$OUT/2_default_step.txt" 2>&1
timeout 600 $PY -m benchmarks.gpu --recipes gptoss120b llama3_1_8b --backends sdpa flex --steps 5 --warmup 3 \
    --no-capture --no-fake --profile "${AS_MEASURED[@]}" --out "$OUT/3_as_measured.json" >"$OUT/3_as_measured.txt" 2>&1
for r in gptoss120b llama3_1_8b; do
    timeout 120 $PY -m benchmarks.step "recipes/$r.yaml" --json >>"$OUT/4_bench_step.jsonl" 2>/dev/null
done
