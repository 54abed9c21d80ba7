#!/usr/bin/env bash
# Prints the path of the Python (with PyTorch) that uckpt builds against and tests with,
# installing what is missing first. Progress goes to stderr, the path to stdout.
#
#   scripts/python-env.sh          PyTorch (requirements/torch.txt): `make demo`, `make python`
#   scripts/python-env.sh --test   also the test libraries (requirements/test.txt, DeepSpeed 0.14.5)
#   scripts/python-env.sh --ready [--test]  installs nothing; exits 0 when the call with the same
#                                           level would install nothing
#
# UCKPT_PYTHON=/path/to/python: use that Python and its own PyTorch (2.7 or newer); nothing is
# installed into it. Otherwise a virtual environment in $UCKPT_VENV (default: .venv in the
# repository) made from python3 on PATH, filled from PyPI by uv (requirements/uv.txt, which pip
# installs there first) or, with UCKPT_INSTALLER=pip or a pip setting uv is not given, by pip;
# a stamp of the requirement files skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
level=torch
ready_query=false
for arg in "$@"; do
  case $arg in
    --test) level=test ;;
    --ready) ready_query=true ;;
    *) echo "python-env: unknown option $arg (--test, --ready)" >&2; exit 2 ;;
  esac
done
say() { echo "python-env: $*" >&2; }

check_torch() {  # PYTHON: torch imports and is 2.7 or newer (older wheels use the old C++ ABI)
  "$1" - <<'PY' >&2
import sys
try:
    import torch
except Exception as e:
    sys.exit(f"python-env: {sys.executable} cannot import torch ({e})")
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
if (major, minor) < (2, 7):
    sys.exit(f"python-env: {sys.executable} has torch {torch.__version__}; uckpt needs 2.7 or newer")
PY
}

