#!/bin/bash
# `uckpt train --resume` over corrupted checkpoints (the real CLI, 2 ranks): a
# truncated, bit-flipped, missing, swapped or hostile file in the ZeRO or the
# universal checkpoint gives a clean error naming a file and a non-zero exit:
# no crash (signal), no hang, no "resumed" run. The in-process matrix over
# every fixture is tests/ckpt/corrupt_matrix_test.cc; this checks the command
# users run, on a sample of cases.
#
# usage: corrupt_resume_test.sh UCKPT WORK_DIR SHARED_DIR
set -euo pipefail
SHARED=$(realpath "$3")
source "$(dirname "$(realpath "$0")")/tiny_gpt2.sh"

tiny_gpt2 4
train() { timeout 120 "$U" launch -n 2 --master_port 0 -- "$U" train $F "$@"; }

train --steps 2 --checkpoint_dir base --run_name base > base.log 2>&1 || { cat base.log; fail "base run"; }
[ "$(cat base/latest)" = global_step2 ] || fail "no global_step2"
"$U" convert -q base/global_step2 base/global_step2_universal > convert.log 2>&1 || { cat convert.log; fail "convert"; }
# The pristine copies resume (so a failure below is the corruption's doing).
cp -a base ok
train --steps 3 --checkpoint_dir ok --resume --run_name ok > ok.log 2>&1 || { cat ok.log; fail "clean ZeRO resume"; }
cp -a base ok_u
train --steps 3 --checkpoint_dir ok_u --resume --universal_checkpoint --run_name ok_u > ok_u.log 2>&1 ||
  { cat ok_u.log; fail "clean universal resume"; }

cases=0
# expect_refusal NAME [train flags...]: runs the resume in case/NAME, expects a clean error.
expect_refusal() {
  local name=$1
  shift
  local status=0
  train --steps 3 --checkpoint_dir "case_$name" --resume --run_name "case_$name" "$@" > "case_$name.log" 2>&1 ||
    status=$?
  cases=$((cases + 1))
  [ "$status" != 0 ] || { cat "case_$name.log"; fail "$name: the resume succeeded"; }
  [ "$status" != 124 ] || { cat "case_$name.log"; fail "$name: hung (timeout)"; }
  [ "$status" -lt 128 ] || { cat "case_$name.log"; fail "$name: killed by a signal (exit $status)"; }
  # The failing rank's "uckpt: error: FILE: ...", or another rank's report of it
  # ("uckpt train: rank 1 of 2: rank 0 failed: FILE: ...") when the launcher
  # stopped the failing rank before it printed.
  grep -qE "^uckpt(: error| train: rank [0-9]+ of [0-9]+): .*case_$name" "case_$name.log" ||
    { cat "case_$name.log"; fail "$name: no error naming a file of the checkpoint"; }
  if grep -qiE "AddressSanitizer|runtime error|Segmentation|core dumped|terminate called" "case_$name.log"; then
    cat "case_$name.log"
    fail "$name: crash output"
  fi
  echo "ok: $name (exit $status): $(grep -m1 -E '^uckpt(: error| train: rank)' "case_$name.log" | cut -c1-200)"
}
fresh() { rm -rf "case_$1"; cp -a base "case_$1"; }
size() { stat -c %s "$1"; }
flip() {  # flip one byte of $1 at offset $2
  printf "$(printf '\\x%02x' $(( $(od -An -tu1 -j "$2" -N1 "$1") ^ 0xff )))" |
    dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}

Z=global_step2
O0=zero_pp_rank_0_mp_rank_00_optim_states.pt
O1=zero_pp_rank_1_mp_rank_00_optim_states.pt
M=mp_rank_00_model_states.pt
for f in $M $O0 $O1; do
  for frac in 1 2 3; do
    n="trunc_${f%%.pt}_$frac"
    fresh "$n"
    truncate -s $(( $(size "case_$n/$Z/$f") * frac / 4 )) "case_$n/$Z/$f"
    expect_refusal "$n"
  done
