#!/usr/bin/env bash
# The resume proof's cost (docs/manifest-format.md, "State fingerprint"): the
# time to hash the state at a save (recorded in the manifest) and to check it
# after a load, as a ratio of that save's and that load's own time, in the
# same `uckpt train` runs (uckpt's own timings: "saved ... in", "loaded ...
# in", "state fingerprint ..."). Also the load of the same folder without its
# manifest, where the expected value is computed from the files (DeepSpeed's
# checkpoints). Best of RUNS each.
# Targets: <= 5% of a save on the GPU, <= 10% of a load.
#
# usage: bench/fingerprint.sh UCKPT [WORK_DIR] [RUNS]
#   env DEVICE=cpu|cuda (default cpu), NGPU=1 ranks (cpu: processes), MODEL="--n_layer ..." (default:
#   GPT-2 124M on cuda, a 4-layer 512-wide GPT-2 (~38 M parameters) on cpu), DTYPE=--bf16 (or empty)
set -euo pipefail
uckpt=$(realpath "${1:?usage: bench/fingerprint.sh UCKPT [WORK_DIR] [RUNS]}")
work=$(realpath -m "${2:-/tmp/uckpt-fingerprint-bench}")
runs=${3:-3}
device=${DEVICE:-cpu}
n=${NGPU:-1}
if [ "$device" = cuda ]; then
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1)))
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  model=${MODEL:---n_layer 12 --n_head 12 --n_embd 768 --vocab_size 50257 --n_positions 1024 --seq_len 1024 --fused_kernels}
else
  model=${MODEL:---n_layer 4 --n_head 8 --n_embd 512 --vocab_size 50257 --n_positions 128 --seq_len 128}
fi
dtype=${DTYPE---bf16}
rm -rf "$work" && mkdir -p "$work" && cd "$work"
cat > cfg.json <<JSON
{"train_batch_size": $((2 * n)), "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
 "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "weight_decay": 0.01}},
 "zero_optimization": {"stage": 2}}
JSON
train() {
  "$uckpt" launch -n "$n" --master_port 0 -- "$uckpt" train --config cfg.json $model $dtype --device "$device" \
    --log_dir logs --no_progress --checkpoint_dir s "$@" 2>&1
}
num() { sed -n "s/^uckpt train: $1 \([0-9.]*\) s.*/\1/p" | tail -1; }
save=() save_fp=() load=() load_fp=() bare=() bare_fp=() bare_files=()
for ((i = 0; i < runs; i++)); do
  rm -rf s; sync
  # Saves at steps 1 and 2; the second (buffers warm) is the one timed.
  out=$(train --steps 2 --checkpoint_interval 1 --run_name s$i)
  save+=("$(echo "$out" | sed -n 's/^uckpt train: saved .* in \([0-9.]*\) s$/\1/p' | tail -1)")
  save_fp+=("$(echo "$out" | num 'state fingerprint of the save in')")
  out=$(train --steps 2 --resume --run_name l$i)
  load+=("$(echo "$out" | sed -n 's/^uckpt train: loaded .* in \([0-9.]*\) s$/\1/p')")
  load_fp+=("$(echo "$out" | sed -n 's/^uckpt train: state fingerprint checked.* in \([0-9.]*\) s .*/\1/p')")
  # Without a manifest (as DeepSpeed's folders): expected value from the files.
  # (synced, as the save synced its folder: no write-back of the copy during the timed load)
  cp -r s/global_step2 s/bare && rm s/bare/uckpt-manifest.json && sync
  out=$(train --steps 2 --resume --checkpoint_tag bare --run_name b$i)
  bare+=("$(echo "$out" | sed -n 's/^uckpt train: loaded .* in \([0-9.]*\) s$/\1/p')")
  bare_fp+=("$(echo "$out" | sed -n 's/^uckpt train: state fingerprint checked.* in \([0-9.]*\) s .*/\1/p')")
  bare_files+=("$(echo "$out" | sed -n 's/^uckpt train: state fingerprint checked.* (\([0-9.]*\) s of it for the files.*/\1/p')")
  rm -rf s/bare
done
bytes=$(du -sb s/global_step2 | cut -f1)
# The record (hashed where the state lay: on the GPU with --device cuda)
# against the files (hashed on the host): one value.
"$uckpt" verify --state s/global_step2 2>&1 | grep "state fingerprint" || { echo "verify --state failed" >&2; exit 1; }
python3 - "$bytes" "$device" "$n" "${save[*]}" "${save_fp[*]}" "${load[*]}" "${load_fp[*]}" "${bare[*]}" "${bare_fp[*]}" "${bare_files[*]}" <<'PY'
import sys
nb, device, n = int(sys.argv[1]), sys.argv[2], sys.argv[3]
save, save_fp, load, load_fp, bare, bare_fp, bare_files = (min(float(x) for x in a.split()) for a in sys.argv[4:11])
print(f"== state fingerprint cost, {device}, {n} rank(s), ZeRO-2 tag folder {nb / 1e9:.3f} GB (best of runs)")
print("runs, s: save " + sys.argv[4] + "; load " + sys.argv[6] + "; load without a record " + sys.argv[8])
print(f"save: {save:.3f} s, of it hashing the state {save_fp:.3f} s = {100 * save_fp / save:.1f}% (target <= 5% on the GPU)")
print(f"load: {load:.3f} s, of it the check {load_fp:.3f} s = {100 * load_fp / load:.1f}% (target <= 10%)")
print(f"load without a record (DeepSpeed's): {bare:.3f} s, of it the check {bare_fp:.3f} s = {100 * bare_fp / bare:.1f}%"
      f" ({bare_files:.3f} s of it for the files' value: their layout, the bytes read hashed where they landed)")
# Against the same load with a record less its own check: the whole cost of
# checking a folder without one (what its files cover, the bytes read hashed).
base = load - load_fp
print(f"load without a record against the same load with one, less its check: {bare:.3f} s vs {base:.3f} s"
      f" = +{100 * (bare - base) / base:.1f}% (target <= 10%)")
PY
