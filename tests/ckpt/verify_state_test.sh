#!/bin/bash
# `uckpt verify --state`: a DeepSpeed ZeRO folder (stages 1, 2, 3), DeepSpeed's
# universal conversion of it and uckpt's print the same state fingerprint;
# uckpt's conversion records it and matches; -v lists every parameter; --json
# carries the record; a record that differs from the files is a problem.
# Usage: verify_state_test.sh UCKPT SHARED_DIR
source "$(dirname "$(realpath "$0")")/cli_lib.sh"

total() { sed -n 's/^.*: state fingerprint \([0-9a-f]\{16\}\) .*/\1/p' "$1"; }

for fx in z1_ws2_bf16 z1_ws2_fp16 z2_ws3_fp32 z3_ws2_fp32; do
  C=$FX/$fx/ckpt
  "$UCKPT" verify --state "$C/global_step5" >"$T/zero" 2>&1
  check "$fx ZeRO folder: exit 0" test $? -eq 0
  "$UCKPT" verify --state "$C/global_step5_universal" >"$T/ds_u" 2>&1
  "$UCKPT" convert -q "$C/global_step5" "$T/$fx/global_step5_universal"
  "$UCKPT" verify --state "$T/$fx/global_step5_universal" >"$T/u" 2>&1
  check "$fx uckpt's universal: exit 0" test $? -eq 0
  z=$(total "$T/zero")
  check "$fx ZeRO folder prints a fingerprint" test -n "$z"
  check "$fx DeepSpeed's universal prints the same" test "$(total "$T/ds_u")" = "$z"
  check "$fx uckpt's universal prints the same" test "$(total "$T/u")" = "$z"
  check "$fx uckpt's universal records it and matches" grep -q "matches the manifest's record" "$T/u"
done

# -v: one line per parameter with fp32=, exp_avg=, exp_avg_sq=.
C=$FX/z2_ws3_fp32/ckpt/global_step5
"$UCKPT" verify --state -v "$C" >"$T/v" 2>&1
check "-v: a line per parameter" test "$(grep -c ' fp32=[0-9a-f]\{16\} exp_avg=[0-9a-f]\{16\} exp_avg_sq=' "$T/v")" -eq 30
"$UCKPT" verify --state --json "$C" >"$T/j" 2>&1
check "--json: the record's format" /usr/bin/python3 -c "
import json, sys
f = json.load(open('$T/j'))['folders'][0]['state_fingerprint']
assert f['version'] == 1 and len(f['params']) == 30 and f['counters']['global_steps'] == 5, f['counters']
"

# A record that the files do not match: a problem naming the parameter.
U=$T/z2_ws3_fp32/global_step5_universal
/usr/bin/python3 - "$U/uckpt-manifest.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
p = m["state_fingerprint"]["params"][3]
h = int(p["states"]["exp_avg"], 16) ^ 1
p["states"]["exp_avg"] = "%016x" % h
t = 0
for q in m["state_fingerprint"]["params"]:
    for v in q["states"].values():
        t = (t + int(v, 16)) % (1 << 64)
m["state_fingerprint"]["total"] = "%016x" % t
json.dump(m, open(sys.argv[1], "w"))
print(p["name"], file=open(sys.argv[1] + ".name", "w"))
PY
name=$(cat "$U/uckpt-manifest.json.name"); rm "$U/uckpt-manifest.json.name"
"$UCKPT" verify --state "$U" >"$T/bad" 2>&1
check "a differing record: exit 1" test $? -eq 1
check "a differing record: names the parameter and key" grep -q "parameter $name 'exp_avg' differs" "$T/bad"

exit $((fails > 0))
