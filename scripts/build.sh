#!/usr/bin/env bash
# The build of `make demo` (the uckpt program) and of `make test` (everything, with the tests):
# installs what is missing, configures, compiles.
#   scripts/build.sh BUILD_DIR JOBS demo|test
# On a fresh machine PyTorch's download and install (scripts/python-env.sh: about 3 GB from
# PyPI, and for `test` transformers, Accelerate, PEFT, TRL and DeepSpeed) take minutes; meanwhile
# what needs no libtorch compiles in the same build folder, configured --without-torch
# (scripts/configure.sh): format, ckpt and the uckpt program's common part, and for `test`
# their test programs too. Then the folder is configured with libtorch and the rest compiles;
# what compiled first is not compiled again (the same flags either way).
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/build.sh BUILD_DIR JOBS demo|test"
build=${1:?$usage} jobs=${2:?$usage} mode=${3:?$usage}
case $mode in
  demo) python_level=()
        early=(uckpt_format uckpt_ckpt uckpt_cli_common)
        final=(--target uckpt) ;;
  test) python_level=(--test)
        early=(uckpt_format uckpt_ckpt uckpt_cli_common format_tests write_samples ckpt_tests corrupt_matrix_test)
        final=() ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
bash scripts/install-deps.sh
if [ ! -f "$build/CMakeCache.txt" ] && ! bash scripts/python-env.sh --ready "${python_level[@]}"; then
  echo "make $mode: installing the Python packages while the parts without libtorch compile"
  bash scripts/python-env.sh "${python_level[@]}" > /dev/null &
  python_env=$!
  trap 'wait $python_env 2> /dev/null' EXIT   # a failing compile leaves no pip behind
  mkdir -p "$build"
  bash scripts/configure.sh "$build" --without-torch "${python_level[@]}" > "$build/configure-without-torch.log" ||
    { cat "$build/configure-without-torch.log"; exit 1; }
  cmake --build "$build" --target "${early[@]}" -j "$jobs"
  wait $python_env || { echo "make $mode: installing the Python packages failed (scripts/python-env.sh ${python_level[*]})"; exit 1; }
  trap - EXIT
fi
bash scripts/configure.sh "$build" "${python_level[@]}"
[ "$mode" = demo ] && echo "make demo: compiling the uckpt program (the tests compile under make test)"
cmake --build "$build" "${final[@]}" -j "$jobs"
