#!/bin/bash
# scripts/python-env.sh's choice of installer, without a network: a stand-in virtual environment
# whose python answers `pip config list` with the settings under test and records every install
# (failing it, so the script stops there), beside a stand-in uv that records its arguments.
#   1. pip's index, extra indexes, find-links and no-cache reach uv as its flags, PIP_* over files;
#   2. a pip setting uv is not given (a proxy) keeps pip, and says so;
#   3. UCKPT_INSTALLER=pip keeps pip; another value is refused, naming it.
# usage: python_env_installer_test.sh SOURCE_DIR WORK_DIR
set -euo pipefail
src=$1 work=$2
fail() { echo "FAIL: $*"; exit 1; }
rm -rf "$work" && mkdir -p "$work/venv/bin"
cat > "$work/venv/bin/python" <<'PY'
#!/bin/bash
[ "$*" = "-m pip config list" ] && { printf '%s\n' "$FAKE_PIP_SETTINGS"; exit 0; }
echo "python $*" >> "$FAKE_LOG"
exit 1
PY
cat > "$work/venv/bin/uv" <<'UV'
#!/bin/bash
echo "uv $*" >> "$FAKE_LOG"
exit 1
UV
chmod +x "$work/venv/bin/python" "$work/venv/bin/uv"
unset UCKPT_PYTHON UCKPT_INSTALLER   # the script under test makes its own choices
export FAKE_LOG=$work/calls UCKPT_VENV=$work/venv
run() {  # run SETTINGS [VAR=VALUE...]: python-env.sh's output (it must fail: every install does)
  local settings=$1; shift
  rm -f "$FAKE_LOG"
  if env FAKE_PIP_SETTINGS="$settings" "$@" bash "$src/scripts/python-env.sh" > "$work/out" 2>&1; then
    cat "$work/out"; fail "python-env.sh succeeded with installs that fail"
  fi
}

run ":env:.index-url='https://mirror.example/simple'
:env:.extra-index-url='https://a.example/simple https://b.example/simple'
:env:.find-links='/opt/wheels'
:env:.cache-dir='/var/cache/pip'
:env:.no-cache-dir='1'
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
global.index-url='https://files.example/simple'"
want="uv pip install --python $work/venv/bin/python --cache-dir /var/cache/pip --no-cache --index-url https://mirror.example/simple"
want+=" --extra-index-url https://a.example/simple --extra-index-url https://b.example/simple"
want+=" --find-links /opt/wheels -r requirements/torch.txt"
[ "$(cat "$FAKE_LOG")" = "$want" ] || fail "uv was called as: $(cat "$FAKE_LOG"); want: $want"
grep -q "UCKPT_INSTALLER=pip installs with pip" "$work/out" || { cat "$work/out"; fail "no remedy named"; }

run ":env:.proxy='http://proxy.example:3128'"
grep -q "pip's setting :env:.proxy has no uv counterpart here: installing with pip" "$work/out" ||
  { cat "$work/out"; fail "the proxy setting was not named"; }
grep -q "^python -m pip install .* -r requirements/torch.txt" "$FAKE_LOG" && ! grep -q "^uv" "$FAKE_LOG" ||
  fail "a proxy setting did not keep pip: $(cat "$FAKE_LOG")"

run "" UCKPT_INSTALLER=pip
grep -q "^python -m pip install .* -r requirements/torch.txt" "$FAKE_LOG" && ! grep -q "^uv" "$FAKE_LOG" ||
  fail "UCKPT_INSTALLER=pip did not keep pip: $(cat "$FAKE_LOG")"
run "" UCKPT_INSTALLER=conda
grep -q "UCKPT_INSTALLER must be uv or pip, not 'conda'" "$work/out" || { cat "$work/out"; fail "conda not refused"; }
echo "python_env_installer: PASS"
