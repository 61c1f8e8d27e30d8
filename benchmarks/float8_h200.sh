#!/usr/bin/env bash
# Float8 training, activation checkpointing of the 30-layer 5B and the loop vs its step on one H200, in calls of
# <= 9 minutes each (STAGES picks the stages of one call, in order).
#
#   OUT=/path STAGES="verify ref short" benchmarks/float8_h200.sh     # BUDGET=540 (seconds for all stages)
#   OUT=/path STAGES="ac wan5b loop4" benchmarks/float8_h200.sh
#
# Wheels: every .whl under .whl/ (torchao, diffusers, ...) is installed with pip --no-index --no-deps into /tmp/site,
# and FA4 too where .gpuwheels-a/ (or a copy at /tmp/.gpuwheels-a, left by an earlier call on the same machine) and
# .gpuwheels-b/ are there (shared tools/gpu-wheels.sh layout); nothing is installed again when /tmp/site has torchao.
# Each stage gets what is left of BUDGET (capped), is skipped when too little is left, and writes its JSON under $OUT
# as it goes (a stage cut at its limit keeps what it finished); the logs come back as one logs.tgz.
#   verify  packed vs per-episode errors under each float8 mode (2 eager blocks, 5B widths; float8_verify_h200.json
#           its dropped-packing control sits under the bf16 noise there: see verify8)
#   ref     4-layer step, reference lengths: bf16 vs float8 tensorwise vs diffusers        train_step_h200.json
#           compiled, side by side
#   short   as ref on the short-episode set                                                 train_step_h200.json
#   loss    loss curves bf16 vs tensorwise vs rowwise, same data and seed, LOSS_STEPS (300)    float8_loss_h200.json
#           steps (+ PNG)
#   ac      30 layers, float8 tensorwise, bare step: every block checkpointed (true), 24    train_step_30l_ac_h200.json
#           of 30, per-op selective; the fastest whose peak stays under AC_LIMIT_GB (125) is the wan5b setting
#   wan5b   30 layers, float8 tensorwise, that setting: the bare step and `flexpack train`'s train_step_30l_h200.json
#           loop (log_every 10) on the same 10 packs (loop_vs_step)
#   loop4   4 layers, float8 tensorwise: `flexpack train`'s loop vs its bare step, same packs train_step_loop_h200.json
#   wan5b24 the 30-layer loop with 24 of 30 blocks checkpointed, wan5b's packs            train_step_30l_ac24_loop_h200.json
#   verify8 `flexpack verify` in the GPU suite's training configuration under float8       logs.tgz (verify8_*.log)
#           tensorwise / rowwise: must pass, and fail with --drop-packing
#   cliset  30 layers, float8 tensorwise, 24 of 30 blocks checkpointed, on the cli stage's       train_step_30l_wan5b_h200.json
#           workload in memory (its 13 episode lengths, 30 action channels): bare step, then      and ..._loop_h200.json
#           the loop on the same packs
#   actprof 4 layers, float8 tensorwise, the wan5b lengths with 0 and with 30 action channels: tokens/s,
#           MFU and the kernel-time split of one step each (where the action tokens' cost goes)  profile_wan5b_a{0,30}.json
#   cli     the full 5B through `flexpack train` (train_wan5b.sh, float8 tensorwise, 24 of 30   wan5b_cli/metrics.jsonl
#           blocks checkpointed, STEPS=30) on a LeRobot dataset; lerobot comes from the wheels     (train.log)
#           of .gpuwheels-l/ and the dataset from .gpudata/ (benchmarks/wan5b_carry.sh makes both; a copy at
#           /tmp/.gpuwheels-l and a dataset at /tmp/wan5b/data left by earlier calls serve too); if no step is
#           logged (out of memory), once more with every block checkpointed into wan5b_cli_true/
set -uo pipefail
OUT=${OUT:?set OUT to the output folder}
BUDGET=${BUDGET:-540}
STAGES=${STAGES:-verify ref short ac wan5b loop4}
AC_LIMIT_GB=${AC_LIMIT_GB:-125}
X=${SMOKE:+--smoke}  # SMOKE=1: every stage on CPU with tiny shapes (a check of the script, no numbers)
mkdir -p "$OUT"
LOGS=$(mktemp -d /tmp/float8_logs.XXXXXX)  # tarred into $OUT at the end: 8 files at most come back
trap 'tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null' EXIT
t0=$SECONDS
left() { echo $((BUDGET - (SECONDS - t0))); }
stage() {  # stage NAME MIN_SECONDS CAP_SECONDS CMD...
  local name=$1 min=$2 cap=$3 l t; shift 3
  l=$(left)
  if [[ " $STAGES " != *" ${name%%_*} "* ]]; then return; fi  # ac_true, ac_24, ...: the stage "ac"
  if (( l < min )); then echo "== $name: skipped, $l s left of BUDGET=$BUDGET"; return; fi
  t=$(( l < cap ? l : cap ))
  echo "== $name (limit $t s, $l s left) $(date -u +%T)"
  timeout -k 10 "$t" "$@" > "$LOGS/$name.log" 2>&1
  echo "   exit $? after $((SECONDS - t0)) s"
  grep -E "^\[|^wrote|rror" "$LOGS/$name.log" | grep -v "^optim group" | tail -20
}

