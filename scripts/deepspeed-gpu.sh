#!/usr/bin/env bash
# Makes a folder from which `import deepspeed` (0.14.5) works on the GPU machines,
# whose Python has PyTorch but no DeepSpeed, pydantic or hjson and cannot install any:
# DeepSpeed's source with accelerator/, op_builder/ and csrc/ where an installed
# package has them (its ops are JIT-built there on first use), Debian's pure-Python
# pydantic 1.10, and the fixtures' hjson shim. Carry the folder and set
# DEEPSPEED_PATH to it for bench/train-gpu.sh (ZERO=3).
# usage: scripts/deepspeed-gpu.sh DEEPSPEED_GIT_DIR [OUT_DIR]   (default OUT_DIR .dsgpu)
#   DEEPSPEED_GIT_DIR: a clone of github.com/microsoft/DeepSpeed holding tag v0.14.5
set -euo pipefail
git_dir=${1:?usage: scripts/deepspeed-gpu.sh DEEPSPEED_GIT_DIR [OUT_DIR]}
out=${2:-.dsgpu}
shim=${UCKPT_SHARED:-../shared}/fixtures/deepspeed/scripts/pyshim/hjson.py
[ -f "$shim" ] || { echo "deepspeed-gpu: no hjson shim at $shim (set UCKPT_SHARED)" >&2; exit 1; }
[ -d /usr/lib/python3/dist-packages/pydantic ] || { echo "deepspeed-gpu: needs Debian's python3-pydantic" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
git --git-dir="$git_dir" archive v0.14.5 deepspeed accelerator op_builder csrc | tar -x -C "$tmp"
rm -rf "$out" && mkdir -p "$out"
cp -r "$tmp/deepspeed" "$out/"
rm -rf "$out/deepspeed/accelerator" "$out/deepspeed/ops/op_builder" "$out/deepspeed/ops/csrc"   # symlinks in git
cp -r "$tmp/accelerator" "$out/deepspeed/accelerator"
cp -r "$tmp/op_builder" "$out/deepspeed/ops/op_builder"
cp -r "$tmp/csrc" "$out/deepspeed/ops/csrc"
cp -r /usr/lib/python3/dist-packages/pydantic "$out/"
cp "$shim" "$out/"
find "$out" -name __pycache__ -prune -exec rm -rf {} +
echo "$out: $(du -sh "$out" | cut -f1)"
