#!/usr/bin/env bash
# One device call per PART, on a warm 2-GPU machine: uckpt's ZeRO-3 step against FSDP2 (with a
# torch-profiler trace) and the BERT tutorial's masked LM through the Python API against DeepSpeed
# 0.14.5 (DeepSpeed's source in .ds, carried; scripts/ds-gpu-source.sh makes it). First used on
# 2026-11-27 (bench/results/2026-11-27.md, docs/benchmarks.md). Results collect in $R (default
# /tmp/zero3-python) and are copied to $OUT each time:
#   PART=1: build; a torch-profiler trace of uckpt's ZeRO-3 step at 2 GPUs (UCKPT_TRACE, steps 6-8);
#           the masked LM through the Python API in fp16 at 1 GPU, DeepSpeed and uckpt (with per-step laps).
#   PART=2: build; ZeRO-3 without offload against FSDP2 at 2 GPUs, twice (RUNS, default 2).
#   PART=3: build; the masked LM in bf16 and fp16 at 1 and 2 GPUs.
#   PART=4: build; PART=1's trace, then PART=2's runs (TAG names the trace folder).
#   PART=5: build; PART=3's runs, then one of PART=2's.
#   PART=6: build; PART=3's runs at 2 GPUs only (the device returns at most 8 files: PART=3's 2-GPU
#           logs did not come back). Results come back as one $OUT/results.tgz.
#   PART=7: build; PART=2's runs once, then FSDP2 alone twice on GPT-2 with its vocabulary padded to
#           50,264 rows (--vocab_size 50264: the head's rows aligned, as uckpt's fused head pads them;
#           the model then has 7 more classes, so its loss is not comparable). Also one results.tgz.
#   PART=8: build; the masked LM in fp16 at 1 GPU, DeepSpeed and uckpt, once more (on another machine).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-zero3-python-out}; R=${R:-/tmp/zero3-python}; mkdir -p "$OUT" "$R"
t0=$SECONDS
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
build() {
  [ -n "${SKIP_BUILD:-}" ] && return
  { scripts/build-gpu.sh /tmp/uckpt-gpu build-gpu-deps && cmake --build /tmp/uckpt-gpu -j16 --target python; } > "$R/build-$1.log" 2>&1 ||
    { tail -30 "$R/build-$1.log"; cp -r "$R"/. "$OUT"/; exit 1; }
  echo "== built in $((SECONDS - t0)) s"
}
save() {  # after each run: a call cut short still returns what it has
  if [ "${PART:-1}" -ge 6 ]; then tar -czf "$OUT/results.tgz" -C "$R" .; else cp -r "$R"/. "$OUT"/ 2>/dev/null; fi
}
train3() {  # train3 NAME: uckpt-z3 and FSDP2 at 2 GPUs
  ZERO=3 GPU_COUNTS=2 EXTRA=0 ONLY="uckpt-z3 fsdp2-hf" timeout 200 bench/train-gpu.sh /tmp/uckpt-gpu/src/cli/uckpt /tmp/z3 \
    > "$R/train3-$1.log" 2>&1
  grep -E '^(uckpt-z3|fsdp2|2 GPUs: uckpt-z3 /|uckpt timers)' "$R/train3-$1.log"; save
}
trace() {  # trace NAME: uckpt-z3 at 2 GPUs, steps 6-8 traced (rank 0's file kept)
  mkdir -p "$R/$1"
  UCKPT_TRACE=$R/$1/z3 UCKPT_TIMERS=1 ZERO=3 GPU_COUNTS=2 EXTRA=0 ONLY="uckpt-z3" STEPS=5 timeout 200 \
    bench/train-gpu.sh /tmp/uckpt-gpu/src/cli/uckpt /tmp/z3trace > "$R/$1-run.log" 2>&1
  grep -E "trace|^uckpt-z3" "$R/$1-run.log"; rm -f "$R/$1"/*rank1*; gzip -f "$R/$1"/*.json
}
case ${PART:-1} in
1)
  build 1
  { nproc; nvidia-smi -L; git log --oneline -1; } > "$R/host.txt" 2>&1
  trace trace
  GPU_COUNTS=1 DTYPES=fp16 timeout 300 bench/python-gpu.sh /tmp/uckpt-gpu .ds "$R/python-fp16-1gpu" 2>&1 | tail -4 ;;
2)
  build 2
  for k in $(seq 1 ${RUNS:-2}); do train3 "$k"; done ;;
4)
  build 4
  trace "trace-${TAG:-4}"
  for k in $(seq 1 ${RUNS:-2}); do train3 "${TAG:-4}-$k"; done ;;
5)
  build 5
  GPU_COUNTS="1 2" timeout 390 bench/python-gpu.sh /tmp/uckpt-gpu .ds "$R/python" 2>&1 | tail -6
  train3 5 ;;
3)
  build 3
  for n in 1 2; do for d in fp16 bf16; do
    GPU_COUNTS=$n DTYPES=$d timeout 200 bench/python-gpu.sh /tmp/uckpt-gpu .ds "$R/python-$n-$d" 2>&1 | tail -2; save
  done; done ;;
6)
  build 6
  for d in fp16 bf16; do
    GPU_COUNTS=2 DTYPES=$d timeout 200 bench/python-gpu.sh /tmp/uckpt-gpu .ds "$R/python-2-$d" 2>&1 | tail -4; save
  done ;;
7)
  build 7
  train3 7
  for k in 1 2; do
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/torch_dp_bench.py --mode fsdp2 --loss hf \
      --vocab_size 50264 > "$R/fsdp2-vocab50264-$k.log" 2>&1; grep '^{' "$R/fsdp2-vocab50264-$k.log"; save
  done ;;
8)
  build 8
  { nproc; nvidia-smi -L; } > "$R/host.txt" 2>&1
  GPU_COUNTS=1 DTYPES=fp16 timeout 300 bench/python-gpu.sh /tmp/uckpt-gpu .ds "$R/python-1-fp16" 2>&1 | tail -4 ;;
esac
save
echo "part ${PART:-1}: $((SECONDS - t0)) s"
