#!/usr/bin/env bash
# Float8 training, selective checkpointing and the loop vs its step on one H200, in one call of <= 9 minutes.
#
#   OUT=/path benchmarks/float8_h200.sh          # BUDGET=515 (seconds for all stages), SKIP="stage ..." to leave some out
#
# Wheels: every .whl under .whl/ (torchao, diffusers, ...) is installed with pip --no-index --no-deps into /tmp/site;
# FA4 too where .gpuwheels-a/ and .gpuwheels-b/ are there (shared tools/gpu-wheels.sh layout). Stages, most
# important first; each gets what is left of BUDGET (capped), is skipped when too little is left, and writes its JSON
# under $OUT as it goes (a stage cut at its limit keeps what it finished):
#   verify     packed vs per-episode errors under each float8 mode (2 blocks, 5B widths)   float8_verify_h200.json
#   ref        4-layer step, reference lengths: bf16 vs float8 rowwise / tensorwise vs     train_step_h200.json
#              diffusers compiled
#   loss       loss curves bf16 vs tensorwise vs rowwise, same data and seed (+ PNG)       float8_loss_h200.json
#   wan5b      30 layers, every block checkpointed, float8 rowwise: bare step and          train_step_30l_h200.json
#              `flexpack train` (log_every 10) on the same packs (loop_vs_step)
#   short      as ref on the short-episode set                                             train_step_h200.json
#   wan5b_ac_* 30 layers, float8: selective checkpointing / 26 of 30 blocks checkpointed   train_step_30l_ac_*_h200.json
#   loop4      4 layers, bf16: `flexpack train` vs its bare step                           train_step_loop_h200.json
set -uo pipefail
OUT=${OUT:?set OUT to the output folder}
BUDGET=${BUDGET:-515}
SKIP=${SKIP:-}
X=${SMOKE:+--smoke}  # SMOKE=1: every stage on CPU with tiny shapes (a check of the script, no numbers)
mkdir -p "$OUT"
t0=$SECONDS
left() { echo $((BUDGET - (SECONDS - t0))); }
stage() {  # stage NAME MIN_SECONDS CAP_SECONDS CMD...
  local name=$1 min=$2 cap=$3 l t; shift 3
  l=$(left)
  if [[ " $SKIP " == *" $name "* ]]; then echo "== $name: skipped (SKIP)"; return; fi
  if (( l < min )); then echo "== $name: skipped, $l s left of BUDGET=$BUDGET"; return; fi
  t=$(( l < cap ? l : cap ))
  echo "== $name (limit $t s, $l s left) $(date -u +%T)"
  timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $? after $((SECONDS - t0)) s"
  grep -E "^\[|^wrote|rror" "$OUT/$name.log" | grep -v "^optim group" | tail -20
}

mkdir -p /tmp/w /tmp/site
cp .whl/*.whl /tmp/w/ 2>/dev/null || echo "no .whl/ folder: torchao missing, float8 variants will say so"
if [[ -d .gpuwheels-a && -d .gpuwheels-b ]]; then
  cp .gpuwheels-a/*.whl .gpuwheels-b/*.whl /tmp/w/
  cat .gpuwheels-a/cu13.partaa .gpuwheels-b/cu13.partab > "/tmp/w/$(cat .gpuwheels-a/cu13.name)"
fi
ls /tmp/w/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/w/*.whl
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch
from flexpack.attention.flex import has_flash
try:
    import torchao; ao = torchao.__version__
except ImportError as e:
    ao = f"missing ({e})"
gpu = f"{torch.cuda.get_device_name()}, sm{''.join(map(str, torch.cuda.get_device_capability()))}" if torch.cuda.is_available() else "no GPU"
print(f"torch {torch.__version__}, {gpu}, torchao {ao}, FA4 {has_flash()}")
PY
S=benchmarks/train_step.py
F8="pack-compiled,pack-float8-rowwise,pack-float8-tensorwise"
stage verify 30 60 python3 benchmarks/float8_verify.py $X --out "$OUT/float8_verify_h200.json"
stage ref 120 230 python3 $S $X --sets ref --variants "$F8,diffusers-compiled" --steps 6 --warmup 2 --diffusers-steps 2 \
  --out "$OUT/train_step_h200.json"
stage loss 50 120 python3 benchmarks/float8_loss.py $X --steps 100 --max-tokens 8192 --out "$OUT/float8_loss_h200.json"
[[ -f "$OUT/float8_loss_h200.json" ]] && python3 benchmarks/plot_float8_loss.py "$OUT/float8_loss_h200.json" 2>&1 | tail -1
# the full 30-layer 5B, every block checkpointed, float8: the bare step and `flexpack train` (log_every 10) on the same packs
stage wan5b 120 240 python3 $S $X --sets ref --layers 30 --activation-checkpointing true \
  --variants pack-float8-rowwise,loop-float8-rowwise --steps 4 --warmup 2 --loop-steps 10 --out "$OUT/train_step_30l_h200.json"
stage short 100 200 python3 $S $X --sets short --variants "$F8,diffusers-compiled" --steps 6 --warmup 2 --diffusers-steps 2 \
  --out "$OUT/train_step_h200.json"
for ac in selective 26; do  # 30 layers: per-op checkpointing of every block, or 4 blocks left whole
  stage "wan5b_ac_$ac" 90 150 python3 $S $X --sets ref --layers 30 --activation-checkpointing "$ac" \
    --variants pack-float8-rowwise --steps 4 --warmup 2 --out "$OUT/train_step_30l_ac_${ac}_h200.json"
done
stage loop4 80 150 python3 $S $X --sets ref --variants pack-compiled,loop-compiled --steps 6 --warmup 2 --loop-steps 30 \
  --out "$OUT/train_step_loop_h200.json"
echo "done after $((SECONDS - t0)) s"
