#!/usr/bin/env bash
# Issue 44's speed measurement on one GPU in one call of <= 9 minutes: benchmarks/lingbot_bundle.py writes a
# RoboTwin-shaped synthetic bundle under /tmp and times upstream LingBot-VA's own training step (the recipe, imported
# from .upstream-lingbot-va/), flexpack at batch 1 and flexpack packed, 32 segments per optimizer step. Results:
# $OUT/${JSON_NAME:-lingbot_bundle_h200.json} and $OUT/bench.log.
#
# Preparation, here in the repository root (PyPI and the upstream mirror needed; nothing is fetched on the GPU):
#   benchmarks/lingbot_bundle_h200.sh --prepare [MIRROR]    # MIRROR: /work/.mirror/robbyant+lingbot-va/repo
# (git archive may print "invalid object ... assets/teaser.mp4": a blob the mirror lacks, outside wan_va/; harmless)
# runs benchmarks/lingbot_carry.sh (.gpuwheels-lv/: diffusers, easydict, einops, ... ~12 MB), exports upstream's
# wan_va/ at the mirror's HEAD into .upstream-lingbot-va/ (ignored by .gitignore) with UPSTREAM_COMMIT and
# FLEXPACK_COMMIT (this checkout's HEAD, "-dirty" with uncommitted tracked changes) beside it, and prints the calls.
# Then the run tool, from this checkout (4 layers, ~6 min; H100 or H200, the JSON names the device):
#   command: bash benchmarks/lingbot_bundle_h200.sh        carry: [".gpuwheels-lv", ".upstream-lingbot-va"]
# 30 layers (flexpack's variants with activation checkpointing, as upstream's; ~100 GB: needs_h200):
#   command: JSON_NAME=lingbot_bundle_30l_h200.json BENCH_ARGS="--layers 30 --activation-checkpointing true
#            --steps 2" bash benchmarks/lingbot_bundle_h200.sh   (one line)      carry: the same two folders
# Wheels: scripts/gpu_wheels.sh (what this call carries or an earlier call on the machine kept in /tmp).
set -uo pipefail
UPSTREAM=.upstream-lingbot-va
if [[ ${1:-} == --prepare ]]; then
  set -e
  mirror=${2:-/work/.mirror/robbyant+lingbot-va/repo}
  cd "$(git rev-parse --show-toplevel)"
  py=${PYTHON:-python3}; [[ -z ${PYTHON:-} && -x .venv/bin/python ]] && py=.venv/bin/python
  PYTHON=$py bash benchmarks/lingbot_carry.sh
  git check-ignore -q "$UPSTREAM/" || { echo "$UPSTREAM/ is not ignored by git: it would travel as a tracked" \
                                              "folder; add it to .gitignore" >&2; exit 1; }
  rm -rf "$UPSTREAM"; mkdir -p "$UPSTREAM"
  git -C "$mirror" archive HEAD wan_va | tar -x -C "$UPSTREAM"
  git -C "$mirror" rev-parse HEAD > "$UPSTREAM/UPSTREAM_COMMIT"
  dirty=$(git status --porcelain --untracked-files=no | head -c1)
  echo "$(git rev-parse HEAD)${dirty:+-dirty}" > "$UPSTREAM/FLEXPACK_COMMIT"
  du -sh .gpuwheels-lv "$UPSTREAM"
  echo "upstream $(cat "$UPSTREAM/UPSTREAM_COMMIT"), flexpack $(cat "$UPSTREAM/FLEXPACK_COMMIT"); run tool call:"
  echo "  command: bash benchmarks/lingbot_bundle_h200.sh   carry: [\".gpuwheels-lv\", \"$UPSTREAM\"]"
  exit 0
fi
OUT=${OUT:?set OUT to the output folder}
JSON=$OUT/${JSON_NAME:-lingbot_bundle_h200.json}
[[ -f $UPSTREAM/wan_va/train.py ]] || { echo "no $UPSTREAM/wan_va/train.py: carry $UPSTREAM (--prepare)"; exit 1; }
mkdir -p "$OUT" /tmp/site
bash scripts/gpu_wheels.sh  # carried or kept wheels into /tmp/site
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export FLEXPACK_COMMIT=${FLEXPACK_COMMIT:-$(cat "$UPSTREAM/FLEXPACK_COMMIT" 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# shellcheck disable=SC2086
timeout -k 10 "${BENCH_S:-520}" python3 benchmarks/lingbot_bundle.py --upstream "$UPSTREAM" --out "$JSON" \
  ${BENCH_ARGS:-} 2>&1 | grep -v -e Warning -e warn | tee "$OUT/bench.log" | grep -E "^\[|rror|Traceback"
[[ -f $JSON ]] && python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print({k: r.get(k) for k in (
  'device', 'layers', 'packed_vs_recipe', 'packed_vs_batch1', 'batch1_vs_recipe', 'params_match')})" "$JSON"
