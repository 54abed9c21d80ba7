#!/bin/bash
# `uckpt ds_to_universal` against a DeepSpeed release's own ds_to_universal.py on the same
# ZeRO checkpoint, same machine (issue 41's acceptance: an input of at least 1 GB, >= 5x faster).
# The input, made if DIR/ckpt/latest is missing (bench/ds_gpt2_ckpt.py, one rank per process on
# the CPU with Gloo): GPT-2 from its config (124M parameters at the defaults, 1.7 GB at 4 ranks),
# bf16, ZeRO-2, torch's AdamW, one step. Each converter runs RUNS times, alternating, each
# into an emptied folder and timed up to the end of a `sync` (nothing else is dropped: the
# input is in the page cache for both). Both get --inject_missing_state (the input has no
# universal_checkpoint_info, as the Hugging Face Trainer saves) and their default workers.
# Prints every time, the best of each, DeepSpeed's best / uckpt's best, and whether the two
# outputs of the last round are the same files (--keep keeps them, and the input is always kept).
# Usage: bench/ds-to-universal.sh PYTHON UCKPT [--dir DIR] [--ranks 4] [--runs 2]
#                                 [--n-layer 12] [--n-embd 768] [--keep]
#   PYTHON: a Python whose `import deepspeed` is the release to compare with (and transformers).
set -euo pipefail
USAGE=$(sed -n '/^# Usage:/,/^[^#]/p' "$0" | grep '^#' | cut -c3-)
[ $# -ge 2 ] || { echo "$USAGE" >&2; exit 2; }
PY=$1 UCKPT=$2; shift 2
DIR=${TMPDIR:-/tmp}/uckpt-bench-ds2u RANKS=4 RUNS=2 NLAYER=12 NEMBD=768 KEEP=0
while [ $# -gt 0 ]; do
  case $1 in
    --dir) DIR=$2; shift 2 ;;
    --ranks) RANKS=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --n-layer) NLAYER=$2; shift 2 ;;
    --n-embd) NEMBD=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    *) echo "unknown argument: $1" >&2; echo "$USAGE" >&2; exit 2 ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
export DS_ACCELERATOR=cpu
VERSION=$("$PY" -c 'import deepspeed; print(deepspeed.__version__)' 2>/dev/null | tail -n 1)
mkdir -p "$DIR"

if [ ! -f "$DIR/ckpt/latest" ]; then
  echo "making the input: GPT-2 n_layer=$NLAYER n_embd=$NEMBD, bf16, ZeRO-2, $RANKS ranks, DeepSpeed $VERSION"
  rm -rf "$DIR/ckpt"
  port=$((29700 + RANDOM % 200)) pids=()
  for ((r = 0; r < RANKS; r++)); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$RANKS MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 \
      "$PY" "$HERE/ds_gpt2_ckpt.py" --n-layer "$NLAYER" --n-embd "$NEMBD" "$DIR/ckpt" >"$DIR/make.rank$r.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || { echo "rank failed: see $DIR/make.rank*.log" >&2; exit 1; }; done
  grep "^saved" "$DIR/make.rank0.log"
fi
IN=$DIR/ckpt/$(cat "$DIR/ckpt/latest")

now() { date +%s.%N; }
# One timed run of "${@:2}" into an emptied $DIR/out-$1/universal, up to the end of a sync.
timed() {
  local out=$DIR/out-$1 t0 t1
  shift
  rm -rf "$out"; mkdir -p "$out"; sync
  t0=$(now)
  "$@" --input_folder "$IN" --output_folder "$out/universal" --inject_missing_state >"$DIR/run.log" 2>&1 ||
    { echo "failed: $* (see $DIR/run.log)" >&2; tail -n 5 "$DIR/run.log" >&2; exit 1; }
  sync
  t1=$(now)
  awk "BEGIN { printf \"%.2f\", $t1 - $t0 }"
}
ds=() uc=()
for ((i = 1; i <= RUNS; i++)); do
  ds+=("$(timed ds "$PY" -m deepspeed.checkpoint.ds_to_universal)")
  uc+=("$(timed uckpt "$UCKPT" ds_to_universal)")
done
best() { printf "%s\n" "$@" | sort -g | head -n 1; }
DS_BEST=$(best "${ds[@]}") UC_BEST=$(best "${uc[@]}")
echo "== ds_to_universal: DeepSpeed $VERSION's script against uckpt's, $(nproc) cores"
echo "input                          $IN, $(du -sb "$IN" | awk '{ printf "%.2f GB", $1 / 1e9 }'), $(ls "$IN" | wc -l) files"
echo "DeepSpeed ds_to_universal.py   ${ds[*]} s (best $DS_BEST s)"
echo "uckpt ds_to_universal          ${uc[*]} s (best $UC_BEST s)"
echo "ratio (DeepSpeed / uckpt)      $(awk "BEGIN { printf \"%.1fx\", $DS_BEST / $UC_BEST }") (issue 41 asks >= 5x at >= 1 GB)"
same="the same files, byte for byte"
diff -rq "$DIR/out-ds" "$DIR/out-uckpt" >"$DIR/diff.log" 2>&1 || same="different: see $DIR/diff.log"
echo "outputs                        $same"
[ "$KEEP" = 1 ] || rm -rf "$DIR/out-ds" "$DIR/out-uckpt"
