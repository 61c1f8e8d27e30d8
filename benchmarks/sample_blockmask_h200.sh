#!/usr/bin/env bash
# On the H200, in one call (results to $OUT as each part ends; a part past its cap is stopped, the rest runs):
#   1. the CUDA block-mask tests (every sampler shape compiled without an eager fallback) and packed sampling
#      on CUDA (no recompiles across lengths, packed == alone): pytest -m gpu, junit XML;
#   2. benchmarks/blockmask_build.py -> blockmask_build_h200.json (worst case per variant);
#   3. benchmarks/sample.py, the short set, then the reference set -> sample_h200.json.
# Needs no carried wheel (Triton FlexAttention).  SAMPLE_BUDGET (default 560 s) bounds the whole; PARTS picks
# parts (default "pytest blockmask sample-short sample-ref").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/sample_blockmask}; mkdir -p "$OUT"
PY=${PYTHON:-python3}; export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
BUDGET=${SAMPLE_BUDGET:-560}
log="$OUT/run.log"; : > "$log"
PARTS=" ${PARTS:-pytest blockmask sample-short sample-ref} "
part() {  # part NAME CAP CMD...
  local name=$1 cap=$2 left=$((BUDGET - SECONDS - 5)); shift 2
  [[ "$PARTS" == *" $name "* ]] || return 0
  [ "$cap" -gt "$left" ] && cap=$left
  [ "$cap" -lt 20 ] && { echo "[$name] not run: budget spent" >> "$log"; return; }
  echo "[$name] start at +${SECONDS}s (cap ${cap}s): $*" >> "$log"
  local t0=$SECONDS; timeout -s INT -k 10 "$cap" "$@" >> "$log" 2>&1
  echo "[$name] exit $? after $((SECONDS - t0))s" >> "$log"
}
xd=(); "$PY" -c "import xdist" 2>/dev/null && xd=(-n 4)
part pytest 210 "$PY" -m pytest -m gpu -rs -p no:cacheprovider "${xd[@]}" --junitxml="$OUT/pytest_gpu_sample_blockmask.xml" \
  tests/test_blockmask_compiled.py tests/test_blockmask.py tests/test_sampling_gpu.py
part blockmask 70 "$PY" benchmarks/blockmask_build.py --rounds 5 --runs 10 --out "$OUT/blockmask_build_h200.json"
part sample-short 150 "$PY" benchmarks/sample.py --sets short --loop-pairs 16 --repeats 2 --out "$OUT/sample_h200.json"
part sample-ref 300 "$PY" benchmarks/sample.py --sets ref --loop-pairs 8 --repeats 2 --out "$OUT/sample_h200.json"
grep -E "^\[|passed|failed|packed .* tok/s|worst|Error|recompil" "$log" | tail -n 60
