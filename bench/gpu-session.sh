#!/usr/bin/env bash
# One device call of issue 7's GPU work: build (scripts/build-gpu.sh), then the parts
# named in PARTS, each under its own time limit, logs into $OUT (the device tool's
# folder that comes back). Parts: check (PyTorch cross-check, 1 GPU), matrix
# (tests/engine/gpu_matrix.sh, the three precisions in parallel), train (bench/train-gpu.sh),
# ckpt (bench/ckpt-gpu.sh), demo (scripts/demo-gpu.sh both), failing (failing ranks under
# NCCL, tests/engine/failing_ranks_test.sh on 2 GPUs), fp16 (GPT-2 124M in fp16 with dynamic
# loss scaling on 4 GPUs, bench/fp16-gpu.sh), ckptio (uckpt sync/async save and load against
# PyTorch DCP on one GPU, bench/ckpt-io-gpu.sh). Several GPUs (NG = the GPUs there are):
# train2 / train3 (bench/train-gpu.sh at NG GPUs, ZeRO-2 / ZeRO-3), failing3 (failing ranks
# under NCCL at stage 3), dsuc (the demo repository's scripts on NG GPUs, scripts/dsuc-gpu.sh;
# .dsuc carried), ckptio2 (bench/ckpt-io-gpu.sh on NG GPUs), convert16 (bench/convert-vs-cp.sh
# on 16 cores, taskset), matrix23 (the engine matrix, stages 2 and 3, fp32 and bf16), loadchunks
# (a load onto one GPU gives the same bits at any staging chunk size, tests/engine/gpu_load_chunks.sh),
# python (the BERT tutorial's masked LM through the Python API against real DeepSpeed, bench/python-gpu.sh;
# DeepSpeed's source in DEEPSPEED_PATH, default .ds, carried), offload3 / offload12 (ZeRO-3 with parameters
# and optimizer offloaded, ZeRO-1 and ZeRO-2 with the optimizer offloaded: uckpt against DeepSpeed's same
# configuration on 1 and NG GPUs, bench/train-gpu.sh), restart / restartsnap (a rank killed, the job going on
# on the GPUs left, without and with a snapshot every step: bench/restart-gpu.sh on 4 GPUs, or 2 where fewer),
# snapcost (training's seconds per step without and with a snapshot every step, bench/snapshot-cost-gpu.sh),
# dsx (DeepSpeedExamples' cases DSX_CASES, default hello, at NG GPUs beside real DeepSpeed 0.14.5:
# bench/ds-examples-both-gpu.sh; build-gpu-deps/dsx and .ds carried), hftrainer (the Hugging Face Trainer
# against DeepSpeed at NG GPUs, bench/hf-trainer-gpu.sh with its MODEL, CASES, RESUME; .ds carried).
# usage: PARTS="check matrix" bench/gpu-session.sh   (build-gpu-deps carried; see scripts/gpu-deps.sh)
# A call carries at most 64 MiB of files (4 KiB blocks each): with DeepSpeedExamples' legacy packages, carry
# build-gpu-deps and .ds as one tarball, build-carry/gpudeps.tgz (tar -czf build-carry/gpudeps.tgz build-gpu-deps .ds,
# carry ["build-carry"]), which is unpacked here first.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-session-out}; mkdir -p "$OUT"
[ -f build-carry/gpudeps.tgz ] && { tar -xzf build-carry/gpudeps.tgz || { echo "build-carry/gpudeps.tgz: cannot unpack"; exit 1; }; }
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
{ date -u; git log -1 --format='commit %H' 2>/dev/null; nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -8
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
t0=$SECONDS
U=$(scripts/build-gpu.sh /tmp/uckpt-gpu build-gpu-deps) || { echo "build failed"; exit 1; }
echo "built $U in $((SECONDS - t0)) s"
NG=$(nvidia-smi -L | wc -l)
case " ${PARTS:-} " in *" dsuc "*|*" convert16 "*|*" dbg "*|*" python "*|*" dsx "*|*" hftrainer "*)
  cmake -DUCKPT_BENCH=ON /tmp/uckpt-gpu > /dev/null && cmake --build /tmp/uckpt-gpu -j"$(nproc)" --target python convert_gen \
    > "$OUT/build-extra.log" 2>&1 || tail -20 "$OUT/build-extra.log"
  echo "built the Python package and convert_gen after $((SECONDS - t0)) s" ;;
