#!/bin/bash
# A tag must not escape its checkpoint folder (docs/reliability.md, "Tags"):
# every command that follows `latest` / `latest_universal` (inspect, export,
# verify, convert) refuses a tag that is not a plain folder name inside the
# checkpoint folder -- `..`, a path with `/`, an absolute path, an empty tag,
# a NUL byte, more than 255 bytes -- exits non-zero, names the file, and reads
# nothing outside. A plain tag still works.
# Usage: tag_test.sh UCKPT SHARED_DIR
source "$(dirname "$(realpath "$0")")/cli_lib.sh"

# ckpt/ holds only `latest`; the real checkpoint sits beside it, in victim/.
SRC=$FX/z2_ws3_fp32/ckpt/global_step5
mkdir -p "$T/victim" "$T/ckpt"
cp -r "$SRC" "$T/victim/global_step5"

# refuses NAME TAG_BYTES_PRINTF [TAG_FILE [all]]: inspect (and with `all`
# every command) exits non-zero, names the tag file, writes no output. The
# commands share one resolver (tests/ckpt/tag_resolver_test.cc tests it
# alone), so every kind of bad tag goes through inspect and the escapes
# through all four.
refuses() {
  local name=$1 bytes=$2 file=${3:-latest}
  rm -f "$T/ckpt/latest" "$T/ckpt/latest_universal" "$T/out.safetensors"
  printf "$bytes" > "$T/ckpt/$file"
  "$UCKPT" inspect "$T/ckpt" > "$T/o" 2>&1
  check "$name: inspect refuses" test $? -ne 0
  check "$name: inspect names $file" grep -q "$T/ckpt/$file: .*not a plain folder name\|$T/ckpt/$file: is empty" "$T/o"
  [ "${4:-}" = all ] || return 0
  "$UCKPT" export "$T/ckpt" "$T/out.safetensors" > "$T/o" 2>&1
  check "$name: export refuses" test $? -ne 0
  check "$name: export names $file" grep -q "$T/ckpt/$file: " "$T/o"
  check "$name: export wrote nothing" test ! -e "$T/out.safetensors"
  "$UCKPT" verify "$T/ckpt" > "$T/o" 2>&1
  check "$name: verify refuses" test $? -ne 0
  check "$name: verify names $file" grep -q "$T/ckpt/$file: " "$T/o"
  if [ "$file" = latest ]; then
    "$UCKPT" convert -q "$T/ckpt" "$T/conv" > "$T/o" 2>&1
    check "$name: convert refuses" test $? -ne 0
    check "$name: convert names $file" grep -q "$T/ckpt/$file: " "$T/o"
    check "$name: convert wrote nothing" test ! -e "$T/conv"
  fi
}

refuses "../ escape" '../victim/global_step5\n' latest all
refuses "../ escape, latest_universal" '../victim/global_step5' latest_universal all
refuses "absolute path" "$T/victim/global_step5" latest all
refuses "a/b" 'sub/global_step5'
refuses ".." '..'
refuses "." '.'
refuses "empty" ''
refuses "whitespace only" ' \n'
refuses "NUL byte" 'global_step5\0../x'
refuses "over 255 bytes" "$(printf 'a%.0s' $(seq 256))"

# The plain tag still resolves, through every command.
rm -f "$T/ckpt/latest" "$T/ckpt/latest_universal"
cp -r "$SRC" "$T/ckpt/global_step5"
printf 'global_step5\n' > "$T/ckpt/latest"
"$UCKPT" inspect "$T/ckpt" > "$T/o" 2>&1
check "plain tag: inspect" test $? -eq 0
"$UCKPT" export "$T/ckpt" "$T/out.safetensors" > "$T/o" 2>&1
check "plain tag: export" test -s "$T/out.safetensors"
"$UCKPT" verify "$T/ckpt" > "$T/o" 2>&1
check "plain tag: verify" test $? -eq 0
"$UCKPT" convert -q "$T/ckpt" "$T/ckpt/global_step5_universal" > "$T/o" 2>&1
check "plain tag: convert follows latest" test -f "$T/ckpt/global_step5_universal/uckpt-manifest.json"

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
