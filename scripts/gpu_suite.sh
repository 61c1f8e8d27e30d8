#!/usr/bin/env bash
# The whole GPU part in one command, on a CUDA machine without a package index (the H200), from the
# repository root; results go to $OUT (default out/gpu_suite) as each phase ends, so a run stopped at
# its time limit still leaves what it did:
#
#   bash scripts/gpu_suite.sh                      # GPU_SUITE_SECONDS=570: the budget of all phases
#
# Phases (each with a time cap inside the budget; its exit status and wall time go to summary.json); the
# verify phases run one after another beside pytest, the benchmark last and alone:
#   wheels      carried wheels -> /tmp/site with `pip install --no-index --no-deps --target`:
#               .gpuwheels-a/ + .gpuwheels-b/ as made by tools/gpu-wheels.sh (FA4 with the CuTe DSL library
#               split in two halves, joined here; diffusers) and .whl/ (any other wheel). None is required:
#               without FA4 the flex-flash tests skip saying so, without diffusers the parity tests do.
#   verify      flexpack verify on CUDA in the training configuration (bf16 autocast, compiled blocks,
#               Triton flex): Wan2.2-5B width (dim 3072, head dim 128), 2 layers, 16,384-token packs of
#               in-memory episodes (--synthetic: no lerobot needed), must exit 0;
#   verify-drop the same with --drop-packing, must exit 1;
#   blockmask   benchmarks/blockmask_build.py -> blockmask_build_h200.json (worst case per variant);
#   pytest      pytest -m gpu over every test file (-rs: each skip with its reason; junit XML), which
#               includes the block-mask shape sweep (tests/test_blockmask_compiled.py) that fails on any
#               eager fallback, and the CUDA case of the compiled-step test; the rest of the budget;
#   verify-auto verify with attn_backend='auto' (FA4 where installed), must exit 0;
#   verify-fsdp torchrun on 2 GPUs (FSDP2, bf16 parameters), only where there are 2 or more GPUs.
# lerobot is not needed: no GPU test reads a LeRobot dataset (the profiling test and verify use in-memory
# episodes). Carrying it would take lerobot, draccus, mergedeep, toml, gymnasium, farama-notifications,
# termcolor, datasets, dill, multiprocess, jsonlines and torchcodec (which also needs FFmpeg's shared
# libraries, not a wheel), against lerobot's pin numpy<2.3 (the H200 has 2.5): not worth it for CPU tests.
# Files in $OUT (8 at most come back from the device machine): summary.json, suite.log,
# pytest_gpu.log, pytest_gpu.xml, verify.log, blockmask_build_h200.json.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd); cd "$root"
OUT=${OUT:-out/gpu_suite}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
BUDGET=${GPU_SUITE_SECONDS:-570}
# NVLink multicast stays off on shared multi-GPU hosts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
log="$OUT/suite.log"; : > "$log"; : > "$OUT/verify.log"
phases=$(mktemp /tmp/gpu_suite_phases.XXXXXX)  # not in $OUT: only 8 files come back from there
exec 3>&1  # the terminal, whatever a phase's output is redirected to
say() { local m="[$(date -u +%H:%M:%S) +${SECONDS}s] $*"; echo "$m" >> "$log"; echo "$m" >&3; }

