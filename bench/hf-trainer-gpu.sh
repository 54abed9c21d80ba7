#!/usr/bin/env bash
# The Hugging Face Trainer on uckpt against real DeepSpeed 0.14.5 (#39), on GPUs: a causal-LM fine-tune of a
# model made from a config (bench/hf_trainer_bench.py: Llama-shaped, about 1.0B parameters, or GPT-2 124M),
# sequence SEQ, synthetic tokens, bf16, only `deepspeed=ds_config.json` given (the "auto" values the Trainer
# fills), global batch GLOBAL_BATCH at every GPU count. The same launcher (torch.distributed.run) and the same
# script run both: `deepspeed` is real DeepSpeed (its source DEEPSPEED_SRC with package metadata beside it, as
# transformers checks for) or uckpt through its alias (`python -m uckpt.alias install` into a venv that sees
# python3's packages through a .pth file: its own site-packages may be a user's). Prints a row per case and GPU count: s/step of each, the ratio DeepSpeed's over uckpt's
# (> 1: uckpt faster), the largest loss difference over the logged steps, peak GPU memory of rank 0.
# RESUME="A:B ..." adds, per case, a run at A GPUs that saves at step STEPS/2 and its resume at B GPUs, by each
# package: the resumed losses against the uninterrupted A-GPU run's.
#
# usage: bench/hf-trainer-gpu.sh BUILD_DIR DEEPSPEED_SRC [OUT_DIR]
# env: MODEL (llama1b | gpt2, default llama1b), CASES ("z2 z3 z3off", default all), GPU_COUNTS ("1 2"),
#      STEPS (20), WARMUP (5), SEQ (2048), GLOBAL_BATCH (4), IMPLS ("deepspeed uckpt"), RESUME (""),
#      PHASES (1: each run also times the engine's forward/backward/step calls, in results.jsonl's phase_ms)
set -uo pipefail
build=$(realpath "${1:?usage: bench/hf-trainer-gpu.sh BUILD_DIR DEEPSPEED_SRC [OUT_DIR]}")
ds=$(realpath "${2:?usage: bench/hf-trainer-gpu.sh BUILD_DIR DEEPSPEED_SRC [OUT_DIR]}")
out=$(realpath -m "${3:-hf-trainer-gpu-out}")
here=$(cd "$(dirname "$0")" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
MODEL=${MODEL:-llama1b} CASES=${CASES:-z2 z3 z3off} GPU_COUNTS=${GPU_COUNTS:-1 2} STEPS=${STEPS:-20}
WARMUP=${WARMUP:-5} SEQ=${SEQ:-2048} GLOBAL_BATCH=${GLOBAL_BATCH:-4} IMPLS=${IMPLS:-deepspeed uckpt}
mkdir -p "$out"
results=$out/results.jsonl
: > "$results"

# uckpt: a venv over the system's packages with the alias installed; DeepSpeed: its source and a dist-info.
venv=$out/venv-uckpt
python3 -m venv --without-pip "$venv" &&
  python3 -c 'import sys; [print(f"import site; site.addsitedir({p!r})") for p in sys.path if p.endswith(("site-packages", "dist-packages"))]' \
    > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-base.pth" &&
  PYTHONPATH=$build/python "$venv/bin/python" -m uckpt.alias install > "$out/alias.log" 2>&1 ||
  { echo "hf-trainer-gpu: the alias did not install:"; cat "$out/alias.log"; exit 1; }
meta=$out/ds-meta/deepspeed-0.14.5.dist-info
mkdir -p "$meta" && printf 'Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.14.5\n' > "$meta/METADATA"
# DeepSpeed JIT-builds its CPU Adam on first use: once, outside the timed runs.
PYTHONPATH=$ds:$out/ds-meta python3 -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' \
  > "$out/cpu-adam-build.log" 2>&1 || { echo "hf-trainer-gpu: DeepSpeed's CPU Adam did not build"; tail -5 "$out/cpu-adam-build.log"; }

run() {  # run IMPL CASE N LABEL [extra args]
  local impl=$1 case=$2 n=$3 label=$4; shift 4
  local python=python3 pypath=$ds:$out/ds-meta extra_env=(TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1)
  [ "$impl" = uckpt ] && { python=$venv/bin/python; pypath=$build/python; extra_env=(); }
  local stage=${case:1:1} flags=(); [[ $case == *off ]] && flags+=(--offload)
  [ "${PHASES:-0}" = 1 ] && flags+=(--phase_times)
  local work=$out/$label log=$out/$label.log t0=$SECONDS
  env "${extra_env[@]}" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) PYTHONPATH=$pypath \
    timeout 900 "$python" -m torch.distributed.run --nproc_per_node "$n" --master_port $((29500 + RANDOM % 1000)) \
    "$here/hf_trainer_bench.py" --model "$MODEL" --stage "$stage" "${flags[@]}" --steps "$STEPS" --warmup "$WARMUP" \
    --seq "$SEQ" --global_batch "$GLOBAL_BATCH" --work "$work" --label "$label" --results "$results" "$@" \
    > "$log" 2>&1
  local rc=$?
  echo "== $label: exit $rc, $((SECONDS - t0)) s"
  [ $rc = 0 ] || grep -E "Error|error:|Exception|refuse" "$log" | grep -v "^\s*$" | tail -6
  return $rc
}

