#!/usr/bin/env bash
# One-command GPU suite, within 10 minutes on one GPU machine that has its own torch, triton and
# transformers and no network:
#   1. pip install --no-deps --no-build-isolation -e .   (never resolves dependencies over its torch)
#   2. random-weight checkpoints at the real shapes of large-v3, tiny, distil-large-v3
#   3. python -m pytest -m cuda   (junit xml into OUT_DIR)
#   4. python bench/gpu.py        (gpu.json, gpu.md, gpu.png into OUT_DIR); its end-to-end section
#      runs the engine as users get it on a GPU: draft and verify steps captured as CUDA graphs per
#      (batch bucket, k), plus a target-only row with cuda_graphs=False (what the graphs buy)
# and OUT_DIR/summary.md (stages, test counts, the benchmark tables). Every stage is time-boxed;
# one failing stage does not stop the next. Exit status: 0 only if every stage passed.
#
#   bash bench/gpu_suite.sh OUT_DIR            # on the GPU machine
#   GPU_SUITE_PROFILE=1 bash bench/gpu_suite.sh OUT_DIR   # ... with bench/gpu_profile.py too
#   bash bench/gpu_suite.sh OUT_DIR --quick    # CPU smoke run (no install, toy sizes): what CI runs
set -uo pipefail
OUT=${1:?usage: bash bench/gpu_suite.sh OUT_DIR [--quick]}
QUICK=${2:-}
cd "$(dirname "$0")/.."
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
TOTAL=${GPU_SUITE_SECONDS:-570}   # leaves a margin inside 10 minutes
start=$(date +%s)
: > "$OUT/stages.tsv"

left() { echo $(( TOTAL - ($(date +%s) - start) )); }

# stage NAME CAP_SECONDS CMD...: run CMD with timeout min(CAP, time left), log to OUT/NAME.log
stage() {
  local name=$1 cap=$2; shift 2
  local limit; limit=$(left); [ "$limit" -gt "$cap" ] && limit=$cap
  if [ "$limit" -le 5 ]; then
    printf '%s\tskipped\t0\tno time left\n' "$name" >> "$OUT/stages.tsv"; return 0
  fi
  local t0; t0=$(date +%s)
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local status=passed; [ $rc -ne 0 ] && status=failed; [ $rc -eq 124 ] && status="timed out"
  printf '%s\t%s\t%s\texit %s\n' "$name" "$status" "$(( $(date +%s) - t0 ))" "$rc" >> "$OUT/stages.tsv"
  tail -n 3 "$OUT/$name.log"
}

# what marks a CUDA test in a test file: pytest.mark.cuda, or triton_interp.on_cuda, which applies it
CUDA_TESTS='mark\.cuda|@on_cuda'
if [ "$QUICK" = "--quick" ]; then
  DEVICE=cpu; BENCH_FLAGS=(--device cpu --quick); MODEL_FLAGS=(--device cpu --dtype float32 --quick)
  TESTS=(tests/test_graphs.py tests/test_gpu.py tests/test_kernels.py)
  export SPECWHISPER_NO_EXT=${SPECWHISPER_NO_EXT:-1}   # no C++ build in a smoke run
else
  DEVICE=cuda; BENCH_FLAGS=(--device cuda); MODEL_FLAGS=(--device cuda --dtype float16)
  mapfile -t TESTS < <(grep -lE "$CUDA_TESTS" tests/test_*.py)   # only files with cuda tests: no collection of the rest
  { nvidia-smi || true; } > "$OUT/nvidia-smi.txt" 2>&1
  stage install 90 "$PY" -m pip install --no-deps --no-build-isolation -e .
fi

stage models 120 "$PY" bench/gpu_models.py "$OUT/models" "${MODEL_FLAGS[@]}"
# GPU_SUITE_PYTEST_ARGS: e.g. "-n 8 --timeout 120" (pytest-xdist / pytest-timeout, where installed)
stage pytest 240 "$PY" -m pytest -m cuda ${GPU_SUITE_PYTEST_ARGS:-} -v -p no:cacheprovider --continue-on-collection-errors --junitxml "$OUT/junit-cuda.xml" "${TESTS[@]}"
# GPU_SUITE_PROFILE=1: also bench/gpu_profile.py (fused linears, attention kernels, race kernels;
# no torch.compile) into OUT_DIR/profile.json, before the benchmark
if [ "${GPU_SUITE_PROFILE:-0}" = "1" ] && [ "$QUICK" != "--quick" ]; then
  stage profile 150 "$PY" bench/gpu_profile.py --models "$OUT/models" --out "$OUT" --no-compile
fi
# the benchmark skips its later sections when its own budget runs out, so it ends before the timeout
bench_left=$(( $(left) - 10 ))
stage bench "$bench_left" "$PY" bench/gpu.py --out "$OUT" --models "$OUT/models" \
  --budget $(( bench_left > 40 ? bench_left - 30 : 10 )) "${BENCH_FLAGS[@]}"

"$PY" - "$OUT" "$DEVICE" "$(( $(date +%s) - start ))" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, device, seconds = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
lines = [f"# GPU suite ({device}), {seconds} s", "", "| stage | status | seconds | detail |", "|---|---|---|---|"]
for row in (out / "stages.tsv").read_text().splitlines():
    lines.append("| " + " | ".join(row.split("\t")) + " |")
junit = out / "junit-cuda.xml"
if junit.is_file():
    suites = ET.parse(junit).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    lines += ["", f"pytest -m cuda: {n['tests']} tests, {n['failures']} failed, {n['errors']} errors, "
              f"{n['skipped']} skipped"]
    for case in suite.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            lines.append(f"- FAILED {case.get('classname')}::{case.get('name')}: {(bad.get('message') or '')[:300]}")
smi = out / "nvidia-smi.txt"
if smi.is_file():
    lines += ["", "```", smi.read_text()[:1500], "```"]
report = out / "gpu.md"
lines += ["", report.read_text() if report.is_file() else "(no benchmark report: see bench.log)"]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines[:12]))
EOF

! grep -qv "	passed	" "$OUT/stages.tsv"
