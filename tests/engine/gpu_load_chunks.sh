#!/usr/bin/env bash
# A load onto a GPU (pinned staging chunks, asynchronous copies) gives the
# same bits at any staging chunk size: on one GPU, bf16 ZeRO-2,
#   base:    8 steps, checkpoint at 4
#   same:    resume global_step4 (default chunks)     -> steps 5..8 equal base's bit for bit
#   small:   the same with UCKPT_LOAD_CHUNK_BYTES=4160 (pieces cut at every chunk edge)
#   reshard: a 2-rank checkpoint (CPU, padded partitions) resumed on the GPU with default and
#            with small chunks -> equal to each other bit for bit
# Prints PASS/FAIL rows; exit 1 if any fails. DEVICE=cpu runs it on the CPU (to test the
# script; the chunks then go unused: a CPU load reads straight into the tensors).
#
# usage: tests/engine/gpu_load_chunks.sh UCKPT [OUT_DIR]
set -uo pipefail
uckpt=$(realpath "${1:?usage: tests/engine/gpu_load_chunks.sh UCKPT [OUT_DIR]}")
out=$(realpath -m "${2:-gpu-load-chunks-out}")
device=${DEVICE:-cuda}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
rm -rf "$out" && mkdir -p "$out" && cd "$out"
model="--n_layer 2 --n_head 4 --n_embd 64 --vocab_size 512 --n_positions 64 --seq_len 64"
cat > cfg.json <<JSON
{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "steps_per_print": 0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
 "bf16": {"enabled": true}, "zero_optimization": {"stage": 2}}
JSON
fail=0
train() {  # train NRANKS DEVICE RUN_NAME [flags...]
  local n=$1 dev=$2 name=$3; shift 3
  "$uckpt" launch -n "$n" --master_port 0 -- "$uckpt" train --config cfg.json $model --device "$dev" \
    --log_dir logs --run_name "$name" --no_progress --timeout 120 "$@" > "logs-$name.txt" 2>&1 && return 0
  echo "FAIL $name: run failed"; tail -5 "logs-$name.txt"; fail=1; return 1
}
same() {  # same LABEL RUN_A RUN_B: every column of RUN_B's steps equal RUN_A's
  python3 - "$@" <<'PY' || fail=1
import csv, sys
label, a, b = sys.argv[1:4]
read = lambda run: {int(r["step"]): r for r in csv.DictReader(open(f"logs/{run}/metrics.csv"))}
x, y = read(a), read(b)
bad = [s for s in y if any(x[s][k] != y[s][k] for k in ("loss", "lr", "grad_norm", "loss_scale"))]
ok = not bad and len(y) >= 4
print(f"{'PASS' if ok else 'FAIL'} {label}: steps {min(y)}..{max(y)} bit-equal" + (f", differs at {bad[0]}" if bad else ""))
sys.exit(0 if ok else 1)
PY
}
copy() { mkdir -p "$2" && cp -r "$1/global_step4" "$2/" && echo global_step4 > "$2/latest"; }

if train 1 "$device" base --steps 8 --checkpoint_dir ck --checkpoint_interval 4; then
  copy ck ck-same && train 1 "$device" same --steps 8 --checkpoint_dir ck-same --resume &&
    same "resume, default chunks" base same
  copy ck ck-small && UCKPT_LOAD_CHUNK_BYTES=4160 train 1 "$device" small --steps 8 --checkpoint_dir ck-small --resume &&
    same "resume, 4160-byte chunks" base small
  grep -h "loaded" logs-same.txt logs-small.txt
fi
# The 2-rank checkpoint: on 2 GPUs, else on 2 CPU ranks (a CPU build, or a GPU
# build with Gloo); a GPU build without Gloo on one GPU cannot make one.
two_dev=cpu
[ "$device" = cuda ] && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] && two_dev=cuda
if [ "$two_dev" = cpu ] && [ "$device" = cuda ]; then
  echo "SKIP 2 -> 1 ranks: needs 2 GPUs (this GPU build has no Gloo for CPU ranks)"
elif train 2 "$two_dev" two --steps 4 --checkpoint_dir ck2 --checkpoint_interval 4; then
  copy ck2 ck2-a && train 1 "$device" reshard --steps 8 --checkpoint_dir ck2-a --resume
  copy ck2 ck2-b && UCKPT_LOAD_CHUNK_BYTES=4160 train 1 "$device" reshard-small --steps 8 --checkpoint_dir ck2-b --resume &&
    same "2 -> 1 ranks, 4160-byte chunks vs default" reshard reshard-small
fi
exit $fail