for case in $CASES; do
  for n in $GPU_COUNTS; do
    for impl in $IMPLS; do run "$impl" "$case" "$n" "$impl-$case-${n}gpu"; done
  done
  for pair in ${RESUME:-}; do
    a=${pair%%:*} b=${pair##*:}
    for impl in $IMPLS; do
      run "$impl" "$case" "$a" "$impl-$case-${a}gpu-save" --save_at $((STEPS / 2)) &&
        run "$impl" "$case" "$b" "$impl-$case-${a}to${b}gpu" \
          --resume_from "$out/$impl-$case-${a}gpu-save/out/checkpoint-$((STEPS / 2))"
    done
  done
done

python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {r["label"]: r for r in rows}
print(f"{'case':<10} {'GPUs':>4} {'DeepSpeed s/step':>16} {'uckpt s/step':>12} {'ratio':>6} {'max |dloss|':>11} "
      f"{'peak GiB DS/uckpt':>17}")
for label, u in by.items():
    if not label.startswith("uckpt-") or "gpu-save" in label or "to" in label.split("-")[-1]:
        continue
    d = by.get("deepspeed-" + label[len("uckpt-"):])
    case = u["label"].split("-")[1]
    if d is None:
        print(f"{case:<10} {u['world']:>4} {'-':>16} {u['s_per_step']:>12.3f}")
        continue
    common = set(u["losses"]) & set(d["losses"])
    dl = max((abs(u["losses"][k] - d["losses"][k]) for k in common), default=float("nan"))
    print(f"{case:<10} {u['world']:>4} {d['s_per_step']:>16.3f} {u['s_per_step']:>12.3f} "
          f"{d['s_per_step'] / u['s_per_step']:>5.2f}x {dl:>11.2e} {d['peak_gib']:>8.1f}/{u['peak_gib']:.1f}")
for label, r in by.items():
    if "to" in label.split("-")[-1]:
        base = by.get(label.rsplit("-", 1)[0] + "-" + label.split("-")[-1].split("to")[0] + "gpu-save")
        common = sorted(set(r["losses"]) & set(base["losses"]) if base else [], key=int)
        deltas = [abs(r["losses"][k] - base["losses"][k]) for k in common]
        print(f"resume {label}: steps {common[:1]}..{common[-1:]}, |dloss| first {deltas[0] if deltas else 'n/a'}, "
              f"max after first {max(deltas[1:], default='n/a')}")
PY
