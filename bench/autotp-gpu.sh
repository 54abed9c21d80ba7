#!/usr/bin/env bash
# Tensor-parallel (AutoTP) checkpoints of DeepSpeed 0.19.8 made and resumed on GPUs (issue 41), NCCL:
# per case, DeepSpeed trains 3 steps at TP 2 and saves (tests/fixtures/deepspeed-releases/train_autotp.py,
# DS_ACCELERATOR=cuda); its ds_to_universal.py converts the checkpoint; `uckpt verify` and `uckpt convert`
# run on it, and the converted folder must equal DeepSpeed's byte for byte (but uckpt's manifest); then
# DeepSpeed 0.19.8 resumes uckpt's folder at TP 2 and at TP 1 × DP 2 (resume_autotp_universal.py: the
# loaded weights equal the ones gathered at the save, one step trained).
# One line per check, "ok" or "FAIL"; exit 1 when any fails.
#
# usage: bench/autotp-gpu.sh UCKPT DS_SITE [WORK_DIR]
#   DS_SITE: DeepSpeed 0.19.8 and the pure-Python packages it needs that the machine lacks (pydantic 2,
#            hjson, py-cpuinfo, msgpack, einops), as `pip install --target` makes them; put first on PYTHONPATH
# env: CASES (default: the 2-rank cases, and with 4 GPUs the 4-rank ones too)
set -uo pipefail
uckpt=$(realpath "${1:?usage: bench/autotp-gpu.sh UCKPT DS_SITE [WORK_DIR]}")
site=$(realpath "${2:?usage: bench/autotp-gpu.sh UCKPT DS_SITE [WORK_DIR]}")
work=$(realpath -m "${3:-/tmp/autotp-gpu}")
fx=$(cd "$(dirname "$0")/../tests/fixtures/deepspeed-releases" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
ngpu=$(nvidia-smi -L | wc -l)
cases=${CASES:-tp2dp1_z1_fp32 tp2dp1_z2_bf16 tp2dp1_z3_fp32}
[ -z "${CASES:-}" ] && [ "$ngpu" -ge 4 ] && cases+=" tp2dp2_z1_bf16 tp2dp2_z2_fp32"
fails=0
check() {  # check DESCRIPTION COMMAND...
  if "${@:2}"; then echo "ok   $1"; else echo "FAIL $1"; fails=$((fails + 1)); fi
}
same_files() {  # every file of $1 in $2 with the same bytes, and no other but uckpt's manifest
  diff <(cd "$1" && find . -type f | sort) <(cd "$2" && find . -type f | grep -v '^./uckpt-manifest.json$' | sort) &&
    (cd "$1" && find . -type f) | while read -r f; do cmp -s "$1/$f" "$2/$f" || { echo "    bytes differ: $f"; exit 1; }; done
}
ranks() {  # ranks N PORT LOG CMD...: CMD as N ranks on GPUs 0..N-1
  local n=$1 port=$2 log=$3 r rc=0 pids=(); shift 3
  for ((r = 0; r < n; r++)); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$n LOCAL_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port DS_ACCELERATOR=cuda \
      "$@" > "$log.rank$r" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  [ $rc = 0 ] || tail -n 5 "$log.rank0"
  return $rc
}
python3 -c 'import deepspeed, torch; print("DeepSpeed", deepspeed.__version__, "torch", torch.__version__)' || exit 1
rm -rf "$work"; mkdir -p "$work"
port=29650
for case in $cases; do
  IFS=_ read -r topo stage dtype <<<"$case"
  tp=${topo#tp}; tp=${tp%dp*}; dp=${topo#*dp}; stage=${stage#z}
  world=$((tp * dp))
  [ "$world" -le "$ngpu" ] || { echo "skip $case: needs $world GPUs"; continue; }
  d=$work/$case; mkdir -p "$d"
  port=$((port + 3))
  check "$case: DeepSpeed trains at tp $tp x dp $dp and saves" ranks "$world" $port "$d/train" \
    python3 "$fx/train_autotp.py" --stage "$stage" --dtype "$dtype" --tp "$tp" \
    --full_weights "$d/full_weights.safetensors" "$d/ckpt" || continue
  grep -h "^saved" "$d/train.rank0"
  in=$d/ckpt/global_step3
  check "$case: DeepSpeed's ds_to_universal" python3 -m deepspeed.checkpoint.ds_to_universal --input_folder "$in" \
    --output_folder "$d/ref/global_step3_universal" --num_extract_workers 1 --num_merge_workers 1 \
    > "$d/ds_to_universal.log" 2>&1
  check "$case: uckpt verify" "$uckpt" verify "$in" > "$d/verify.log" 2>&1
  check "$case: uckpt convert" "$uckpt" convert "$in" "$d/ours/global_step3_universal" -q
  check "$case: uckpt's folder equals DeepSpeed's, byte for byte" same_files "$d/ref/global_step3_universal" \
    "$d/ours/global_step3_universal"
  for rtp in 2 1; do
    check "$case: DeepSpeed 0.19.8 resumes uckpt's folder at tp $rtp x dp $((2 / rtp))" \
      ranks 2 $((port + rtp)) "$d/resume-tp$rtp" python3 "$fx/resume_autotp_universal.py" --stage "$stage" \
      --dtype "$dtype" --tp "$rtp" --full_weights "$d/full_weights.safetensors" "$d/ours"
    grep -h "^resumed" "$d/resume-tp$rtp.rank0"
  done
done
echo "autotp-gpu: $fails failed"
[ $fails = 0 ]
