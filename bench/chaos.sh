#!/bin/bash
# Chaos run (docs/reliability.md, "The chaos run"): random faults against a
# training job under `uckpt launch` and against `uckpt convert`, each trial
# checked for orphans, hangs, a verifiable `latest` and a bit-identical resume.
#
# Training trials: RANKS ranks train a tiny GPT-2 (1 layer x 16, vocab 97,
# 16 tokens) from a copy of the reference run's global_step2, saving every
# step, to step STEPS. At a random time one fault hits:
#   target  one rank (random), every rank, or the launcher
#   signal  SIGKILL or SIGSTOP (a stopped launcher is continued 1-3 s later)
#   when    during training (random delay), during a sync save (the moment
#           its temporary folder appears, or for SIGKILL of ranks the crash
#           hook at a random write point of a random rank)
# Convert trials: `uckpt convert --force` of global_step2 over an existing
# universal folder, SIGKILLed at a random write point (crash hook) or at a
# random moment, or SIGSTOPped and continued 1 s later.
# After every trial:
#   - no process of the trial is left (launcher, ranks, convert);
#   - a job the fault ends is over within the heartbeat timeout + 2 s (the
#     worst time is printed); a job it does not end finishes by itself;
#   - `uckpt verify` accepts the checkpoint folder (so `latest` and
#     `latest_universal` name complete checkpoints);
#   - a resume from `latest` (ZeRO) or `latest_universal` to step STEPS logs
#     the reference run's step, loss, lr, grad norm and loss scale, and its
#     final checkpoint's .pt files are byte-identical to the reference's.
#
# Async saves: CHAOS_ASYNC_FLAGS=--async_save runs half of the training trials
# with background saves ("during a save" then means while its writer runs).
#
# usage: bench/chaos.sh UCKPT [WORK_DIR]
#   TRIALS=N (default 30), SEED=S (default: random, printed), RANKS=N (2),
#   STEPS=N (50; about 50 ms a step with its save here), FAULT_WINDOW=S (1.5),
#   HB_TIMEOUT=S (3; interval = timeout / 12)
#   CI: TRIALS=4 STEPS=30 FAULT_WINDOW=1 SEED=2 (CTest train_chaos_short).
set -uo pipefail
U=$(realpath "$1")
W=${2:-/tmp/uckpt-chaos}
TRIALS=${TRIALS:-30}
SEED=${SEED:-$RANDOM}
RANKS=${RANKS:-2}
STEPS=${STEPS:-50}
FAULT_WINDOW=${FAULT_WINDOW:-1.5}  # faults fall this many seconds into training at most
HB_TIMEOUT=${HB_TIMEOUT:-3}
ASYNC=${CHAOS_ASYNC_FLAGS:-}
RANDOM=$SEED
rm -rf "$W"
mkdir -p "$W"
cd "$W"

die() { echo "chaos: $*" >&2; exit 2; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
gt() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a > b) }'; }
alive() { [ -r "/proc/$1/stat" ] && ! sed 's/.*) //' "/proc/$1/stat" 2> /dev/null | grep -q '^Z'; }
rnd() { echo $((RANDOM % ($2 - $1 + 1) + $1)); }  # rnd LO HI
pick() { local a=("$@"); echo "${a[RANDOM % ${#a[@]}]}"; }
hb_interval=$(awk -v t="$HB_TIMEOUT" 'BEGIN { print t / 12 }')

