#!/usr/bin/env bash
# The universal-checkpoint demo repository's own scripts (train.py,
# grad_accu_ds.py, deepspeed_config.json: ZeRO-3, parameters and optimizer
# offloaded to CPU, DeepSpeedCPUAdam, fp32) on uckpt, changed only in their
# import lines, on W GPUs (W = NGPU, default every GPU, at most 4): the demo
# README's three tests, then a table (scripts/dsuc_table.py).
#   1. `default`: train.py on W GPUs (batch 64*W = micro 64 x W, GA 1), STEPS
#      steps, a checkpoint at STEPS/2; `resume_no_uc`: resumed from that ZeRO
#      checkpoint on W GPUs; `uckpt convert` to a universal folder;
#      `resume_uc_Wgpu`: resumed from it on W GPUs;
#   2. grad_accu_ds.py: micro 32 x GA 1 and micro 8 x GA 4 on 1 GPU, micro 8 x
#      GA 2 on 2 GPUs;
#   3. `resume_uc`: the universal folder resumed on W/2 GPUs (GA doubles);
#   and, beyond the demo, `resume_zero_half`: the ZeRO checkpoint itself
#   resumed on W/2 GPUs, without converting.
# Both scripts stop on their last step with "cannot reshape tensor of 0
# elements" (they read one batch past their data), under DeepSpeed too; the
# table uses the steps they logged. Needs transformers, tensorboard and ipdb
# (the scripts import them; DSUC_DIR/shim/ipdb.py stands in where ipdb is
# missing) and a build with the Python package (`--target python uckpt`).
# usage: scripts/dsuc-gpu.sh DSUC_DIR BUILD_DIR [WORK_DIR]   (env: NGPU, STEPS=40)
set -uo pipefail
dsuc=$(realpath "$1"); build=$(realpath "$2"); work=${3:-/tmp/dsuc-uckpt}
here=$(dirname "$(realpath "$0")")
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
W=${NGPU:-$(( gpus >= 4 ? 4 : gpus ))}; H=$(( W / 2 > 0 ? W / 2 : 1 ))
STEPS=${STEPS:-40}; MID=$(( STEPS / 2 ))
[ "$W" -ge 1 ] || { echo "dsuc-gpu: no GPU" >&2; exit 2; }
rm -rf "$work"; mkdir -p "$work"
cp "$dsuc/train.py" "$dsuc/grad_accu_ds.py" "$dsuc/deepspeed_config.json" "$work/"
cd "$work"
for f in train.py grad_accu_ds.py; do
  sed -i -e 's/^import deepspeed$/import uckpt as deepspeed/' \
         -e 's/^from deepspeed\.ops\.adam import/from uckpt.ops.adam import/' "$f"
  echo "== $f: the changed lines"; diff "$dsuc/$f" "$f"
done
python3 -c 'import ipdb' 2>/dev/null || export PYTHONPATH="$dsuc/shim${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}"
run() {  # run NAME GPUS SCRIPT ARGS...
  local name=$1 n=$2; shift 2
  local t0=$SECONDS
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) "$build/src/cli/uckpt" launch -n "$n" --master_port 0 -- \
    python3 "$@" --run_name "$name" > "$name.log" 2>&1
  local rc=$?
  echo "== $name ($n GPUs): exit $rc after $((SECONDS - t0)) s; last line: $(tail -1 "$name.log")"
}
B=$((64 * W)); common=(--train_batch_size $B --train_micro_batch_size_per_gpu 64 --steps $STEPS --checkpoint_dir ckpt)
echo "== test 1: $W GPUs, batch $B, $STEPS steps, checkpoint at $MID"
run default $W train.py "${common[@]}" --checkpoint_interval $MID
ls ckpt
run resume_no_uc $W train.py "${common[@]}" --checkpoint_interval 100000 --resume --checkpoint_tag global_step$MID
t0=$(date +%s.%N)
"$build/src/cli/uckpt" convert -q ckpt/global_step$MID ckpt/global_step${MID}_universal &&
  echo "== uckpt convert: $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')") s"
run resume_uc_${W}gpu $W train.py "${common[@]}" --checkpoint_interval 100000 --resume --universal_checkpoint \
  --checkpoint_tag global_step${MID}_universal
echo "== test 2: gradient accumulation"
run no_grad_accu_ds 1 grad_accu_ds.py --steps $STEPS --train_micro_batch_size_per_gpu 32 --train_batch_size 32
run grad_accu_4_ds 1 grad_accu_ds.py --steps $STEPS --train_micro_batch_size_per_gpu 8 --train_batch_size 32
[ "$W" -ge 2 ] && run grad_accu_4_ds_ws2 2 grad_accu_ds.py --steps $STEPS --train_micro_batch_size_per_gpu 8 \
  --train_batch_size 32
echo "== test 3: the universal checkpoint on $H GPUs (GA $((W / H)))"
run resume_uc $H train.py "${common[@]}" --checkpoint_interval 100000 --resume --universal_checkpoint \
  --checkpoint_tag global_step${MID}_universal
run resume_zero_half $H train.py "${common[@]}" --checkpoint_interval 100000 --resume --checkpoint_tag global_step$MID
python3 "$here/dsuc_table.py" logs "$W" "$H" "$MID"
