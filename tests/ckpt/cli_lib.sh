# Sourced by the command-line tests of tests/ckpt with their arguments
# (UCKPT SHARED_DIR): UCKPT, FX (the DeepSpeed fixtures), a scratch folder T
# removed on exit, and check DESCRIPTION COMMAND..., which prints ok/FAIL and
# counts failures in `fails`.
set -u
UCKPT=$1
FX=$2/fixtures/deepspeed
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fails=0
check() {  # check DESCRIPTION COMMAND...
  if "${@:2}"; then echo "ok   $1"; else echo "FAIL $1"; fails=$((fails + 1)); fi
}

# Every file of the reference folder $1 is in $2 with the same bytes, and $2 has no other
# (but the manifest, when $3 is "manifest").
same_files() {
  local ref=$1 ours=$2 extra=${3:-} f bad=0
  (cd "$ref" && find . -type f | sort) >"$T/ref.list"
  (cd "$ours" && find . -type f | sort) | { [ "$extra" = manifest ] && grep -v '^./uckpt-manifest.json$' || cat; } >"$T/ours.list"
  if ! diff "$T/ref.list" "$T/ours.list" >"$T/list.diff"; then
    echo "    file lists differ:"; sed 's/^/      /' "$T/list.diff" | head -n 20; bad=1
  fi
  while read -r f; do
    [ -f "$ours/$f" ] && ! cmp -s "$ref/$f" "$ours/$f" && { echo "    bytes differ: $f"; bad=1; }
  done <"$T/ref.list"
  return $bad
}
