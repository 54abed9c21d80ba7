#!/bin/bash
# Every checkpoint uckpt writes verifies (docs/reliability.md): engine saves
# at ZeRO stage 0 (1 and 2 ranks), 1 and 2 (fp32, and bf16) on a tiny
# GPT-2, and the universal checkpoints `uckpt convert` makes of stages 1 and
# 2 -- each folder with its manifest, `uckpt verify` exit 0 on the folder, on
# the checkpoint root (which also checks `latest` / `latest_universal`) and
# with --sizes-only. Async saves do not exist yet; when they do, add them to
# CASES.
#
# usage: verify_own_test.sh UCKPT WORK_DIR
set -euo pipefail
source "$(dirname "$(realpath "$0")")/tiny_gpt2.sh"
tiny_gpt2 8 --timeout 60 --heartbeat_interval 0.25 --heartbeat_timeout 3

# NAME RANKS FLAGS: a 2-step run saving global_step2 into ck_NAME.
CASES=(
  "z0_1rank 1 --zero_stage 0"
  "z0 2 --zero_stage 0"
  "z1 2 --zero_stage 1"
  "z2 2 --zero_stage 2"
  "z2_bf16 2 --zero_stage 2 --bf16"
)
verified() {  # verified PATH FOLDERS: exit 0, every folder with its manifest
  local out
  out=$("$U" verify "$1" 2>&1) || { echo "$out"; fail "uckpt verify $1"; }
  echo "$out" | grep -q ": OK: 0 problem(s) in $2 folder(s) ($2 with a manifest)" || { echo "$out"; fail "verify $1: $2 folder(s) with a manifest"; }
  "$U" verify --sizes-only "$1" > /dev/null 2>&1 || fail "uckpt verify --sizes-only $1"
}
for c in "${CASES[@]}"; do
  set -- $c
  name=$1 ranks=$2
  shift 2
  "$U" launch -n "$ranks" --master_port 0 -- "$U" train $F "$@" --steps 2 --checkpoint_dir "ck_$name" \
    --checkpoint_interval 2 --run_name "$name" > "$name.log" 2>&1 || { cat "$name.log"; fail "$name: training"; }
  verified "ck_$name/global_step2" 1
  verified "ck_$name" 1
  echo "  $name: global_step2 verifies"
  case $name in
    z0*) ;;
    *)
      "$U" convert -q "ck_$name/global_step2" "ck_$name/global_step2_universal" > "conv_$name.log" 2>&1 ||
        { cat "conv_$name.log"; fail "$name: convert"; }
      verified "ck_$name/global_step2_universal" 1
      verified "ck_$name" 2
      echo "  $name: global_step2_universal verifies"
      ;;
  esac
done
echo "every checkpoint verifies"
