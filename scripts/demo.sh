#!/usr/bin/env bash
# The README's main job. For now: inspect shipped example files with the
# freshly built uckpt (the demo issue turns this into the three experiments).
set -euo pipefail
build=${1:-build}
uckpt="$build/src/cli/uckpt"
cd "$(dirname "$0")/.."

echo "== uckpt inspect examples/deepspeed_like.pt  (a DeepSpeed-style checkpoint: custom classes stay inert)"
"$uckpt" inspect examples/deepspeed_like.pt
echo
echo "== uckpt inspect examples/malicious_builtins_eval_in_dict.pt  (a hostile pickle: shown, never run)"
"$uckpt" inspect examples/malicious_builtins_eval_in_dict.pt
echo
echo "== uckpt inspect --json examples/deepspeed_like.pt | head"
"$uckpt" inspect --json examples/deepspeed_like.pt | head -n 20
