#!/usr/bin/env bash
# Prepares what `benchmarks/train_wan5b.sh` needs on a GPU machine that has torch, transformers and pandas but
# neither lerobot nor a package index, in two folders of at most ~60 MB each (both ignored by git):
#   .gpuwheels-l/  lerobot and what reading a dataset's metadata with it imports (datasets, PyAV, torchvision,
#                  draccus, gymnasium, aiohttp, ...), as wheels for CPython 3.12 on manylinux x86_64, the versions
#                  of this environment; float8_h200.sh's `cli` stage installs those the machine lacks
#   .gpudata/      wan5b-data.tar.gz: train_wan5b.sh's dataset (~35 MB), made and encoded here (making it needs video encoding)
#
#   benchmarks/wan5b_carry.sh          # then carry .gpuwheels-l and .gpudata in two calls (BENCHMARKS.md)
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
PY=${PYTHON:-.venv/bin/python}
dists=(lerobot datasets dill multiprocess xxhash fsspec aiohttp aiohappyeyeballs aiosignal frozenlist multidict
       propcache yarl attrs draccus mergedeep toml typing-inspect mypy-extensions gymnasium cloudpickle
       farama-notifications termcolor av torchvision pillow accelerate einops click rich markdown-it-py mdurl)
pins=$("$PY" - "${dists[@]}" <<'PY'
import importlib.metadata as md, sys
print(" ".join(f"{d}=={md.version(d).split('+')[0]}" for d in sys.argv[1:]))
PY
)
rm -rf .gpuwheels-l; mkdir -p .gpuwheels-l .gpudata
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d .gpuwheels-l $pins
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
PYTHON=$PY benchmarks/wan5b_data.sh "$work/data"
tar -czf .gpudata/wan5b-data.tar.gz.part -C "$work" data && mv .gpudata/wan5b-data.tar.gz.part .gpudata/wan5b-data.tar.gz
du -sh .gpuwheels-l .gpudata
