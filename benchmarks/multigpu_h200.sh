#!/usr/bin/env bash
# Several GPUs of one host, in one command: FSDP2 training steps of the full 30-layer LingBot-VA-5B and the Wan2.2-5B
# shape of WanVA (batch 1 x accumulation vs packed micro-steps, bf16 and float8 all-gather, every block checkpointed,
# 128 episodes a step), weak scaling from 1 to N GPUs, `flexpack verify` under FSDP2, and a run stopped on N GPUs and
# resumed on N/2. Everything lands in $OUT (default benchmarks/results/multigpu_xN): step_multigpu_h200xN.json,
# resume_h200xN.json, verify_*.txt and a log per stage; `summary.txt` lists the stages that passed and failed.
#
#   benchmarks/multigpu_h200.sh 8                       # every stage (roughly 40-60 min on 8 H200s)
#   benchmarks/multigpu_h200.sh 8 resume verify         # some stages: resume verify lingbot_bf16 lingbot_float8
#                                                       #   wan_bf16 wan_float8 weak1 weakN
#   FLEXPACK_SMOKE=1 benchmarks/multigpu_h200.sh 2      # CPU, gloo, tiny models: every python part, ~2-3 min
#
# Float8 needs torchao: carry .gpuwheels-mem (benchmarks/memory_carry.sh); installed here into /tmp/site.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the like).
set -uo pipefail
n=${1:?usage: multigpu_h200.sh N [STAGE ...]  (FLEXPACK_SMOKE=1 for the CPU smoke path)}
shift
[[ $n =~ ^[0-9]+$ && $n -ge 2 && $((n % 2)) -eq 0 ]] || { echo "N must be an even number >= 2, got $n" >&2; exit 2; }
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(resume verify lingbot_bf16 lingbot_float8 wan_bf16 wan_float8 weak1 weakN)
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-benchmarks/results/multigpu_x$n}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
smoke=()
if [ "${FLEXPACK_SMOKE:-0}" = 1 ]; then
  smoke=(--smoke)
  export OMP_NUM_THREADS=1
else
  [ -d .gpuwheels-mem ] && "$PY" benchmarks/install_wheels.py .gpuwheels-mem
  export PYTHONPATH=/tmp/site:$root${PYTHONPATH:+:$PYTHONPATH}
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
fi
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
json=$out/step_multigpu_h200x$n.json
per_gpu=16  # weak scaling: episodes per GPU and step (128 on 8 GPUs)
[ ${#smoke[@]} -gt 0 ] && per_gpu=4

launch() {  # launch RANKS ARGS...: torchrun on one host
  local ranks=$1
  shift
  "$PY" -m torch.distributed.run --standalone --nproc_per_node "$ranks" "$@"
}
passed=()
failed=()
stage() {  # stage NAME COMMAND...: its output in $out/NAME.log
  local name=$1
  shift
  echo "== $name: $*"
  if "$@" 2>&1 | tee "$out/$name.log"; then passed+=("$name"); else failed+=("$name"); fi
}
bench() {  # bench RANKS ARGS...: benchmarks/step_multigpu.py, the full models with every block checkpointed
  local ranks=$1
  shift
  launch "$ranks" benchmarks/step_multigpu.py --layers 30 --activation-checkpointing true --variants batch1,packed \
    --out "$json" "${smoke[@]}" "$@"
}
verify() {  # verify NAME ARGS...: flexpack verify of a small synthetic run under FSDP2 on N ranks
  local name=$1
  shift
  local dev=(--set "runtime.device='cuda'" --set parallel.compile=true --set "model.overrides.attn_backend='flex'")
  [ ${#smoke[@]} -gt 0 ] && dev=(--set "runtime.device='cpu'")
  launch "$n" -m flexpack.cli verify configs/tiny_cpu.toml --synthetic --micro-batches 2 \
    --set "runtime.dtype='bfloat16'" "${dev[@]}" "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  cat "$out/$name.txt"
  return $rc
}
verify_both() {  # packed == per-episode passes; with the packing dropped it must fail (exit status 1)
  verify verify_fsdp || return 1
  verify verify_fsdp_dropped --drop-packing
  [ $? -eq 1 ] && grep -q MISMATCH "$out/verify_fsdp_dropped.txt"
}
resume() {  # stopped on N ranks, resumed on N/2
  rm -rf "$out/resume"
  launch "$n" benchmarks/resume_multigpu.py first "$out/resume" "${smoke[@]}" &&
    launch $((n / 2)) benchmarks/resume_multigpu.py second "$out/resume" "${smoke[@]}" &&
    "$PY" benchmarks/resume_multigpu.py check "$out/resume" --out "$out/resume_h200x$n.json"
}

for s in "${stages[@]}"; do
  case $s in
    resume) stage resume resume ;;
    verify) stage verify verify_both ;;
    lingbot_bf16) stage "$s" bench "$n" --family lingbot --float8 off --global-episodes 128 ;;
    lingbot_float8) stage "$s" bench "$n" --family lingbot --float8 tensorwise --global-episodes 128 ;;
    wan_bf16) stage "$s" bench "$n" --family wan --float8 off --global-episodes 128 ;;
    wan_float8) stage "$s" bench "$n" --family wan --float8 tensorwise --global-episodes 128 ;;
    weak1) stage "$s" bench 1 --family lingbot --float8 off --episodes-per-gpu "$per_gpu" ;;
    weakN)  # the lingbot_bf16 stage already is the N-GPU point where N x per_gpu = 128
      if [ $((n * per_gpu)) -ne 128 ] || [ ${#smoke[@]} -gt 0 ]; then
        stage "$s" bench "$n" --family lingbot --float8 off --episodes-per-gpu "$per_gpu"
      fi ;;
    *) echo "unknown stage $s (resume verify lingbot_bf16 lingbot_float8 wan_bf16 wan_float8 weak1 weakN)" >&2
       failed+=("$s") ;;
  esac
done
{ echo "passed: ${passed[*]:-}"; echo "failed: ${failed[*]:-}"; } | tee "$out/summary.txt"
[ ${#failed[@]} -eq 0 ]
