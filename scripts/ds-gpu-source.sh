#!/usr/bin/env bash
# Makes the DeepSpeed 0.14.5 source tree that the GPU benchmarks import (`.ds`, carried with the
# device call: carry [".ds", "build-gpu-deps"]). The GPU machines' image has PyTorch, transformers,
# ninja and psutil but not DeepSpeed's pure-Python dependencies hjson, pydantic and py-cpuinfo, and
# nothing can be installed there: this copies the fixtures' hjson stand-in and Debian's pure-Python
# pydantic 1.10 (its compiled modules dropped: they are for this machine's Python) and py-cpuinfo
# beside the source. Do not add typing_extensions: the image's own must win (pydantic 1.10 under
# Python 3.12 fails with Debian's). About 12 MiB.
#
# usage: scripts/ds-gpu-source.sh SRC [DIR]
#   SRC: a DeepSpeed git directory holding tag v0.14.5 (e.g. the one `fetch` makes), or an
#        unpacked source tree; DIR: default .ds (ignored by git)
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:?usage: scripts/ds-gpu-source.sh SRC [DIR]}
dir=${2:-.ds}
shim=../shared/fixtures/deepspeed/scripts/pyshim/hjson.py
for p in "$shim" /usr/lib/python3/dist-packages/pydantic /usr/lib/python3/dist-packages/cpuinfo; do
  [ -e "$p" ] || { echo "ds-gpu-source: $p is missing here (apt-get install python3-pydantic python3-cpuinfo)" >&2; exit 1; }
done
tmp=$(mktemp -d "${dir%/}.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
if git -C "$src" rev-parse -q --verify v0.14.5 > /dev/null 2>&1; then
  git -C "$src" archive v0.14.5 -- deepspeed op_builder csrc accelerator version.txt | tar -x -C "$tmp/"
  # deepspeed/ops/{csrc,op_builder} and deepspeed/accelerator are links into the tree: make them copies
  cp -rL "$tmp" "$tmp.deref" && rm -rf "$tmp" && mv "$tmp.deref" "$tmp"
elif [ -f "$src/deepspeed/__init__.py" ]; then
  cp -rL "$src"/. "$tmp/"
else
  echo "ds-gpu-source: $src is neither a git directory with tag v0.14.5 nor a DeepSpeed source tree" >&2; exit 1
fi
grep -qx "0.14.5" "$tmp/version.txt" || { echo "ds-gpu-source: $src is not DeepSpeed 0.14.5 ($(cat "$tmp/version.txt" 2>/dev/null))" >&2; exit 1; }
cp "$shim" "$tmp/"
# Imported from a source tree, DeepSpeed reads its version from ./version.txt of the working directory,
# else says 0.0.0, and then writes 0.0.0 into its checkpoints and refuses to load them (ZeRO-1's
# "Old version" check): give it what its setup.py would install.
cat > "$tmp/deepspeed/git_version_info_installed.py" <<'PY'
version = '0.14.5'
git_hash = '[none]'
git_branch = '[none]'
from .ops.op_builder.all_ops import ALL_OPS  # noqa: E402
installed_ops = dict.fromkeys(ALL_OPS.keys(), False)
accelerator_name = ""
torch_info = {'version': "0.0", "cuda_version": "0.0", "hip_version": "0.0"}
PY
cp -r /usr/lib/python3/dist-packages/pydantic /usr/lib/python3/dist-packages/cpuinfo "$tmp/"
find "$tmp/pydantic" -name "*.so" -delete
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
echo "ds-gpu-source: $dir ($(du -sh "$dir" | cut -f1))"
