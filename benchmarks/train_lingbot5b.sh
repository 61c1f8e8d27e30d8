#!/usr/bin/env bash
# The full 30-layer LingBot-VA-5B (LeRobot's lingbot_va at its released shape, the lingbot-va-5b preset) through
# `flexpack train` on one GPU, on train_wan5b.sh's synthetic LeRobot dataset, then its numbers into the benchmark's
# JSON as `full_5b` (benchmarks/lingbot_va.py --full-5b-metrics).
#
#   benchmarks/train_lingbot5b.sh OUT [--set key=value ...]          # JSON=... (default OUT/lingbot_va_h200.json)
#
# It is train_wan5b.sh (same dataset: two 128x128 cameras, 30 action columns, 512 x 4096 hash text; same stop at
# the last logged step) with model.family = lingbot-va, model.preset = lingbot-va-5b, the dataset's 30 action
# columns as used_action_channel_ids (action_channels = 30) and packs of MAX_TOKENS (default 32,768) tokens of one
# copy: 65,536 computed with the clean copy, as the WanVA runs compute. Defaults: float8 tensorwise (FLOAT8) and
# every block checkpointed (AC=true; WanVA's 5B needed 94 GB so at 65,536 tokens, 24 of 30 blocks 126 GB).
set -euo pipefail
out=${1:?usage: train_lingbot5b.sh OUT [--set key=value ...]}
shift
here=$(dirname "$0")
export FLOAT8=${FLOAT8:-tensorwise} AC=${AC:-true}
sets=(--set model.family=lingbot-va --set model.preset=lingbot-va-5b --set model.overrides.action_channels=30
      --set data.max_tokens="${MAX_TOKENS:-32768}" "$@")
"$here/train_wan5b.sh" "$out" "${sets[@]}"
cmd="FLOAT8=$FLOAT8 AC=$AC benchmarks/train_lingbot5b.sh $out ${sets[*]}"
python3 "$here/lingbot_va.py" --full-5b-metrics "$out/metrics.jsonl" --full-5b-float8 "$FLOAT8" --full-5b-ac "$AC" \
  --full-5b-command "$cmd" --out "${JSON:-$out/lingbot_va_h200.json}"
