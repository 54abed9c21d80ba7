#!/usr/bin/env bash
# The lead's device calls of 2026-11-26's seventh session, one PART per call on one warm 2 x H100 machine
# (results collect in /tmp/lead7 and are copied to $OUT each time):
#   PART=1: build; issue 25's big-model benchmark, uckpt (train at 2 GPUs, resume at 1 and at 2);
#   PART=2: the same for DeepSpeed 0.14.5 (its summary compares both);
#   PART=3: rebuild; issue 23's ZeRO-3 without offload against FSDP2 at 2 GPUs.
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-lead7-out}; R=/tmp/lead7; mkdir -p "$OUT" "$R"
t0=$SECONDS
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
build() {
  { scripts/build-gpu.sh /tmp/uckpt-gpu build-gpu-deps && cmake --build /tmp/uckpt-gpu -j16 --target python; } > "$R/build-$1.log" 2>&1 ||
    { tail -30 "$R/build-$1.log"; exit 1; }
  echo "== built in $((SECONDS - t0)) s"
}
case ${PART:-1} in
1)
  build 1
  { nproc; free -g; df -h /tmp; which nsys ncu; nvidia-smi -L; git log --oneline -1; } > "$R/host.txt" 2>&1
  IMPLS=uckpt timeout 480 bench/zero3-large-gpu.sh /tmp/uckpt-gpu .ds "$R/zero3-large" 2>&1 | grep -v "^{" ;;
2)
  IMPLS=deepspeed timeout 520 bench/zero3-large-gpu.sh /tmp/uckpt-gpu .ds "$R/zero3-large" 2>&1 | grep -v "^{" ;;
3)
  build 3
  for k in 1 2; do
    ZERO=3 GPU_COUNTS=2 EXTRA=0 ONLY="uckpt-z3 fsdp2-hf" timeout 200 bench/train-gpu.sh /tmp/uckpt-gpu/src/cli/uckpt /tmp/z3 \
      > "$R/train3-2gpu-$k.log" 2>&1
    grep -E '^(uckpt-z3|fsdp2|2 GPUs: uckpt-z3 /|uckpt timers)' "$R/train3-2gpu-$k.log"
  done ;;
esac
cp -r "$R"/. "$OUT"/ 2>/dev/null
echo "part ${PART:-1}: $((SECONDS - t0)) s"