summary() {  # summary.json from the phases so far and the junit XML
  "$PY" - "$OUT" "$phases" <<'EOF' || true
import json, os, sys, xml.etree.ElementTree as ET
out, phases = sys.argv[1], sys.argv[2]
rows = [dict(zip(("phase", "rc", "expected", "seconds", "note"), ln.rstrip("\n").split("\t"))) for ln in open(phases) if ln.strip()]
for r in rows:
    r["rc"], r["seconds"] = int(r["rc"]), int(r["seconds"])
    r["ok"] = r["expected"] == "any" or str(r["rc"]) == r["expected"]
res = {"phases": rows}
xml = os.path.join(out, "pytest_gpu.xml")
if os.path.exists(xml):
    suites = ET.parse(xml).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    n["time_s"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    bad = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]
    skips = [f"{c.get('classname')}::{c.get('name')}: {c.find('skipped').get('message', '')}" for s in suites
             for c in s.iter("testcase") if c.find("skipped") is not None]
    res["pytest"] = {**n, "failed_tests": bad, "skipped_tests": skips}
try:
    import torch
    res["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    res["gpus"], res["torch"] = torch.cuda.device_count(), torch.__version__
except Exception as e:  # noqa: BLE001
    res["device"] = f"torch not importable: {e}"
tmp = os.path.join(out, f"summary.json.{os.getpid()}")  # the verify chain writes it beside the main line
json.dump(res, open(tmp, "w"), indent=1)
os.replace(tmp, os.path.join(out, "summary.json"))
EOF
}

# phase NAME EXPECTED_RC CAP_SECONDS CMD... : runs CMD with the smaller of CAP and the budget left
phase() {
  local name=$1 expected=$2 cap=$3; shift 3
  local left=$((BUDGET - ${RESERVE:-0} - SECONDS - 5)) t0=$SECONDS rc
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$cap" -lt 20 ]; then
    say "$name: not run (budget of ${BUDGET}s spent)"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" -1 "$expected" 0 "not run: budget spent" >> "$phases"; summary; return
  fi
  say "$name: start (cap ${cap}s): $*"
  timeout -s INT -k 15 "$cap" "$@"; rc=$?
  say "$name: exit $rc (expected $expected) after $((SECONDS - t0))s"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$expected" "$((SECONDS - t0))" "" >> "$phases"; summary
}

first_dir() { for d in "$@"; do [ -d "$d" ] && { echo "$d"; return; }; done; }
install_wheels() {
  # a call carries at most 64 MiB: .gpuwheels-a may come in an earlier call and wait in /tmp/.gpuwheels-a
  local a b x w=/tmp/w; a=$(first_dir .gpuwheels-a /tmp/.gpuwheels-a); b=$(first_dir .gpuwheels-b /tmp/.gpuwheels-b)
  x=$(first_dir .whl /tmp/.whl)
  rm -rf "$w" /tmp/site; mkdir -p "$w" /tmp/site
  for d in $a $b $x; do cp "$d"/*.whl "$w"/ 2>/dev/null; done
  if [ -n "$a" ] && [ -n "$b" ] && [ -f "$a/cu13.name" ] && [ -f "$a/cu13.partaa" ] && [ -f "$b/cu13.partab" ]; then
    cat "$a/cu13.partaa" "$b/cu13.partab" > "$w/$(cat "$a/cu13.name")"  # the CuTe DSL library, split in two
  elif [ -n "$a$b" ]; then
    echo "only one half of the CuTe DSL library wheel is here (.gpuwheels-a: ${a:-none}, .gpuwheels-b: ${b:-none})"
    rm -f "$w"/nvidia_cutlass_dsl*.whl "$w"/flash_attn*.whl "$w"/quack*.whl  # FA4 without it would fail at import
  fi
  ls "$w"/*.whl >/dev/null 2>&1 || { echo "no carried wheels (.gpuwheels-a/, .gpuwheels-b/, .whl/): none installed"; return 0; }
  ls -1 "$w"
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site "$w"/*.whl
}
export -f install_wheels first_dir
export PY

say "flexpack GPU suite in $root -> $OUT (budget ${BUDGET}s)"
phase wheels 0 120 bash -c install_wheels >> "$log" 2>&1
export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$root${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - >> "$log" 2>&1 <<'EOF'
import importlib.util as u, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "(no CUDA)")
for m in ("flash_attn.cute", "diffusers", "transformers", "lerobot"):
    try:
        print(f"{m}: {'importable' if u.find_spec(m) else 'missing'}")
    except ModuleNotFoundError:
        print(f"{m}: missing")
EOF

# the training configuration at Wan2.2-5B width: bf16 autocast, compiled blocks, activation checkpointing
V=(scripts/verify_packing.py configs/wan5b_pack.toml --synthetic --synthetic-hw 8 16 --synthetic-text 64
   --set data.max_tokens=16384 --set runtime.device="'cuda'" --micro-batches 1)
flex=(--set "model.overrides={attn_backend='flex', num_layers=2}")
# verify (one process at a time) beside the pytest workers: the GPU has room for both and the wall time is
# mostly compiling on the CPU; the benchmark runs alone afterwards (its timings need an idle GPU)
export RESERVE=150  # seconds kept for the benchmark (it compiles 18 builder signatures first)
[ -n "${GPU_SUITE_NO_BENCH:-}" ] && RESERVE=0  # GPU_SUITE_NO_BENCH=1: pytest gets the whole budget, no benchmark
(
  phase verify 0 150 "$PY" "${V[@]}" "${flex[@]}" >> "$OUT/verify.log" 2>&1
  phase verify-drop 1 90 "$PY" "${V[@]}" "${flex[@]}" --drop-packing >> "$OUT/verify.log" 2>&1
  phase verify-auto 0 100 "$PY" "${V[@]}" --set "model.overrides={attn_backend='auto', num_layers=2}" >> "$OUT/verify.log" 2>&1
  if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)" -ge 2 ]; then
    phase verify-fsdp 0 150 "$PY" -m torch.distributed.run --nproc_per_node 2 "${V[@]}" "${flex[@]}" >> "$OUT/verify.log" 2>&1
  else
    say "verify-fsdp: not run: FSDP2 needs 2 GPUs, this machine has fewer (the CPU test runs it on gloo)"
    printf '%s\t%s\t%s\t%s\t%s\n' verify-fsdp -1 any 0 "not run: fewer than 2 GPUs" >> "$phases"; summary
  fi
) &
chain=$!
xdist=(); "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 8 --dist load)  # compiles are CPU-bound (16 cores)
phase pytest 0 480 "$PY" -m pytest -m gpu -rs -p no:cacheprovider --durations=15 "${xdist[@]}" \
  --junitxml="$OUT/pytest_gpu.xml" tests > "$OUT/pytest_gpu.log" 2>&1
tail -n 40 "$OUT/pytest_gpu.log" >> "$log"
wait "$chain"
[ -z "${GPU_SUITE_NO_BENCH:-}" ] && RESERVE=0 phase blockmask 0 150 "$PY" benchmarks/blockmask_build.py --rounds 5 --runs 10 --out "$OUT/blockmask_build_h200.json" >> "$log" 2>&1
grep -E "^(OK|MISMATCH)|rel diff|^cuda" "$OUT/verify.log" >> "$log"
summary; rm -f "$phases"
say "done: $(cat "$OUT/summary.json" | tr -d '\n' | head -c 600)"
