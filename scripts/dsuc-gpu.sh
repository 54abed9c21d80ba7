#!/usr/bin/env bash
# The universal-checkpoint demo repository's own scripts (train.py,
# grad_accu_ds.py, deepspeed_config.json) on uckpt, changed only in the import
# lines, on one GPU: the runs real DeepSpeed 0.14.5 made on one H200
# (train.py: 20 steps, global_step10 saved, then resumed from it; both stop on
# their last step with "cannot reshape tensor of 0 elements", the script reading
# one batch past its data). Prints each run's exit status and last lines; the
# full logs stay in WORK_DIR. Needs transformers, tensorboard and ipdb (the
# scripts import them) and a build with the Python package (`--target python uckpt`).
# usage: scripts/dsuc-gpu.sh DSUC_DIR BUILD_DIR [WORK_DIR]
set -uo pipefail
dsuc=$(realpath "$1"); build=$(realpath "$2"); work=${3:-/tmp/dsuc-uckpt}
rm -rf "$work"; mkdir -p "$work"
cp "$dsuc/train.py" "$dsuc/grad_accu_ds.py" "$dsuc/deepspeed_config.json" "$work/"
cd "$work"
for f in train.py grad_accu_ds.py; do
  sed -i -e 's/^import deepspeed$/import uckpt as deepspeed/' \
         -e 's/^from deepspeed\.ops\.adam import/from uckpt.ops.adam import/' "$f"
  echo "== $f: the changed lines"; diff "$dsuc/$f" "$f"
done
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}"
run() {
  local name=$1; shift
  local t0=$SECONDS
  "$build/src/cli/uckpt" launch -n 1 -- python3 "$@" >"$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s; last lines:"; tail -4 "$name.log"
}
run train train.py --train_batch_size 64 --train_micro_batch_size_per_gpu 64 --steps 20 --checkpoint_interval 10 \
  --checkpoint_dir ckpt --run_name uckpt
ls ckpt 2>/dev/null
run train_resume train.py --train_batch_size 64 --train_micro_batch_size_per_gpu 64 --steps 20 --checkpoint_interval 10 \
  --checkpoint_dir ckpt --run_name uckpt_resume --resume --checkpoint_tag global_step10
run grad_accu grad_accu_ds.py --train_batch_size 64 --train_micro_batch_size_per_gpu 16 --steps 4
