#!/usr/bin/env bash
# Offloaded training against DeepSpeed 0.14.5 (DeepSpeed's source in .ds, carried), and the runs around
# it, one PART per call on a warm 2-GPU machine. First used on 2026-11-26 (bench/results/2026-11-26.md,
# docs/benchmarks.md). Results collect in /tmp/offload-gpu and are copied to $OUT each time:
#   PART=1: build; the disk's write speed (buffered + fsync against O_DIRECT); bench/host_adam_bench at
#           several thread counts with the new and the old job size; ZeRO-1 with the optimizer
#           offloaded at 1 GPU, uckpt alone, the overlapped update with the new and the old job size,
#           and without the overlap, with UCKPT_TIMERS;
#   PART=2: build; issue 23's ZeRO-1 and ZeRO-2 with the optimizer offloaded at 1 and 2 GPUs, uckpt and
#           DeepSpeed 0.14.5 in the same call;
#   PART=3: ZeRO-3 with offload against DeepSpeed at 1 and 2 GPUs; ZeRO-3 without offload against FSDP2
#           at 2 GPUs;
#   PART=4: the Python masked LM against DeepSpeed (bf16, fp16; 1 and 2 GPUs); checkpoint I/O at 2 GPUs;
#   PART=5: (a fresh machine) build; the Python masked LM at 1 GPU again; ZeRO-3 against FSDP2 again;
#   PART=6: (a fresh machine, the last device minutes) build; the big-model benchmark cut to 6 layers and 3
#           steps, uckpt alone: a smoke test of the save published before durable and of resuming it.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-offload-gpu-out}; R=/tmp/offload-gpu; mkdir -p "$OUT" "$R"
t0=$SECONDS
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
U=/tmp/uckpt-gpu/src/cli/uckpt
z1_timers() {  # z1_timers LOG [uckpt train flags]: 25 steps of ZeRO-1 offload at 1 GPU with UCKPT_TIMERS
  local log=$1; shift
  mkdir -p /tmp/z1t && cat > /tmp/z1t/cfg.json <<JSON
{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 16, "gradient_clipping": 1.0, "steps_per_print": 0,
 "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
 "bf16": {"enabled": true},
 "zero_optimization": {"stage": 1, "overlap_comm": true, "reduce_bucket_size": 50000000, "offload_optimizer": {"device": "cpu", "pin_memory": true}}}
JSON
  UCKPT_TIMERS=1 CUDA_VISIBLE_DEVICES=0 timeout 120 $U train --config /tmp/z1t/cfg.json --n_layer 12 --n_head 12 --n_embd 768 --vocab_size 50257 --n_positions 1024 --seq_len 1024 --fused_kernels \
    --device cuda --steps 25 --log_dir /tmp/z1t/logs --run_name "$(basename "$log" .log)" --no_progress "$@" > "$R/$log" 2>&1
  grep -E "timers|tok" "$R/$log" | tail -2
  python3 - "/tmp/z1t/logs/$(basename "$log" .log)/metrics.csv" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if int(r["step"]) > 5]
print("  tokens/s (steps 6-25): %.0f" % (16384 * len(rows) / sum(16384 / float(r["tokens_per_s"]) for r in rows)))
PY
}
case ${PART:-1} in
1)
  { scripts/build-gpu.sh /tmp/uckpt-gpu build-gpu-deps && cmake --build /tmp/uckpt-gpu -j16 --target python host_adam_bench; } \
    > "$R/build.log" 2>&1 || { tail -30 "$R/build.log"; exit 1; }
  echo "== built in $((SECONDS - t0)) s"
  { df -T /tmp; lsblk -o NAME,SIZE,ROTA,TYPE,MOUNTPOINT 2>/dev/null; nproc; lscpu | grep -E "Model name|Socket|Thread|NUMA"; free -g; } > "$R/host.txt" 2>&1
  cat "$R/host.txt"
  { echo "buffered + fsync, 8 GiB:"; dd if=/dev/zero of=/tmp/ddtest bs=64M count=128 conv=fsync 2>&1 | tail -1; rm -f /tmp/ddtest
    echo "O_DIRECT, 8 GiB:"; dd if=/dev/zero of=/tmp/ddtest bs=64M count=128 oflag=direct conv=fsync 2>&1 | tail -1; rm -f /tmp/ddtest
    echo "O_DIRECT, 2 writers x 8 GiB:"; s=$SECONDS
    for i in 1 2; do dd if=/dev/zero of=/tmp/ddtest$i bs=64M count=128 oflag=direct conv=fsync 2>/dev/null & done; wait
    echo "$((SECONDS - s)) s for 16 GiB"; rm -f /tmp/ddtest*; } > "$R/disk.txt" 2>&1
  cat "$R/disk.txt"
  echo "== new job size"; /tmp/uckpt-gpu/bench/host_adam_bench --threads 8,16,24,31,32 --runs 3 | tee "$R/host-adam-new.txt"
  echo "== old job size (256 Ki)"; UCKPT_ADAM_JOB_EXPERIMENT=262144 /tmp/uckpt-gpu/bench/host_adam_bench --threads 16,31,32 --runs 3 | tee "$R/host-adam-old.txt"
  echo "== ZeRO-1 offload, 1 GPU: overlap, new jobs"; z1_timers z1-new.log
  echo "== overlap, old jobs"; UCKPT_ADAM_JOB_EXPERIMENT=262144 z1_timers z1-old.log
  echo "== no overlap, new jobs"; z1_timers z1-new-nooverlap.log --no_overlap_update
  echo "== overlap, new jobs, --threads 16"; z1_timers z1-new-t16.log --threads 16
  ;;
