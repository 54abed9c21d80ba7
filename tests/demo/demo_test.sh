#!/usr/bin/env bash
# The demo's tolerances at tiny size, through the CLI (CTest label `demo`).
# Usage: demo_test.sh UCKPT WORK_DIR CASE [STAGE]
#   STAGE: 2 (default) or 3 (the original demo's configuration: ZeRO-3 with
#   parameters and optimizer offloaded to CPU), as `make demo --stage`
#   baseline<N>           fixture: 8 steps on N ranks, checkpoint at 4, convert it to universal
#   zero_4to4 universal_4to4      same-size resumes: bit-identical losses
#   universal_<N>to<M>    changed size: 1st step 1e-6 relative, later 1e-3 absolute
#   no_optimizer_4to2     negative control: must FAIL that tolerance
#   ga                    1x12 GA1, 1x3 GA4, 2x3 GA2, 3x2 GA2: within 1e-5 relative
#   plot_svg plot_png plot_bad_input    `uckpt plot`
set -euo pipefail
UCKPT=$(realpath "$1"); work=$2; case=$3; stage=${4:-2}
source "$(dirname "$0")/../../scripts/demo-lib.sh"
mkdir -p "$work"; cd "$work"

STEPS=8; MID=4; BATCH=12
MODEL=(--n_layer 1 --n_head 2 --n_embd 32 --vocab_size 256 --n_positions 16 --seq_len 16)
# Micro-batch per world size for global batch 12 (3 ranks: micro 2, GA 2).
micro() { case $1 in 1) echo 12 ;; 2) echo 6 ;; 3) echo 2 ;; 4) echo 3 ;; esac; }
data() {
  [ -f data.txt ] && return
  # Deterministic bytes with structure to learn (no dependency on the source tree).
  for i in $(seq 1 300); do echo "step $i: the quick brown fox $((i * 7919 % 1000)) jumps over the lazy dog"; done >data.txt.$$
  mv -f data.txt.$$ data.txt   # other cases may be reading it
}
zero="{\"stage\": $stage}"
[ "$stage" = 3 ] && zero='{"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}'
cat >"config-$case.json" <<JSON
{"train_batch_size": $BATCH, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3}},
 "zero_optimization": $zero}
JSON
train() {  # train NP NAME MICRO FLAGS...
  local np=$1 name=$2 mb=$3; shift 3
  rm -rf "logs/$name"   # metrics.csv appends: a rerun starts a fresh log
  "$UCKPT" launch -n "$np" --master_port 0 -- "$UCKPT" train --config "config-$case.json" --text data.txt \
    "${MODEL[@]}" --log_dir logs --run_name "$name" --threads 1 --no_progress --timeout 60 \
    --train_micro_batch_size_per_gpu "$mb" --steps $STEPS "$@" >"logs-$name.out" 2>&1 \
    || { cat "logs-$name.out"; echo "FAIL: run $name"; exit 1; }
}
csv() { echo "logs/$1/metrics.csv"; }
expect() {  # expect pass|fail BASE RUN FIRST LAST MODE
  local want=$1 line rc=0; shift
  line=$(compare_losses "$@") || rc=$?
  echo "compare $2 vs $1 steps $3-$4 ($5): $line"
  if [ "$want" = pass ] && [ $rc -ne 0 ]; then echo "FAIL: expected within tolerance"; exit 1; fi
  if [ "$want" = fail ] && [ $rc -eq 0 ]; then echo "FAIL: the negative control was not detected"; exit 1; fi
  echo OK
}
resume() {  # resume FROM_NP TO_NP NAME TAG FLAGS...
  local from=$1 to=$2 name=$3 tag=$4; shift 4
  copy_checkpoint "ckpt$from" "$tag" "ckpt-$name"
  train "$to" "$name" "$(micro "$to")" --checkpoint_dir "ckpt-$name" --resume "$@"
}

