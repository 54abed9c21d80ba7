#!/bin/bash
# Tensor-parallel (AutoTP) ZeRO checkpoints written by DeepSpeed 0.19.8
# (tests/fixtures/deepspeed-releases/autotp): uckpt verify, convert (byte for byte against that
# release's ds_to_universal.py output on the same PyTorch), the ds_to_universal drop-in, and
# refusals that name what is wrong. export is checked against the model's whole weights by
# ds_autotp_export_check.py.
# Usage: ds_autotp_test.sh UCKPT FIXTURES_DIR   (FIXTURES_DIR: .../deepspeed-releases/autotp)
source "$(dirname "$(realpath "$0")")/cli_lib.sh"
FXR=$2

cases=0
for dir in "$FXR"/ds*/*/; do
  case=$(basename "$(dirname "$dir")")/$(basename "$dir")
  in=$dir/ckpt/global_step3
  ref=$dir/ckpt/global_step3_universal
  out=$T/${case//\//-}
  cases=$((cases + 1))
  "$UCKPT" verify "$in" >"$T/verify.out" 2>&1
  check "$case: verify exit 0" test $? -eq 0
  "$UCKPT" inspect "$in" >"$T/inspect.out" 2>&1
  check "$case: inspect says tensor-parallel 2" grep -q "tensor-parallel: *2" "$T/inspect.out"
  "$UCKPT" convert "$in" "$out/u" -q 2>"$T/convert.err"
  check "$case: convert exit 0" test $? -eq 0
  [ -s "$T/convert.err" ] && cat "$T/convert.err"
  check "$case: convert byte-identical to DeepSpeed's ds_to_universal" same_files "$ref" "$out/u" manifest
  "$UCKPT" verify "$out/u" >"$T/verify_u.out" 2>&1
  check "$case: verify of the converted folder exit 0" test $? -eq 0
  fp_in=$("$UCKPT" verify --state "$in" 2>&1 | grep -o "state fingerprint [0-9a-f]*")
  fp_out=$("$UCKPT" verify --state "$out/u" 2>&1 | grep -o "state fingerprint [0-9a-f]*")
  check "$case: the TP folder's state fingerprint is its conversion's" test -n "$fp_in" -a "$fp_in" = "$fp_out"
  # The drop-in, as a framework calls it: AutoTP writes universal_checkpoint_info, no flag needed.
  "$UCKPT" ds_to_universal --input_folder "$in" --output_folder "$out/d/global_step3_universal" \
    --num_extract_workers 1 --num_merge_workers 1 >"$T/d.out" 2>"$T/d.err"
  check "$case: ds_to_universal exit 0" test $? -eq 0
  check "$case: ds_to_universal writes DeepSpeed's files, byte for byte" same_files "$ref" "$out/d/global_step3_universal"
  check "$case: ds_to_universal writes latest_universal" test "$(cat "$out/d/latest_universal")" = global_step3_universal
done
check "found the fixtures" test "$cases" -ge 4

# Refusals, on copies of one case.
src=$FXR/ds0.19.8/tp2dp2_z1_bf16/ckpt/global_step3
cp -r "$src" "$T/missing"
rm "$T/missing/bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"
"$UCKPT" convert "$T/missing" "$T/missing_u" -q 2>"$T/missing.err"
check "a missing TP rank file: convert fails" test $? -ne 0
check "... naming the file" grep -q "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt" "$T/missing.err"
"$UCKPT" verify "$T/missing" >"$T/missing_v.out" 2>&1
check "... and verify reports it" test $? -ne 0
cp -r "$src" "$T/nompr1"
rm "$T/nompr1/mp_rank_01_model_states.pt"
"$UCKPT" convert "$T/nompr1" "$T/nompr1_u" -q 2>"$T/nompr1.err"
check "a missing TP rank's model states: convert fails naming it" grep -q "mp_rank_01" "$T/nompr1.err"
# One value of a replicated parameter (model.embed_tokens.weight, at the start of every flat
# partition) changed on TP rank 1: the ranks disagree, and convert says so.
cp -r "$FXR/ds0.19.8/tp2dp1_z1_fp32/ckpt/global_step3" "$T/tampered"
/usr/bin/python3 - "$T/tampered/zero_pp_rank_0_mp_rank_01_optim_states.pt" <<'PY'
import struct, sys, zipfile
path = sys.argv[1]
record = next(i for i in zipfile.ZipFile(path).infolist() if i.file_size == 3600 * 4)  # a flat partition
with open(path, "r+b") as f:
    f.seek(record.header_offset + 26)
    name_len, extra_len = struct.unpack("<HH", f.read(4))
    f.seek(record.header_offset + 30 + name_len + extra_len)
    first = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([first[0] ^ 1]))
PY
"$UCKPT" convert "$T/tampered" "$T/tampered_u" -q 2>"$T/tampered.err"
check "TP ranks disagreeing on a replicated parameter: convert fails" test $? -ne 0
check "... naming the parameter and the rank" grep -q "model.embed_tokens.weight.*TP rank 1 holds other values" "$T/tampered.err"
check "... and writing nothing" test ! -e "$T/tampered_u"

# uckpt's engine has no tensor parallelism: a resume of a TP checkpoint, or of its universal
# conversion, is refused naming the TP degree and the remedy.
if "$UCKPT" train --help >/dev/null 2>&1; then
  mkdir -p "$T/engine"
  cp -r "$FXR/ds0.19.8/tp2dp1_z1_fp32/ckpt" "$T/engine/ckpt"
  echo '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
         "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}' >"$T/engine/ds.json"
  train=("$UCKPT" train --config "$T/engine/ds.json" --steps 4 --checkpoint_dir "$T/engine/ckpt" --resume
         --n_layer 1 --n_embd 16 --n_head 2 --vocab_size 67 --threads 1 --log_dir "$T/engine/logs")
  "${train[@]}" >"$T/engine/out" 2>&1
  check "engine resume of a TP checkpoint: refused" test $? -ne 0
  check "... naming the TP degree and the remedy" grep -q "tensor-parallel checkpoint (DeepSpeed AutoTP, TP degree 2).*uckpt convert.*uckpt export" "$T/engine/out"
  # (The fixture's ckpt/ holds DeepSpeed's conversion and latest_universal.)
  "${train[@]}" --universal_checkpoint >"$T/engine/out_u" 2>&1
  check "engine resume of its universal conversion: refused" test $? -ne 0
  check "... naming the TP degree and export" grep -q "converted from a tensor-parallel checkpoint (DeepSpeed AutoTP, TP degree 2).*uckpt export" "$T/engine/out_u"
else
  echo "skip engine refusals: this uckpt has no engine (uckpt train)"
fi

echo "$fails failure(s)"
exit $((fails > 0))
