#!/bin/bash
# The uckpt convert/inspect/export command lines: flag spellings, progress
# output, -j, --force, trailing slashes, exit codes, and a full disk (a small
# tmpfs in a private mount namespace, when this machine allows one).
# Usage: cli_test.sh UCKPT SHARED_DIR
source "$(dirname "$(realpath "$0")")/cli_lib.sh"

IN=$FX/z2_ws3_fp32/ckpt/global_step5
UNI=$FX/z2_ws3_fp32/ckpt/global_step5_universal

# DeepSpeed's flag spellings, and a trailing slash on the output: latest_universal
# still goes beside the output folder, with its name.
mkdir "$T/a"
"$UCKPT" convert --input_folder "$IN" --output_folder "$T/a/step5_universal/" -q 2>"$T/err"
check "--input_folder/--output_folder" test $? -eq 0
check "trailing slash: latest_universal beside the output" test "$(cat "$T/a/latest_universal")" = step5_universal
check "no latest_universal inside the output" test ! -e "$T/a/step5_universal/latest_universal"
check "--quiet prints nothing" test ! -s "$T/err"
check "files equal DeepSpeed's" diff -r "$T/a/step5_universal/zero" "$UNI/zero"

# -j 1 and -j 4 give the same bytes; progress on a pipe is plain lines.
"$UCKPT" convert "$IN" "$T/j1" -j 1 2>"$T/progress"
check "-j 1 exit 0" test $? -eq 0
check "progress lines when not a TTY" grep -q "^convert: 100% .* 30 of 30 params" "$T/progress"
check "summary line" grep -q "^convert: wrote $T/j1: 30 parameters" "$T/progress"
check "no carriage returns when not a TTY" bash -c "! grep -q $'\r' '$T/progress'"
"$UCKPT" convert "$IN" "$T/j4" -j 4 -q
check "-j 4 equals -j 1" diff -r "$T/j1" "$T/j4"
if command -v script >/dev/null; then
  script -qec "'$UCKPT' convert '$IN' '$T/tty'" /dev/null >"$T/tty.log" 2>&1
  check "progress bar on a TTY" grep -q $'\r\\[#' "$T/tty.log"
fi

# An existing output: refused (exit != 0, left alone) unless --force.
"$UCKPT" convert "$IN" "$T/j1" -q 2>"$T/err"
rc=$?
check "existing output refused" test $rc -ne 0
check "refusal says --force" grep -q -- "--force" "$T/err"
"$UCKPT" convert "$IN" "$T/j1" -q --force
check "--force replaces" test $? -eq 0

# Bad input: a clear message naming the file, exit 2, nothing written.
mkdir "$T/bad" && cp "$IN"/* "$T/bad/" && chmod u+w "$T/bad"/* && rm "$T/bad/zero_pp_rank_1_mp_rank_00_optim_states.pt"
"$UCKPT" convert "$T/bad" "$T/bad_out" 2>"$T/err"
rc=$?
check "missing rank: exit 2" test $rc -eq 2
check "missing rank: names the file" grep -q "zero_pp_rank_1_mp_rank_00_optim_states.pt: missing rank file" "$T/err"
check "missing rank: no output" test ! -e "$T/bad_out"
check "missing rank: no temporary folder" bash -c "! ls -A '$T' | grep -q uckpt-tmp"

# inspect DIR and --json; export.
"$UCKPT" inspect "$FX/z2_ws3_fp32/ckpt" >"$T/inspect"
check "inspect DIR" grep -q "kind: *ZeRO-2" "$T/inspect"
"$UCKPT" inspect --json "$T/j1" >"$T/inspect.json"
check "inspect --json universal" grep -q '"kind": "universal"' "$T/inspect.json"
"$UCKPT" export "$T/j1" "$T/m.safetensors" --dtype fp16 -q
check "export --dtype fp16" grep -q '"F16"' "$T/m.safetensors"

# A full disk: ENOSPC from a 64 KiB tmpfs. Needs a private mount namespace.
if unshare -m true 2>/dev/null; then
  unshare -m bash -c "
    mkdir -p '$T/small' && mount -t tmpfs -o size=64k tmpfs '$T/small' || exit 77
    '$UCKPT' convert '$IN' '$T/small/u' -q 2>'$T/enospc'; rc=\$?
    echo \$rc > '$T/enospc.rc'; ls -A '$T/small' > '$T/enospc.ls'"
  if [ -e "$T/enospc.rc" ]; then
    check "full disk: exit 2" test "$(cat "$T/enospc.rc")" = 2
    check "full disk: says so, naming the file" grep -q "cannot write .*: No space left on device" "$T/enospc"
    check "full disk: nothing left" test ! -s "$T/enospc.ls"
  else
    echo "skip full-disk test (no tmpfs mount allowed)"
  fi
else
  echo "skip full-disk test (no mount namespace)"
fi

# An injected write failure without privileges: the file-size limit (EFBIG).
bash -c "trap '' XFSZ; ulimit -f 16; exec '$UCKPT' convert '$IN' '$T/limited' -q" 2>"$T/efbig"
rc=$?
check "write failure: exit 2" test $rc -eq 2
check "write failure: names the file" grep -q "cannot write .*File too large" "$T/efbig"
check "write failure: nothing left" bash -c "! ls -A '$T' | grep -q -e limited -e uckpt-tmp"

echo "$fails failure(s)"
exit $((fails > 0))