done
fresh missing_rank1; rm "case_missing_rank1/$Z/$O1"; expect_refusal missing_rank1
fresh missing_model; rm "case_missing_model/$Z/$M"; expect_refusal missing_model
fresh swapped
mv "case_swapped/$Z/$O0" tmp.pt; mv "case_swapped/$Z/$O1" "case_swapped/$Z/$O0"; mv tmp.pt "case_swapped/$Z/$O1"
expect_refusal swapped --verify
fresh empty_latest; : > case_empty_latest/latest; expect_refusal empty_latest
fresh latest_elsewhere; printf '../../etc' > case_latest_elsewhere/latest; expect_refusal latest_elsewhere
# Flips: in the pickle (first KB after the local header) and anywhere, with --verify.
for off in 100 200 400; do
  fresh "flip_$off"; flip "case_flip_$off/$Z/$O0" $off; expect_refusal "flip_$off" --verify
done
fresh flip_last; flip "case_flip_last/$Z/$M" $(( $(size "case_flip_last/$Z/$M") - 30 )); expect_refusal flip_last
# Without a manifest (as DeepSpeed's own folders): the readers themselves must refuse.
nomanifest() { fresh "$1"; rm -f "case_$1/$Z/uckpt-manifest.json" "case_$1/$UZ/uckpt-manifest.json"; }
UZ=global_step2_universal
for f in $M $O0 $O1; do
  n="nm_trunc_${f%%.pt}"
  nomanifest "$n"
  truncate -s $(( $(size "case_$n/$Z/$f") / 2 )) "case_$n/$Z/$f"
  expect_refusal "$n"
done
nomanifest nm_missing_rank1; rm "case_nm_missing_rank1/$Z/$O1"; expect_refusal nm_missing_rank1
nomanifest nm_flip_signature; flip "case_nm_flip_signature/$Z/$O1" 0  # the first local header signature
expect_refusal nm_flip_signature
# A hostile file in place of the model states: strict mode refuses it by name.
fresh hostile; cp "$SHARED/fixtures/torch/torch-2.11/malicious_builtins_eval_in_dict.pt" "case_hostile/$Z/$M"
rm -f "case_hostile/$Z/uckpt-manifest.json"
expect_refusal hostile
grep -q "strict mode refuses global builtins.eval" case_hostile.log || { cat case_hostile.log; fail "hostile: global not named"; }

# The universal checkpoint.
P=$(ls "base/$UZ/zero" | grep -v '\.pt$' | head -1)
for f in "zero/$P/fp32.pt" "zero/$P/exp_avg.pt" zero/optimizer_state.pt $M; do
  n="u_trunc_$(echo "$f" | tr '/.' '__')"
  fresh "$n"
  truncate -s $(( $(size "case_$n/$UZ/$f") / 2 )) "case_$n/$UZ/$f"
  expect_refusal "$n" --universal_checkpoint
done
fresh u_missing; rm "case_u_missing/$UZ/zero/$P/exp_avg_sq.pt"; expect_refusal u_missing --universal_checkpoint
fresh u_swapped
mv "case_u_swapped/$UZ/zero/$P/fp32.pt" tmp.pt
mv "case_u_swapped/$UZ/zero/$P/exp_avg.pt" "case_u_swapped/$UZ/zero/$P/fp32.pt"
mv tmp.pt "case_u_swapped/$UZ/zero/$P/exp_avg.pt"
expect_refusal u_swapped --universal_checkpoint --verify
fresh u_flip; flip "case_u_flip/$UZ/zero/$P/fp32.pt" 120; expect_refusal u_flip --universal_checkpoint --verify
nomanifest u_nm_trunc; truncate -s 100 "case_u_nm_trunc/$UZ/zero/$P/exp_avg.pt"
expect_refusal u_nm_trunc --universal_checkpoint
nomanifest u_nm_missing; rm "case_u_nm_missing/$UZ/zero/$P/fp32.pt"; expect_refusal u_nm_missing --universal_checkpoint

echo "PASS: $cases corrupted checkpoints refused by uckpt train --resume with a clean error"
