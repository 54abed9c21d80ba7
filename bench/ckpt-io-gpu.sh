#!/usr/bin/env bash
# Checkpoint I/O on NGPU GPUs (default 1), GPT-2 124M, bf16, ZeRO-2, one rank per GPU: uckpt's
# synchronous save, async save (time the training loop is blocked, and until
# the checkpoint is published) and resume, against PyTorch DCP's save (+ sync),
# async_save (blocked, and until done + sync) and load on the same model and
# disk, and `cp -r` + `sync` of uckpt's tag folder. uckpt's times are its own
# ("saved ... in", "snapshot ... in", "background save published after",
# "loaded ... in"); each figure is the best of RUNS. The timed sync save's parts
# (UCKPT_TIMERS=1, rank 0; "previous save": waiting for the step-1 save's
# background syncfs) are printed for every run after the table.
# Targets (issue: checkpoints at the speed of the disk): async blocked <= 0.2x
# DCP async_save's blocked time; sync save GB/s >= DCP save's; load >= 5x DCP
# load's speed.
#
# On several GPUs uckpt's figures are rank 0's (every rank writes its own
# partition of the optimizer state in parallel; the save ends when all are
# durable) and PyTorch's model is sharded with FSDP2 (fully_shard), DCP saving
# each rank's shards, the usual way to checkpoint a sharded model in PyTorch.
#
# The load fills the GPU through pinned staging chunks (docs/training.md);
# LOAD_SWEEP="THREADS:CHUNK_BYTES ..." also times it with those
# UCKPT_LOAD_THREADS / UCKPT_LOAD_CHUNK_BYTES settings (best of RUNS each).
#
# usage: bench/ckpt-io-gpu.sh UCKPT [WORK_DIR] [RUNS]   (WORK_DIR on the disk to measure; env NGPU=1)
# (as a gpu-session part: build with scripts/build-gpu.sh, then run this with the built uckpt)
set -euo pipefail
here=$(dirname "$(realpath "$0")")
uckpt=$(realpath "${1:?usage: bench/ckpt-io-gpu.sh UCKPT [WORK_DIR] [RUNS]}")
work=$(realpath -m "${2:-/tmp/uckpt-ckpt-io-gpu}")
runs=${3:-3}
export NGPU=${NGPU:-1}
export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((NGPU - 1)))
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
rm -rf "$work" && mkdir -p "$work" && cd "$work"
model="--n_layer 12 --n_head 12 --n_embd 768 --vocab_size 50257 --n_positions 1024 --seq_len 1024 --fused_kernels"
for async in false true; do
  cat > cfg_$async.json <<JSON
{"train_batch_size": $((4 * NGPU)), "train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
 "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
 "bf16": {"enabled": true}, "zero_optimization": {"stage": 2}, "checkpoint": {"async_save": $async}}
JSON
done
train() { "$uckpt" launch -n "$NGPU" --master_port 0 -- "$uckpt" train --config "cfg_$1.json" $model --device cuda --log_dir logs --no_progress "${@:2}" 2>&1; }
pick() { sed -n "s/^uckpt train: $1.* in \([0-9.]*\) s.*/\1/p" | tail -1; }
save=() blocked=() total=() load=() cps=() parts=()
for ((i = 0; i < runs; i++)); do
  rm -rf s a cp_copy; sync
  # Saves at steps 1 and 2; the second (buffers warm) is the one timed.
  out=$(UCKPT_TIMERS=1 train false --steps 2 --checkpoint_interval 1 --checkpoint_dir s --run_name s$i)
  parts+=("$(echo "$out" | sed -n 's/^uckpt save timers (rank 0): //p' | tail -1)")
  # returned ("saved ... in"), then durable (a new tag is synced after the save returns)
  durable=$(echo "$out" | sed -n 's/^uckpt train: last save durable after \([0-9.]*\) s.*/\1/p')
  save+=("$(python3 -c "print($(echo "$out" | pick saved) + ${durable:-0})")")
  sync
  # Async: saves at steps 100 and 200, far enough apart that the first is
  # published before the second starts (a save waits for the previous one, and
  # that wait is not the snapshot's cost); the second (buffers warm) is timed.
  out=$(train true --steps 200 --checkpoint_interval 100 --checkpoint_dir a --run_name a$i)
  b=$(echo "$out" | pick snapshot)
  more=$(echo "$out" | sed -n 's/^uckpt train: background save published after \([0-9.]*\) s.*/\1/p')
  blocked+=("$b"); total+=("$(python3 -c "print($b + $more)")")
  sync
  load+=("$(train false --steps 2 --checkpoint_dir s --resume --run_name l$i | pick loaded)")
  sync
  t0=$(date +%s.%N); cp -r s/global_step2 cp_copy; sync -f cp_copy; t1=$(date +%s.%N)
  cps+=("$(python3 -c "print($t1 - $t0)")")