case $case in
  baseline[1-4])
    np=${case#baseline}; data
    rm -rf "ckpt$np"
    train "$np" "baseline$np" "$(micro "$np")" --checkpoint_dir "ckpt$np" --checkpoint_interval $MID
    "$UCKPT" convert -q "ckpt$np/global_step$MID" "ckpt$np/global_step${MID}_universal"
    [ "$(wc -l <"$(csv "baseline$np")")" -eq $((STEPS + 1)) ] || { echo "FAIL: baseline$np logged"; exit 1; }
    echo OK ;;
  zero_4to4)
    resume 4 4 "$case" "global_step$MID"
    expect pass "$(csv baseline4)" "$(csv $case)" $((MID + 1)) $STEPS exact ;;
  universal_4to4)
    resume 4 4 "$case" "global_step${MID}_universal" --universal_checkpoint
    expect pass "$(csv baseline4)" "$(csv $case)" $((MID + 1)) $STEPS exact ;;
  universal_[1-4]to[1-4])
    n=${case#universal_}; from=${n%to*}; to=${n#*to}
    resume "$from" "$to" "$case" "global_step${MID}_universal" --universal_checkpoint
    expect pass "$(csv baseline$from)" "$(csv $case)" $((MID + 1)) $STEPS universal ;;
  no_optimizer_4to2)
    resume 4 2 "$case" "global_step${MID}_universal" --universal_checkpoint --no_load_optimizer_states
    # Same weights, so the first resumed step still matches; the later ones must depart.
    expect pass "$(csv baseline4)" "$(csv $case)" $((MID + 1)) $((MID + 1)) universal
    expect fail "$(csv baseline4)" "$(csv $case)" $((MID + 1)) $STEPS universal ;;
  ga)
    data
    train 1 ga_1x12 12
    train 1 ga_1x3x4 3
    train 2 ga_2x3x2 3
    train 3 ga_3x2x2 2
    grep -q "micro 3 x GA 4 x 1 ranks" logs-ga_1x3x4.out || { echo "FAIL: GA 4 not in effect"; exit 1; }
    for run in ga_1x3x4 ga_2x3x2 ga_3x2x2; do expect pass "$(csv ga_1x12)" "$(csv $run)" 1 $STEPS rel:1e-5; done
    # The tolerance can fail: a run with another learning rate departs.
    train 1 ga_other_lr 3 --lr 1e-3
    expect fail "$(csv ga_1x12)" "$(csv ga_other_lr)" 1 $STEPS rel:1e-5 ;;
  plot_svg|plot_png)
    mkdir -p runs/base runs/resumed
    { echo "step,loss,lr,grad_norm,loss_scale,tokens_per_s"; for s in $(seq 1 20); do echo "$s,$((100 - s)).5,0.001,1,1,10"; done; } >runs/base/metrics.csv
    # A resumed run appended twice to its folder: step 14 logged twice keeps one point.
    { echo "step,loss,lr,grad_norm,loss_scale,tokens_per_s"; for s in $(seq 11 14) $(seq 14 20); do echo "$s,$((101 - s)),0.001,1,1,10"; done; } >runs/resumed/metrics.csv
    ext=${case#plot_}
    "$UCKPT" plot runs/base runs/resumed/ -o "plot.$ext" --resume-step 10 --title "a <test> & title"
    if [ "$ext" = png ]; then
      [ "$(head -c 8 plot.png | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || { echo "FAIL: not a PNG"; exit 1; }
      [ ! -e plot.png.tmp.svg ] || { echo "FAIL: temporary SVG left behind"; exit 1; }
      echo OK; exit 0
    fi
    /usr/bin/python3 - plot.svg <<'PY'
import sys, xml.etree.ElementTree as ET
ns = {"s": "http://www.w3.org/2000/svg"}
root = ET.parse(sys.argv[1]).getroot()                     # raises on malformed XML
lines = root.findall(".//s:polyline", ns)
assert [l.get("data-run") for l in lines] == ["base", "resumed"], [l.get("data-run") for l in lines]
counts = [len(l.get("points").split()) for l in lines]
assert counts == [20, 10], counts
xs = [float(p.split(",")[0]) for p in lines[0].get("points").split()]
assert xs == sorted(xs) and len(set(xs)) == 20, xs
texts = ["".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text")]
assert "base" in texts and "resumed" in texts, texts          # legend
assert "a <test> & title" in texts, texts                      # escaped title
assert "resume @10" in texts, texts                            # resume marker
circles = root.findall(".//s:circle[@class='resume-point']", ns)
assert len(circles) == 1, len(circles)                         # the resumed run starts at a dot
print("OK: 2 polylines with 20 and 10 points, legend, marker")
PY
    ;;
  plot_bad_input)
    mkdir -p runs/bad runs/empty
    printf 'step,loss\n1,2.5\n2,oops\n' >runs/bad/metrics.csv
    for args in "runs/bad -o x.svg" "runs/empty -o x.svg" "runs/missing -o x.svg"; do
      rc=0; "$UCKPT" plot $args 2>err.txt || rc=$?
      [ $rc -ne 0 ] && [ $rc -lt 128 ] || { echo "FAIL: plot $args exited $rc"; exit 1; }
      grep -q "metrics.csv" err.txt || { echo "FAIL: message does not name the file:"; cat err.txt; exit 1; }
      cat err.txt
    done
    grep -q "line 3" <("$UCKPT" plot runs/bad -o x.svg 2>&1) || { echo "FAIL: line number"; exit 1; }
    rc=0; "$UCKPT" plot runs/bad -o x.pdf 2>/dev/null || rc=$?
    [ $rc -ne 0 ] || { echo "FAIL: .pdf accepted"; exit 1; }
    [ ! -e x.svg ] || { echo "FAIL: output written on error"; exit 1; }
    echo OK ;;
  *) echo "unknown case $case"; exit 2 ;;
esac
