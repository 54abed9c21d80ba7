#!/usr/bin/env bash
# Per-rank peak memory (CPU resident set, VmHWM) of ZeRO stage 2, stage 3 and
# stage 3 with parameters and optimizer offloaded, at 1, 2 and 4 ranks, for one
# GPT-2 (default 6 x 512, vocab 8192: ~25M parameters), a few steps of fp32
# training on the CPU. Prints each rank's peak and the ratio to stage 2 at the
# same world size (the baseline, measured in the same run). On a CPU "offload"
# moves nothing (the model is in host memory already): the same numbers are expected.
#   usage: bench/zero3_memory.sh UCKPT [WORKDIR]   (env: LAYERS EMBD VOCAB STEPS RANKS BUCKET)
set -euo pipefail
UCKPT=${1:?usage: zero3_memory.sh UCKPT [WORKDIR]}
DIR=${2:-/tmp/uckpt_zero3_memory}
LAYERS=${LAYERS:-6} EMBD=${EMBD:-512} VOCAB=${VOCAB:-8192} STEPS=${STEPS:-3} RANKS=${RANKS:-"1 2 4"}
BUCKET=${BUCKET:-2000000}  # reduce_bucket_size (elements), the same for every row
# glibc's dynamic mmap threshold rises to the size of the first large block freed, after
# which stage 3's gather/free churn (a unit's parameters allocated and freed per use) lands
# on the heap and fragments it: RSS then stays well above the live memory. A fixed threshold
# keeps large blocks in mmap (returned at once); set MALLOC_MMAP_THRESHOLD_ yourself to compare.
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-1048576}
rm -rf "$DIR" && mkdir -p "$DIR"
config() {  # stage, offload
  local off=""
  [ "$2" = 1 ] && off=', "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}'
  echo "{\"train_micro_batch_size_per_gpu\": 1, \"gradient_accumulation_steps\": 1,
    \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}},
    \"zero_optimization\": {\"stage\": $1, \"reduce_bucket_size\": $BUCKET,
      \"stage3_param_persistence_threshold\": 0 $off}}"
}
peak() {  # world, stage, offload [layers embd vocab] -> the ranks' peak RSS (MiB), space-separated
  local name="w$1_s$2_o$3_${4:-$LAYERS}"
  config "$2" "$3" > "$DIR/$name.json"
  UCKPT_TIMERS=1 "$UCKPT" launch -n "$1" --master_port 0 -- "$UCKPT" train --config "$DIR/$name.json" \
    --n_layer "${4:-$LAYERS}" --n_head 8 --n_embd "${5:-$EMBD}" --vocab_size "${6:-$VOCAB}" --n_positions 128 --seq_len 128 \
    --steps "$STEPS" --threads 1 --no_progress --log_dir "$DIR/logs" --run_name "$name" 2> "$DIR/$name.err" >/dev/null
  grep -o "rank [0-9]* peak RSS [0-9.]*" "$DIR/$name.err" | sort -k2n | awk '{printf "%s ", $5}'
}
max() { echo "$1" | tr ' ' '\n' | sort -n | tail -1; }
# "model" = peak minus the peak of the same launch with a tiny model (8 wide, 1 layer,
# vocab 256): what the run's parameters, gradients, optimizer state and activations add to
# the process (libtorch and Gloo alone take several hundred MiB).
printf "%-6s %-20s %-30s %-14s %s\n" ranks config "peak RSS per rank (MiB)" "model (MiB)" "model vs stage 2"
for w in $RANKS; do
  tiny=$(max "$(peak "$w" 2 0 1 8 256)")
  s2list=$(peak "$w" 2 0)
  s2=$(max "$s2list")
  for cfg in "2 0" "3 0" "3 1"; do
    set -- $cfg
    if [ "$1" = 2 ]; then got=$s2list; else got=$(peak "$w" "$1" "$2"); fi
    label="stage $1"; [ "$2" = 1 ] && label="stage 3 + offload"
    printf "%-6s %-20s %-30s %-14s %s\n" "$w" "$label" "$got" "$(awk -v a="$(max "$got")" -v t="$tiny" 'BEGIN{printf "%.0f", a-t}')" \
      "$(awk -v a="$(max "$got")" -v b="$s2" -v t="$tiny" 'BEGIN{printf "%.2f", (a-t)/(b-t)}')"
  done
done
