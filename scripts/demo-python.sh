#!/usr/bin/env bash
# The demo's three experiments (scripts/demo.sh) through the Python API:
# examples/python/train.py, shaped like the demo repository's train.py, with
# `import uckpt as deepspeed`, started by `uckpt launch`, on CPU; the same
# comparisons and tolerances as `make demo`.
#   1. baseline on 4 ranks, checkpoint at the midpoint; resume it on 4 ranks
#      from the ZeRO checkpoint and from its universal conversion;
#   2. gradient accumulation: one global batch as 1 rank x micro M*4,
#      1 rank x micro M x GA 4, 2 ranks x micro M x GA 2;
#   3. the universal checkpoint resumed on 2 ranks (GA doubles);
# plus the negative control (no optimizer state: must fail the comparison).
# Usage: scripts/demo-python.sh [BUILD_DIR]; output in $DEMO_OUT (default demo-out-python/).
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(realpath "${1:-build}")
UCKPT="$build/src/cli/uckpt"
PY=${UCKPT_PYTHON:-/usr/bin/python3}
out=${DEMO_OUT:-demo-out-python}
source scripts/demo-lib.sh
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1

STEPS=${DEMO_STEPS:-20}
MID=$((STEPS / 2))
BATCH=${DEMO_BATCH:-16}
MICRO=${DEMO_MICRO:-4}
TOL_SAME=exact TOL_CHANGED=universal TOL_GA=rel:1e-5

rm -rf "$out"; mkdir -p "$out/logs"
cat >"$out/deepspeed_config.json" <<JSON
{
  "gradient_clipping": 1.0,
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-3, "warmup_num_steps": 5}},
  "zero_optimization": {"stage": 2},
  "steps_per_print": 100000,
  "checkpoint": {"load_universal": false}
}
JSON
echo "== uckpt demo through the Python API (examples/python/train.py), output in $out/"

train() {
  local np=$1 name=$2; shift 2
  local t0=$SECONDS
  "$UCKPT" launch -n "$np" --master_port 0 -- "$PY" examples/python/train.py --deepspeed_config "$out/deepspeed_config.json" \
    --log_dir "$out/logs" --run_name "$name" --steps "$STEPS" "$@" >"$out/logs/$name.out" 2>&1 ||
    { cat "$out/logs/$name.out"; echo "demo-python: $name failed"; exit 1; }
  printf '   %-34s %2d ranks  %3ds\n' "$name" "$np" $((SECONDS - t0))
}

echo "-- experiment 1: baseline, resume from ZeRO and from universal at the same size"
train 4 baseline_4ranks --train_batch_size "$BATCH" --train_micro_batch_size_per_gpu "$MICRO" \
  --checkpoint_dir "$out/ckpt/baseline" --checkpoint_interval "$MID"
copy_checkpoint "$out/ckpt/baseline" "global_step$MID" "$out/ckpt/resume_zero"
train 4 resume_zero_4ranks --train_batch_size "$BATCH" --train_micro_batch_size_per_gpu "$MICRO" \
  --checkpoint_dir "$out/ckpt/resume_zero" --checkpoint_interval 1000 --resume --checkpoint_tag "global_step$MID"
"$UCKPT" convert -q "$out/ckpt/baseline/global_step$MID" "$out/ckpt/universal/global_step${MID}_universal"
echo -n "global_step${MID}_universal" >"$out/ckpt/universal/latest_universal"
train 4 resume_universal_4ranks --train_batch_size "$BATCH" --train_micro_batch_size_per_gpu "$MICRO" \
  --checkpoint_dir "$out/ckpt/universal" --checkpoint_interval 1000 --resume --universal_checkpoint \
  --checkpoint_tag "global_step${MID}_universal"

echo "-- experiment 2: gradient accumulation (global batch $BATCH)"
train 1 ga_1rank_micro${BATCH}_ga1 --train_batch_size "$BATCH" --train_micro_batch_size_per_gpu "$BATCH" --checkpoint_interval 1000 \
  --checkpoint_dir "$out/ckpt/unused"
train 1 ga_1rank_micro${MICRO}_ga4 --train_batch_size "$BATCH" --train_micro_batch_size_per_gpu "$MICRO" --checkpoint_interval 1000 \
  --checkpoint_dir "$out/ckpt/unused"
train 2 ga_2ranks_micro${MICRO}_ga2 --train_batch_size "$BATCH" --train_micro_batch_size_per_gpu "$MICRO" --checkpoint_interval 1000 \
  --checkpoint_dir "$out/ckpt/unused"

echo "-- experiment 3: the universal checkpoint on 2 ranks (GA doubles to 2)"
train 2 resume_universal_2ranks --train_batch_size "$BATCH" --train_micro_batch_size_per_gpu "$MICRO" \
  --checkpoint_dir "$out/ckpt/universal" --checkpoint_interval 1000 --resume --universal_checkpoint \
  --checkpoint_tag "global_step${MID}_universal"
train 2 no_optimizer_states_2ranks --train_batch_size "$BATCH" --train_micro_batch_size_per_gpu "$MICRO" \
  --checkpoint_dir "$out/ckpt/universal" --checkpoint_interval 1000 --resume --universal_checkpoint \
  --checkpoint_tag "global_step${MID}_universal" --no_load_optimizer_states
echo

add_demo_rows "$out/logs" "$BATCH" "$MICRO"
print_table
if [ "$demo_failures" -gt 0 ]; then
  echo "demo-python: $demo_failures comparison(s) FAILED"
  exit 1
fi
echo "demo-python: all comparisons PASS"
