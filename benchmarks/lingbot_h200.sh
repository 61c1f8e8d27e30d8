#!/usr/bin/env bash
# LingBot-VA on one H200, in calls of <= 9 minutes (STAGES picks the stages of one call, in order):
#   bench   benchmarks/lingbot_va.py: LeRobot's own training step against flexpack's packed step, 5B width at
#           4 layers, ref and short lengths, bf16 and float8 tensorwise (BENCH_ARGS adds arguments)    (~6 min)
#   layers30  the same flexpack step at 30 layers, float8 tensorwise, every block checkpointed, ref set: whether
#           the full model's step fits (peak memory) and its tokens/s, without a dataset   (~3 min; own JSON)
#   cli     the full 30-layer LingBot-VA-5B through `flexpack train` (benchmarks/train_lingbot5b.sh) on
#           train_wan5b.sh's dataset, then `full_5b` into the JSON                                      (~7 min)
#
#   OUT=/path STAGES="bench" benchmarks/lingbot_h200.sh        # carry .gpuwheels-lv (benchmarks/lingbot_carry.sh)
#   OUT=/path STAGES="cli" benchmarks/lingbot_h200.sh          # carry .gpuwheels-l and .gpudata (wan5b_carry.sh) in
#                                                              # two calls on one warm machine, as float8_h200.sh's cli
# Wheels: scripts/gpu_wheels.sh (what this call carries or an earlier call on the machine kept in /tmp). The JSON is
# $OUT/lingbot_va_h200.json.
set -uo pipefail
OUT=${OUT:?set OUT to the output folder}
STAGES=${STAGES:-bench}
JSON=$OUT/lingbot_va_h200.json
mkdir -p "$OUT" /tmp/site
bash scripts/gpu_wheels.sh  # carried or kept wheels into /tmp/site (FA4 once both halves are there)
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if [[ " $STAGES " == *" bench "* ]]; then
  # shellcheck disable=SC2086
  timeout -k 10 "${BENCH_S:-520}" python3 benchmarks/lingbot_va.py --out "$JSON" ${BENCH_ARGS:-} 2>&1 \
    | grep -v -e Warning -e warn | tee "$OUT/bench.log" | grep -E "^\[|rror" 
fi
if [[ " $STAGES " == *" layers30 "* ]]; then
  timeout -k 10 "${L30_S:-300}" python3 benchmarks/lingbot_va.py --out "$OUT/lingbot_va_30l_h200.json" --no-lerobot \
    --sets ref --layers 30 --activation-checkpointing true --float8 tensorwise --steps 3 --warmup 2 2>&1 \
    | grep -v -e Warning -e warn | tee "$OUT/layers30.log" | grep -E "^\[|rror"
fi
if [[ " $STAGES " == *" cli "* ]]; then
  export WORK=${WORK:-/tmp/wan5b}
  if [[ ! -f $WORK/data/.encoded && -f .gpudata/wan5b-data.tar.gz ]]; then
    mkdir -p "$WORK" && tar -xzf .gpudata/wan5b-data.tar.gz -C "$WORK"
  fi
  STEPS=${STEPS:-30} MAX_S=${MAX_S:-390} JSON=$JSON bash benchmarks/train_lingbot5b.sh "$OUT/lingbot5b_cli"
  tail -n 3 "$OUT/lingbot5b_cli/train.log" 2>/dev/null
fi
