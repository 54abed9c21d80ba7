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
