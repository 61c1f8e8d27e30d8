#!/usr/bin/env bash
# Prepares what benchmarks/memory_budget.py needs on a GPU machine that has torch and transformers but no package
# index: .gpuwheels-mem/ (ignored by git), torchao (8-bit / 4-bit AdamW, the host-offloaded optimizer, float8) and
# peft (LoRA) with what peft imports besides (accelerate, psutil, pyyaml), at this environment's versions, for
# CPython 3.12 on manylinux x86_64. On the machine: python3 benchmarks/install_wheels.py .gpuwheels-mem
# (installs those it lacks into /tmp/site; then PYTHONPATH=/tmp/site:.).
#
#   benchmarks/memory_carry.sh         # then carry .gpuwheels-mem
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
PY=${PYTHON:-python3}
dists=(torchao peft accelerate psutil pyyaml)
pins=$("$PY" - "${dists[@]}" <<'PY'
import importlib.metadata as md, sys
print(" ".join(f"{d}=={md.version(d).split('+')[0]}" for d in sys.argv[1:]))
PY
)
rm -rf .gpuwheels-mem; mkdir -p .gpuwheels-mem
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .gpuwheels-mem $pins
du -sh .gpuwheels-mem