done
sweep=()
for setting in ${LOAD_SWEEP:-}; do
  times=()
  for ((i = 0; i < runs; i++)); do
    times+=("$(UCKPT_LOAD_THREADS=${setting%%:*} UCKPT_LOAD_CHUNK_BYTES=${setting##*:} \
               train false --steps 2 --checkpoint_dir s --resume --run_name w$i | pick loaded)")
  done
  sweep+=("$setting=$(printf '%s\n' "${times[@]}" | sort -g | head -1)")
done
bytes=$(du -sb s/global_step2 | cut -f1)
if [ "$NGPU" = 1 ]; then
  dcp=$(python3 "$here/dcp_ckpt_bench.py" "$work/dcp" "$runs" | tail -1)
else
  dcp=$(python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" "$here/dcp_ckpt_bench.py" "$work/dcp" \
    "$runs" 2> dcp.err | grep '^{' | tail -1)
  [ -n "$dcp" ] || { cat dcp.err >&2; exit 1; }
fi
python3 - "$bytes" "$dcp" "${save[*]}" "${blocked[*]}" "${total[*]}" "${load[*]}" "${cps[*]}" "${sweep[*]:-}" <<'PY'
import json, os, sys
nb = int(sys.argv[1]); d = json.loads(sys.argv[2])
u = [min(float(x) for x in a.split()) for a in sys.argv[3:8]]
save, blocked, total, load, cps = u
G = 1e9
ds, dab, dat, dl = (min(d[k]) for k in ("save_s", "async_blocked_s", "async_total_s", "load_s"))
print(f"== GPT-2 124M, {os.environ.get('NGPU', '1')} GPU(s): uckpt bf16 ZeRO-2 tag folder {nb / G:.2f} GB; DCP (torch {d['torch']}) fp32 + AdamW {d['bytes'] / G:.2f} GB")
print(f"{'':34}{'uckpt s':>9}{'GB/s':>7}{'DCP s':>9}{'GB/s':>7}{'uckpt/DCP time':>16}")
rows = [("sync save (durable)", save, nb, ds, d["bytes"]), ("async save: blocked", blocked, None, dab, None),
        ("async save: until durable", total, nb, dat, d["bytes"]), ("load", load, nb, dl, d["bytes"])]
for name, a, ab, b, bb in rows:
    ga = f"{ab / a / G:7.2f}" if ab else " " * 7
    gb = f"{bb / b / G:7.2f}" if bb else " " * 7
    print(f"{name:34}{a:9.3f}{ga}{b:9.3f}{gb}{a / b:16.2f}")
print(f"{'cp -r + sync of the tag folder':34}{cps:9.3f}{nb / cps / G:7.2f}")
for item in sys.argv[8].split():
    setting, t = item.split("=")
    threads, chunk = setting.split(":")
    print(f"{f'load: {threads} threads, {chunk} B':34}{float(t):9.3f}{nb / float(t) / G:7.2f}"
          f"{'':16}{(nb / float(t)) / (d['bytes'] / dl):7.2f}x DCP's speed")
print(f"targets: async blocked <= 0.2x DCP's: {blocked / dab:.2f}x; sync save GB/s >= DCP's: "
      f"{(nb / save) / (d['bytes'] / ds):.2f}x; load speed >= 5x DCP's: {(nb / load) / (d['bytes'] / dl):.2f}x; "
      f"sync save / (cp -r + sync): {save / cps:.2f}")
PY
for p in "${parts[@]}"; do echo "sync save parts (rank 0): $p"; done
