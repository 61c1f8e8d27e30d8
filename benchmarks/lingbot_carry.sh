#!/usr/bin/env bash
# Prepares what benchmarks/lingbot_va.py needs on a GPU machine that has torch and transformers but neither lerobot
# nor diffusers nor a package index: .gpuwheels-lv/ (~12 MB, ignored by git), the wheels of LeRobot's lingbot_va
# policy as it imports without lerobot's dataset extra (lerobot, draccus, mergedeep, toml, gymnasium,
# farama-notifications, termcolor; `datasets` absent, so neither is PyAV needed), diffusers (the policy's Wan
# blocks, Timesteps, ...) with importlib_metadata, torchao (flexpack's float8), and what upstream LingBot-VA's
# training code imports besides (benchmarks/lingbot_bundle.py: easydict for its configs, einops), at this
# environment's versions (easydict, absent here, at the pin below), for CPython 3.12 on manylinux x86_64.
# benchmarks/lingbot_h200.sh and benchmarks/lingbot_bundle_h200.sh install those the machine lacks.
#
#   benchmarks/lingbot_carry.sh        # then carry .gpuwheels-lv (for the cli stage: wan5b_carry.sh's two folders)
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
PY=${PYTHON:-python3}
dists=(lerobot draccus mergedeep toml gymnasium farama-notifications termcolor diffusers importlib_metadata torchao
       einops easydict==1.14)
pins=$("$PY" - "${dists[@]}" <<'PY'
import importlib.metadata as md, sys
print(" ".join(d if "==" in d else f"{d}=={md.version(d).split('+')[0]}" for d in sys.argv[1:]))
PY
)
if ! git check-ignore -q .gpuwheels-lv/; then  # .gitignore's /.gpuwheels-*/ covers it in this repository
  ex=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$ex")"
  grep -qx "/.gpuwheels-lv/" "$ex" 2>/dev/null || echo "/.gpuwheels-lv/" >> "$ex"
fi
rm -rf .gpuwheels-lv; mkdir -p .gpuwheels-lv
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d .gpuwheels-lv $pins
du -sh .gpuwheels-lv
