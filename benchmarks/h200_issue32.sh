#!/usr/bin/env bash
# One call of <= 9 minutes on one H200 (FA4, diffusers and torchao installed, or carried as wheels:
# scripts/gpu_wheels.sh): like-for-like packed vs diffusers steps on four length sets, recompiles after warm-up,
# what action tokens cost FA4, and the block-mask build on fixed segment grids. STAGES picks the stages of a
# call, in this order; each gets what is left of BUDGET (540 s) up to its cap, is skipped when less than its
# minimum is left, and writes its JSON under $OUT as it goes (a stage cut at its limit keeps what it finished:
# train_step.py rewrites its JSON after every variant). The logs come back as one logs.tgz.
#
#   OUT=/path benchmarks/h200_issue32.sh                          # STAGES="wheels step actprof grids"
#   OUT=/path STAGES="step" SETS="ref,short" benchmarks/h200_issue32.sh   # resume: the sets a cut call left
#   OUT=/path STAGES="wheels step" SETS=long,short STEP_CAP=520 BUDGET=570 benchmarks/h200_issue32.sh  # longer step
#   OUT=/path VARIANTS=pack-float8-tensorwise,diffusers-float8-compiled benchmarks/h200_issue32.sh  # one pair only
#   OUT=/tmp/dry SMOKE=1 benchmarks/h200_issue32.sh               # CPU: every stage's command on tiny shapes
#
# stage    cap (min)  what                                                              $OUT file
# wheels    60  (0)   scripts/gpu_wheels.sh: carried or kept wheels into /tmp/site      (log)
# step     400 (120)  train_step.py, 4-layer Wan2.2-5B shape, 65,536-token packs, sets   train_step_issue32_h200.json
#                     $SETS (veryshort,long,ref,short) in one process (compiled kernels
#                     reused across sets), variants pack-compiled, pack-float8-tensorwise,
#                     diffusers-compiled, diffusers-float8-compiled; 2 warm-up + 3 timed
#                     packs, diffusers on the first timed pack's episodes; per set:
#                     pack_vs_diffusers_compiled (bf16/bf16), pack_float8_vs_diffusers_float8,
#                     recompiles_after_warmup, packing waste, text slots
# actprof  150  (60)  action_attention.py --time: FA4 forward and forward + backward on     action_attention_h200.json
#                     the same packs of wan5b and long laid out without action tokens,
#                     with them, with episodes starting on blocks, and FA4's varlen kernel
#                     (useful TFLOP/s, rate vs no action tokens; block counts as on the CPU)
# grids     90  (45)  blockmask_build.py: build time of the default (power-of-two) and      blockmask_grids_h200.json
#                     fixed (one cell per frame, training's) segment grids, 3 masks
set -uo pipefail
OUT=${OUT:?set OUT to the output folder}
BUDGET=${BUDGET:-540}
STAGES=${STAGES:-wheels step actprof grids}
SETS=${SETS:-veryshort,long,ref,short}
X=${SMOKE:+--smoke}  # SMOKE=1: tiny shapes on the CPU (a check of the commands, no numbers)
mkdir -p "$OUT"
LOGS=$(mktemp -d /tmp/issue32_logs.XXXXXX)  # tarred into $OUT at the end: 8 files at most come back
trap 'tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null' EXIT
t0=$SECONDS
stage() {  # stage NAME MIN_SECONDS CAP_SECONDS CMD...
  local name=$1 min=$2 cap=$3 l t rc; shift 3
  l=$((BUDGET - (SECONDS - t0)))
  if [[ " $STAGES " != *" $name "* ]]; then return; fi
  if (( l < min )); then echo "== $name: skipped, $l s left of BUDGET=$BUDGET (needs $min)"; return; fi
  t=$(( l < cap ? l : cap ))
  echo "== $name (limit $t s, $l s left) $(date -u +%T): $*"
  timeout -k 10 "$t" "$@" > "$LOGS/$name.log" 2>&1; rc=$?
  echo "   exit $rc after $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (cut at its limit)')"
  grep -E "^\[|^wrote|^fit|rror|  (video|actions|aligned|varlen) " "$LOGS/$name.log" | grep -v "^optim group" | tail -25
}

[[ -z ${SMOKE:-} ]] && stage wheels 0 60 bash scripts/gpu_wheels.sh
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import importlib.util as u
import torch
from flexpack.attention.flex import has_flash
def version(m):
    try:
        return __import__(m).__version__ if u.find_spec(m) else "missing"
    except Exception as e:  # noqa: BLE001
        return f"missing ({e})"
gpu = f"{torch.cuda.get_device_name()}, sm{''.join(map(str, torch.cuda.get_device_capability()))}" if torch.cuda.is_available() else "no GPU"
print(f"torch {torch.__version__}, {gpu}, FA4 {has_flash()}, torchao {version('torchao')}, diffusers {version('diffusers')}")
PY
V=${VARIANTS:-pack-compiled,pack-float8-tensorwise,diffusers-compiled,diffusers-float8-compiled}
stage step 120 "${STEP_CAP:-400}" python3 benchmarks/train_step.py $X --sets "$SETS" --variants "$V" --steps 3 --warmup 2 \
  --diffusers-steps 1 --host-steps 1 --out "$OUT/train_step_issue32_h200.json"
if [[ -n ${SMOKE:-} ]]; then  # block counts only: no FA4 on the CPU
  stage actprof 60 150 python3 benchmarks/action_attention.py --sets wan5b,long --packs 2 \
    --out "$OUT/action_attention_h200.json"
else
  stage actprof 60 150 python3 benchmarks/action_attention.py --time --sets wan5b,long --packs 3 --runs 5 \
    --layouts video,actions,aligned,varlen --out "$OUT/action_attention_h200.json"
fi
[[ -z ${SMOKE:-} ]] && stage grids 45 90 python3 benchmarks/blockmask_build.py \
  --cases document_8,teacher_forcing_4,text_8 --variants graphs,fixed --rounds 3 --runs 10 \
  --out "$OUT/blockmask_grids_h200.json"
python3 - "$OUT" <<'PY'  # the like-for-like table of what ran
import json, pathlib, sys
f = pathlib.Path(sys.argv[1]) / "train_step_issue32_h200.json"
if f.exists():
    d = json.loads(f.read_text())
    print("set        bf16 pack/diffusers  float8 pack/diffusers  recompiles  waste (with repeats)")
    for s, r in d.items():
        if isinstance(r, dict) and "comparisons" in r:
            c = r["comparisons"]
            fmt = lambda x: f"{x:.3f}" if x else "  -  "
            print(f"{s:<10} {fmt(c['bf16']['ratio']):>19}  {fmt(c['float8']['ratio']):>21}  "
                  f"{r.get('recompiles_after_warmup')!s:>10}  {r['packing_waste']:.4f} ({r['packing_waste_incl_repeats']:.4f})")
PY
echo "done after $((SECONDS - t0)) s"
