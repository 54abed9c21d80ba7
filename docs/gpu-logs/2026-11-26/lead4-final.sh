#!/usr/bin/env bash
# The lead's last device call of 2026-11-26 (fourth session): builds the tree and old d3e0bd5 (.old, carried)
# with their Python packages, then
#   1. issue 24: the masked LM through the Python API, tree first then old, LAST steps (ab24.sh);
#   2. issue 26: DeepSpeedExamples' scripts with only their imports changed (bench/ds-examples-gpu.sh, all cases);
#   3. issue 23: ZeRO-1 and ZeRO-2 with the optimizer offloaded at 1 GPU, uckpt only (DeepSpeed's figures on
#      this machine type: docs/gpu-logs/2026-11-26/offload12-z{1,2}-1gpu-h100.log).
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-final-out}; mkdir -p "$OUT"
t0=$SECONDS
OUT=$OUT/ab PARTS=python PAIRS=${PAIRS:-1} ORDER="gpu old" LAST=${LAST:-200} docs/gpu-logs/2026-11-26/ab24.sh
echo "== after the A/B: $((SECONDS - t0)) s"
TIMEOUT_S=120 bench/ds-examples-gpu.sh build-dsx /tmp/uckpt-gpu /tmp/dsx 2>&1 | grep -E "^(PASS|FAIL|==)"
cp /tmp/dsx/*.log "$OUT/" 2>/dev/null
echo "== after the scripts: $((SECONDS - t0)) s"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
for z in ${OFFLOAD_STAGES:-1 2}; do
  ZERO=$z OFFLOAD=1 GPU_COUNTS=1 ONLY="uckpt-z$z-offload" EXTRA=0 timeout 90 bench/train-gpu.sh /tmp/uckpt-gpu/src/cli/uckpt \
    /tmp/o12-z$z > "$OUT/offload12-z$z-1gpu.log" 2>&1
  grep -E '^uckpt-z[12]-offload' "$OUT/offload12-z$z-1gpu.log"
done
echo "total $((SECONDS - t0)) s"
