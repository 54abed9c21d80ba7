# Sourced by the shell tests of tests/engine (after `set -euo pipefail`) with
# their arguments: U = the uckpt binary ($1); a fresh scratch folder ($2)
# becomes the working folder; fail(); and `tiny_gpt2 BATCH [FLAGS...]`, which
# writes ds.json (ZeRO-2, AdamW) and sets F, the flags of the tiny GPT-2
# those tests train (1 layer x 16, vocab 97, 16 tokens, one thread; MODEL_FLAGS replaces these).
# ASYNC_SAVE=1 adds "checkpoint": {"async_save": true} (the same tests then
# cover background saves); STAGE=N sets the ZeRO stage (default 2).
U=$(realpath "$1")
W=$2
rm -rf "$W"
mkdir -p "$W"
cd "$W"

fail() { echo "FAIL: $*" >&2; exit 1; }

tiny_gpt2() {
  local batch=$1
  shift
  cat > ds.json <<JSON
{"train_batch_size": $batch, "zero_optimization": {"stage": ${STAGE:-2}},
 "checkpoint": {"async_save": $([ -n "${ASYNC_SAVE:-}" ] && echo true || echo false)},
 "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}}
JSON
  F="--config ds.json ${MODEL_FLAGS:---n_layer 1 --n_head 2 --n_embd 16 --vocab_size 97 --n_positions 16 --seq_len 16
   --threads 1} --log_dir logs --no_progress $*"
}

# The run $1's logged steps so far, and its last step (0 before the first).
steps_done() { [ -f "logs/$1/metrics.csv" ] && tail -n +2 "logs/$1/metrics.csv" | wc -l || echo 0; }
last_step() { [ -f "logs/$1/metrics.csv" ] && tail -n 1 "logs/$1/metrics.csv" | cut -d, -f1 || echo 0; }
# Waits until run $1's metrics.csv has more than $2 rows: $3 seconds at most,
# and no longer than the launcher $LPID lives.
wait_rows() {
  local i
  for i in $(seq $(($3 * 10))); do
    [ "$(steps_done "$1")" -gt "$2" ] && return 0
    kill -0 "$LPID" 2> /dev/null || return 1
    sleep 0.1
  done
  return 1
}
# The pid of the rank with RANK=$2 among the launcher $1's children.
rank_pid() {
  local p
  for p in $(pgrep -P "$1"); do
    tr '\0' '\n' < "/proc/$p/environ" 2> /dev/null | grep -qx "RANK=$2" && { echo "$p"; return; }
  done
}
