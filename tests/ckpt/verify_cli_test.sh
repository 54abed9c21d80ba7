#!/bin/bash
# The `uckpt verify` command line and the --verify flags of convert/export:
# exit codes (0 intact, 1 problems, 2 not a checkpoint / usage), one line per
# problem naming the file, the summary line, --json, --sizes-only, and the
# manifest's hashes against xxhsum (Debian package xxhash), an independent
# XXH64 implementation.
# Usage: verify_cli_test.sh UCKPT SHARED_DIR
source "$(dirname "$(realpath "$0")")/cli_lib.sh"

# DeepSpeed's folders (no manifest): structure and CRC-32s.
"$UCKPT" verify "$FX/z2_ws3_fp32/ckpt" >"$T/out" 2>&1
check "DeepSpeed root: exit 0" test $? -eq 0
check "DeepSpeed root: summary" grep -q "^verify: $FX/z2_ws3_fp32/ckpt: OK: 0 problem(s) in 2 folder(s) (0 with a manifest)" "$T/out"

# Our conversion has a manifest whose hashes xxhsum agrees with.
mkdir "$T/ckpt"
"$UCKPT" convert -q "$FX/z2_ws3_fp32/ckpt/global_step5" "$T/ckpt/global_step5_universal"
U=$T/ckpt/global_step5_universal
"$UCKPT" verify "$T/ckpt" >"$T/out" 2>&1
check "converted root: exit 0" test $? -eq 0
check "converted root: summary" grep -q ": OK: 0 problem(s) in 1 folder(s) (1 with a manifest)" "$T/out"
if command -v xxhsum >/dev/null; then
  /usr/bin/python3 - "$U" >"$T/listed" <<'PY'
import json, sys
m = json.load(open(sys.argv[1] + "/uckpt-manifest.json"))
for f in m["files"]:
    print(f["xxh64"] + "  " + f["path"])
PY
  (cd "$U" && xxhsum -H1 -c --quiet "$T/listed") >"$T/xxhsum" 2>&1
  check "xxhsum -H1 -c agrees with every manifest hash" test $? -eq 0
  check "the manifest lists every other file" test "$(wc -l <"$T/listed")" -eq "$(find "$U" -type f ! -name uckpt-manifest.json | wc -l)"
else
  echo "FAIL xxhsum missing (apt-get install xxhash; scripts/install-deps.sh installs it)"
  fails=$((fails + 1))
fi

# A flipped byte: found by hash (exit 1, the file named), not by sizes.
V=$U/zero/h.0.attn.c_attn.weight/exp_avg.pt
/usr/bin/python3 -c "
import sys; p = sys.argv[1]; b = bytearray(open(p, 'rb').read()); b[len(b) // 2] ^= 4; open(p, 'wb').write(b)" "$V"
"$UCKPT" verify "$T/ckpt" >"$T/out" 2>"$T/err"
check "flipped byte: exit 1" test $? -eq 1
check "flipped byte: the file named" grep -q "^$V: content differs from the manifest (xxh64 [0-9a-f]*, expected [0-9a-f]*)$" "$T/out"
check "flipped byte: summary FAILED" grep -q ": FAILED: 1 problem(s)" "$T/out"
"$UCKPT" verify --sizes-only "$U" >/dev/null 2>&1
check "flipped byte: --sizes-only does not read contents (exit 0)" test $? -eq 0
"$UCKPT" verify --json "$U" >"$T/json"
check "--json: exit 1" test $? -eq 1
check "--json: report" /usr/bin/python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))
assert r['ok'] is False and r['problem_count'] == 1, r
f = r['folders'][0]
assert f['manifest'] and f['kind'] == 'universal' and f['problems'][0]['file'] == sys.argv[2], f" "$T/json" "$V"
"$UCKPT" export "$U" "$T/m.safetensors" -q 2>/dev/null
check "export without --verify: sizes match, exported" test -s "$T/m.safetensors"
"$UCKPT" export --verify "$U" "$T/m2.safetensors" -q 2>"$T/err"
check "export --verify: exit 2" test $? -eq 2
check "export --verify: names the file" grep -q "$V: content differs" "$T/err"
check "export --verify: no output" test ! -e "$T/m2.safetensors"

# A truncated file fails every load, without --verify.
truncate -s 100 "$V"
"$UCKPT" export "$U" "$T/m3.safetensors" -q 2>"$T/err"
check "truncated: export exit 2" test $? -eq 2
check "truncated: names the file and sizes" grep -q "$V: size 100 bytes, the manifest says [0-9]* (truncated)" "$T/err"
"$UCKPT" verify -q "$U" >"$T/out"
check "truncated: verify -q exit 1" test $? -eq 1
check "truncated: -q prints the problem only" test "$(wc -l <"$T/out")" -eq 1

# Not a checkpoint, or a wrong command line: exit 2.
"$UCKPT" verify "$T/nowhere" >/dev/null 2>&1
check "missing folder: exit 2" test $? -eq 2
mkdir "$T/empty"
"$UCKPT" verify "$T/empty" >/dev/null 2>"$T/err"
check "not a checkpoint: exit 2" test $? -eq 2
check "not a checkpoint: says so" grep -q "not a checkpoint" "$T/err"
# A folder name that is not UTF-8 still gives a JSON report (replacement characters).
bad=$(printf '%s/ckpt_\377' "$T")
mkdir -p "$bad" && cp -r "$FX/z2_ws3_fp32/ckpt/global_step5" "$bad/"
"$UCKPT" verify --json "$bad" >"$T/json-bad" 2>"$T/err-bad"
check "--json, non-UTF-8 folder name: exit 0" test $? -eq 0
check "--json, non-UTF-8 folder name: a JSON report" /usr/bin/python3 -c "
import json, sys
r = json.load(open(sys.argv[1], encoding='utf-8'))
assert r['folders'] and '\ufffd' in r['folders'][0]['folder'], r" "$T/json-bad"

"$UCKPT" verify >/dev/null 2>&1
check "no DIR: exit 2" test $? -eq 2
"$UCKPT" verify --help >"$T/help"
check "--help: exit 0 and teaches the exit status" grep -q "Exit status: 0 intact, 1 problems found" "$T/help"

echo "$fails failure(s)"
exit $((fails > 0))
