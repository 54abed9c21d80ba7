#!/bin/bash
# Builds uckpt against the machine's PyTorch 2.x (CUDA + NCCL) and checks the
# fixture's ZeRO-2 baseline on two GPUs: losses vs DeepSpeed, resume from our
# own ZeRO checkpoint (bit for bit) and from DeepSpeed's universal checkpoint.
#
# usage: tests/engine/gpu_check.sh DEPS FIXTURE OUT
#   DEPS     the prefix scripts/gpu-deps.sh makes (deps the GPU image lacks; see scripts/build-gpu.sh)
#   FIXTURE  a folder with init.pt, ds.json (runs/z2_ws2_baseline's ds_config_as_passed),
#            losses.json ({step: loss} of z2_ws2_baseline) and ckpt/ (the fixture's)
#   OUT      scratch folder
set -eo pipefail
D=$(realpath "$1"); export F=$(realpath "$2"); OUTDIR=$3
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:$LD_LIBRARY_PATH
U=$(scripts/build-gpu.sh /tmp/uckpt-gpu "$D")
mkdir -p "$OUTDIR" && cd "$OUTDIR"
rm -rf dsck ck logs && cp -r "$F/ckpt" dsck && chmod -R u+w dsck
M="--device cuda --config $F/ds.json --n_layer 2 --n_head 2 --n_embd 16 --vocab_size 97 --n_positions 16 --seq_len 16
   --init $F/init.pt --log_dir logs --timeout 120"
L="$U launch -n 2 --master_port 29650 --"
$L $U train $M --steps 12 --run_name base --checkpoint_dir ck --checkpoint_interval 6
$L $U train $M --steps 12 --run_name resumed --checkpoint_dir ck --checkpoint_tag global_step6 --resume
$L $U train $M --steps 12 --run_name univ --checkpoint_dir dsck --resume --universal_checkpoint
python3 - <<'PY'
import csv, json, os, sys
want = json.load(open(os.environ['F'] + '/losses.json'))
runs, ok = {}, True
for run in ['base', 'resumed', 'univ']:
    rows = list(csv.DictReader(open(f'logs/{run}/metrics.csv')))
    runs[run] = {r['step']: float(r['loss']) for r in rows}
    worst = max(abs(float(r['loss']) - want[r['step']]) / want[r['step']] for r in rows)
    ok &= worst < 1e-6
    print(f'{run}: steps {rows[0]["step"]}..{rows[-1]["step"]}, max rel loss diff vs DeepSpeed {worst:.3g}')
same = all(runs['base'][s] == runs['resumed'][s] for s in runs['resumed'])
print('resumed == uninterrupted, bit for bit:', same)
sys.exit(0 if ok and same else 1)
PY
