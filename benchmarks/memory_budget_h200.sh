#!/usr/bin/env bash
# benchmarks/memory_budget.py on the GPU machine: installs the carried wheels it lacks (.gpuwheels-mem from
# benchmarks/memory_carry.sh: torchao, peft), then runs one stage with the arguments given; JSON and log under OUT.
#
#   benchmarks/memory_budget_h200.sh OUT --stage calibrate [--only ...]
#   benchmarks/memory_budget_h200.sh OUT --stage budgets --budgets 130,80,48 --lora-budget 24
set -euo pipefail
out=${1:?usage: memory_budget_h200.sh OUT --stage STAGE [args]}
shift
mkdir -p "$out"
[ -d .gpuwheels-mem ] && python3 benchmarks/install_wheels.py .gpuwheels-mem
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
free -g | head -2 | tee -a "$out/gpu.txt"
stage=$(printf '%s\n' "$@" | grep -A1 -x -- --stage | tail -1)
tag=$(printf '%s\n' "$@" | grep -A1 -x -- --tag | tail -1 || true)  # runs with other tags beside each other
python3 benchmarks/memory_budget.py "$@" --out "$out/memory_${stage}${tag}_h200.json" 2>&1 \
  | tee "$out/memory_${stage}${tag}.log"
