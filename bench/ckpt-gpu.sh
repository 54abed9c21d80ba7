#!/usr/bin/env bash
# Checkpoint speed of GPT-2 124M (bf16, ZeRO-2) trained on 4 GPUs: save (every rank
# writes its optimizer partition, rank 0 the model states), `uckpt convert` to the
# universal layout, and loading that at 2 GPUs (each rank reads only its slices),
# plus loading the ZeRO files at 4; bytes moved and GB/s, against `cp -r` (+ sync)
# of the same checkpoint folder on the same disk. Times are uckpt's own (rank 0,
# "saved ... in", "loaded ... in") or wall time (convert, cp). The page cache is
# left as it is (warm after the save): the figures are for a warm cache.
#
# usage: bench/ckpt-gpu.sh UCKPT [WORK_DIR]   (needs 4 GPUs; WORK_DIR on the disk to measure)
set -euo pipefail
uckpt=$(realpath "${1:?usage: bench/ckpt-gpu.sh UCKPT [WORK_DIR]}")
work=$(realpath -m "${2:-/tmp/uckpt-ckpt-bench}")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ "$(nvidia-smi -L | wc -l)" -ge 4 ] || { echo "ckpt-gpu: needs 4 GPUs" >&2; exit 2; }
rm -rf "$work" && mkdir -p "$work" && cd "$work"
model="--n_layer 12 --n_head 12 --n_embd 768 --vocab_size 50257 --n_positions 1024 --seq_len 1024 --fused_kernels"
cat > cfg.json <<JSON
{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
 "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
 "bf16": {"enabled": true}, "zero_optimization": {"stage": 2}}
JSON
now() { date +%s%N; }
secs() { python3 -c "import sys; print(f'{(int(sys.argv[2]) - int(sys.argv[1])) / 1e9:.3f}')" "$1" "$2"; }
train() { "$uckpt" launch -n "$1" --master_port 0 -- "$uckpt" train --config cfg.json $model --device cuda \
            --log_dir logs --no_progress "${@:2}" 2>&1; }

train 4 --run_name save --steps 2 --checkpoint_dir ck | tee save.log | grep "saved"
save_s=$(sed -n 's/.*saved .* in \([0-9.]*\) s/\1/p' save.log | tail -1)
tag=ck/global_step2
save_bytes=$(du -sb "$tag" | cut -f1)

t0=$(now); "$uckpt" convert -q "$tag" ck/global_step2_universal; t1=$(now)
convert_s=$(secs "$t0" "$t1")
univ_bytes=$(du -sb ck/global_step2_universal | cut -f1)

train 2 --run_name load2 --steps 2 --checkpoint_dir ck --resume --universal_checkpoint | tee load2.log | grep "loaded"
load2_s=$(sed -n 's/.*loaded .* in \([0-9.]*\) s/\1/p' load2.log | tail -1)
train 4 --run_name load4 --steps 2 --checkpoint_dir ck --resume | tee load4.log | grep "loaded"
load4_s=$(sed -n 's/.*loaded .* in \([0-9.]*\) s/\1/p' load4.log | tail -1)

t0=$(now); cp -r "$tag" cp_copy; sync; t1=$(now)
cp_s=$(secs "$t0" "$t1")
t0=$(now); cp -r ck/global_step2_universal cp_copy_univ; sync; t1=$(now)
cp_univ_s=$(secs "$t0" "$t1")

python3 - "$save_bytes" "$univ_bytes" "$save_s" "$convert_s" "$load2_s" "$load4_s" "$cp_s" "$cp_univ_s" <<'PY'
import json, sys
sb, ub = int(sys.argv[1]), int(sys.argv[2])
save, conv, l2, l4, cp, cpu = (float(x) for x in sys.argv[3:9])
G = 1e9
rows = [
    ("save at 4 GPUs (ZeRO files, written)", sb, save),
    ("uckpt convert (ZeRO files read + universal written)", sb + ub, conv),
    ("load universal at 2 GPUs (universal folder)", ub, l2),
    ("load ZeRO files at 4 GPUs", sb, l4),
    ("cp -r + sync of the ZeRO folder (read + written)", 2 * sb, cp),
    ("cp -r + sync of the universal folder (read + written)", 2 * ub, cpu),
]
print(f"\n{'operation':<56}{'bytes':>14}{'seconds':>9}{'GB/s':>8}")
for name, b, s in rows:
    print(f"{name:<56}{b:>14}{s:>9.3f}{b / s / G:>8.2f}")
print(f"save vs cp of the same bytes: {(sb / save) / (2 * sb / cp):.2f}x cp's GB/s (cp counted read + write); "
      f"save {save:.3f} s vs cp {cp:.3f} s")
print(json.dumps({"zero_bytes": sb, "universal_bytes": ub, "save_s": save, "convert_s": conv, "load_universal_2gpu_s": l2,
                  "load_zero_4gpu_s": l4, "cp_zero_s": cp, "cp_universal_s": cpu}))
PY
