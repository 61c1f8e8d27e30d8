#!/usr/bin/env bash
# The GPU tests in shards of one call each, on a CUDA machine without a package index (the H200), from the
# repository root; results go to $OUT (default out/gpu_suite) as each phase ends, so a shard stopped at its time
# limit still leaves what it did:
#
#   bash scripts/gpu_suite.sh --shard 1/2     # carry .gpuwheels-a/ and .whl/ (FA4's first half, torchao)
#   bash scripts/gpu_suite.sh --shard 2/2     # the next call on the same machine: carry .gpuwheels-b/
#   bash scripts/gpu_suite.sh                 # --shard 1/1: every GPU test in one call (wheels already in place)
#
# Shards split by what they need: 1/2 runs `pytest -m "gpu and not fa4"` (Triton flex, the compiled block-mask
# builder, compiled step, float8 with torchao, profiling, the host-sync checks), 2/2 runs `-m "gpu and fa4"` (the
# FA4 backend against a float64 reference, FA4 in the step, verify and sampling, diffusers' VAE), so the wheels a
# call carries (at most 64 MiB: FA4 comes in two halves, scripts/gpu_wheels.sh) are the ones its tests use.
# Each call copies the wheel folders it carries to /tmp/.gpuwheels-*/ and installs every complete set found there
# into /tmp/site (scripts/gpu_wheels.sh), so a later call on the same machine has them without carrying them
# again; .gpuwheels-l/ (lerobot and what its dataset code imports, benchmarks/wan5b_carry.sh) is installed too
# where the machine lacks a distribution, but no GPU test needs lerobot.
#
# Phases of a shard, each with a time cap inside GPU_SUITE_SECONDS (540 a shard), exit status and seconds in the
# summary:
#   wheels        the install above;
#   requirements  what the shard's tests need is importable (1/2: torchao; 2/2: FA4's flash_attn.cute and
#                 diffusers): a missing one fails the shard instead of letting its tests skip;
#   pytest        the shard's tests (-rs: each skip with its reason; junit XML; pytest-xdist workers, work stealing
#                 where it has it; pytest-timeout fails a test that runs past GPU_SUITE_TEST_TIMEOUT, 300 s);
#   verify-fsdp   (2/2, only with 2+ GPUs) flexpack verify under torchrun, FSDP2;
#   verify, verify-drop, verify-auto (GPU_SUITE_VERIFY=1): flexpack verify at Wan2.2-5B width (tests/test_verify.py's
#                 CUDA case checks the same property at head dim 128 and 400 tokens, faster).
# Files in $OUT (8 at most come back from the device machine): summary_I.json, suite_I.log, pytest_I.xml,
# pytest_I.log (I = 1of2, 2of2, 1of1), and on the last shard summary.json, the whole suite merged from every
# shard summary this machine has written (/tmp/gpu_suite_state); `python scripts/gpu_suite_summary.py merge
# DIR... --out summary.json` merges copies brought back from several calls.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd); cd "$root"
SHARD=1/1
while [ $# -gt 0 ]; do
  case $1 in
    --shard) SHARD=${2:-}; shift 2 ;;
    --shard=*) SHARD=${1#--shard=}; shift ;;
    *) echo "gpu_suite.sh: unknown argument $1 (use --shard I/N)" >&2; exit 2 ;;
  esac
done
case $SHARD in
  1/1) MARK="gpu"; NEED="" ;;
  1/2) MARK="gpu and not fa4"; NEED="torchao" ;;
  2/2) MARK="gpu and fa4"; NEED="flash_attn.cute diffusers" ;;
  *) echo "gpu_suite.sh: --shard must be 1/1, 1/2 or 2/2, got '$SHARD'" >&2; exit 2 ;;
