#!/usr/bin/env bash
# Installs the wheels a GPU machine without a package index lacks, from the repository root, into /tmp/site
# (pip --no-index --no-deps; put /tmp/site and /tmp/site/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH):
#   .gpuwheels-a/ + .gpuwheels-b/  FA4 (flash-attn-4, quack-kernels, the CuTe DSL packages, apache-tvm-ffi,
#                                  torch-c-dlpack-ext) and diffusers; the 92 MB CuTe DSL library wheel split in
#                                  two (cu13.partaa in -a with its name in cu13.name, cu13.partab in -b), joined
#                                  here: a call carries at most 64 MiB, so the halves usually come in two calls;
#   .whl/                          any other wheel (torchao, ...);
#   .gpuwheels-l/                  lerobot and its dataset dependencies (benchmarks/wan5b_carry.sh),
#   .gpuwheels-lv/                 what LeRobot's lingbot_va imports (benchmarks/lingbot_carry.sh): of these two only
#                                  the distributions the machine lacks (benchmarks/install_wheels.py).
# Every folder carried is kept in /tmp/<folder> for later calls on the same machine, and every complete set kept
# there is installed, so the second call completes FA4 with the first call's half. Used by scripts/gpu_suite.sh and
# benchmarks/h200_issue32.sh.
set -uo pipefail
PY=${PYTHON:-python3}
w=/tmp/w
for d in .gpuwheels-a .gpuwheels-b .gpuwheels-l .gpuwheels-lv .whl; do  # carried this call: kept for the next one
  [ -d "$d" ] && { rm -rf "/tmp/$d"; cp -r "$d" "/tmp/$d"; echo "kept $d in /tmp/$d"; }
done
rm -rf "$w"; mkdir -p "$w" /tmp/site
cp /tmp/.whl/*.whl "$w"/ 2>/dev/null
if [ -f /tmp/.gpuwheels-a/cu13.partaa ] && [ -f /tmp/.gpuwheels-b/cu13.partab ]; then
  cp /tmp/.gpuwheels-a/*.whl /tmp/.gpuwheels-b/*.whl "$w"/
  cat /tmp/.gpuwheels-a/cu13.partaa /tmp/.gpuwheels-b/cu13.partab > "$w/$(cat /tmp/.gpuwheels-a/cu13.name)"
else  # FA4 without the CuTe DSL library would fail at import; diffusers comes with the second half
  echo "FA4 not complete here (.gpuwheels-a: $(ls -d /tmp/.gpuwheels-a 2>/dev/null || echo none), .gpuwheels-b:" \
       "$(ls -d /tmp/.gpuwheels-b 2>/dev/null || echo none)): not installed"
fi
if ls "$w"/*.whl >/dev/null 2>&1; then
  ls -1 "$w"
  "$PY" -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "$w"/*.whl || exit 1
else
  echo "no complete wheel set carried or kept: none installed"
fi
lacking=(); for d in /tmp/.gpuwheels-l /tmp/.gpuwheels-lv; do [ -d "$d" ] && lacking+=("$d"); done
[ ${#lacking[@]} -eq 0 ] || "$PY" benchmarks/install_wheels.py "${lacking[@]}"
