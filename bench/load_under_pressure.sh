#!/bin/bash
# Load under pressure (issue 6): a run saved on 4 ranks resumes on 1 rank
# from its universal checkpoint under a memory limit of 3x the model's full
# state, because the rank maps only the slices it owns (at world size 1: all
# of them, one parameter file at a time) instead of loading whole state dicts.
#
# "Full state" here = 16 bytes per parameter: fp32 weights, fp32 gradients and
# the two fp32 Adam moments (12 without the gradients). The resumed process
# itself holds 20 B/param (model weights + gradients + fp32 master + 2 moments).
#
# The limit is a memory cgroup (v2 memory.max, else v1 memory.limit_in_bytes:
# resident memory, page cache included but reclaimable), else RLIMIT_AS via
# prlimit (address space: mappings count in full). Peak RSS is the kernel's VmHWM (GNU time %M), and the cgroup's own
# peak is shown where it has one. A second resume under 1x the full state
# must fail: it shows that the limit bites; one under 1.5x shows that the
# load needs little beyond the process's own 20 B/param (a load that read the
# universal state of 12 B/param into memory first would not fit).
#
# usage: bench/load_under_pressure.sh UCKPT [WORK_DIR] [N_LAYER] [N_EMBD]
#        UCKPT_PRESSURE_LIMIT=rlimit forces the RLIMIT_AS fallback
#        (default /tmp/uckpt-pressure, 4 layers x 768: 66.9 M parameters)
set -euo pipefail
U=$(realpath "$1")
W=${2:-/tmp/uckpt-pressure}
L=${3:-4}
E=${4:-768}
rm -rf "$W"
mkdir -p "$W"
cd "$W"

fail() { echo "FAIL: $*" >&2; exit 1; }

