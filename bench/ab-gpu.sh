#!/usr/bin/env bash
# A "same or better" check in one device call: builds the working tree and, from .old/ (an older
# commit, e.g. `mkdir .old && git archive OLD | tar -x -C .old`, carried), that commit, both with the
# Python package; then on every GPU, old and new alternated (ORDER, PAIRS): the BERT tutorial's masked
# LM through the Python API (bench/roberta_mlm.py, ZeRO-1 + optimizer offloaded, bf16), ZeRO-1 and
# ZeRO-2 with the optimizer offloaded (bench/train-gpu.sh), and checkpoint I/O (bench/ckpt-io-gpu.sh).
# First used on 2026-11-26 for issue 24 (bench/results/2026-11-26.md). Logs into $OUT.
# env: PARTS="python offload12 ckptio" PAIRS=2 ORDER="old gpu" LAST=100 PHASES= RUNS=2 SKIP_BUILD=
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-ab-out}; mkdir -p "$OUT"
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
{ date -u; git log -1 --format='commit %H' 2>/dev/null; nvidia-smi -L; nproc; } > "$OUT/env.txt"; cat "$OUT/env.txt"
t0=$SECONDS
DEPS=$(realpath build-gpu-deps)
build() {  # build SRC_DIR BUILD_DIR
  (cd "$1" && scripts/build-gpu.sh "$2" "$DEPS" > /dev/null &&
   cmake --build "$2" -j8 --target python > /dev/null) || echo "build of $1 failed"
}
if [ -z "${SKIP_BUILD:-}" ]; then
  build .old /tmp/uckpt-old > "$OUT/build-old.txt" 2>&1 &
  build . /tmp/uckpt-gpu > "$OUT/build-gpu.txt" 2>&1
  wait; echo "built both in $((SECONDS - t0)) s"; cat "$OUT/build-old.txt" "$OUT/build-gpu.txt"
fi
NG=$(nvidia-smi -L | wc -l)
DEV=$(seq -s, 0 $((NG - 1)))
for p in ${PARTS:-python offload12 ckptio}; do
  for i in $(seq ${PAIRS:-2}); do
    for b in ${ORDER:-old gpu}; do
      s=$SECONDS; log=$OUT/$p-$b-$i.log
      case $p in
        python) CUDA_VISIBLE_DEVICES=$DEV PYTHONPATH=/tmp/uckpt-$b/python timeout 150 /tmp/uckpt-$b/src/cli/uckpt launch \
                  -n "$NG" --master_port 0 -- python3 bench/roberta_mlm.py --impl uckpt --dtype bf16 --stage 1 --offload 1 \
                  --last ${LAST:-100} ${PHASES:+--phases} > "$log" 2>&1
                r=$(grep '^{' "$log" | tail -1) ;;
        offload12) for z in 1 2; do
                     ZERO=$z OFFLOAD=1 GPU_COUNTS=$NG ONLY="uckpt-z$z-offload" EXTRA=0 timeout 120 bench/train-gpu.sh \
                       /tmp/uckpt-$b/src/cli/uckpt /tmp/ab-$b-$i-z$z > "$log.z$z" 2>&1
                   done
                   r=$(grep -hE '^uckpt-z[12]-offload' "$log".z1 "$log".z2) ;;
        ckptio) NGPU=$NG timeout 200 bench/ckpt-io-gpu.sh /tmp/uckpt-$b/src/cli/uckpt /tmp/ckio-$b ${RUNS:-2} > "$log" 2>&1
                rm -rf /tmp/ckio-$b
                r=$(grep -E '^(sync save|async save|load )' "$log") ;;
      esac
      echo "== $p $b run $i ($((SECONDS - s)) s):"; echo "$r"
    done
  done
done
echo "total $((SECONDS - t0)) s"
