#!/bin/bash
# SIGINT / SIGTERM during `uckpt convert`: the command exits non-zero, says it
# was interrupted, and leaves neither the output nor its temporary folder.
# Usage: interrupt_test.sh UCKPT CONVERT_GEN
set -u
UCKPT=$1
GEN=$2
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fails=0
check() {  # check DESCRIPTION COMMAND...
  if "${@:2}"; then echo "ok   $1"; else echo "FAIL $1"; fails=$((fails + 1)); fi
}

"$GEN" --params 100e6 --dp 4 "$T/in" >/dev/null || { echo "FAIL generating the input"; exit 1; }
for sig in INT TERM; do
  "$UCKPT" convert "$T/in" "$T/out" -j 1 --no-sync 2>"$T/err.$sig" &
  pid=$!
  # Signal once the conversion is under way (its temporary folder exists).
  for _ in $(seq 1 2000); do
    compgen -G "$T/.out.uckpt-tmp-*" >/dev/null && break
    sleep 0.005
  done
  kill -$sig $pid
  wait $pid
  rc=$?
  check "SIG$sig: non-zero exit" test $rc -ne 0
  check "SIG$sig: says it was interrupted" grep -q "interrupted by signal" "$T/err.$sig"
  check "SIG$sig: no output folder" test ! -e "$T/out"
  check "SIG$sig: no temporary folder" bash -c "! compgen -G '$T/.out.uckpt-tmp-*' >/dev/null"
  check "SIG$sig: no latest_universal" test ! -e "$T/latest_universal"
done
echo "$fails failure(s)"
exit $((fails > 0))