esac
TAG=${SHARD/\//of}
OUT=${OUT:-out/gpu_suite}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
STATE=/tmp/gpu_suite_state; mkdir -p "$STATE"
PY=${PYTHON:-python3}
BUDGET=${GPU_SUITE_SECONDS:-540}
# NVLink multicast stays off on shared multi-GPU hosts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
log="$OUT/suite_$TAG.log"; : > "$log"
phases="$STATE/phases_$TAG.tsv"; : > "$phases"  # not in $OUT: only 8 files come back from there
exec 3>&1  # the terminal, whatever a phase's output is redirected to
say() { local m="[$(date -u +%H:%M:%S) +${SECONDS}s] $*"; echo "$m" >> "$log"; echo "$m" >&3; }
summary() { "$PY" scripts/gpu_suite_summary.py shard "$OUT" "$phases" "$TAG" >> "$log" 2>&1; }
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$@" >> "$phases"; summary; }

# phase NAME EXPECTED_RC CAP_SECONDS CMD... : runs CMD with the smaller of CAP and the budget left
phase() {
  local name=$1 expected=$2 cap=$3; shift 3
  local left=$((BUDGET - SECONDS - 5)) t0=$SECONDS rc
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$cap" -lt 20 ]; then
    say "$name: not run (budget of ${BUDGET}s spent)"; record "$name" -1 "$expected" 0 "not run: budget spent"; return
  fi
  say "$name: start (cap ${cap}s): $*"
  timeout -s INT -k 15 "$cap" "$@"; rc=$?
  say "$name: exit $rc (expected $expected) after $((SECONDS - t0))s"
  record "$name" "$rc" "$expected" "$((SECONDS - t0))" ""
}


say "flexpack GPU suite, shard $SHARD (-m '$MARK'), in $root -> $OUT (budget ${BUDGET}s)"
phase wheels 0 120 env PYTHON="$PY" bash scripts/gpu_wheels.sh >> "$log" 2>&1
export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$root${PYTHONPATH:+:$PYTHONPATH}"
phase requirements 0 60 "$PY" - $NEED >> "$log" 2>&1 <<'EOF'
import importlib, sys
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "(no CUDA)")
missing = []
for m in ("flash_attn.cute", "diffusers", "torchao", "lerobot"):
    try:
        importlib.import_module(m)
        print(f"{m}: importable")
    except Exception as e:  # noqa: BLE001
        print(f"{m}: missing ({type(e).__name__}: {e})")
        missing += [m] if m in sys.argv[1:] else []
if not torch.cuda.is_available():
    missing.append("CUDA")
if missing:
    print(f"this shard needs {missing}: its tests would skip or fail without them")
sys.exit(1 if missing else 0)
EOF

if [ -n "${GPU_SUITE_VERIFY:-}" ]; then  # flexpack verify at Wan2.2-5B width, the training configuration
  V=(scripts/verify_packing.py configs/wan5b_pack.toml --synthetic --synthetic-hw 8 16 --synthetic-text 64
     --set data.max_tokens=16384 --set runtime.device="'cuda'" --micro-batches 1)
  phase verify 0 150 "$PY" "${V[@]}" --set "model.overrides={attn_backend='flex', num_layers=2}" >> "$log" 2>&1
  phase verify-drop 1 90 "$PY" "${V[@]}" --set "model.overrides={attn_backend='flex', num_layers=2}" \
    --drop-packing >> "$log" 2>&1
  phase verify-auto 0 100 "$PY" "${V[@]}" --set "model.overrides={attn_backend='auto', num_layers=2}" >> "$log" 2>&1
fi

opts=(-m "$MARK" -rs -p no:cacheprovider --durations=25 --junitxml="$OUT/pytest_$TAG.xml")
workers=${GPU_SUITE_WORKERS:-8}  # compiles are CPU-bound: 16 cores
if [ "$workers" -gt 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
  dist=load; "$PY" -c "import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split('.')[:2])) < (3, 2))" \
    2>/dev/null && dist=worksteal  # long compiles finish while idle workers take the rest
  opts+=(-n "$workers" --dist "$dist")
fi
"$PY" -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout "${GPU_SUITE_TEST_TIMEOUT:-300}")
phase pytest 0 "$BUDGET" "$PY" -m pytest "${opts[@]}" tests > "$OUT/pytest_$TAG.log" 2>&1
tail -n 45 "$OUT/pytest_$TAG.log" >> "$log"

if [ "$SHARD" != "1/2" ]; then
  if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)" -ge 2 ]; then
    phase verify-fsdp 0 150 "$PY" -m torch.distributed.run --nproc_per_node 2 scripts/verify_packing.py \
      configs/wan5b_pack.toml --synthetic --synthetic-hw 8 16 --synthetic-text 64 --set data.max_tokens=16384 \
      --set runtime.device="'cuda'" --micro-batches 1 --set "model.overrides={attn_backend='flex', num_layers=2}" \
      >> "$log" 2>&1
  else
    say "verify-fsdp: not run: FSDP2 needs 2 GPUs, this machine has fewer (tests/test_verify.py runs it on gloo)"
    record verify-fsdp -1 any 0 "not run: fewer than 2 GPUs"
  fi
fi
GPU_SUITE_DEVICE_INFO=1 summary
cp "$OUT/summary_$TAG.json" "$STATE/" 2>/dev/null
if [ "$SHARD" != "1/2" ]; then  # the last shard: the whole suite from every shard summary this machine has
  "$PY" scripts/gpu_suite_summary.py merge "$STATE" --out "$OUT/summary.json" >> "$log" 2>&1
fi
say "done: $(tr -d '\n' < "$OUT/summary_$TAG.json" | head -c 400)"
