#!/usr/bin/env bash
# Makes the folder of pure-Python packages that the Hugging Face harnesses need on the GPU machines and their
# image lacks (TRL, datasets, dill, multiprocess; the image has transformers, Accelerate, PEFT, pyarrow, pandas,
# xxhash, fsspec, requests), at the versions PYTHON has installed, as wheels for the image's Python 3.12 on
# x86_64 installed without their dependencies. Carry it (device call: carry ["build-gpu-deps"]);
# bench/hf-stack-gpu.sh takes it as PY_HF. About 8 MiB.
#
# usage: scripts/gpu-py-hf.sh [DIR]   (default: build-gpu-deps/py-hf, ignored by git; PYTHON: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-gpu-deps/py-hf}
python=${PYTHON:-.venv/bin/python}
pins=$("$python" -c 'import importlib.metadata as m
print(" ".join(f"{n}=={m.version(n)}" for n in ("trl", "datasets", "dill", "multiprocess")))') ||
  { echo "gpu-py-hf: $python lacks one of trl, datasets, dill, multiprocess (set PYTHON)" >&2; exit 1; }
mkdir -p "$(dirname "$dir")"
tmp=$(mktemp -d "${dir%/}.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2086  # $pins is a list of requirements
"$python" -m pip install --quiet --no-deps --target "$tmp" --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --only-binary=:all: $pins
find "$tmp" -name __pycache__ -type d -prune -exec rm -rf {} +  # compiled by this Python, not 3.12
rm -rf "$dir" && mv "$tmp" "$dir" && trap - EXIT
echo "gpu-py-hf: $dir: $pins ($(du -sh "$dir" | cut -f1))"
