#!/usr/bin/env bash
# A "same or better" check of ZeRO-3 in one device call: builds the working tree
# and, from .old/ (an older commit, e.g. `mkdir .old && git archive OLD | tar -x
# -C .old`, carried), that commit; then ZeRO-3 against FSDP2 on every GPU on the
# tree (SKIP_MEM=1 leaves it out), and ZeRO-3 with parameters and optimizer
# offloaded, old and new alternated twice. First used on 2026-11-26 for issue 24
# (bench/results/2026-11-26.md). Logs into $OUT.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-ab-out}; mkdir -p "$OUT"
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
{ date -u; nvidia-smi -L; nproc; } > "$OUT/env.txt"; cat "$OUT/env.txt"
t0=$SECONDS
(cd .old && scripts/build-gpu.sh /tmp/uckpt-old ../build-gpu-deps) > "$OUT/build-old.txt" 2>&1 &
U=$(scripts/build-gpu.sh /tmp/uckpt-gpu build-gpu-deps) || { echo "build failed"; exit 1; }
wait; echo "built both in $((SECONDS - t0)) s"; tail -1 "$OUT/build-old.txt"
NG=$(nvidia-smi -L | wc -l)
if [ -z "${SKIP_MEM:-}" ]; then
  ZERO=3 GPU_COUNTS=$NG ONLY="uckpt-z3 fsdp2-hf" EXTRA=0 timeout 200 bench/train-gpu.sh "$U" /tmp/t3 > "$OUT/train3-mem.log" 2>&1
  grep -E "^uckpt|^fsdp2|tokens/s .*x" "$OUT/train3-mem.log"
fi
for i in 1 2; do
  for b in old gpu; do
    ZERO=3 GPU_COUNTS=$NG ONLY="uckpt-z3-offload" EXTRA=0 timeout 120 bench/train-gpu.sh /tmp/uckpt-$b/src/cli/uckpt /tmp/ab-$b-$i \
      > "$OUT/offload3-$b-$i.log" 2>&1
    echo "$b run $i: $(grep -E '^uckpt-z3-offload' "$OUT/offload3-$b-$i.log")"
  done
done
echo "total $((SECONDS - t0)) s"