esac
part() {  # part NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local s=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "==== $name: rc $rc, $((SECONDS - s)) s"
  tail -n "${TAIL:-30}" "$OUT/$name.log"
}
for p in ${PARTS:-check matrix train ckpt}; do
  case $p in
    check) part check ${LIMIT_check:-120} bench/crosscheck-torch.sh "$U" cuda /tmp/crosscheck ;;
    matrix)
      s=$SECONDS
      for prec in fp32 bf16 fp16; do
        PRECISIONS=$prec timeout ${LIMIT_matrix:-300} tests/engine/gpu_matrix.sh "$U" /tmp/matrix-$prec > "$OUT/matrix-$prec.log" 2>&1 &
      done
      wait
      echo "==== matrix: $((SECONDS - s)) s"
      for prec in fp32 bf16 fp16; do sed -n '/==== gpu_matrix/,$p' "$OUT/matrix-$prec.log"; grep -m3 "failed:" -A3 "$OUT/matrix-$prec.log"; done ;;
    train) part train ${LIMIT_train:-330} bench/train-gpu.sh "$U" /tmp/train-gpu ;;
    ckpt) part ckpt ${LIMIT_ckpt:-150} bench/ckpt-gpu.sh "$U" /tmp/ckpt-gpu ;;
    ckptio) part ckptio ${LIMIT_ckptio:-400} bench/ckpt-io-gpu.sh "$U" /tmp/ckpt-io-gpu ${RUNS:-3} ;;
    loadchunks) part loadchunks ${LIMIT_loadchunks:-180} tests/engine/gpu_load_chunks.sh "$U" /tmp/load-chunks ;;
    failing) RANKS=2 DEVICE=cuda part failing ${LIMIT_failing:-240} tests/engine/failing_ranks_test.sh "$U" /tmp/failing ;;
    fp16) part fp16 ${LIMIT_fp16:-180} bench/fp16-gpu.sh "$U" /tmp/fp16-gpu ;;
    demo) part demo ${LIMIT_demo:-300} scripts/demo-gpu.sh /tmp/uckpt-gpu both ;;
    train2) EXTRA=0 GPU_COUNTS=$NG part train2 ${LIMIT_train2:-240} bench/train-gpu.sh "$U" /tmp/train2 ;;
    train3) ZERO=3 GPU_COUNTS=$NG part train3 ${LIMIT_train3:-240} bench/train-gpu.sh "$U" /tmp/train3 ;;
    failing3) STAGE=3 RANKS=$NG DEVICE=cuda part failing3 ${LIMIT_failing3:-150} tests/engine/failing_ranks_test.sh "$U" /tmp/failing3 ;;
    dsuc) part dsuc ${LIMIT_dsuc:-300} scripts/dsuc-gpu.sh .dsuc /tmp/uckpt-gpu /tmp/dsuc
          tar -C /tmp/dsuc -czf "$OUT/dsuc-logs.tgz" logs $(cd /tmp/dsuc && ls *.log) 2>/dev/null ;;
    python) part python ${LIMIT_python:-500} bench/python-gpu.sh /tmp/uckpt-gpu "${DEEPSPEED_PATH:-.ds}" /tmp/python-gpu ;;
    offload3) ZERO=3 GPU_COUNTS=${GPU_COUNTS:-"1 $NG"} ONLY="uckpt-z3-offload deepspeed_z3_offload-hf" EXTRA=0 \
                DEEPSPEED_PATH=$(realpath "${DEEPSPEED_PATH:-.ds}") part offload3 ${LIMIT_offload3:-400} bench/train-gpu.sh "$U" /tmp/offload3 ;;
    offload12) for z in 1 2; do
                 ZERO=$z OFFLOAD=1 GPU_COUNTS=${GPU_COUNTS:-"1 $NG"} EXTRA=0 DEEPSPEED_PATH=$(realpath "${DEEPSPEED_PATH:-.ds}") \
                   part offload12-z$z ${LIMIT_offload12:-300} bench/train-gpu.sh "$U" /tmp/offload12-z$z
               done ;;
    restart) part restart ${LIMIT_restart:-240} bench/restart-gpu.sh "$U" /tmp/restart-gpu ;;
    restartsnap) SNAPSHOT_EVERY=1 part restartsnap ${LIMIT_restart:-240} bench/restart-gpu.sh "$U" /tmp/restart-snap ;;
    dsx) CASES=${DSX_CASES:-hello} NPROC=$NG DEADLINE_S=${DEADLINE_dsx:-300} part dsx ${LIMIT_dsx:-330} \
           bench/ds-examples-both-gpu.sh build-gpu-deps/dsx/dse /tmp/uckpt-gpu "${DEEPSPEED_PATH:-.ds}" "$OUT/dsx" ;;
    hftrainer) GPU_COUNTS=${GPU_COUNTS:-$NG} part hftrainer ${LIMIT_hftrainer:-500} \
                 bench/hf-trainer-gpu.sh /tmp/uckpt-gpu "${DEEPSPEED_PATH:-.ds}" /tmp/hftrainer
               cp /tmp/hftrainer/results.jsonl "$OUT/hftrainer-results.jsonl" 2> /dev/null ;;
    snapcost) part snapcost ${LIMIT_snapcost:-360} bench/snapshot-cost-gpu.sh "$U" /tmp/snapcost ;;
    dbg) part dbg ${LIMIT_dbg:-200} .dsuc/dbg.sh ;;
    ckptio2) NGPU=$NG part ckptio2 ${LIMIT_ckptio2:-300} bench/ckpt-io-gpu.sh "$U" /tmp/ckpt-io-gpu2 ${RUNS:-3} ;;
    convert16) part convert16 ${LIMIT_convert16:-300} taskset -c 0-15 bench/convert-vs-cp.sh --uckpt "$U" \
                 --gen /tmp/uckpt-gpu/bench/convert_gen --runs 3 --dir /tmp/cvcp ;;
    matrix23)
      s=$SECONDS
      for prec in fp32 bf16; do
        STAGES="2 3" PRECISIONS=$prec timeout ${LIMIT_matrix:-300} tests/engine/gpu_matrix.sh "$U" /tmp/matrix-$prec > "$OUT/matrix-$prec.log" 2>&1 &
      done
      wait
      echo "==== matrix23: $((SECONDS - s)) s"
      for prec in fp32 bf16; do sed -n '/==== gpu_matrix/,$p' "$OUT/matrix-$prec.log"; done ;;
  esac
done