mkdir -p /tmp/w /tmp/site
A=.gpuwheels-a; [[ -d $A ]] || A=/tmp/.gpuwheels-a
if [[ -z ${SMOKE:-} && ! -d /tmp/site/torchao ]]; then  # SMOKE: the local environment as it is
  cp .whl/*.whl /tmp/w/ 2>/dev/null || echo "no .whl/ folder: torchao missing, float8 variants will say so"
  if [[ -d $A && -d .gpuwheels-b ]]; then
    cp "$A"/*.whl .gpuwheels-b/*.whl /tmp/w/
    cat "$A/cu13.partaa" .gpuwheels-b/cu13.partab > "/tmp/w/$(cat "$A/cu13.name")"
  fi
  ls /tmp/w/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/w/*.whl
fi
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
F8="pack-compiled,pack-float8-tensorwise"  # rowwise measured 0.94x of tensorwise (train_step_float8_h200.json)
stage verify 30 120 python3 benchmarks/float8_verify.py $X --out "$OUT/float8_verify_h200.json"
stage ref 120 330 python3 $S $X --sets ref --variants "$F8,diffusers-compiled" --steps 6 --warmup 2 --diffusers-steps 2 \
  --out "$OUT/train_step_h200.json"
stage short 100 230 python3 $S $X --sets short --variants "$F8,diffusers-compiled" --steps 6 --warmup 2 \
  --diffusers-steps 2 --out "$OUT/train_step_h200.json"
stage loss 50 330 python3 benchmarks/float8_loss.py $X --steps "${LOSS_STEPS:-300}" --max-tokens 8192 \
  --out "$OUT/float8_loss_h200.json"
[[ -f "$OUT/float8_loss_h200.json" ]] && python3 benchmarks/plot_float8_loss.py "$OUT/float8_loss_h200.json" 2>&1 | tail -1
L30="--sets ref --layers 30 --warmup 2 --host-steps 1"
for ac in true 24 selective; do  # one JSON per setting (the benchmark keeps one entry per set and variant)
  stage "ac_$ac" 60 110 python3 $S $X $L30 --activation-checkpointing $ac --variants pack-float8-tensorwise --steps 3 \
    --out "$OUT/ac_$ac.json"
done
if [[ " $STAGES " == *" ac "* ]]; then  # the ac runs' numbers, and the fastest setting that fits, into one JSON
  AC=$(python3 benchmarks/pick_checkpointing.py "$OUT" --limit-gb "$AC_LIMIT_GB" --out "$OUT/train_step_30l_ac_h200.json")
  rm -f "$OUT"/ac_*.json
fi
stage wan5b 120 330 python3 $S $X $L30 --activation-checkpointing "${AC:-true}" \
  --variants pack-float8-tensorwise,loop-float8-tensorwise --steps 10 --loop-steps 10 --loop-log-every 10 \
  --out "$OUT/train_step_30l_h200.json"
stage loop4 80 150 python3 $S $X --sets ref --variants pack-float8-tensorwise,loop-float8-tensorwise --steps 10 \
  --warmup 2 --loop-steps 30 --loop-log-every 10 --out "$OUT/train_step_loop_h200.json"
# the full 5B's loop with 24 of 30 blocks checkpointed (the fastest `ac` setting; 126 GB there), on the packs of
# the wan5b stage's measured window
stage wan5b24 120 200 python3 $S $X $L30 --activation-checkpointing 24 --variants loop-float8-tensorwise --steps 10 \
  --loop-steps 10 --loop-log-every 10 --out "$OUT/train_step_30l_ac24_loop_h200.json"
# the cli stage's workload (train_wan5b.sh's episode lengths, 4 action tokens per frame) without lerobot: what the
# step itself reaches there, and the loop on the same packs (two processes: each peaks at ~126 GB)
W5=(--sets wan5b --layers 30 --warmup 2 --host-steps 1 --action-channels 30 --activation-checkpointing 24 --steps 10
    --loop-steps 10 --loop-log-every 10)
stage cliset_step 100 220 python3 $S $X "${W5[@]}" --variants pack-float8-tensorwise \
  --out "$OUT/train_step_30l_wan5b_h200.json"
stage cliset_loop 100 260 python3 $S $X "${W5[@]}" --variants loop-float8-tensorwise \
  --out "$OUT/train_step_30l_wan5b_loop_h200.json"
for ca in 0 30; do  # the same episode lengths without and with action tokens, 4 layers
  stage "actprof_$ca" 60 150 python3 $S $X --sets wan5b --action-channels $ca --variants pack-float8-tensorwise \
    --steps 4 --warmup 2 --profile --out "$OUT/profile_wan5b_a$ca.json"
done
# `flexpack verify` in the training configuration of the GPU suite (5B width, 2 layers, compiled, Triton) under float8:
# must pass, and must still fail with the packing dropped
# (16,416 tokens: 456 frames x 36, a multiple of 16 as float8 GEMMs need; 16,384 would pack 16,380)
V=(scripts/verify_packing.py configs/wan5b_pack.toml --synthetic --synthetic-hw 8 16 --synthetic-text 64
   --set data.max_tokens=16416 --set runtime.device="'cuda'" --micro-batches 1
   --set "model.overrides={attn_backend='flex', num_layers=2}")
for f8 in tensorwise rowwise; do
  stage "verify8_$f8" 60 110 python3 "${V[@]}" --set parallel.float8="'$f8'"
  stage "verify8_${f8}_drop" 60 110 python3 "${V[@]}" --set parallel.float8="'$f8'" --drop-packing
done
[[ " $STAGES " == *" verify8 "* ]] && tail -n 30 "$LOGS"/verify8_*.log
if [[ " $STAGES " == *" cli "* ]]; then
  bash scripts/gpu_wheels.sh  # lerobot's wheels (.gpuwheels-l/ or a copy kept in /tmp): those the machine lacks
  export WORK=${WORK:-/tmp/wan5b} HF_HUB_OFFLINE=1
  if [[ ! -f $WORK/data/.encoded && -f .gpudata/wan5b-data.tar.gz ]]; then
    mkdir -p "$WORK" && tar -xzf .gpudata/wan5b-data.tar.gz -C "$WORK"
  fi
  stage cli 150 420 env STEPS=${STEPS:-30} MAX_S=390 bash benchmarks/train_wan5b.sh "$OUT/wan5b_cli"
  tail -n 3 "$OUT/wan5b_cli/train.log" 2>/dev/null
  if ! grep -q '"step"' "$OUT/wan5b_cli/metrics.jsonl" 2>/dev/null; then
    stage cli_true 150 420 env STEPS=${STEPS:-30} MAX_S=390 bash benchmarks/train_wan5b.sh "$OUT/wan5b_cli_true" \
      --set parallel.activation_checkpointing=true
    tail -n 3 "$OUT/wan5b_cli_true/train.log" 2>/dev/null
  fi
fi
echo "done after $((SECONDS - t0)) s"