2)
  { scripts/build-gpu.sh /tmp/uckpt-gpu build-gpu-deps && cmake --build /tmp/uckpt-gpu -j16 --target python; } \
    > "$R/build.log" 2>&1 || { tail -30 "$R/build.log"; exit 1; }
  echo "== built in $((SECONDS - t0)) s"
  for z in 1 2; do
    ZERO=$z OFFLOAD=1 GPU_COUNTS="1 2" EXTRA=0 DEEPSPEED_PATH=$(realpath .ds) timeout 260 bench/train-gpu.sh $U \
      /tmp/o12-z$z > "$R/offload12-z$z.log" 2>&1
    grep -E '^(uckpt-z|deepspeed_z|[12] GPUs, uckpt-z[12]-offload /)' "$R/offload12-z$z.log"
    echo "== after ZeRO-$z: $((SECONDS - t0)) s"
  done ;;
3)
  ZERO=3 GPU_COUNTS="1 2" EXTRA=0 ONLY="uckpt-z3-offload deepspeed_z3_offload-hf" DEEPSPEED_PATH=$(realpath .ds) timeout 300 \
    bench/train-gpu.sh $U /tmp/z3o > "$R/offload3.log" 2>&1
  grep -E '^(uckpt-z3|deepspeed_z3|[12] GPUs, uckpt-z3-offload /)' "$R/offload3.log"
  echo "== after ZeRO-3 offload: $((SECONDS - t0)) s"
  ZERO=3 GPU_COUNTS=2 EXTRA=0 ONLY="uckpt-z3 fsdp2-hf" timeout 200 bench/train-gpu.sh $U /tmp/z3 > "$R/train3-2gpu.log" 2>&1
  grep -E '^(uckpt-z3|fsdp2|2 GPUs: uckpt-z3 /)' "$R/train3-2gpu.log" ;;
4)
  GPU_COUNTS="1 2" timeout 420 bench/python-gpu.sh /tmp/uckpt-gpu .ds "$R/python" > "$R/python.log" 2>&1
  grep -vE '^\{' "$R/python.log" | tail -8
  echo "== after the Python path: $((SECONDS - t0)) s"
  NGPU=2 timeout 150 bench/ckpt-io-gpu.sh $U /tmp/ckpt-io 3 > "$R/ckpt-io-2gpu.log" 2>&1
  tail -12 "$R/ckpt-io-2gpu.log" ;;
5)
  { scripts/build-gpu.sh /tmp/uckpt-gpu build-gpu-deps && cmake --build /tmp/uckpt-gpu -j16 --target python; } \
    > "$R/build.log" 2>&1 || { tail -30 "$R/build.log"; exit 1; }
  echo "== built in $((SECONDS - t0)) s"
  GPU_COUNTS=1 timeout 300 bench/python-gpu.sh /tmp/uckpt-gpu .ds "$R/python-1gpu-again" > "$R/python-1gpu-again.log" 2>&1
  grep -vE '^\{' "$R/python-1gpu-again.log" | tail -4
  ZERO=3 GPU_COUNTS=2 EXTRA=0 ONLY="uckpt-z3 fsdp2-hf" timeout 150 bench/train-gpu.sh $U /tmp/z3 > "$R/train3-2gpu-again.log" 2>&1
  grep -E '^(uckpt-z3|fsdp2|2 GPUs: uckpt-z3 /)' "$R/train3-2gpu-again.log" ;;
6)
  { scripts/build-gpu.sh /tmp/uckpt-gpu build-gpu-deps && cmake --build /tmp/uckpt-gpu -j16 --target python; } \
    > "$R/build.log" 2>&1 || { tail -30 "$R/build.log"; exit 1; }
  echo "== built in $((SECONDS - t0)) s"
  IMPLS=uckpt STEPS=3 MODEL="--layers 6" timeout 150 bench/zero3-large-gpu.sh /tmp/uckpt-gpu .ds "$R/zero3-small" 2>&1 |
    grep -v "^{" | grep -E "==|save|load|resume|error|Error" | head -40
  ls -la /tmp/zero3-large 2>/dev/null ;;
esac
cp -r "$R"/. "$OUT"/ 2>/dev/null
echo "part ${PART:-1}: $((SECONDS - t0)) s"
