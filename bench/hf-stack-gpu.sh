#!/usr/bin/env bash
# The Hugging Face stack on uckpt beside real DeepSpeed 0.14.5 on 2 GPUs (#39): the CPU harnesses of CI in
# their GPU mode (UCKPT_TEST_GPU=1: a rank per GPU, NCCL; tests/python/hf_env.py), bf16 (DTYPE), both packages
# on the same config:
#   trainer-lora-zero3  hf_trainer_test --lora --stage 3: save at 2 GPUs, resume at 1 (uckpt; real DeepSpeed's
#                       resume at another size is expected to fail: printed as EXPECTED-FAIL, not a failure),
#                       uckpt's 2-GPU losses against DeepSpeed's;
#   accelerate-2to1     hf_accelerate_test: Accelerate's loop, save_state at 2 GPUs, load_state at 1 (uckpt);
#   trl-sft, trl-dpo    hf_trl_test at 2 GPUs, uckpt and real DeepSpeed, their losses compared.
# The four run at once on the same 2 GPUs (the models are tiny; most of the time is process start-up), each
# under a wall-clock limit; a summary line each: PASS/FAIL/TIMEOUT, seconds, the first error; exit 1 if any
# failed. Needs, carried: DeepSpeed's source DEEPSPEED_SRC (holding deepspeed/ and op_builder/; its FusedAdam is
# JIT-built once, first), and PY_HF (default build-gpu-deps/py-hf: TRL, datasets, dill, multiprocess, made here
# by scripts/gpu-py-hf.sh). Exits 0 with a message where there are fewer than 2 GPUs.
#
# OUT_DIR gets text only: the summary's sources (NAME.log, the harnesses' output) and rank-logs/ (every
# launch's output); venvs, checkpoints and DeepSpeed's build go to WORK.
#
# usage: bench/hf-stack-gpu.sh BUILD_DIR DEEPSPEED_SRC OUT_DIR
# env: GPU_COUNT (default: nvidia-smi's count), DTYPE (bf16 | fp32, default bf16), RUN_TIMEOUT (s, default 400),
#      PY_HF, PYTHON (python3), PARALLEL (1; 0 runs them one after another), WORK (default a new /tmp folder)
set -uo pipefail
usage="usage: bench/hf-stack-gpu.sh BUILD_DIR DEEPSPEED_SRC OUT_DIR"
repo=$(cd "$(dirname "$0")/.." && pwd)
GPU_COUNT=${GPU_COUNT:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')}
if [ "${GPU_COUNT:-0}" -lt 2 ]; then
  echo "hf-stack-gpu: skipped: it runs on 2 GPUs and this machine has ${GPU_COUNT:-0} (GPU_COUNT, nvidia-smi -L)"
  exit 0
fi
build=$(realpath "${1:?$usage}") ds=$(realpath "${2:?$usage}") out=$(realpath -m "${3:?$usage}")
py_hf=$(realpath -m "${PY_HF:-$repo/build-gpu-deps/py-hf}")
PYTHON=${PYTHON:-python3} DTYPE=${DTYPE:-bf16} RUN_TIMEOUT=${RUN_TIMEOUT:-400} PARALLEL=${PARALLEL:-1}
[ -d "$build/python/uckpt" ] || { echo "hf-stack-gpu: $build/python/uckpt is missing (cmake --build $build --target python)"; exit 1; }
[ -d "$ds/deepspeed" ] || { echo "hf-stack-gpu: $ds holds no deepspeed/ (DeepSpeed 0.14.5's source)"; exit 1; }
[ -d "$py_hf/trl" ] || { echo "hf-stack-gpu: $py_hf holds no trl/ (make it with scripts/gpu-py-hf.sh and carry it)"; exit 1; }
mkdir -p "$out/rank-logs"
work=${WORK:-$(mktemp -d /tmp/hf-stack-work.XXXXXX)}
mkdir -p "$work"
export UCKPT_TEST_GPU=1 UCKPT_TEST_DEEPSPEED=$ds UCKPT_TEST_SITE=$py_hf CUDA_VISIBLE_DEVICES=0,1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TORCH_EXTENSIONS_DIR=$work/torch-extensions
unset DS_ACCELERATOR

# DeepSpeed JIT-builds FusedAdam (the config's AdamW on a GPU) on first use; its runs wait on the build's lock.
t0=$SECONDS
PYTHONPATH=$ds "$PYTHON" -c 'from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()' \
  > "$out/ds-fused-adam-build.log" 2>&1 &
build_pid=$!

run_case() {  # NAME HARNESS ARGS...: the harness under RUN_TIMEOUT; its output in OUT/NAME.log
  local name=$1 script=$2; shift 2
  local log=$out/$name.log start=$SECONDS rc
  timeout -k 15 "$RUN_TIMEOUT" "$PYTHON" "$repo/tests/python/$script" "$build/python" "$work/$name" "$@" \
    > "$log" 2>&1
  rc=$?
  echo "$rc $((SECONDS - start))" > "$out/$name.rc"
}

cases=(
  "trainer-lora-zero3|hf_trainer_test.py --lora --stage 3 --world 2 --resume 1 --against both --dtype $DTYPE --deepspeed-resize-may-fail"
  "accelerate-2to1|hf_accelerate_test.py --world 2 --resume-world 1 --dtype $DTYPE"
  "trl-sft|hf_trl_test.py --trainer sft --against both --dtype $DTYPE"
  "trl-dpo|hf_trl_test.py --trainer dpo --against both --dtype $DTYPE"
)
for entry in "${cases[@]}"; do
  # shellcheck disable=SC2086  # the harness's arguments, split
  if [ "$PARALLEL" = 1 ]; then run_case "${entry%%|*}" ${entry#*|} & else run_case "${entry%%|*}" ${entry#*|}; fi
done
wait
wait "$build_pid" 2> /dev/null
(cd "$work" && find . -name '*.log' -not -path '*/venv-*' -exec cp --parents {} "$out/rank-logs/" \;) 2> /dev/null
echo "hf-stack-gpu: $GPU_COUNT GPUs (2 used), $DTYPE, $((SECONDS - t0)) s in all; logs in $out, work in $work"
grep -q "Error" "$out/ds-fused-adam-build.log" && { echo "  DeepSpeed's FusedAdam build:"; tail -3 "$out/ds-fused-adam-build.log"; }

failed=0
for entry in "${cases[@]}"; do
  name=${entry%%|*} log=$out/${entry%%|*}.log
  read -r rc secs < "$out/$name.rc" 2> /dev/null || { rc=1 secs="?"; }
  if [ "$rc" = 0 ]; then verdict=PASS; elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then verdict=TIMEOUT; else verdict=FAIL; fi
  [ "$verdict" = PASS ] || failed=1
  # The first failure and the exception under it, on one line.
  err=$(awk '/^FAIL:/ && !f {f=1; line=$0; next} f && /^\(whole output/ {exit} f && NF {last=$0}
             END {if (f) print line (last ? " | " last : "")}' "$log" | cut -c1-300)
  [ "$verdict" = FAIL ] && [ -z "$err" ] && err=$(tail -1 "$log" | cut -c1-300)
  [ "$verdict" = TIMEOUT ] && err="over ${RUN_TIMEOUT} s; last line: $(tail -1 "$log" | cut -c1-200)"
  printf '%-20s %-7s %4s s  %s\n' "$name" "$verdict" "$secs" "$err"
  # What each run measured: loss deltas, package comparisons, DeepSpeed's expected refusals.
  awk '/^(RESULT|max .*loss difference)/ {print "    " substr($0, 1, 200)}
       /^EXPECTED-FAIL/ {e=1; line=$0; next} e && /^\(whole output/ {print "    " line " | " last; e=0}
       e && NF {last=$0}' "$log"
done
exit $failed
