#!/usr/bin/env bash
# What a snapshot in host memory at every step costs training (issue 43, docs/reliability.md):
# `uckpt train` on NGPU GPUs (default: all), GPT-2 124M (12 x 768, context 1024), bf16, ZeRO-2,
# global batch 48 (micro-batch 4), no save to disk, without and with --snapshot-every 1. Each is
# run for SHORT and LONG steps and its seconds per step are the slope (time(LONG) - time(SHORT)) /
# (LONG - SHORT): start-up, the first steps and the end cancel out, and everything a snapshot
# costs (the blocked copy, the background write beside training, the folder's upkeep) is in it.
# The two alternate, ROUNDS times; one line per round, then the snapshot summary of the last run.
# usage: bench/snapshot-cost-gpu.sh UCKPT [WORK_DIR]   (env: NGPU, SHORT=10, LONG=50, ROUNDS=2)
set -euo pipefail
uckpt=$(realpath "${1:?usage: bench/snapshot-cost-gpu.sh UCKPT [WORK_DIR]}")
work=$(realpath -m "${2:-/tmp/snapshot-cost-gpu}")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
SHORT=${SHORT:-10} LONG=${LONG:-50} ROUNDS=${ROUNDS:-2}
[ "$LONG" -gt "$SHORT" ] || { echo "snapshot-cost-gpu: LONG ($LONG) must exceed SHORT ($SHORT)" >&2; exit 2; }
rm -rf "$work"
mkdir -p "$work"
cd "$work"
cat > ds.json << 'JSON'
{"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true},
 "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 0.0003}}}
JSON
MODEL="--n_layer 12 --n_head 12 --n_embd 768 --vocab_size 50257 --n_positions 1024 --seq_len 1024"

# run NAME STEPS FLAGS...: seconds of the whole job (launch to exit)
run() {
  local name=$1 steps=$2
  shift 2
  rm -rf "ck-$name" "logs/$name"
  local t0
  t0=$(date +%s.%N)
  "$uckpt" launch -n "$NGPU" --master_port 0 -- "$uckpt" train --config ds.json $MODEL --device cuda --steps "$steps" \
    --checkpoint_interval 0 --checkpoint_dir "ck-$name" --log_dir logs --run_name "$name" --no_progress "$@" \
    > "$name.log" 2>&1 || { tail -20 "$name.log"; echo "snapshot-cost-gpu: run $name failed" >&2; exit 1; }
  python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.3f}')" "$t0" "$(date +%s.%N)"
}
echo "== snapshot cost: GPT-2 124M bf16 ZeRO-2 on $NGPU GPU(s), s/step as the slope over $SHORT -> $LONG steps"
for r in $(seq "$ROUNDS"); do
  off_s=$(run "off-$r-s" "$SHORT") off_l=$(run "off-$r-l" "$LONG")
  on_s=$(run "on-$r-s" "$SHORT" --snapshot-every 1) on_l=$(run "on-$r-l" "$LONG" --snapshot-every 1)
  python3 - "$SHORT" "$LONG" "$off_s" "$off_l" "$on_s" "$on_l" "$r" << 'PY'
import sys
short, long_ = int(sys.argv[1]), int(sys.argv[2])
off_s, off_l, on_s, on_l = map(float, sys.argv[3:7])
off, on = (off_l - off_s) / (long_ - short), (on_l - on_s) / (long_ - short)
print(f"round {sys.argv[7]}: without snapshots {off:.4f} s/step, with one every step {on:.4f} s/step: "
      f"{on / off:.3f}x ({(on - off) * 1000:+.1f} ms per step); jobs {off_s:.1f}/{off_l:.1f} s and {on_s:.1f}/{on_l:.1f} s")
PY
done
grep -h "uckpt train: snapshots every" "on-$ROUNDS-l.log" || true
