#!/usr/bin/env bash
# Builds uckpt on a GPU machine against its PyTorch 2.x (libtorch with CUDA,
# so UCKPT_NCCL is on and `--device cuda` uses ProcessGroupNCCL).
#
# The GPU image has no nlohmann-json, CLI11, zlib.h, OpenSSL or xxhash headers and
# nothing can be installed there: make them here with scripts/gpu-deps.sh and
# carry the folder (device call: carry ["build-gpu-deps"]). The image's own
# libz/libcrypto shared libraries are linked.
#
# Beware: the PyTorch wheel's libtorch.so exports its own std::filesystem, and
# uckpt's calls bind to that copy; its remove_all jumped to address 0 on a
# non-empty folder, so src/format/env.cc removes trees with nftw (docs/gpu.md).
#
# usage: scripts/build-gpu.sh [BUILD_DIR] [DEPS_DIR]
#        (defaults /tmp/uckpt-gpu and build-gpu-deps; prints the uckpt path last)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-/tmp/uckpt-gpu}
deps=$(realpath "${2:-${UCKPT_GPU_DEPS:-build-gpu-deps}}")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -f "$deps/include/nlohmann/json.hpp" ] || { echo "build-gpu: $deps has no include/nlohmann/json.hpp (run scripts/gpu-deps.sh here and carry it)" >&2; exit 1; }
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') ||
  { echo "build-gpu: python3 has no torch" >&2; exit 1; }
libdir=/usr/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
libz=$(ls "$libdir"/libz.so* 2>/dev/null | head -1)
libcrypto=$(ls "$libdir"/libcrypto.so* 2>/dev/null | head -1)
[ -n "$libz" ] && [ -n "$libcrypto" ] || { echo "build-gpu: no libz.so/libcrypto.so in $libdir" >&2; exit 1; }
gen=(); command -v ninja > /dev/null && gen=(-G Ninja)
cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix;$deps" \
  -DUCKPT_TESTS=OFF -DUCKPT_BENCH=OFF -DZLIB_INCLUDE_DIR="$deps/include" -DZLIB_LIBRARY="$libz" \
  -DOPENSSL_INCLUDE_DIR="$deps/include" -DOPENSSL_CRYPTO_LIBRARY="$libcrypto" -DOPENSSL_SSL_LIBRARY="$libcrypto" \
  -DXXHASH_LIBRARY="$deps/lib/libxxhash.a" -DCMAKE_CXX_FLAGS="-isystem $deps/include" \
  > "$build.cmake.log" 2>&1 || { tail -30 "$build.cmake.log" >&2; exit 1; }
grep -q 'UCKPT_NCCL:BOOL=ON' "$build/CMakeCache.txt" || { echo "build-gpu: this libtorch has no CUDA (UCKPT_NCCL off)" >&2; exit 1; }
cmake --build "$build" -j"$(nproc)" --target uckpt > "$build.build.log" 2>&1 || { grep -m5 -A5 "error" "$build.build.log" >&2; tail -20 "$build.build.log" >&2; exit 1; }
echo "$build/src/cli/uckpt"
