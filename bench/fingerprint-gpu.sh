#!/usr/bin/env bash
# One device call for the state fingerprint's cost (bench/fingerprint.sh with
# DEVICE=cuda): builds uckpt into its own folder (scripts/build-gpu.sh; the
# fingerprint's CUDA kernel where nvcc is found, else CUDA tensors are hashed
# by tensor ops: the log says which), then the benchmark on 1 GPU and, where
# the machine has more, on all of them. BASELINE=1: then again on 1 GPU built
# without the kernel (the tensor ops, as before it), on the same machine.
# Logs into $OUT.
# usage: bench/fingerprint-gpu.sh [BUILD_DIR] [RUNS]   (build-gpu-deps carried)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-/tmp/uckpt-gpu-fingerprint}
runs=${2:-3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-gpu-fingerprint-out}; mkdir -p "$OUT"
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
{ date -u; nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  command -v nvcc || ls /usr/local/cuda/bin/nvcc; nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
t0=$SECONDS
if ! U=$(scripts/build-gpu.sh "$build" build-gpu-deps); then
  echo "build with the kernel failed; again without it (tensor ops)"
  cp "$build.build.log" "$OUT/build-kernel-failed.log" 2>/dev/null
  cmake -DUCKPT_FINGERPRINT_KERNEL=OFF "$build" > /dev/null && U=$(scripts/build-gpu.sh "$build" build-gpu-deps) || { echo "build failed"; exit 1; }
fi
grep "fingerprint's CUDA kernel\|fingerprinted by tensor ops" "$build.cmake.log" "$build/CMakeCache.txt" | head -3 | tee "$OUT/kernel.txt"
echo "built $U in $((SECONDS - t0)) s"
NG=$(nvidia-smi -L | wc -l)
for n in 1 $([ "$NG" -gt 1 ] && echo "$NG"); do
  s=$SECONDS
  DEVICE=cuda NGPU=$n timeout 240 bench/fingerprint.sh "$U" /tmp/fingerprint-bench-$n "$runs" > "$OUT/fingerprint-${n}gpu.log" 2>&1
  echo "==== $n GPU(s): rc $?, $((SECONDS - s)) s"
  cat "$OUT/fingerprint-${n}gpu.log"
done
if [ "${BASELINE:-0}" = 1 ] && grep -q "UCKPT_FINGERPRINT_KERNEL:BOOL=ON" "$build/CMakeCache.txt"; then
  s=$SECONDS
  cmake -DUCKPT_FINGERPRINT_KERNEL=OFF "$build" > /dev/null && U=$(scripts/build-gpu.sh "$build" build-gpu-deps) || { echo "baseline build failed"; exit 1; }
  echo "rebuilt without the kernel in $((SECONDS - s)) s"
  s=$SECONDS
  DEVICE=cuda NGPU=1 timeout 240 bench/fingerprint.sh "$U" /tmp/fingerprint-bench-ops "$runs" > "$OUT/fingerprint-1gpu-tensorops.log" 2>&1
  echo "==== 1 GPU, tensor ops: rc $?, $((SECONDS - s)) s"
  cat "$OUT/fingerprint-1gpu-tensorops.log"
fi
