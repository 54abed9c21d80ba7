#!/usr/bin/env bash
# Per-rank peak memory (CPU resident set, VmHWM) of ZeRO stage 2, stage 3 and
# stage 3 with parameters and optimizer offloaded, at 1, 2 and 4 ranks, for one
# GPT-2 (default 6 x 512, vocab 8192: ~25M parameters), a few steps of fp32
# training on the CPU. Prints each rank's peak and the ratio to stage 2 at the
# same world size (the baseline, measured in the same run). On a CPU "offload"
# moves nothing (the model is in host memory already); on GPUs use --device cuda
# via EXTRA and read the allocator peak line instead.
#   usage: bench/zero3_memory.sh UCKPT [WORKDIR]   (env: LAYERS EMBD VOCAB STEPS RANKS EXTRA)
set -euo pipefail
UCKPT=${1:?usage: zero3_memory.sh UCKPT [WORKDIR]}
DIR=${2:-/tmp/uckpt_zero3_memory}
LAYERS=${LAYERS:-6} EMBD=${EMBD:-512} VOCAB=${VOCAB:-8192} STEPS=${STEPS:-3} RANKS=${RANKS:-"1 2 4"}
rm -rf "$DIR" && mkdir -p "$DIR"
config() {  # stage, offload
  local off=""
  [ "$2" = 1 ] && off=', "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}'
  echo "{\"train_micro_batch_size_per_gpu\": 1, \"gradient_accumulation_steps\": 1,
    \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}},
    \"zero_optimization\": {\"stage\": $1, \"stage3_param_persistence_threshold\": 0 $off}}"
}
peak() {  # world, stage, offload -> the ranks' peak RSS (MiB), space-separated
  local name="w$1_s$2_o$3"
  config "$2" "$3" > "$DIR/$name.json"
  UCKPT_TIMERS=1 "$UCKPT" launch -n "$1" --master_port 0 -- "$UCKPT" train --config "$DIR/$name.json" \
    --n_layer "$LAYERS" --n_head 8 --n_embd "$EMBD" --vocab_size "$VOCAB" --n_positions 128 --seq_len 128 \
    --steps "$STEPS" --threads 1 --no_progress --log_dir "$DIR/logs" --run_name "$name" 2> "$DIR/$name.err" >/dev/null
  grep -o "rank [0-9]* peak RSS [0-9.]*" "$DIR/$name.err" | sort -k2n | awk '{printf "%s ", $5}'
}
printf "%-6s %-22s %-30s %s\n" ranks config "peak RSS per rank (MiB)" "max vs stage 2"
for w in $RANKS; do
  base=$(peak "$w" 2 0)
  bmax=$(echo "$base" | tr ' ' '\n' | sort -n | tail -1)
  printf "%-6s %-22s %-30s %s\n" "$w" "stage 2" "$base" "1.00"
  for cfg in "3 0" "3 1"; do
    set -- $cfg
    got=$(peak "$w" "$1" "$2")
    gmax=$(echo "$got" | tr ' ' '\n' | sort -n | tail -1)
    label="stage 3"; [ "$2" = 1 ] && label="stage 3 + offload"
    printf "%-6s %-22s %-30s %s\n" "$w" "$label" "$got" "$(awk -v a="$gmax" -v b="$bmax" 'BEGIN{printf "%.2f", a/b}')"
  done
done
