#!/usr/bin/env bash
# Per-rank peak host memory (resident set, as the kernel counts it: getrusage
# via /usr/bin/time) of ZeRO stage 2, stage 3 and stage 3 with parameters and
# optimizer offloaded, at 1, 2 and 4 CPU ranks, for one GPT-2. Under stage 3
# the memory of parameters, gradients and optimizer state should fall as 1/W;
# stage 2 keeps every parameter and gradient whole on every rank.
# The baseline in the same run is an "empty" job of the same ranks: a tiny
# model and --steps 0 (the process, libtorch, communication); "state" is the
# peak minus that baseline: parameters, gradients, optimizer state and one
# micro-batch's activations.
# Prints one table (max over ranks); exit status 0 when stage 3's state at the
# largest W is at most 1.5/W of stage 2's state at 1 rank.
# Usage: bench/zero3-memory.sh [--build build] [--ranks "1 2 4"] [--model "..."] [--steps 3] [--dir DIR]
set -euo pipefail
BUILD=build RANKS="1 2 4" STEPS=3
MODEL="--n_layer 6 --n_head 8 --n_embd 512 --vocab_size 8192 --n_positions 128 --seq_len 128"
DIR=${TMPDIR:-/tmp}/uckpt-bench-z3mem
USAGE=$(sed -n '/^# Usage:/,/^[^#]/p' "$0" | grep '^#' | cut -c3-)
while [ $# -gt 0 ]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --ranks) RANKS=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    -h|--help) echo "$USAGE"; exit 0 ;;
    *) echo "zero3-memory: unknown argument '$1'" >&2; echo "$USAGE" >&2; exit 2 ;;
  esac
done
UCKPT=$(realpath "$BUILD/src/cli/uckpt")
[ -x /usr/bin/time ] || { echo "zero3-memory: needs /usr/bin/time (Debian package time)" >&2; exit 2; }
rm -rf "$DIR" && mkdir -p "$DIR"

config() {  # config NAME ZERO_JSON
  cat >"$DIR/$1.json" <<JSON
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
 "zero_optimization": $2}
JSON
}
config stage2 '{"stage": 2}'
config stage3 '{"stage": 3}'
config stage3_offload '{"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}'

TINY="--n_layer 1 --n_head 2 --n_embd 32 --vocab_size 256 --n_positions 16 --seq_len 16"
# run NAME W STEPS MODEL: prints the max over ranks of the peak RSS in MiB.
run() {
  local name=$1 w=$2 steps=$3 model=$4 d="$DIR/$1.$2.$3.${#4}"
  mkdir -p "$d"
  # shellcheck disable=SC2086
  "$UCKPT" launch -n "$w" --master_port 0 -- bash -c \
    '/usr/bin/time -f %M -o "$0/rss.$RANK" "$@"' "$d" "$UCKPT" train --config "$DIR/$name.json" \
    $model --steps "$steps" --threads 1 --no_progress --log_dir "$d/logs" >"$d/out.log" 2>&1 ||
    { cat "$d/out.log" >&2; echo "zero3-memory: $name at $w ranks failed (log: $d/out.log)" >&2; exit 1; }
  sort -n "$d"/rss.* | tail -1 | awk '{printf "%.0f", $1 / 1024}'
}

printf '%-16s %5s %12s %12s %12s %14s\n' config ranks "peak MiB" "empty MiB" "state MiB" "state x W"
declare -A state
for name in stage2 stage3 stage3_offload; do
  for w in $RANKS; do
    peak=$(run "$name" "$w" "$STEPS" "$MODEL")
    base=$(run "$name" "$w" 0 "$TINY")
    s=$((peak - base))
    state[$name.$w]=$s
    printf '%-16s %5d %12d %12d %12d %14d\n' "$name" "$w" "$peak" "$base" "$s" $((s * w))
  done
done
first=${RANKS%% *}; last=${RANKS##* }
ref=${state[stage2.$first]}
echo
ok=1
for name in stage3 stage3_offload; do
  r=$(awk -v a="${state[$name.$last]}" -v b="$ref" 'BEGIN { printf "%.3f", a / b }')
  lim=$(awk -v w="$last" 'BEGIN { printf "%.3f", 1.5 / w }')
  verdict=PASS; awk -v r="$r" -v l="$lim" 'BEGIN { exit !(r <= l) }' || { verdict=FAIL; ok=0; }
  echo "$name at $last ranks: state / stage 2's at $first rank = $r (limit 1.5/$last = $lim): $verdict"
done
[ $ok = 1 ]
