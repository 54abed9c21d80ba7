#!/usr/bin/env bash
# Lose a GPU, keep training (issue 43), on 4 GPUs: tests/engine/restart_test.sh with GPT-2 124M
# (12 layers x 768, vocab 50257, context 1024), bf16, ZeRO-2, global batch 48 = micro 4 x GA 3/4/6 on
# 4/3/2 GPUs, an async checkpoint every INTERVAL steps. `uckpt launch -n 4 --max_restarts 2`;
# rank 2's process killed (SIGKILL) after KILL_AFTER steps, then rank 1 of the 3 left. Prints the
# seconds from each kill to the first step on the new world, the steps run again, and the loss
# check against an uninterrupted 4-GPU run (the test's tolerances). NGPU=2 (the default on a
# machine of 2 or 3 GPUs): 2 GPUs, rank 1 killed, the job ends on 1 (GA 6 -> 12).
# SNAPSHOT_EVERY=N adds a snapshot in host memory every N steps (docs/reliability.md): the restarts
# then load the newest snapshot, and the run's snapshot cost (blocked seconds, host memory) is printed.
# usage: bench/restart-gpu.sh UCKPT [WORK_DIR]
#   (env: STEPS=40 INTERVAL=5 KILL_AFTER=12 STAGE=2 SNAPSHOT_EVERY= NGPU=4, or 2 where there are fewer)
set -euo pipefail
uckpt=$(realpath "${1:?usage: bench/restart-gpu.sh UCKPT [WORK_DIR]}")
work=$(realpath -m "${2:-/tmp/restart-gpu}")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
have=$(nvidia-smi -L | wc -l)
NGPU=${NGPU:-$((have >= 4 ? 4 : 2))}
[ "$NGPU" = 4 ] || [ "$NGPU" = 2 ] || { echo "restart-gpu: NGPU=$NGPU: 4 or 2" >&2; exit 2; }
[ "$have" -ge "$NGPU" ] || { echo "restart-gpu: needs $NGPU GPUs, this machine has $have" >&2; exit 2; }
export RANKS=$NGPU CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((NGPU - 1)))
export BATCH=48 MICRO=4 STEPS=${STEPS:-40} INTERVAL=${INTERVAL:-5} KILL_AFTER=${KILL_AFTER:-12}
export MODEL_FLAGS="--n_layer 12 --n_head 12 --n_embd 768 --vocab_size 50257 --n_positions 1024 --seq_len 1024"
export TRAIN_FLAGS="--device cuda${SNAPSHOT_EVERY:+ --snapshot-every $SNAPSHOT_EVERY}"
export DS_EXTRA='"bf16": {"enabled": true}' ASYNC_SAVE=1 LOSS_TOL=1e-2  # the demo's bf16 tolerance after a resize
"$(dirname "$(realpath "$0")")/../tests/engine/restart_test.sh" "$uckpt" "$work"
if [ -n "${SNAPSHOT_EVERY:-}" ]; then
  echo "snapshots: the uninterrupted $NGPU-GPU run's; the restarted run's loads, and its last world's:"
  grep -E "uckpt train: snapshots every" "$work/ref.log" || true
  grep -E "from the snapshot in host memory|uckpt train: snapshots every" "$work/r.log" || true
fi
