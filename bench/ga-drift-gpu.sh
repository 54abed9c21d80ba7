#!/usr/bin/env bash
# How far the demo's gradient-accumulation curves drift apart on GPUs, step by step:
# experiment 2 of scripts/demo-gpu.sh (GPT-2 4 x 128, vocab 50257, 128 tokens, batch 32;
# 1 GPU micro 32, 1 GPU micro 8 GA 4, 2 GPUs micro 8 GA 2) for each lr in LRS, and for
# each pair the relative loss difference at steps 1, 10, 25, 50, 75, 100, 150, 200, the
# max, and the first step over 1e-5. Diagnostics for docs/gpu.md, not a test.
# usage: bench/ga-drift-gpu.sh UCKPT OUT_DIR   (env: LRS="6e-4", STEPS=200, FLAGS="")
set -euo pipefail
uckpt=$(realpath "${1:?usage: bench/ga-drift-gpu.sh UCKPT OUT_DIR}")
out=$(realpath -m "${2:?usage: bench/ga-drift-gpu.sh UCKPT OUT_DIR}")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEPS=${STEPS:-200}
rm -rf "$out" && mkdir -p "$out" && cd "$out"
cat /usr/share/common-licenses/{Apache-2.0,Artistic,BSD,GFDL-1.3,GPL-2,GPL-3,LGPL-2.1,LGPL-3,MPL-1.1,MPL-2.0} > data.txt 2>/dev/null ||
  { echo "needs Debian's /usr/share/common-licenses"; exit 2; }
model="--n_layer 4 --n_head 4 --n_embd 128 --vocab_size 50257 --n_positions 128 --seq_len 128"
for lr in ${LRS:-6e-4}; do
  cat > "cfg-$lr.json" <<JSON
{"gradient_clipping": 1.0, "train_batch_size": 32,
 "optimizer": {"type": "AdamW", "params": {"lr": $lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": $lr, "warmup_num_steps": 20}},
 "zero_optimization": {"stage": 2}}
JSON
  run() {  # run NAME NP MICRO
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $(($2 - 1))) "$uckpt" launch -n "$2" --master_port 0 -- "$uckpt" train \
      --config "cfg-$lr.json" --text data.txt $model --device cuda ${FLAGS:-} --train_micro_batch_size_per_gpu "$3" \
      --steps "$STEPS" --log_dir logs --run_name "$1-$lr" --no_progress --threads 1 > "$1-$lr.log" 2>&1 || { tail "$1-$lr.log"; exit 1; }
  }
  run m32 1 32 & run m8ga4 1 8 & wait
  run m8ga2x2 2 8
  python3 - "$lr" <<'PY'
import csv, sys
lr = sys.argv[1]
load = lambda n: {int(r["step"]): float(r["loss"]) for r in csv.DictReader(open(f"logs/{n}-{lr}/metrics.csv"))}
a, b, c = load("m32"), load("m8ga4"), load("m8ga2x2")
for name, x, y in (("m8ga4 vs m32", b, a), ("m8ga2x2 vs m32", c, a), ("m8ga2x2 vs m8ga4", c, b)):
    rel = {s: abs(x[s] - y[s]) / abs(y[s]) for s in y if s in x}
    first = next((s for s in sorted(rel) if rel[s] > 1e-5), None)
    marks = " ".join(f"{s}:{rel[s]:.1e}" for s in (1, 2, 5, 10, 25, 50, 75, 100, 150, 200) if s in rel)
    print(f"lr {lr} {name:<18} max {max(rel.values()):.2e}  first >1e-5: {first}  | {marks}")
print(f"lr {lr} losses m32: " + " ".join(f"{s}:{a[s]:.3f}" for s in (1, 10, 20, 30, 40, 50, 60, 70, 80, 100, 150, 200) if s in a))
PY
done
