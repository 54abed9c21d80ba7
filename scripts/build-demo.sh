#!/usr/bin/env bash
# `make demo`'s build: installs what is missing, then builds the uckpt program only.
#   scripts/build-demo.sh BUILD_DIR [JOBS]
# On a fresh machine PyTorch's download and install (scripts/python-env.sh: about 3 GB from
# PyPI) take a minute or more; meanwhile the layers that need no libtorch (format, ckpt, the
# uckpt program's common part) compile in the same build folder, configured --without-torch
# (scripts/configure.sh). Then the folder is configured with libtorch and the rest compiles.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: scripts/build-demo.sh BUILD_DIR [JOBS]}
jobs=${2:-$(nproc)}
bash scripts/install-deps.sh
if [ ! -f "$build/CMakeCache.txt" ] && ! bash scripts/python-env.sh --ready; then
  echo "make demo: installing PyTorch while the parts without libtorch compile"
  bash scripts/python-env.sh > /dev/null &
  python_env=$!
  trap 'wait $python_env 2> /dev/null' EXIT   # a failing compile leaves no pip behind
  mkdir -p "$build"
  bash scripts/configure.sh "$build" --without-torch > "$build/configure-without-torch.log" ||
    { cat "$build/configure-without-torch.log"; exit 1; }
  cmake --build "$build" --target uckpt_format uckpt_ckpt uckpt_cli_common -j "$jobs"
  wait $python_env
  trap - EXIT
fi
bash scripts/configure.sh "$build"
echo "make demo: compiling the uckpt program (the tests compile under make test)"
cmake --build "$build" --target uckpt -j "$jobs"
