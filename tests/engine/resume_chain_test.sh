#!/bin/bash
# A run carried across world sizes and ZeRO stages without converting: each
# hop RANKS:STAGE trains STEPS_PER_HOP steps, saves, and the next hop resumes
# that ZeRO checkpoint directly (`--resume`, no `uckpt convert`). Every hop's
# losses must continue the uninterrupted run of the first hop's size and stage
# (fp32: within 1e-6 relative; the global batch stays 16 = micro 2 x GA x
# ranks, 1 to 8 ranks, so GA is re-derived at each size). Stage 3 partitions every
# parameter (stage3_param_persistence_threshold 0).
#
# usage: resume_chain_test.sh UCKPT WORK_DIR
#        HOPS="4:2 2:2 1:3 4:3 2:2" (default), DEVICE=cuda for one GPU per rank,
#        BF16=1 (then within 2e-2 relative)
set -euo pipefail
U=$(realpath "$1")
W=$2
HOPS=${HOPS:-"4:2 2:2 1:3 4:3 2:2"}
DEVICE=${DEVICE:-cpu}
PER=${STEPS_PER_HOP:-2}
TOL=1e-6; [ -n "${BF16:-}" ] && TOL=2e-2
rm -rf "$W" && mkdir -p "$W" && cd "$W"
fail() { echo "FAIL: $*" >&2; exit 1; }

config() {  # config STAGE -> cfg-STAGE.json
  cat > "cfg-$1.json" <<JSON
{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 0,
 "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}},
 "bf16": {"enabled": $([ -n "${BF16:-}" ] && echo true || echo false)},
 "zero_optimization": {"stage": $1, "stage3_param_persistence_threshold": 0}}
JSON
}
train() {  # train RANKS STAGE NAME STEPS [flags...]
  local n=$1 stage=$2 name=$3 steps=$4
  shift 4
  config "$stage"
  "$U" launch -n "$n" --master_port 0 -- "$U" train --config "cfg-$stage.json" --n_layer 2 --n_head 2 --n_embd 16 \
    --vocab_size 97 --n_positions 16 --seq_len 16 --threads 1 --device "$DEVICE" --log_dir logs --run_name "$name" \
    --no_progress --steps "$steps" "$@" > "$name.log" 2>&1 || { cat "$name.log"; fail "$name"; }
}

set -- $HOPS
total=$(( $# * PER ))
first=${1%:*} first_stage=${1#*:}
train "$first" "$first_stage" base "$total"
step=0 hop=0
for h in $HOPS; do
  n=${h%:*} stage=${h#*:}
  step=$(( step + PER )) hop=$(( hop + 1 ))
  flags=(--checkpoint_dir ck --checkpoint_interval "$PER")
  [ $hop -gt 1 ] && flags+=(--resume)
  train "$n" "$stage" "hop$hop" "$step" "${flags[@]}"
  [ "$(cat ck/latest)" = "global_step$step" ] || fail "hop $hop ($h) did not save global_step$step"
  ! ls ck | grep -q universal || fail "a universal folder appeared in ck/"
  echo "hop $hop: $n ranks, stage $stage, steps $(( step - PER + 1 ))..$step"
done

python3 - "$HOPS" "$PER" "$TOL" <<'PY'
import csv, sys
hops, per, tol = sys.argv[1].split(), int(sys.argv[2]), float(sys.argv[3])
def losses(run):
    return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(open(f"logs/{run}/metrics.csv"))}
base, worst, bad = losses("base"), 0.0, []
for k, h in enumerate(hops, 1):
    got = losses(f"hop{k}")
    for s in range((k - 1) * per + 1, k * per + 1):
        if s not in got:
            bad.append(f"hop {k} ({h}) has no step {s}"); continue
        rel = abs(got[s] - base[s]) / abs(base[s])
        worst = max(worst, rel)
        if rel > tol: bad.append(f"hop {k} ({h}) step {s}: {got[s]!r} vs {base[s]!r} (rel {rel:.3g})")
print(f"{len(hops)} hops ({' -> '.join(hops)}, ranks:stage): max relative loss difference {worst:.3g} (limit {tol:g})")
if bad:
    print("FAIL: " + "; ".join(bad)); sys.exit(1)
PY
