#!/usr/bin/env bash
# A model larger than one rank (issue 25): a Llama-shaped model of 3.4B parameters (bench/zero3_large.py,
# OpenLLaMA-3B's shape: hidden 3200, 26 layers, vocab 32000) at ZeRO stage 3 with parameters and optimizer
# offloaded to CPU, bf16, on 2 GPUs, through `import uckpt as deepspeed` and through real DeepSpeed 0.14.5,
# each built under zero.Init: construct, initialize, load random weights from safetensors shards (Hugging
# Face's sharded layout, written first by the benchmark), STEPS steps, save a checkpoint, save the 16-bit
# weights; then resume the checkpoint: uckpt at 1 GPU without converting; DeepSpeed at 2 GPUs (its stage 3
# loads only at the world size that saved) and uckpt at DeepSpeed's world size too. Prints each phase's seconds (slowest rank), the peak host RSS
# per rank against its partitions + one unit (18 bytes per partitioned parameter: bf16 weights, fp32
# master, Adam's two moments, the fp32 gradient; plus one layer's bf16 weights; target <= 1.1x), and the
# peak GPU memory (nvidia-smi, per GPU) against DeepSpeed's.
# usage: bench/zero3-large-gpu.sh BUILD_DIR DEEPSPEED_SRC [OUT_DIR]
#        env: IMPLS="uckpt deepspeed" STEPS=10 MODEL="--hidden 3200 ..." WORK=/tmp/zero3-large NG=2
set -uo pipefail
build=$(realpath "${1:?usage: bench/zero3-large-gpu.sh BUILD_DIR DEEPSPEED_SRC [OUT_DIR]}")
ds=$(realpath "${2:?usage: bench/zero3-large-gpu.sh BUILD_DIR DEEPSPEED_SRC [OUT_DIR]}")
out=$(realpath -m "${3:-zero3-large-out}")
here=$(cd "$(dirname "$0")" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
work=${WORK:-/tmp/zero3-large} NG=${NG:-2} STEPS=${STEPS:-10} PYTHON=${PYTHON:-python3}
read -r -a model <<<"${MODEL:-}"
mkdir -p "$out" "$work"
py() { "$PYTHON" "$here/zero3_large.py" "${model[@]}" "$@"; }
launch() {  # launch IMPL N LOG ARGS...
  local impl=$1 n=$2 log=$3 path=$build/python; shift 3
  # DeepSpeed 0.14.5 loads its own checkpoints with torch.load's old default (PyTorch >= 2.6 defaults to weights_only).
  local env=(); [ "$impl" = deepspeed ] && path=$ds && env=(TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1)
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$log.smi" & local smi=$!
  local t0=$SECONDS
  env "${env[@]}" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) PYTHONPATH=$path "$build/src/cli/uckpt" launch -n "$n" --master_port 0 -- \
    "$PYTHON" "$here/zero3_large.py" "${model[@]}" --impl "$impl" "$@" > "$log" 2>&1
  local rc=$?
  kill $smi 2>/dev/null; wait $smi 2>/dev/null
  echo "== $impl at $n GPU(s) $*: exit $rc, $((SECONDS - t0)) s"
  grep "rank(s):" "$log"
  [ $rc = 0 ] || grep -v "^ " "$log" | grep -iv warn | tail -8
}
[ -f "$work/shards/model.safetensors.index.json" ] || { t0=$SECONDS; py --write-shards "$work/shards" | tee "$out/shards.txt"; echo "shards written in $((SECONDS - t0)) s"; }
if [[ " ${IMPLS:-uckpt deepspeed} " == *" deepspeed "* ]]; then  # DeepSpeed's CPU Adam JIT-built once, outside the timed runs
  PYTHONPATH=$ds "$PYTHON" -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' > "$out/ds-cpu-adam-build.log" 2>&1 ||
    { echo "DeepSpeed's CPU Adam did not build:"; tail -5 "$out/ds-cpu-adam-build.log"; }
fi
for impl in ${IMPLS:-uckpt deepspeed}; do
  rm -rf "$work/ckpt" "$work/ckpt16"
  launch "$impl" "$NG" "$out/$impl-train.log" --shards "$work/shards" --steps "$STEPS" --ckpt "$work/ckpt" --ckpt16 "$work/ckpt16"
  du -sh "$work/ckpt" "$work/ckpt16" 2>/dev/null
  rn=1; [ "$impl" = deepspeed ] && rn=$NG
  launch "$impl" "$rn" "$out/$impl-resume.log" --resume --ckpt "$work/ckpt"
  # uckpt at DeepSpeed's world size too: the same load as DeepSpeed's, for its time
  [ "$impl" = uckpt ] && [ "$NG" != 1 ] && launch "$impl" "$NG" "$out/$impl-resume-same.log" --resume --ckpt "$work/ckpt"
  rm -rf "$work/ckpt" "$work/ckpt16"
