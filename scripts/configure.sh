#!/usr/bin/env bash
# Installs what is missing and configures a build folder against the Python's PyTorch.
#   scripts/configure.sh BUILD_DIR [--test]
#   scripts/configure.sh BUILD_DIR --without-torch [--test]
# Debian's packages (scripts/install-deps.sh), the Python (scripts/python-env.sh: a virtual
# environment with PyTorch from PyPI, or $UCKPT_PYTHON), then CMake, which finds libtorch in
# that Python's torch. A build folder configured for another Python is configured again.
# --without-torch: a new folder only, configured for the layers without libtorch (with --test,
# and their tests) and nothing installed into Python (scripts/build.sh compiles them while
# PyTorch installs); the next plain configure adds the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: scripts/configure.sh BUILD_DIR [--test|--without-torch]}
shift
bash scripts/install-deps.sh
cache=$build/CMakeCache.txt
opts=()
command -v ccache > /dev/null && opts+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# Ninja, for a new folder: it compiles a library's units while the libraries it links still
# build (Make waits for them), so both cores stay busy to the end.
[ ! -f "$cache" ] && command -v ninja > /dev/null && opts+=(-G Ninja)
if [ "${1:-}" = --without-torch ]; then
  [ -f "$cache" ] && exit 0
  tests=OFF
  [ "${2:-}" = --test ] && tests=ON
  exec cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DUCKPT_LIBTORCH=OFF -DUCKPT_TESTS=$tests \
    -DUCKPT_BENCH=OFF "${opts[@]}"
fi
py=$(bash scripts/python-env.sh "$@")
if [ -f "$cache" ] && grep -qx "Python3_EXECUTABLE:FILEPATH=$py" "$cache"; then
  exit 0
fi
# A folder begun --without-torch: now with libtorch, the tests and the benchmarks (the defaults).
if [ -f "$cache" ] && grep -qx "UCKPT_LIBTORCH:BOOL=OFF" "$cache"; then
  opts+=(-DUCKPT_LIBTORCH=ON -DUCKPT_TESTS=ON -DUCKPT_BENCH=ON)
fi
# With CUDA's compiler here (CI's machines have it, and no GPU), the GPU paths must compile.
command -v nvcc > /dev/null || [ -x /usr/local/cuda/bin/nvcc ] && opts+=(-DUCKPT_REQUIRE_CUDA=ON)
# CMake finds libtorch's CMake package in that Python's torch itself.
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython3_EXECUTABLE="$py" "${opts[@]}"
