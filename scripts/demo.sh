#!/usr/bin/env bash
# The README's main job (`make demo`): the universal-checkpoint demo's three
# experiments on CPU, scaled down to run in minutes on 2 cores.
#   1. baseline on 4 ranks, checkpoint at the midpoint; resume it on 4 ranks
#      from the ZeRO checkpoint and from its universal conversion;
#   2. gradient accumulation: 1 rank micro M*4 GA 1, 1 rank micro M GA 4,
#      2 ranks micro M GA 2 (one global batch);
#   3. resume the universal checkpoint on 2 ranks (GA doubles);
# plus a negative control (a resume without the optimizer state must fail the
# comparison). Prints a table and exits non-zero when a comparison fails.
# The README's "demo by hand" is this script, command by command.
# Usage: scripts/demo.sh [--stage N] [BUILD_DIR] ; output in $DEMO_OUT (default demo-out/).
#   --stage 3 (the default; the original demo's configuration): ZeRO-3 with parameters and
#             optimizer offloaded to CPU; --stage 1 or 2: that stage, no offload.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${DEMO_STAGE:-3}
if [ "${1:-}" = --stage ]; then STAGE=${2:?--stage needs 1, 2 or 3}; shift 2; fi
case $STAGE in 1|2|3) ;; *) echo "demo: --stage must be 1, 2 or 3, got '$STAGE'" >&2; exit 2 ;; esac
build=${1:-build}
UCKPT=$(realpath "$build/src/cli/uckpt")
out=${DEMO_OUT:-demo-out}
source scripts/demo-lib.sh