cat > ds.json <<'JSON'
{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
JSON
F="--config ds.json --n_layer $L --n_head 12 --n_embd $E --vocab_size 50257 --n_positions 64 --seq_len 16
   --threads 1 --log_dir logs --no_progress"

echo "1. 4 ranks, 1 step, save; convert to universal"
"$U" launch -n 4 --master_port 0 -- "$U" train $F --steps 1 --checkpoint_dir ckpt --run_name ws4 > ws4.log 2>&1 ||
  { cat ws4.log; fail "the 4-rank run"; }
P=$(sed -n 's/.*, \([0-9]*\) parameters,.*/\1/p' ws4.log | head -1)
[ -n "$P" ] || { cat ws4.log; fail "no parameter count"; }
"$U" convert -q ckpt/global_step1 ckpt/global_step1_universal || fail "convert"
STATE=$((16 * P))
mib() { awk -v b="$1" 'BEGIN { printf "%.0f MiB", b / 1048576 }'; }
echo "   $P parameters; full state 16 B/param = $(mib $STATE); universal folder $(du -sm ckpt/global_step1_universal | cut -f1) MiB"

# The limit mechanism: the first that works here.
CG= MECH=
if [ "${UCKPT_PRESSURE_LIMIT:-}" = rlimit ]; then  # force the RLIMIT_AS fallback
  MECH="RLIMIT_AS (prlimit --as)"
elif [ -f /sys/fs/cgroup/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/cgroup.controllers &&
   mkdir /sys/fs/cgroup/uckpt-pressure-$$ 2> /dev/null; then
  CG=/sys/fs/cgroup/uckpt-pressure-$$ MECH="cgroup v2 memory.max"
elif [ -d /sys/fs/cgroup/memory ] && mkdir /sys/fs/cgroup/memory/uckpt-pressure-$$ 2> /dev/null; then
  CG=/sys/fs/cgroup/memory/uckpt-pressure-$$ MECH="cgroup v1 memory.limit_in_bytes"
elif command -v prlimit > /dev/null; then
  MECH="RLIMIT_AS (prlimit --as)"
else
  fail "no way to limit memory here (no writable memory cgroup, no prlimit)"
fi
cleanup() { [ -z "$CG" ] || rmdir "$CG" 2> /dev/null || true; }
trap cleanup EXIT
echo "   limit mechanism: $MECH"

# Runs the command under a limit of `bytes`; sets CODE, PEAK_RSS (bytes), CG_PEAK (bytes or "-").
limited() {
  local bytes=$1
  shift
  CG_PEAK=-
  if [ -n "$CG" ]; then
    if [ -f "$CG/memory.max" ]; then
      echo "$bytes" > "$CG/memory.max"
      echo 0 > "$CG/memory.swap.max" 2> /dev/null || true
    else
      echo "$bytes" > "$CG/memory.limit_in_bytes"
      echo 0 > "$CG/memory.max_usage_in_bytes"
    fi
    CODE=0
    /usr/bin/time -f %M -o rss.txt sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$CG" "$@" || CODE=$?
    if [ -f "$CG/memory.peak" ]; then CG_PEAK=$(cat "$CG/memory.peak");
    elif [ -f "$CG/memory.max_usage_in_bytes" ]; then CG_PEAK=$(cat "$CG/memory.max_usage_in_bytes"); fi
  else
    CODE=0
    /usr/bin/time -f %M -o rss.txt prlimit --as="$bytes" "$@" || CODE=$?
  fi
  PEAK_RSS=$(( $(grep -E '^[0-9]+$' rss.txt | tail -1) * 1024 ))
}

resume() {  # $1: folder copy name, $2: --steps (1: load only; 2: load, one step, save)
  rm -rf "$1"
  cp -a ckpt "$1"
  echo "$U" train $F --gradient_accumulation_steps 4 --steps "$2" --checkpoint_dir "$1" --resume --universal_checkpoint \
    --run_name "$1"
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
ROWS=()
# case NAME FACTOR STEPS EXPECT(ok|fail|show)
case_() {
  local name=$1 factor=$2 steps=$3 expect=$4 limit
  limit=$(awk -v f="$factor" -v s="$STATE" 'BEGIN { printf "%.0f", f * s }')
  limited "$limit" $(resume "$name" "$steps") > "$name.log" 2>&1
  local result="exit $CODE"
  [ "$CODE" = 137 ] && result="exit 137 (OOM-killed)"
  if [ "$expect" = ok ]; then
    [ "$CODE" = 0 ] || { cat "$name.log"; fail "$name: failed under $factor x ($result)"; }
    [ "$steps" = 1 ] || [ "$(cat "$name/latest")" = global_step2 ] || fail "$name: did not save global_step2"
  elif [ "$expect" = fail ]; then
    [ "$CODE" != 0 ] || { cat "$name.log"; fail "$name: succeeded under $factor x: the limit does not bite"; }
  fi
  local cg=-
  [ "$CG_PEAK" = - ] || cg="$(mib "$CG_PEAK") ($(ratio "$CG_PEAK" "$STATE") x)"
  ROWS+=("$(printf '%-34s %5s x = %-9s %-22s %-20s %s' "$name" "$factor" "$(mib "$limit")" \
    "$(mib "$PEAK_RSS") ($(ratio "$PEAK_RSS" "$STATE") x)" "$cg" "$result")")
  echo "   $name under $factor x: $result"
}

echo "2. resumes at world size 1 from the universal checkpoint"
case_ load-3x 3 1 ok                # the issue's case: load only
# Shown, not asserted: training a step and saving at world size 1 needs more
# (gradient and Adam temporaries, the save's buffers: ~2.1 GiB anonymous at
# the default size), and a cgroup also charges the checkpoint's dirty page
# cache: the peak comes close to 3x (a run with a 2 GiB limit was OOM-killed).
case_ load-step-save-3x 3 2 show
# Tighter: a load that read the universal state (12 B/param) into memory
# first would not fit. Resident memory only: address space (RLIMIT_AS) also
# counts libtorch's reservations and whole-file mappings, so there it is shown.
tight=ok
[ -n "$CG" ] || tight=show
case_ load-1.5x 1.5 1 $tight
case_ load-1x 1 1 fail              # too small: the limit bites

echo
echo "parameters $P; full state (16 B/param) $(mib $STATE); limit: $MECH"
printf '%-34s %-19s %-22s %-20s %s\n' case limit "peak RSS (VmHWM)" "cgroup peak" result
for r in "${ROWS[@]}"; do echo "$r"; done
echo "(the resumed process holds 20 B/param = 1.25 x: weights, gradients, fp32 master and 2 moments)"