requirements_hash() { cat requirements/*.txt | sha256sum | cut -c1-16; }

if [ -n "${UCKPT_PYTHON:-}" ]; then
  $ready_query && exit 0
  py=$(command -v "$UCKPT_PYTHON" || true)
  [ -x "$py" ] || { say "UCKPT_PYTHON=$UCKPT_PYTHON is not an executable"; exit 1; }
  check_torch "$py"
  echo "$py"
  exit 0
fi

venv=${UCKPT_VENV:-$PWD/.venv}
py=$venv/bin/python
if $ready_query; then
  stamps=(torch)
  [ "$level" = test ] && stamps+=(test deepspeed)
  [ -x "$py" ] || exit 1
  for name in "${stamps[@]}"; do
    [ "$(cat "$venv/uckpt-$name.stamp" 2>/dev/null)" = "$(requirements_hash)" ] || exit 1
  done
  exit 0
fi
if [ ! -x "$py" ]; then
  base=$(command -v python3) || { say "no python3 on PATH to make $venv with"; exit 1; }
  say "making a virtual environment in $venv ($("$base" --version 2>&1))"
  "$base" -m venv "$venv" || { say "python3 -m venv failed (Debian: apt-get install python3-venv)"; exit 1; }
fi

# The installer. uv installs the same wheels as pip with far less CPU (PyTorch's 3 GB on 2 cores:
# 37 s of the machine's CPU against pip's 120 s), and the compile that runs beside it gets the
# cores. pip's settings (files and PIP_* variables) carry over where uv has the same setting;
# any other keeps pip, as does UCKPT_INSTALLER=pip or a failure to install uv.
uv="" uv_args=()
use_uv() {
  [ "${UCKPT_INSTALLER:-uv}" = pip ] && return 1
  [ "${UCKPT_INSTALLER:-uv}" = uv ] || { say "UCKPT_INSTALLER must be uv or pip, not '$UCKPT_INSTALLER'"; exit 2; }
  local line key value index="" extra=() links=() v settings scope
  settings=$("$py" -m pip config list 2> /dev/null || true)
  while IFS= read -r line; do
    key=${line%%=*} value=${line#*=}
    key=${key##*.} value=${value#\'} value=${value%\'}
    case $key in
      index-url) index=$value ;;
      extra-index-url) read -r -a extra <<< "$value" ;;
      find-links) read -r -a links <<< "$value" ;;
      cert) export SSL_CERT_FILE=$value ;;
      timeout | default-timeout) export UV_HTTP_TIMEOUT=${value%.*} ;;
      cache-dir) uv_args+=(--cache-dir "$value") ;;
      no-cache-dir) [[ ${value,,} =~ ^(1|true|yes|on)$ ]] && uv_args+=(--no-cache) ;;
      disable-pip-version-check | progress-bar | no-compile | quiet | verbose) ;;
      *) say "pip's setting ${line%%=*} has no uv counterpart here: installing with pip"; return 1 ;;
    esac
  done < <(  # in pip's order of precedence, so that the last one wins: its files, then PIP_*
    for scope in global user site :env:; do grep "^$scope\." <<< "$settings" || true; done)
  [ -n "$index" ] && uv_args+=(--index-url "$index")
  for v in "${extra[@]}"; do uv_args+=(--extra-index-url "$v"); done
  for v in "${links[@]}"; do uv_args+=(--find-links "$v"); done
  [ -x "$venv/bin/uv" ] && return 0
  "$py" -m pip install --disable-pip-version-check --progress-bar off --no-compile -q -r requirements/uv.txt \
    > "$venv/pip-uv.log" 2>&1 && return 0
  say "pip could not install uv (its log: $venv/pip-uv.log): installing with pip"
  return 1
}

# install STAMP_NAME ARGS...: installs (pip's arguments, which uv takes too) unless the stamp
# holds these requirement files' hash.
install() {
  local name=$1; shift
  local want have=""
  want=$(requirements_hash)
  [ -f "$venv/uckpt-$name.stamp" ] && have=$(cat "$venv/uckpt-$name.stamp")
  [ "$have" = "$want" ] && return 0
  local t0=$SECONDS
  local note=""
  [ "$name" = torch ] && note=" (the first time downloads about 3 GB: PyTorch and its CUDA libraries)"
  rm -f "$venv/uckpt-bytecode.stamp"
  local cmd progress
  [ -n "$uv" ] || { use_uv && uv=true || uv=false; }
  if $uv; then
    # uv compiles no bytecode (compile_bytecode does, once).
    cmd=("$venv/bin/uv" pip install --python "$py" "${uv_args[@]}" "$@")
    progress='^(Resolved|Prepared|Installed|Uninstalled|error|warning|  [x×] )'
  else
    # --no-compile: compile_bytecode compiles everything installed at once, on every core.
    cmd=("$py" -m pip install --disable-pip-version-check --progress-bar off --no-compile "$@")
    progress='^(Collecting|Successfully|ERROR)'
  fi
  say "$($uv && echo uv pip || echo pip) install $*$note"
  # Progress: the installer's lines naming each step, not its progress bars.
  set +e
  "${cmd[@]}" 2>&1 | tee "$venv/install-$name.log" | grep --line-buffered -E "$progress" >&2
  local rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" = 0 ] || { say "the install failed; its log: $venv/install-$name.log (UCKPT_INSTALLER=pip installs with pip)"; exit 1; }
  # The stamp says "installed and imports": checked once here, not on every call (an import of
  # torch costs 6 s of CPU without bytecode, on the way to the build's configure).
  [ "$name" = torch ] && check_torch "$py"
  echo "$want" > "$venv/uckpt-$name.stamp"
  say "installed in $((SECONDS - t0)) s"
}

# For the tests, the bytecode of every installed module, once after each install. Python caches
# what it compiles on import only where it may write, and not at all under PYTHONDONTWRITEBYTECODE=1
# (which some machines set, this project's among them): then each of the tests' hundreds of
# processes compiled PyTorch's modules again, 3 s of CPU, and transformers' Trainer 16 s more.
# About 70 s of CPU once. `make demo` imports torch twice, less than compiling it would cost.
compile_bytecode() {
  [ -f "$venv/uckpt-bytecode.stamp" ] && return 0
  local t0=$SECONDS site
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  say "compiling the bytecode of $site"
  # A module that does not compile (a template file, another Python's syntax) is compiled, and
  # fails, on import only if imported: the log names it; the rest is cached.
  "$py" -m compileall -q -j 0 "$site" > "$venv/compileall.log" 2>&1 ||
    say "some files did not compile (their import compiles them; $venv/compileall.log names them)"
  touch "$venv/uckpt-bytecode.stamp"
  say "compiled in $((SECONDS - t0)) s"
}

install torch -r requirements/torch.txt
if [ "$level" = test ]; then
  install test -r requirements/test.txt
  install deepspeed --no-build-isolation -r requirements/deepspeed.txt
  compile_bytecode
fi
echo "$py"
