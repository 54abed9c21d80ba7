#!/usr/bin/env bash
# The lead's last device calls of 2026-11-26's fifth session, one PART per call on one warm 2 x H100 machine
# (each call's $OUT is fresh, so results collect in /tmp/lead5 and are copied to $OUT each time):
#   PART=1: build; issue 25's big-model benchmark, uckpt (train at 2 GPUs, resume at 1 and at 2);
#   PART=2: the same for DeepSpeed 0.14.5 (its summary compares both); issue 23's ZeRO-1 and ZeRO-2 with the
#           optimizer offloaded at 1 GPU, uckpt and DeepSpeed in the same call;
#   PART=3: issue 23's ZeRO-3 without offload against FSDP2 at 2 GPUs, and ZeRO-3 with offload against
#           DeepSpeed at 1 GPU.
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-lead5-out}; R=/tmp/lead5; mkdir -p "$OUT" "$R"
t0=$SECONDS
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
case ${PART:-1} in
1)
  { scripts/build-gpu.sh /tmp/uckpt-gpu build-gpu-deps && cmake --build /tmp/uckpt-gpu -j16 --target python; } > "$R/build.log" 2>&1 ||
    { tail -30 "$R/build.log"; exit 1; }
  echo "== built in $((SECONDS - t0)) s"
  IMPLS=uckpt timeout 480 bench/zero3-large-gpu.sh /tmp/uckpt-gpu .ds "$R/zero3-large" 2>&1 | grep -v "^{" ;;
2)
  IMPLS=deepspeed timeout 330 bench/zero3-large-gpu.sh /tmp/uckpt-gpu .ds "$R/zero3-large" 2>&1 | grep -v "^{"
  echo "== after DeepSpeed's big model: $((SECONDS - t0)) s"
  for z in 1 2; do
    ZERO=$z OFFLOAD=1 GPU_COUNTS=1 EXTRA=0 DEEPSPEED_PATH=$(realpath .ds) timeout 100 bench/train-gpu.sh /tmp/uckpt-gpu/src/cli/uckpt \
      /tmp/o12-z$z > "$R/offload12-z$z-1gpu.log" 2>&1
    grep -E '^(uckpt-z|deepspeed_z|1 GPUs, uckpt-z[12]-offload /)' "$R/offload12-z$z-1gpu.log"
  done ;;
3)
  ZERO=3 GPU_COUNTS=2 EXTRA=0 Z3_BUCKETS=10000000 ONLY="uckpt-z3 uckpt-z3-rb10000000 fsdp2-hf" timeout 200 bench/train-gpu.sh /tmp/uckpt-gpu/src/cli/uckpt /tmp/z3 \
    > "$R/train3-2gpu.log" 2>&1
  grep -E '^(uckpt-z3|fsdp2|2 GPUs: uckpt-z3 /|uckpt timers)' "$R/train3-2gpu.log"
  ZERO=3 GPU_COUNTS=1 EXTRA=0 ONLY="uckpt-z3-offload deepspeed_z3_offload-hf" DEEPSPEED_PATH=$(realpath .ds) timeout 200 \
    bench/train-gpu.sh /tmp/uckpt-gpu/src/cli/uckpt /tmp/z3o > "$R/offload3-1gpu.log" 2>&1
  grep -E '^(uckpt-z3|deepspeed_z3|1 GPUs, uckpt-z3-offload /)' "$R/offload3-1gpu.log" ;;
esac
cp -r "$R"/. "$OUT"/ 2>/dev/null
echo "part ${PART:-1}: $((SECONDS - t0)) s"