cat > ds.json <<JSON
{"train_batch_size": 8, "zero_optimization": {"stage": 2},
 "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}}
JSON
F="--config ds.json --n_layer 1 --n_head 2 --n_embd 16 --vocab_size 97 --n_positions 16 --seq_len 16
   --threads 1 --log_dir logs --no_progress --timeout 120 --heartbeat_interval $hb_interval
   --heartbeat_timeout $HB_TIMEOUT"
LAUNCH="$U launch -n $RANKS --master_port 0 --stop_timeout $HB_TIMEOUT --grace 5 --"
# The columns that must match: step, loss, lr, grad_norm, loss_scale.
losses() { cut -d, -f1-5 "logs/$1/metrics.csv" | tail -n +2; }
pt_sums() { (cd "$1" && sha256sum ./*.pt | sort -k2); }

# The reference: an uninterrupted run to STEPS, every step saved.
$LAUNCH "$U" train $F --steps "$STEPS" --checkpoint_dir ref --checkpoint_interval 1 --run_name ref > ref.log 2>&1 ||
  { cat ref.log; die "the reference run failed"; }
[ -d ref/global_step2 ] && [ -d "ref/global_step$STEPS" ] || die "the reference run did not save"
mkdir base && cp -a ref/global_step2 base/ && echo global_step2 > base/latest
# The reference resumed from universal (the same numbers, by the demo's first experiment).
"$U" convert -q ref/global_step2 ucref/global_step2_universal > /dev/null 2>&1 || die "reference convert"
$LAUNCH "$U" train $F --steps "$STEPS" --checkpoint_dir ucref --checkpoint_interval "$STEPS" --resume \
  --universal_checkpoint --run_name ucref > ucref.log 2>&1 || { cat ucref.log; die "reference universal resume"; }
ref_universal_ok=1
[ "$(losses ucref)" = "$(losses ref | tail -n +3)" ] || ref_universal_ok=0

# Every process of this trial that is still alive.
survivors() { local p; for p in "$@"; do alive "$p" && echo -n "$p "; done; }

# Waits until `pids` are gone (at most `limit` s); prints the seconds taken
# since T0, or "hang" (and SIGKILLs them, continuing stopped ones first).
wait_gone() {
  local limit=$1 i left
  shift
  for i in $(seq $((limit * 20))); do
    left=$(survivors "$@")
    [ -z "$left" ] && break
    sleep 0.05
  done
  if [ -n "$left" ]; then
    kill -CONT $left 2> /dev/null
    kill -9 $left 2> /dev/null
    echo hang
  else
    elapsed "$T0" "$(now)"
  fi
}

# Checks a checkpoint folder after a trial and resumes it: sets CHECK.
check_resume() {
  local dir=$1 universal=$2 tag resumed want
  CHECK=
  if ! "$U" verify "$dir" > "$dir.verify" 2>&1; then CHECK="verify failed: $(tail -1 "$dir.verify")"; return; fi
  local flags="" ref=ref
  [ "$universal" = 1 ] && { flags="--universal_checkpoint"; ref=ucref; }
  tag=$(cat "$dir/$([ "$universal" = 1 ] && echo latest_universal || echo latest)")
  if [ "$universal" = 0 ] && [ "$tag" = "global_step$STEPS" ]; then
    resumed="(none: latest is the last step)"
  else
    rm -rf "logs/r_$dir"
    $LAUNCH "$U" train $F --steps "$STEPS" --checkpoint_dir "$dir" --checkpoint_interval "$STEPS" --resume $flags \
      --run_name "r_$dir" > "$dir.resume.log" 2>&1 || { CHECK="resume from $tag failed: $(grep -m1 uckpt "$dir.resume.log")"; return; }
    local first
    first=$(head -1 <(losses "r_$dir") | cut -d, -f1)
    want=$(losses $ref | awk -F, -v f="$first" '$1 >= f')
    [ "$(losses "r_$dir")" = "$want" ] || { CHECK="resume from $tag: the losses differ from the reference"; return; }
    resumed="steps $first-$STEPS"
  fi
  [ "$(pt_sums "$dir/global_step$STEPS")" = "$(pt_sums "$ref/global_step$STEPS")" ] ||
    { CHECK="resume from $tag: global_step$STEPS is not byte-identical to the reference's ($ref)"; return; }
  CHECK="ok: $tag verifies, resume $resumed bit-identical"
}

declare -A OUTCOMES
fails=0 worst=0 worst_what=
note_time() {  # note_time SECS WHAT
  gt "$1" "$worst" && { worst=$1; worst_what=$2; }
}

train_trial() {
  local i=$1 dir=t$1 target sig when delay hit="" env=() flags="" what
  target=$(pick rank rank all launcher)
  sig=$(pick KILL STOP)
  when=$(pick train save)
  [ -n "$ASYNC" ] && [ $((RANDOM % 2)) = 1 ] && flags=$ASYNC
  cp -a base "$dir"
  local victim_rank
  victim_rank=$(rnd 0 $((RANKS - 1)))
  local hook=0
  if [ "$when" = save ] && [ "$sig" = KILL ] && [ "$target" != launcher ] && [ $((RANDOM % 2)) = 1 ]; then
    # The crash hook: a random write point of a random save.
    # Write points a save: rank 0 25, every other rank 5.
    local points=5
    [ "$target" = rank ] && [ "$victim_rank" = 0 ] && points=25
    hook=$(rnd 1 $((points * (STEPS - 4))))
    [ "$target" = rank ] && env=(UCKPT_CRASH_RANK=$victim_rank)
    env+=(UCKPT_CRASH_AFTER_WRITES=$hook)
  fi
  setsid env "${env[@]}" $LAUNCH "$U" train $F $flags --steps "$STEPS" --checkpoint_dir "$dir" --checkpoint_interval 1 \
    --resume --run_name "$dir" > "$dir.log" 2>&1 &
  local lpid=$! ranks="" k
  for k in $(seq 100); do ranks=$(pgrep -P "$lpid" | tr '\n' ' '); [ "$(echo $ranks | wc -w)" = "$RANKS" ] && break; sleep 0.05; done
  local rank_pids=() p
  for p in $ranks; do
    rank_pids[$(tr '\0' '\n' < "/proc/$p/environ" 2> /dev/null | sed -n 's/^RANK=//p')]=$p
  done
  local victims
  case $target in
    rank) victims=${rank_pids[$victim_rank]:-}; what="$sig rank $victim_rank" ;;
    all) victims=$ranks; what="$sig every rank" ;;
    launcher) victims=$lpid; what="$sig the launcher" ;;
  esac
  if [ "$hook" != 0 ]; then
    what="KILL $([ "$target" = rank ] && echo "rank $victim_rank" || echo "every rank") at write point $hook (crash hook)"
    for k in $(seq 600); do alive "$lpid" || break; [ "$(survivors $ranks | wc -w)" -lt "$RANKS" ] && break; sleep 0.02; done
    T0=$(now)
    hit=" (in a save)"
  else
    # A random moment once training runs (the first step is logged).
    for k in $(seq 600); do [ -s "logs/$dir/metrics.csv" ] && [ "$(wc -l < "logs/$dir/metrics.csv")" -ge 2 ] && break; alive "$lpid" || break; sleep 0.02; done
    delay=$(awk -v r=$RANDOM -v m="$FAULT_WINDOW" 'BEGIN { printf "%.2f", r / 32767 * m }')
    sleep "$delay"
    if [ "$when" = save ]; then
      for k in $(seq 2000); do compgen -G "$dir/.global_step*.uckpt-tmp" > /dev/null && break; alive "$lpid" || break; done
    fi
    [ -n "$victims" ] && kill -"$sig" $victims 2> /dev/null
    T0=$(now)
    if [ "$when" = save ]; then
      compgen -G "$dir/.global_step*.uckpt-tmp" > /dev/null && hit=" (in a save)" || hit=" (save missed)"
    else
      hit=" (${delay} s into training)"
    fi
    what="$what$hit"
  fi
  [ -n "$flags" ] && what="$what [async]"
  local secs code outcome
  if [ "$target" = launcher ] && [ "$sig" = STOP ]; then
    sleep "$(rnd 1 3)"
    kill -CONT "$lpid"
    secs=$(wait_gone 120 $lpid $ranks)
    wait "$lpid"; code=$?
    outcome="job finished (exit $code)"
    [ "$secs" = hang ] && outcome="HANG"
    [ "$code" = 0 ] || { alive "$lpid" || outcome="$outcome, expected 0"; }
  else
    secs=$(wait_gone 60 $lpid $ranks)
    wait "$lpid" 2> /dev/null; code=$?
    if [ "$secs" = hang ]; then
      outcome="HANG (processes left after 60 s)"
    elif [ "$code" = 0 ]; then
      outcome="job finished first (exit 0)"
    else
      outcome="job ended in $secs s (exit $code)"
      note_time "$secs" "trial $i: $what"
      gt "$secs" $((HB_TIMEOUT + 2)) && outcome="$outcome SLOWER THAN $((HB_TIMEOUT + 2)) s"
    fi
  fi
  local left
  left=$(pgrep -f -- "--checkpoint_dir $dir " | tr '\n' ' ')
  [ -n "$left" ] && { outcome="$outcome; LEFT RUNNING: $left"; kill -CONT $left; kill -9 $left; }
  check_resume "$dir" 0
  local ok=1
  case "$outcome$CHECK" in *HANG* | *SLOWER* | *LEFT* | *expected*) ok=0 ;; esac
  [[ $CHECK == ok:* ]] || ok=0
  report "$i" "$what" "$outcome" "$ok"
  OUTCOMES["$target/$sig"]=$((${OUTCOMES["$target/$sig"]:-0} + 1))
}

convert_trial() {
  local i=$1 dir=c$1 mode what hook=0 code secs outcome
  mkdir "$dir"
  cp -a base/global_step2 "$dir/"
  echo global_step2 > "$dir/latest"
  cp -a ucref/global_step2_universal "$dir/"
  echo global_step2_universal > "$dir/latest_universal"
  mode=$(pick hook kill stop)
  local env=()
  [ "$mode" = hook ] && { hook=$(rnd 1 60); env=(UCKPT_CRASH_AFTER_WRITES=$hook); }
  env "${env[@]}" "$U" convert -q --force "$dir/global_step2" "$dir/global_step2_universal" > "$dir.log" 2>&1 &
  local pid=$!
  case $mode in
    hook) what="convert: KILL at write point $hook (crash hook)" ;;
    kill)
      local d; d=$(awk -v r=$RANDOM 'BEGIN { printf "%.3f", r / 32767 * 0.08 }')
      sleep "$d"; kill -9 "$pid" 2> /dev/null; what="convert: KILL at $d s" ;;
    stop)
      local d; d=$(awk -v r=$RANDOM 'BEGIN { printf "%.3f", r / 32767 * 0.08 }')
      sleep "$d"; kill -STOP "$pid" 2> /dev/null; sleep 1; kill -CONT "$pid" 2> /dev/null
      what="convert: STOP at $d s, CONT 1 s later" ;;
  esac
  T0=$(now)
  secs=$(wait_gone 60 "$pid")
  wait "$pid"; code=$?
  outcome="exit $code"
  [ "$secs" = hang ] && outcome="HANG"
  [ "$mode" = stop ] && [ "$code" != 0 ] && outcome="$outcome, expected 0"
  check_resume "$dir" 1
  local ok=1
  case "$outcome" in *HANG* | *expected*) ok=0 ;; esac
  [[ $CHECK == ok:* ]] || ok=0
  report "$i" "$what" "$outcome" "$ok"
  OUTCOMES["convert/$mode"]=$((${OUTCOMES["convert/$mode"]:-0} + 1))
}

report() {  # report I WHAT OUTCOME OK
  printf '%-4s %-62s %-34s %s %s\n' "$1" "$2" "$3" "$([ "$4" = 1 ] && echo PASS || echo FAIL)" "$CHECK"
  [ "$4" = 1 ] || fails=$((fails + 1))
}

echo "chaos: $TRIALS trials, seed $SEED, $RANKS ranks, steps 3-$STEPS saved every step, heartbeat $hb_interval s / $HB_TIMEOUT s${ASYNC:+, async flags $ASYNC}"
[ "$ref_universal_ok" = 1 ] || echo "chaos: note: the universal resume of the reference differs from it; convert trials compare with the reference anyway"
START=$(now)
for i in $(seq "$TRIALS"); do
  if [ $((RANDOM % 4)) = 0 ]; then convert_trial "$i"; else train_trial "$i"; fi
done
echo
echo "outcomes:"
for k in $(printf '%s\n' "${!OUTCOMES[@]}" | sort); do printf '  %-16s %s\n' "$k" "${OUTCOMES[$k]}"; done
echo "worst time from a fault to the end of every process: ${worst} s${worst_what:+ ($worst_what)}"
echo "chaos: $TRIALS trials in $(elapsed "$START" "$(now)") s, $fails failure(s)"
[ "$fails" = 0 ]
