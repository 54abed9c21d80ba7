#!/usr/bin/env bash
# GPT-2 124M in fp16 with DeepSpeed's dynamic loss scaling on 4 GPUs (ZeRO-2, micro 16,
# the model and optimizer of bench/train-gpu.sh), STEPS steps from a fresh init: prints
# each step's loss, loss scale and gradient norm, the skipped steps (grad_norm -1), the
# tokens/s after the skips, and checks every loss against an fp32 run of the same steps
# (same init and data; within 2e-2 relative, the matrix's fp16 tolerance) — the synthetic
# data are uniform tokens, so the loss can only fall towards ln(50257) = 10.82. Then saves at the last step, converts, and resumes on 2 GPUs for 5 steps: the resumed
# run must keep the saved loss scale.
# usage: bench/fp16-gpu.sh UCKPT [OUT_DIR]   (env: STEPS=60, GPUS=4)
set -euo pipefail
uckpt=$(realpath "${1:?usage: bench/fp16-gpu.sh UCKPT [OUT_DIR]}")
out=$(realpath -m "${2:-fp16-gpu-out}")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEPS=${STEPS:-60} n=${GPUS:-4}
rm -rf "$out" && mkdir -p "$out" && cd "$out"
model="--n_layer 12 --n_head 12 --n_embd 768 --vocab_size 50257 --n_positions 1024 --seq_len 1024"
cfg() {  # cfg GPUS MICRO  (train_batch_size fixed: GA follows the world size)
  cat <<JSON
{"train_batch_size": $((16 * n)), "train_micro_batch_size_per_gpu": $2, "gradient_clipping": 1.0, "steps_per_print": 0,
 "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 6e-4, "warmup_num_steps": 20}},
 "fp16": {"enabled": true, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
 "zero_optimization": {"stage": 2, "overlap_comm": true, "reduce_bucket_size": 50000000}}
JSON
}
cfg "$n" 16 > cfg4.json
sed 's/"fp16": {[^}]*}/"fp16": {"enabled": false}/' cfg4.json > cfg4-fp32.json
CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) "$uckpt" launch -n "$n" --master_port 0 -- "$uckpt" train \
  --config cfg4-fp32.json $model --fused_kernels --device cuda --steps "$STEPS" \
  --log_dir logs --run_name fp32-$n --no_progress > train-fp32.log 2>&1 || { tail -20 train-fp32.log; exit 1; }
CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) "$uckpt" launch -n "$n" --master_port 0 -- "$uckpt" train \
  --config cfg4.json $model --fused_kernels --device cuda --steps "$STEPS" --checkpoint_interval "$STEPS" \
  --checkpoint_dir ckpt --log_dir logs --run_name fp16-$n --no_progress > train.log 2>&1 || { tail -20 train.log; exit 1; }
"$uckpt" convert -q "ckpt/global_step$STEPS" "uni/global_step${STEPS}_universal"
half=$((n / 2))
CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((half - 1))) "$uckpt" launch -n "$half" --master_port 0 -- "$uckpt" train \
  --config cfg4.json $model --fused_kernels --device cuda --steps $((STEPS + 5)) --resume --universal_checkpoint \
  --checkpoint_dir uni --log_dir logs --run_name fp16-$half --no_progress > resume.log 2>&1 || { tail -20 resume.log; exit 1; }
python3 - "logs/fp16-$n/metrics.csv" "logs/fp16-$half/metrics.csv" "$n" "logs/fp32-$n/metrics.csv" <<'PY'
import csv, math, sys
rows = list(csv.DictReader(open(sys.argv[1])))
n = int(sys.argv[3])
ref = {int(r["step"]): float(r["loss"]) for r in csv.DictReader(open(sys.argv[4]))}
print(f"{'step':>5}{'loss':>10}{'fp32 loss':>10}{'scale':>10}{'grad_norm':>11}")
for r in rows:
    s = int(r["step"])
    print(f"{s:>5}{float(r['loss']):>10.4f}{ref.get(s, float('nan')):>10.4f}{float(r['loss_scale']):>10.0f}{float(r['grad_norm']):>11.4f}")
skipped = [int(r["step"]) for r in rows if float(r["grad_norm"]) < 0]
losses = [float(r["loss"]) for r in rows]
ok = all(math.isfinite(l) for l in losses)
applied = [r for r in rows if float(r["grad_norm"]) >= 0]
tail = [r for r in rows if int(r["step"]) > (max(skipped) if skipped else 0) + 2]
tps = sum(float(r["tokens_per_s"]) for r in tail) / max(1, len(tail))
print(f"skipped steps: {skipped}; loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
      f"tokens/s after the skips {tps:.0f} on {n} GPUs")
rel = max(abs(float(r["loss"]) - ref[int(r["step"])]) / ref[int(r["step"])] for r in rows)
print(f"fp16 vs fp32, steps 1..{len(rows)}: max rel loss diff {rel:.2e} (limit 2e-2); loss fell {losses[0] - losses[-1]:.4f} "
      f"(fp32: {ref[1] - ref[len(rows)]:.4f})")
ok &= len(ref) == len(rows) and rel <= 2e-2 and losses[-1] < losses[0]
res = list(csv.DictReader(open(sys.argv[2])))
first = res[0]
print(f"resumed on {n // 2} GPUs (universal, GA 2): step {first['step']} loss {float(first['loss']):.4f} "
      f"scale {float(first['loss_scale']):.0f}; saved scale {float(rows[-1]['loss_scale']):.0f}")
ok &= float(first["loss_scale"]) == float(rows[-1]["loss_scale"]) or float(first["grad_norm"]) < 0
ok &= all(math.isfinite(float(r["loss"])) for r in res)
print("fp16 124M:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
