#!/usr/bin/env bash
# The Python path against real DeepSpeed 0.14.5: DeepSpeed's BERT tutorial's masked LM
# (bench/roberta_mlm.py: transformers' RoBERTa, ZeRO stage 1, optimizer offloaded to CPU, Adam)
# through `import deepspeed` and through `import uckpt as deepspeed`, in bf16 and fp16, on 1 GPU
# and on every GPU count in GPU_COUNTS, seconds per step over steps 50-LAST (default 100).
# Both run under the same launcher (`uckpt launch`, which sets the environment as torchrun does and
# leaves OMP_NUM_THREADS alone, as DeepSpeed's launcher does), with each library's default
# thread settings. Prints one table row per (GPUs, dtype) and the ratio DeepSpeed's s/step over
# uckpt's (> 1: uckpt faster; target >= 1.3x). Each run then times its phases alone (roberta_mlm.py
# --phases): the table's "median" columns are the sum of the median batch, forward, backward and
# step times, without the steps whose batch width is new to cuDNN (it builds its attention plans per
# shape: 50-70 ms a forward on an H200, in both libraries, 15 of the 50 timed steps here); a line per
# run then gives its mean host time between step ends on new and on seen widths, and its skipped steps.
# usage: bench/python-gpu.sh BUILD_DIR DEEPSPEED_SRC [OUT_DIR]   (env: GPU_COUNTS="1 2" DTYPES="bf16 fp16"
#        STAGE=1 OFFLOAD=1 LAST=100)
set -uo pipefail
build=$(realpath "${1:?usage: bench/python-gpu.sh BUILD_DIR DEEPSPEED_SRC [OUT_DIR]}")
ds=$(realpath "${2:?usage: bench/python-gpu.sh BUILD_DIR DEEPSPEED_SRC [OUT_DIR]}")
out=$(realpath -m "${3:-python-gpu-out}")
here=$(cd "$(dirname "$0")" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
gpus=$(nvidia-smi -L | wc -l)
STAGE=${STAGE:-1} OFFLOAD=${OFFLOAD:-1}
mkdir -p "$out"
results=$out/results.jsonl
: > "$results"
run() {  # run IMPL N DTYPE
  local impl=$1 n=$2 dtype=$3 path log=$out/$1-$2gpu-$3-z$STAGE.log
  path=$build/python; [ "$impl" = deepspeed ] && path=$ds
  local t0=$SECONDS
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) PYTHONPATH=$path "$build/src/cli/uckpt" launch -n "$n" \
    --master_port 0 -- python3 "$here/roberta_mlm.py" --impl "$impl" --dtype "$dtype" --stage "$STAGE" \
    --offload "$OFFLOAD" --last "${LAST:-100}" --phases > "$log" 2>&1
  local rc=$?
  echo "== $impl $n GPU(s) $dtype: exit $rc, $((SECONDS - t0)) s; $(grep '^{' "$log" | tail -1)"
  [ $rc = 0 ] || tail -15 "$log"
  grep '^{' "$log" | tail -1 >> "$results"
}
# DeepSpeed JIT-builds its CPU Adam on first use; build it once, alone, outside the timed runs.
PYTHONPATH=$ds python3 -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' \
  > "$out/ds-cpu-adam-build.log" 2>&1 || { echo "DeepSpeed's CPU Adam did not build:"; tail -20 "$out/ds-cpu-adam-build.log"; }
for n in ${GPU_COUNTS:-1 2}; do
  [ "$n" -le "$gpus" ] || { echo "skipping $n GPUs (have $gpus)"; continue; }
  for dtype in ${DTYPES:-bf16 fp16}; do
    run deepspeed "$n" "$dtype"
    run uckpt "$n" "$dtype"
  done
done
python3 - "$results" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {(r["impl"], r["world"], r["dtype"]): r for r in rows}
def median_step(r):
    p = r.get("phases") or {}
    parts = [p.get(k) for k in ("batch", "forward_seen_width", "backward", "step")]
    return sum(parts) if all(x is not None for x in parts) else float("nan")
print(f"{'GPUs':>4} {'dtype':>5} {'DeepSpeed s/step':>17} {'uckpt s/step':>13} {'ratio':>6} {'loss DS':>8} {'loss uckpt':>10}  "
      f"target >= 1.3x  {'median DS':>9} {'median uckpt':>12} {'ratio':>6}")
for (impl, world, dtype), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
    if impl != "uckpt" or ("deepspeed", world, dtype) not in by:
        continue
    d = by[("deepspeed", world, dtype)]
    ratio = d["s_per_step"] / r["s_per_step"]
    print(f"{world:>4} {dtype:>5} {d['s_per_step']:>17.4f} {r['s_per_step']:>13.4f} {ratio:>5.2f}x {d['mean_loss']:>8.4f} "
          f"{r['mean_loss']:>10.4f}  {'met' if ratio >= 1.3 else 'MISSED':>14}  {median_step(d):>9.4f} {median_step(r):>12.4f} "
          f"{median_step(d) / median_step(r):>5.2f}x")
# Host time between step ends, on batch widths new to cuDNN and on seen ones (roberta_mlm.py's lap_ms).
for (impl, world, dtype), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
    lap = r.get("lap_ms") or {}
    print(f"laps {impl:>9} {world} GPU(s) {dtype}: new widths {lap.get('new')} ms, seen {lap.get('seen')} ms, "
          f"skipped steps {r.get('skipped_steps')}")
EOF
