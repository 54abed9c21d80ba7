#!/usr/bin/env bash
# uckpt train against a plain PyTorch loop (bench/gpt2_reference_loop.py):
# same initial weights (uckpt train --steps 0, then uckpt export to
# safetensors), same synthetic data, AdamW/WarmupLR/clipping config, fp32, one
# process. Prints the max relative difference of the first STEPS losses and
# PASS/FAIL (limit 1e-5 relative). ZeRO stage 1 on one rank (the same update as
# no ZeRO; stage 0 would keep the optimizer in the model file, which export does not read).
#
# usage: bench/crosscheck-torch.sh UCKPT [cpu|cuda] [WORK_DIR]
#   PYTHON (default python3; on the Debian machine /usr/bin/python3 has torch 1.13)
#   model/batch: defaults are the demo's GPU size (4 layers x 4 heads x 128, vocab 50257,
#   context 128, batch 32 = micro 16 x GA 2, lr 6e-4, warmup 20); override with
#   N_LAYER N_HEAD N_EMBD VOCAB CTX BATCH MICRO STEPS
set -euo pipefail
uckpt=$(realpath "${1:?usage: bench/crosscheck-torch.sh UCKPT [cpu|cuda] [WORK_DIR]}")
device=${2:-cpu}
work=${3:-crosscheck-out-$device}
here=$(cd "$(dirname "$0")" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTHON=${PYTHON:-python3}
L=${N_LAYER:-4} H=${N_HEAD:-4} C=${N_EMBD:-128} V=${VOCAB:-50257} T=${CTX:-128}
B=${BATCH:-32} MB=${MICRO:-16} S=${STEPS:-20} LR=${LR:-6e-4} W=${WARMUP:-20}
rm -rf "$work" && mkdir -p "$work"
cat > "$work/ds.json" <<JSON
{
  "train_batch_size": $B, "train_micro_batch_size_per_gpu": $MB, "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": $LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": $LR, "warmup_num_steps": $W}},
  "zero_optimization": {"stage": 1}, "steps_per_print": 0
}
JSON
model="--n_layer $L --n_head $H --n_embd $C --vocab_size $V --n_positions $T --seq_len $T"
"$uckpt" train --config "$work/ds.json" $model --device "$device" --steps 0 --checkpoint_dir "$work/init" \
  --log_dir "$work/logs" --run_name init --no_progress
"$uckpt" export -q "$work/init" "$work/init.safetensors"
t0=$(date +%s%N)
"$uckpt" train --config "$work/ds.json" $model --device "$device" --init "$work/init.safetensors" --steps "$S" \
  --log_dir "$work/logs" --run_name uckpt --no_progress
t1=$(date +%s%N)
"$PYTHON" "$here/gpt2_reference_loop.py" --init "$work/init.safetensors" --n_layer "$L" --n_head "$H" --n_embd "$C" \
  --vocab_size "$V" --n_positions "$T" --seq_len "$T" --batch "$B" --micro "$MB" --steps "$S" --lr "$LR" \
  --warmup_num_steps "$W" --device "$device" --out "$work/torch_losses.csv" --compare "$work/logs/uckpt/metrics.csv"
t2=$(date +%s%N)
echo "time: uckpt $(( (t1 - t0) / 1000000 )) ms, PyTorch loop $(( (t2 - t1) / 1000000 )) ms"