done
"$PYTHON" - "$out" <<'EOF'
import json, os, sys, collections
out = sys.argv[1]
def rows(path):  # every JSON object in the log (two ranks' lines can end up on one line)
    out, dec = [], json.JSONDecoder()
    for line in open(path) if os.path.exists(path) else []:
        i = line.find("{")
        while i >= 0:
            try:
                obj, end = dec.raw_decode(line, i)
            except ValueError:  # not JSON here (a phase line's dict): the next brace
                i = line.find("{", i + 1)
                continue
            if isinstance(obj, dict) and "phases" in obj:
                out.append(obj)
            i = line.find("{", end)
    return out
def smi_peak(path):
    peak = collections.defaultdict(int)
    if os.path.exists(path):
        for line in open(path):
            try: i, m = (int(x) for x in line.split(","))
            except ValueError: continue
            peak[i] = max(peak[i], m)
    return max(peak.values()) if peak else float("nan")
res = {}
for impl in ("uckpt", "deepspeed"):
    for part in ("train", "resume", "resume-same"):
        r = rows(f"{out}/{impl}-{part}.log")
        if r:
            res[(impl, part)] = {"phases": {k: max(x["phases"].get(k, 0) for x in r) for k in r[0]["phases"]},
                                 "host": max(max(p["host_gib"] for p in x["peaks"].values()) for x in r),
                                 "world": r[0]["world"], "params": r[0]["params"], "unit": r[0]["unit_params"], "losses": r[0]["losses"],
                                 "smi_gib": smi_peak(f"{out}/{impl}-{part}.log.smi") / 1024}
for (impl, part), v in sorted(res.items()):
    print(f"{impl:9} {part:6} {v['world']} GPU(s): " + ", ".join(f"{k} {s:.1f} s" for k, s in v["phases"].items()) +
          f"; host peak/rank {v['host']:.2f} GiB; GPU peak {v['smi_gib']:.2f} GiB; losses {v['losses']}")
u, d = res.get(("uckpt", "train")), res.get(("deepspeed", "train"))
if u:
    n = u["params"]
    bound = (18 * n / u["world"] + 2 * u["unit"]) / 2**30
    print(f"uckpt host peak per rank {u['host']:.2f} GiB vs its partitions + one unit {bound:.2f} GiB: "
          f"{u['host'] / bound:.3f}x (target <= 1.1x)")
if u and d and "save_sync" in u["phases"] and "save_sync" in d["phases"]:
    us, ds_ = u["phases"]["save"] + u["phases"]["save_sync"], d["phases"]["save"] + d["phases"]["save_sync"]
    print(f"save until durable (save + os.sync()): uckpt {us:.1f} s, DeepSpeed {ds_:.1f} s: {us / max(ds_, 1e-9):.2f}x")
if u and d:
    for k in u["phases"]:
        if k in d["phases"]:
            print(f"phase {k:9}: uckpt {u['phases'][k]:7.1f} s, DeepSpeed {d['phases'][k]:7.1f} s: {u['phases'][k] / max(d['phases'][k], 1e-9):.2f}x (target <= 1.0x)")
    print(f"GPU peak: uckpt {u['smi_gib']:.2f} GiB vs DeepSpeed {d['smi_gib']:.2f} GiB: {u['smi_gib'] / d['smi_gib']:.3f}x (target <= 1.0x)")
ur, us, dr = res.get(("uckpt", "resume")), res.get(("uckpt", "resume-same")), res.get(("deepspeed", "resume"))
if ur and dr:
    print(f"resume: uckpt at {ur['world']} GPU(s) {ur['phases'].get('resume', 0):.1f} s (load), DeepSpeed at {dr['world']} "
          f"{dr['phases'].get('resume', 0):.1f} s")
if us and dr:
    print(f"resume at {us['world']} GPU(s): uckpt {us['phases'].get('resume', 0):.1f} s, DeepSpeed {dr['phases'].get('resume', 0):.1f} s: "
          f"{us['phases'].get('resume', 0) / max(dr['phases'].get('resume', 0), 1e-9):.2f}x (target <= 1.0x); "
          f"host peak/rank {us['host']:.2f} vs {dr['host']:.2f} GiB")
EOF
