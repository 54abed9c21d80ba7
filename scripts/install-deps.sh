#!/usr/bin/env bash
# Installs the Debian 12 packages uckpt needs to build and test, skipping the
# ones already present. Runs apt-get only when something is missing. PyTorch and
# the Python libraries come from PyPI instead (scripts/python-env.sh).
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  ninja-build                       # Ninja: a library's units compile while the ones it links build
  clang libclang-rt-14-dev          # libFuzzer and the sanitizer runtimes
  zlib1g-dev libssl-dev             # CRC-32 (zlib), SHA-256 (OpenSSL)
  libcli11-dev nlohmann-json3-dev libfmt-dev libxxhash-dev
  xxhash                            # xxhsum: independent check of manifest hashes
  libgtest-dev libgmock-dev libbenchmark-dev
  libgloo-dev                       # Gloo's headers: PyTorch's wheels have Gloo, not its headers
  python3 python3-venv python3-dev # the virtual environment PyTorch is installed in
  librsvg2-bin                      # rsvg-convert: `uckpt plot -o FILE.png`
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
