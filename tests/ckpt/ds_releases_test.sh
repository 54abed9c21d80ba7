#!/bin/bash
# ZeRO checkpoints written by newer DeepSpeed releases (tests/fixtures/deepspeed-releases):
# uckpt verify, inspect, convert (byte for byte against that release's ds_to_universal.py
# output on the same PyTorch), export, and the ds_to_universal drop-in (flags, exit codes,
# the same files). Cases DeepSpeed's converter failed on (ds_to_universal.rc != 0, Muon: #8608)
# are converted by uckpt and checked by their values.
# Usage: ds_releases_test.sh UCKPT FIXTURES_DIR [RELEASE]   (RELEASE: e.g. ds0.19.8; default all)
source "$(dirname "$(realpath "$0")")/cli_lib.sh"
FXR=$2
releases=${3:-$(cd "$FXR" && ls -d ds*)}

for rel in $releases; do
  for dir in "$FXR/$rel"/*/; do
    case=$(basename "$dir")
    in=$dir/ckpt/global_step3
    ref=$dir/ckpt/global_step3_universal
    stage=${case:1:1}
    "$UCKPT" verify "$in" >"$T/verify.out" 2>&1
    check "$rel/$case: verify exit 0" test $? -eq 0
    "$UCKPT" inspect "$dir/ckpt" >"$T/inspect.out" 2>&1
    check "$rel/$case: inspect says ZeRO-$stage" grep -q "kind: *ZeRO-$stage" "$T/inspect.out"
    out=$T/$rel-$case
    "$UCKPT" convert "$in" "$out/u" -q 2>"$T/convert.err"
    check "$rel/$case: convert exit 0" test $? -eq 0
    [ -s "$T/convert.err" ] && cat "$T/convert.err"
    if [ -d "$ref" ]; then
      check "$rel/$case: convert byte-identical to DeepSpeed's ds_to_universal" same_files "$ref" "$out/u" manifest
      check "$rel/$case: latest_universal beside the output" test "$(cat "$out/latest_universal")" = u
    fi
    "$UCKPT" verify "$out/u" >"$T/verify_u.out" 2>&1
    check "$rel/$case: verify of the converted folder exit 0" test $? -eq 0
    "$UCKPT" export "$out/u" "$out/m.safetensors" -q
    check "$rel/$case: export exit 0" test $? -eq 0
    param=fc1.weight
    [[ $case == *_hf ]] && param=transformer.h.0.mlp.c_fc.weight  # the Trainer's GPT-2
    check "$rel/$case: export holds $param" grep -q "\"$param\"" "$out/m.safetensors"
    "$UCKPT" export "$in" "$out/direct.safetensors" -q
    check "$rel/$case: export of the ZeRO folder exit 0" test $? -eq 0

    if [ "$stage" = 0 ]; then
      # DeepSpeed's script has no stage 0 (#7200: it finds no *_optim_states.pt, exit 1); the
      # drop-in writes the folder convert writes.
      "$UCKPT" ds_to_universal --input_folder "$in" --output_folder "$out/d/u" >/dev/null 2>"$T/d.err"
      check "$rel/$case: ds_to_universal of stage 0 exit 0" test $? -eq 0
      check "$rel/$case: ... the files convert writes" same_files "$out/d/u" "$out/u" manifest
    fi

    # The drop-in, as a framework calls it.
    [ -d "$ref" ] || continue
    "$UCKPT" ds_to_universal --input_folder "$in" --output_folder "$out/d/global_step3_universal" \
      --inject_missing_state --num_extract_workers 1 --num_merge_workers 1 >"$T/d.out" 2>"$T/d.err"
    check "$rel/$case: ds_to_universal exit 0" test $? -eq 0
    check "$rel/$case: ds_to_universal writes DeepSpeed's files, byte for byte" \
      same_files "$ref" "$out/d/global_step3_universal"
    check "$rel/$case: ds_to_universal writes latest_universal" \
      test "$(cat "$out/d/latest_universal")" = global_step3_universal
    if [ "$stage" != 3 ]; then
      # No universal_checkpoint_info (saved as the HF Trainer saves): DeepSpeed's script
      # stops unless told --inject_missing_state, with exit 1.
      "$UCKPT" ds_to_universal --input_folder "$in" --output_folder "$out/e/u" >/dev/null 2>"$T/e.err"
      check "$rel/$case: without --inject_missing_state exit 1" test $? -eq 1
      check "$rel/$case: ... naming the flag" grep -q -- "--inject_missing_state" "$T/e.err"
      check "$rel/$case: ... and writing nothing" test ! -e "$out/e/u"
    fi
  done
done

# Every flag of DeepSpeed's argparse is taken; those uckpt has nothing to do for are said.
rel=$(echo $releases | cut -d' ' -f1)
in=$FXR/$rel/z2_fp32/ckpt/global_step3
"$UCKPT" ds_to_universal --input_folder "$in" --output_folder "$T/flags/u" --inject_missing_state \
  --num_extract_workers 3 --num_merge_workers 5 --keep_temp_folder --no_strict >/dev/null 2>"$T/flags.err"
check "every flag: exit 0" test $? -eq 0
check "--keep_temp_folder said" grep -q -- "--keep_temp_folder: nothing to keep" "$T/flags.err"
check "--num_merge_workers said" grep -q -- "--num_merge_workers 5: no merge phase" "$T/flags.err"
check "--no_strict said" grep -q -- "--no_strict: nothing to relax" "$T/flags.err"
check "no manifest: only DeepSpeed's files" test ! -e "$T/flags/u/uckpt-manifest.json"
# Run again into the same folder, as DeepSpeed's script may be: it writes over it.
"$UCKPT" ds_to_universal --input_folder "$in" --output_folder "$T/flags/u" --inject_missing_state >/dev/null 2>&1
check "an existing output folder is written over (exit 0)" test $? -eq 0
"$UCKPT" ds_to_universal --input_folder "$in" >/dev/null 2>&1
check "missing --output_folder: usage error, exit 2" test $? -eq 2
"$UCKPT" ds_to_universal --input_folder "$T/nowhere" --output_folder "$T/x/u" --inject_missing_state >/dev/null 2>"$T/nf.err"
check "missing input: exit 1" test $? -eq 1
check "missing input: says so" grep -q "nowhere" "$T/nf.err"

echo "$fails failure(s)"
exit $((fails > 0))
