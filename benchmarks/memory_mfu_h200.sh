#!/usr/bin/env bash
# Toward MFU 0.60 on the full LingBot-VA-5B (issue 41), one H200 call: the planner at memory.budget_gb = "auto"
# with packs of 8,136 tokens a copy in four micro-batches (about the 32,768 tokens an optimizer step of today's
# reference; 226 frames of 36 tokens, 16,272 computed, a multiple of 16 as float8 takes; data.crop: the wan5b
# episodes are 9,000-12,600 tokens a copy), today's reference (32,768 a copy, every block checkpointed, AdamW),
# the reference's settings on the 8,136-token micro-batches, then the 48 GB plan.
#
#   benchmarks/memory_mfu_h200.sh OUT        (carry .gpuwheels-mem from benchmarks/memory_carry.sh)
set -uo pipefail
out=${1:?usage: memory_mfu_h200.sh OUT}
run=benchmarks/memory_budget_h200.sh
small=(--max-tokens 8136 --set optim.accum_steps=4 --set data.crop=true --tag _8k)
$run "$out" --stage budgets --budgets auto --lora-budget 0 --only budget_auto "${small[@]}" --steps 8 --timeout 230
$run "$out" --stage budgets --budgets '' --lora-budget 0 --only reference --tag _32k --steps 6 --timeout 200
$run "$out" --stage budgets --budgets '' --lora-budget 0 --only reference "${small[@]}" --steps 8 --timeout 200
$run "$out" --stage budgets --budgets 48 --lora-budget 0 --only budget_48 --tag _32k_48 --steps 6 --timeout 200
