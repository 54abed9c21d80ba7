#!/usr/bin/env bash
# The lead's first device call of 2026-11-26's fifth session: builds the tree (exact-size pinned host buffers)
# and runs issue 25's big-model benchmark for uckpt alone (train at 2 GPUs, resume at 1), with each phase's
# resident set by kind, to see where host memory goes beyond the partitions.
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-lead5-out}; mkdir -p "$OUT"
t0=$SECONDS
{ scripts/build-gpu.sh /tmp/uckpt-gpu build-gpu-deps && cmake --build /tmp/uckpt-gpu -j16 --target python; } > "$OUT/build.log" 2>&1 ||
  { tail -30 "$OUT/build.log"; exit 1; }
echo "== built in $((SECONDS - t0)) s"; grep -E "pinned host|fingerprint" "$OUT/build.log"
IMPLS=${IMPLS:-uckpt} STEPS=${STEPS:-10} timeout ${LIMIT:-420} bench/zero3-large-gpu.sh /tmp/uckpt-gpu .ds "$OUT/zero3-large"
echo "total $((SECONDS - t0)) s"
