#!/usr/bin/env bash
# Installs what is missing and configures a build folder against the Python's PyTorch.
#   scripts/configure.sh BUILD_DIR [--test]
# Debian's packages (scripts/install-deps.sh), the Python (scripts/python-env.sh: a virtual
# environment with PyTorch from PyPI, or $UCKPT_PYTHON), then CMake, which finds libtorch in
# that Python's torch. A build folder configured for another Python is configured again.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: scripts/configure.sh BUILD_DIR [--test]}
shift
bash scripts/install-deps.sh
py=$(bash scripts/python-env.sh "$@")
cache=$build/CMakeCache.txt
if [ -f "$cache" ] && grep -qx "Python3_EXECUTABLE:FILEPATH=$py" "$cache"; then
  exit 0
fi
torch_prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')
opts=()
command -v ccache > /dev/null && opts+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# With CUDA's compiler here (CI's machines have it, and no GPU), the GPU paths must compile.
command -v nvcc > /dev/null || [ -x /usr/local/cuda/bin/nvcc ] && opts+=(-DUCKPT_REQUIRE_CUDA=ON)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython3_EXECUTABLE="$py" \
  -DCMAKE_PREFIX_PATH="$torch_prefix" "${opts[@]}"
