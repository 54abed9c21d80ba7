#!/usr/bin/env bash
# The 3.4B-parameter model of bench/zero3-large-gpu.sh (stage 3, parameters and optimizer offloaded,
# 2 GPUs), uckpt against DeepSpeed 0.14.5 (DeepSpeed's source in .ds, carried), with the save timed
# alone. One PART per call on a warm machine. First used on 2026-11-26 (bench/results/2026-11-26.md,
# docs/benchmarks.md). Results collect in $R (default /tmp/zero3-large-save) and are copied to $OUT:
#   PART=1: build; issue 25's big-model benchmark, uckpt (train at 2 GPUs, resume at 1 and at 2);
#   PART=2: the same for DeepSpeed 0.14.5 (its summary compares both);
#   PART=3: rebuild; issue 23's ZeRO-3 without offload against FSDP2 at 2 GPUs.
#   PART=4: build; uckpt's big-model save alone with its save timers and the page cache's dirty and
#           writeback bytes sampled each 0.5 s; then PART=3's runs.
#   PART=5: build; the big model's save alone (3 steps, then save and os.sync()), uckpt, DeepSpeed, uckpt
#           again, each with the page cache sampled; after the fingerprint moved beside the write.
#           PART=5 SKIP_BUILD=1 RUNS="deepspeed-2 uckpt-3" R=\$OUT: the same on the warm machine, DeepSpeed first.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-zero3-large-save-out}; R=${R:-/tmp/zero3-large-save}; mkdir -p "$OUT" "$R"
t0=$SECONDS
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
build() {
  { scripts/build-gpu.sh /tmp/uckpt-gpu build-gpu-deps && cmake --build /tmp/uckpt-gpu -j16 --target python; } > "$R/build-$1.log" 2>&1 ||
    { tail -30 "$R/build-$1.log"; exit 1; }
  echo "== built in $((SECONDS - t0)) s"
}
case ${PART:-1} in
1)
  build 1
  { nproc; free -g; df -h /tmp; which nsys ncu; nvidia-smi -L; git log --oneline -1; } > "$R/host.txt" 2>&1
  IMPLS=uckpt timeout 480 bench/zero3-large-gpu.sh /tmp/uckpt-gpu .ds "$R/zero3-large" 2>&1 | grep -v "^{" ;;
2)
  IMPLS=deepspeed timeout 520 bench/zero3-large-gpu.sh /tmp/uckpt-gpu .ds "$R/zero3-large" 2>&1 | grep -v "^{" ;;
3)
  build 3
  for k in 1 2; do
    ZERO=3 GPU_COUNTS=2 EXTRA=0 ONLY="uckpt-z3 fsdp2-hf" timeout 200 bench/train-gpu.sh /tmp/uckpt-gpu/src/cli/uckpt /tmp/z3 \
      > "$R/train3-2gpu-$k.log" 2>&1
    grep -E '^(uckpt-z3|fsdp2|2 GPUs: uckpt-z3 /|uckpt timers)' "$R/train3-2gpu-$k.log"
  done ;;
4)
  build 4
  export PYTHONPATH=/tmp/uckpt-gpu/python W=/tmp/zero3-large
  python3 bench/zero3_large.py --write-shards $W/shards > "$R/shards.txt" 2>&1
  ( while :; do echo "$(date +%s.%N) $(grep -E '^(Dirty|Writeback):' /proc/meminfo | tr -s ' ' | tr '\n' ' ') $(head -1 /proc/stat)"; sleep 0.5; done ) > "$R/meminfo.log" &
  s=$!
  rm -rf $W/ckpt; UCKPT_TIMERS=1 CUDA_VISIBLE_DEVICES=0,1 /tmp/uckpt-gpu/src/cli/uckpt launch -n 2 --master_port 0 -- \
    python3 bench/zero3_large.py --impl uckpt --shards $W/shards --steps 3 --ckpt $W/ckpt > "$R/save-timers.log" 2>&1
  sleep 2; kill $s
  grep -E "save|rank\(s\)" "$R/save-timers.log" | grep -v "^{" | cut -c1-200
  rm -rf $W
  PART=3 "$0" ;;
5)
  export W=/tmp/zero3-large
  [ -n "${SKIP_BUILD:-}" ] || { build 5; python3 bench/zero3_large.py --write-shards $W/shards > "$R/shards.txt" 2>&1; }
  PYTHONPATH=.ds python3 -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' > "$R/ds-cpu-adam-build.log" 2>&1
  for run in ${RUNS:-uckpt-1 deepspeed uckpt-2}; do
    impl=${run%-*}; path=/tmp/uckpt-gpu/python; [ $impl = deepspeed ] && path=.ds
    ( while :; do echo "$(date +%s.%N) $(grep -E '^(Dirty|Writeback):' /proc/meminfo | tr -s ' ' | tr '\n' ' ') $(head -1 /proc/stat)"; sleep 0.5; done ) > "$R/meminfo-$run.log" &
    s=$!
    rm -rf $W/ckpt; sync
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 PYTHONPATH=$path UCKPT_TIMERS=1 CUDA_VISIBLE_DEVICES=0,1 timeout 150 /tmp/uckpt-gpu/src/cli/uckpt launch -n 2 --master_port 0 -- \
      python3 bench/zero3_large.py --impl $impl --shards $W/shards --steps 3 --ckpt $W/ckpt > "$R/save-$run.log" 2>&1
    echo "== $run: exit $?"; kill $s
    grep -E "save|rank\(s\)" "$R/save-$run.log" | grep -v "^{" | grep -E "save|train" | cut -c1-150
  done ;;
esac
cp -r "$R"/. "$OUT"/ 2>/dev/null
echo "part ${PART:-1}: $((SECONDS - t0)) s"
