#!/usr/bin/env bash
# Makes a prefix of the header-only / header-side dependencies that the GPU
# machines' image lacks (it has PyTorch, CUDA, NCCL and the zlib/libcrypto
# shared libraries, but no nlohmann-json, CLI11, zlib.h, OpenSSL or xxhash
# headers, no libxxhash, and no way to install them). xxhash goes as Debian's
# static library (plain C, libc only), so nothing extra is needed at run time. Run it here, on the Debian machine that has them
# (scripts/install-deps.sh), and carry the folder with the device call;
# scripts/build-gpu.sh takes it as UCKPT_GPU_DEPS. About 4 MiB.
#
# usage: scripts/gpu-deps.sh [DIR]   (default: build-gpu-deps, ignored by git)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-gpu-deps}
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
# Files, not only their folders: while apt-get unpacks, a folder holds *.dpkg-new files instead.
need=(/usr/include/nlohmann/json.hpp /usr/include/CLI/CLI.hpp /usr/include/zlib.h /usr/include/zconf.h
      /usr/include/openssl/evp.h /usr/include/"$multiarch"/openssl/configuration.h
      /usr/share/cmake/CLI11/CLI11Config.cmake /usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake
      /usr/include/xxhash.h /usr/lib/"$multiarch"/libxxhash.a)
for p in "${need[@]}"; do
  [ -e "$p" ] || { echo "gpu-deps: $p is missing here (apt-get install nlohmann-json3-dev libcli11-dev zlib1g-dev libssl-dev libxxhash-dev)" >&2; exit 1; }
done
tmp=$(mktemp -d "${dir%/}.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/include/openssl" "$tmp/share/cmake" "$tmp/lib"
cp -r /usr/include/nlohmann /usr/include/CLI /usr/include/zlib.h /usr/include/zconf.h /usr/include/xxhash.h "$tmp/include/"
cp /usr/lib/"$multiarch"/libxxhash.a "$tmp/lib/"
cp /usr/include/openssl/*.h "$tmp/include/openssl/"
# Debian keeps the configuration headers under the multiarch folder.
cp /usr/include/"$multiarch"/openssl/*.h "$tmp/include/openssl/"
cp -r /usr/share/cmake/CLI11 /usr/share/cmake/nlohmann_json "$tmp/share/cmake/"
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
echo "gpu-deps: $dir ($(du -sh "$dir" | cut -f1))"
