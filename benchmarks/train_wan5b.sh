#!/usr/bin/env bash
# The full 30-layer Wan2.2-5B through `flexpack train` on one GPU, on a synthetic LeRobot dataset.
#
#   benchmarks/train_wan5b.sh OUT [--set key=value ...]      # e.g. --set parallel.activation_checkpointing=true
#
# Defaults, the fastest settings that fit on the H200: float8 matmuls in the blocks (FLOAT8=tensorwise; rowwise or
# off) and the first 24 of 30 blocks checkpointed (AC=24: 126 GB with float8 in float8_h200.sh's ac stage; AC=true,
# every block, needs 94 GB at ~5 % less speed; per-op "selective" checkpointing of all 30 blocks runs out of memory
# next to the fp32 weights, gradients and AdamW state), log_every 10 as a real run logs. --set overrides any.
#
# Makes (once, under $WORK, default /tmp/wan5b) the 13-episode dataset of benchmarks/wan5b_data.sh (two 128x128
# cameras, 30 action channels: 32 video + 4 action tokens per latent frame; FRAMES="..." sets other latent frame
# counts), then trains configs/wan5b_pack.toml for $STEPS (default 40) steps and copies metrics.jsonl and the log
# to OUT. The run is stopped (SIGKILL) once its last step is logged: the final
# checkpoint (fp32 weights and AdamW state, ~80 GB) is not what is measured, and SIGTERM would save it.
set -euo pipefail
out=${1:?usage: train_wan5b.sh OUT [--set key=value ...]}
shift
work=${WORK:-/tmp/wan5b}
steps=${STEPS:-40}  # a multiple of 10: the run is stopped at its last logged step
MAX_S=${MAX_S:-0}   # > 0: stopped (SIGKILL, no checkpoint) after this many seconds at the latest
mkdir -p "$out" "$work"
"$(dirname "$0")/wan5b_data.sh" "$work/data"  # once
run="$work/run"
rm -rf "$run"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
python3 -m flexpack.cli train configs/wan5b_pack.toml --set data.root="$work/data" --set runtime.out_dir="$run" \
  --set schedule.steps="$steps" --set schedule.warmup_steps=4 --set log.every=10 --set log.progress=false \
  --set data.num_workers=4 --set parallel.float8="${FLOAT8:-tensorwise}" --set parallel.activation_checkpointing="${AC:-24}" "$@" \
  > "$out/train.log" 2>&1 &
pid=$!
t0=$SECONDS
while kill -0 "$pid" 2>/dev/null; do
  if grep -q "^{\"step\": $steps," "$run/metrics.jsonl" 2>/dev/null || (( MAX_S && SECONDS - t0 > MAX_S )); then
    kill -9 "$pid"
    break
  fi
  sleep 1
done
wait "$pid" 2>/dev/null || true
cp "$run/metrics.jsonl" "$out/metrics.jsonl" 2>/dev/null || { echo "no step logged: see $out/train.log"; exit 1; }
python3 - "$out/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(x) for x in open(sys.argv[1])]
later = rows[1:] or rows
med = {k: statistics.median(r[k] for r in later) for k in ("step_s", "tokens_per_s", "mfu", "peak_mem_gb") if k in later[0]}
print(f"{len(rows)} logged windows; loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}; median of windows 2+: "
      + ", ".join(f"{k} {v:.4g}" for k, v in med.items()))
PY