# Scaled-down sizes (the original demo's: GPT-2 default model, 200 steps, batch 256,
# micro 64, checkpoint at 100; scripts/demo-gpu.sh sets those through these
# variables). Experiment 2 keeps the original demo's batch 32 = 32x1 = 8x4 = 8x2x2.
STEPS=${DEMO_STEPS:-100}
MID=$((STEPS / 2))
BATCH=${DEMO_BATCH:-32}      # experiments 1 and 3
MICRO=${DEMO_MICRO:-8}       # experiment 1: 4 ranks x MICRO x GA 1; experiment 3: 2 ranks, GA 2
read -r -a MODEL <<<"${DEMO_MODEL:---n_layer 2 --n_head 4 --n_embd 64 --vocab_size 256 --n_positions 64 --seq_len 64}"
read -r -a RUN_FLAGS <<<"${DEMO_RUN_FLAGS:-}"   # e.g. --device cuda --bf16
LR=${DEMO_LR:-2e-3}          # AdamW, reached after WARMUP steps of WarmupLR
WARMUP=${DEMO_WARMUP:-10}
TOL_SAME=${DEMO_TOL_SAME:-exact}
TOL_CHANGED=${DEMO_TOL_CHANGED:-universal}
TOL_GA=${DEMO_TOL_GA:-rel:1e-5}
DEMO_SCALED=${DEMO_SCALED-"scaled down from the original demo's sizes: GPT-2 with ${MODEL[*]}
   (byte-level, trained on Debian's license texts), $STEPS steps (not 200), global batch $BATCH (not 256),
   micro $MICRO (not 64), checkpoint at step $MID (not 100); experiment 2 at the original demo's sizes (batch 32)"}

rm -rf "$out"; mkdir -p "$out/logs" "$out/plots"
# The data: the license texts every Debian system ships (package base-files),
# as bytes: the same on every machine, whatever the checkout.
cat /usr/share/common-licenses/{Apache-2.0,Artistic,BSD,GFDL-1.3,GPL-2,GPL-3,LGPL-2.1,LGPL-3,MPL-1.1,MPL-2.0} >"$out/data.txt"
zero="{\"stage\": $STAGE}"
if [ "$STAGE" = 3 ]; then
  zero='{"stage": 3, "offload_param": {"device": "cpu", "pin_memory": true}, "offload_optimizer": {"device": "cpu", "pin_memory": true}}'
fi
cat >"$out/ds_config.json" <<JSON
{
  "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": $LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": $LR, "warmup_num_steps": $WARMUP}},
  "zero_optimization": $zero
}
JSON

where="CPU (Gloo)"; [[ " ${RUN_FLAGS[*]} " == *" --device cuda"* ]] && where="GPUs (NCCL)"
echo "== uckpt demo: three experiments on $where, output in $out/"
echo "   ZeRO stage $STAGE$([ "$STAGE" = 3 ] && echo ", parameters and optimizer offloaded to CPU (the original demo's configuration)")"
echo "   $DEMO_SCALED"
echo "   tolerances: same size $TOL_SAME; changed size $TOL_CHANGED; gradient accumulation $TOL_GA"
echo

# train NP RUN_NAME TRAIN_FLAGS...: one job of NP ranks, logs in $out/logs/RUN_NAME
train() {
  local np=$1 name=$2; shift 2
  local t0=$SECONDS
  local threads=${DEMO_THREADS:-1}   # 1: more spins and thrashes on a loaded 2-core machine
  "$UCKPT" launch -n "$np" --master_port 0 -- "$UCKPT" train --config "$out/ds_config.json" \
    --text "$out/data.txt" "${MODEL[@]}" --log_dir "$out/logs" --run_name "$name" --threads $threads "${RUN_FLAGS[@]}" --no_progress \
    --timeout 120 "$@" >"$out/logs/$name.out" 2>&1 || { cat "$out/logs/$name.out"; echo "demo: $name failed"; exit 1; }
  printf '   %-34s %2d ranks  %3ds  %s\n' "$name" "$np" $((SECONDS - t0)) "$(grep -m1 'world size' "$out/logs/$name.out" | sed 's/.*ZeRO/ZeRO/')"
}
start=$SECONDS

echo "-- experiment 1: baseline, resume from ZeRO and from universal at the same size"
train 4 baseline_4ranks --steps "$STEPS" --train_batch_size $BATCH --train_micro_batch_size_per_gpu $MICRO \
  --checkpoint_dir "$out/ckpt/baseline" --checkpoint_interval "$MID"
# Resumed runs save their own step $STEPS, so the ZeRO resume works in a copy
# of the tag; the universal resumes share the converted folder (each reads
# latest_universal, which saving never rewrites).
mkdir -p "$out/ckpt/resume_zero" && cp -r "$out/ckpt/baseline/global_step$MID" "$out/ckpt/resume_zero/"
train 4 resume_zero_4ranks --steps "$STEPS" --train_batch_size $BATCH --train_micro_batch_size_per_gpu $MICRO \
  --checkpoint_dir "$out/ckpt/resume_zero" --resume --checkpoint_tag "global_step$MID"
"$UCKPT" convert -q "$out/ckpt/baseline/global_step$MID" "$out/ckpt/universal/global_step${MID}_universal"
echo "   uckpt convert ckpt/baseline/global_step$MID -> ckpt/universal/global_step${MID}_universal"
train 4 resume_universal_4ranks --steps "$STEPS" --train_batch_size $BATCH --train_micro_batch_size_per_gpu $MICRO \
  --checkpoint_dir "$out/ckpt/universal" --resume --universal_checkpoint

echo "-- experiment 2: gradient accumulation (global batch 32)"
train 1 ga_1rank_micro32_ga1 --steps "$STEPS" --train_batch_size 32 --train_micro_batch_size_per_gpu 32
train 1 ga_1rank_micro8_ga4 --steps "$STEPS" --train_batch_size 32 --train_micro_batch_size_per_gpu 8
train 2 ga_2ranks_micro8_ga2 --steps "$STEPS" --train_batch_size 32 --train_micro_batch_size_per_gpu 8

echo "-- experiment 3: the universal checkpoint on 2 ranks (micro $MICRO, GA doubles to 2)"
train 2 resume_universal_2ranks --steps "$STEPS" --train_batch_size $BATCH --train_micro_batch_size_per_gpu $MICRO \
  --checkpoint_dir "$out/ckpt/universal" --resume --universal_checkpoint
echo "-- negative control: the same resume without the optimizer state (load_optimizer_states=false)"
train 2 no_optimizer_states_2ranks --steps "$STEPS" --train_batch_size $BATCH --train_micro_batch_size_per_gpu $MICRO \
  --checkpoint_dir "$out/ckpt/universal" --resume --universal_checkpoint --no_load_optimizer_states

plot() { "$UCKPT" plot "$@" 2>/dev/null; }
exts=svg; command -v rsvg-convert >/dev/null && exts="svg png"   # PNG needs librsvg2-bin
for ext in $exts; do
  plot "$out/logs/baseline_4ranks" "$out/logs/resume_zero_4ranks" "$out/logs/resume_universal_4ranks" \
    --resume-step "$MID" --title "1. resume at step $MID on 4 ranks (ZeRO and universal)" -o "$out/plots/1_resume.$ext"
  plot "$out/logs/ga_1rank_micro32_ga1" "$out/logs/ga_1rank_micro8_ga4" "$out/logs/ga_2ranks_micro8_ga2" \
    --title "2. gradient accumulation, global batch 32" -o "$out/plots/2_gradient_accumulation.$ext"
  plot "$out/logs/baseline_4ranks" "$out/logs/resume_universal_2ranks" "$out/logs/no_optimizer_states_2ranks" \
    --resume-step "$MID" --title "3. universal checkpoint resumed on 2 ranks (GA 2)" -o "$out/plots/3_universal_2ranks.$ext"
done
echo "   plots: $(cd "$out/plots" && echo *)  (in $out/plots/)"
echo

add_demo_rows "$out/logs" 32 8
print_table
echo
echo "demo: $((SECONDS - start)) s; logs (metrics.csv, TensorBoard events) in $out/logs/, plots in $out/plots/"
if [ "$demo_failures" -gt 0 ]; then
  echo "demo: $demo_failures comparison(s) FAILED"
  exit 1
fi
echo "demo: all comparisons PASS"
