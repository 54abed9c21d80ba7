#!/usr/bin/env bash
# DeepSpeedExamples' scripts (issue 40) on uckpt and on real DeepSpeed 0.14.5 side by side, on one GPU machine,
# within a time budget: each case of bench/ds-examples-gpu.sh runs once with IMPL=uckpt and, for the cases in
# DS_CASES, once with IMPL=deepspeed at the same time (same script, launcher, stand-ins, arguments and seed), so
# their losses are those of the same training. PARALLEL cases run at once (the models are small; one GPU holds
# them all). No case starts once less than MIN_START_S of DEADLINE_S is left, and a case's time limit is cut to
# what is left: the whole run ends by DEADLINE_S after the start. Cases not started are listed as NOT RUN.
#
# One line per case: the uckpt result (PASS / REFUSED / GPU-ONLY / N/A / FAIL, as bench/ds-examples-gpu.sh says
# them), DeepSpeed's, and the losses each printed (their count, first and last), with the largest difference
# over the losses both printed, step by step.
#
# usage: bench/ds-examples-both-gpu.sh DSE_CHECKOUT BUILD_DIR DEEPSPEED_SRC OUT_DIR
#   DSE_CHECKOUT   DeepSpeedExamples (all of it, or the folders the cases use: build-gpu-deps/dsx/dse)
#   BUILD_DIR      uckpt built with its Python package (target python)
#   DEEPSPEED_SRC  DeepSpeed 0.14.5's source (.ds)
#   OUT_DIR        gets summary.txt, losses.txt (every loss printed, uckpt's beside DeepSpeed's) and logs.tgz (the
#                  cases' logs; no checkpoints or models)
# env: CASES (in order of value, default below), DS_CASES (the cases DeepSpeed runs too: those it can run here),
#      RESUME_NPROC (hello's resume: as bench/ds-examples-gpu.sh, but 1 on a machine of one GPU),
#      DS_PREBUILD (DeepSpeed's ops JIT-built at the start, default "fused_adam cpu_adam"), DEADLINE_S (420),
#      TIMEOUT_S (per case, 150), MIN_START_S (45), PARALLEL (4), NPROC (1),
#      DSX_SITE (packages the scripts import that the machine lacks, put on PYTHONPATH; default
#      build-gpu-deps/dsx/site), DSX_S3_SITE (boto3 and botocore, for squad only: accelerate imports boto3 where
#      it finds it; default build-gpu-deps/dsx/site-s3), DSX_LEGACY_SITE (the older packages of
#      bench/ds_examples/make_legacy_site.sh; default build-gpu-deps/dsx/legacy), WORK_DIR (/tmp/ds-examples-both),
#      PYTHON (python3)
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
usage="usage: bench/ds-examples-both-gpu.sh DSE_CHECKOUT BUILD_DIR DEEPSPEED_SRC OUT_DIR"
dse=$(realpath "${1:?$usage}") build=$(realpath "${2:?$usage}") ds=$(realpath "${3:?$usage}")
out=$(realpath -m "${4:?$usage}")
CASES=${CASES:-imagenet imagenet_fp16 imagenet_fp16_z1 gan squad compress_cifar cifar hello chat_z0 chat_z2 chat_z3 \
chat_rm chat_dpo visualchat_api bing_bert de_vit_cifar de_vit_imagenet compress_bert bingbertglue bing_bert_glue \
offload_states cifar_moe visualchat moq autotuning domino stable_diffusion de_gpt compress_gpt2 pipeline chat_rlhf}
DS_CASES=${DS_CASES:-imagenet imagenet_fp16 imagenet_fp16_z1 gan squad compress_cifar cifar hello chat_z0 chat_z2 chat_z3 \
chat_rm chat_dpo visualchat_api bing_bert de_vit_cifar de_vit_imagenet compress_bert bingbertglue bing_bert_glue \
offload_states cifar_moe visualchat}
DEADLINE_S=${DEADLINE_S:-420} TIMEOUT_S=${TIMEOUT_S:-150} MIN_START_S=${MIN_START_S:-45} PARALLEL=${PARALLEL:-4}
work=$(realpath -m "${WORK_DIR:-/tmp/ds-examples-both}")
site=$(realpath -m "${DSX_SITE:-$here/build-gpu-deps/dsx/site}")
s3_site=$(realpath -m "${DSX_S3_SITE:-$here/build-gpu-deps/dsx/site-s3}")
[ -d "$s3_site" ] && export DSX_S3_SITE=$s3_site
legacy_site=$(realpath -m "${DSX_LEGACY_SITE:-$here/build-gpu-deps/dsx/legacy}")  # make_dsx_deps.sh with LEGACY=1
[ -d "$legacy_site" ] && export DSX_LEGACY_SITE=$legacy_site
export PYTHON=${PYTHON:-python3} NPROC=${NPROC:-1} DEEPSPEED_SRC=$ds
gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')
# hello resumes at another rank count (RESUME_NPROC, 2 from 1): on a machine of one GPU, at 1 again
[ "$NPROC" = 1 ] && [ "$gpus" = 1 ] && export RESUME_NPROC=${RESUME_NPROC:-1}
export CIFAR_ARGS=${CIFAR_ARGS:---log-interval 4}  # cifar prints its loss every 2000 steps by default: 32 here
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$work/torch_extensions}  # DeepSpeed's JIT-built ops: this run's own
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -d "$site" ] && export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
[ -d "$site" ] || echo "ds-examples-both: no $site: the scripts get only the machine's packages"
rm -rf "$work"; mkdir -p "$work" "$out"
start=$SECONDS
summary=$out/summary.txt
: > "$summary"; : > "$out/losses.txt"
say() { echo "$*" | tee -a "$summary"; }
say "== DeepSpeedExamples on uckpt ($build) and DeepSpeed ($ds), $NPROC GPU(s) a run, deadline ${DEADLINE_S} s"
say "   $("$PYTHON" -c '
import importlib
def version(name):
    try:
        return getattr(importlib.import_module(name), "__version__", "?")
    except Exception as e:
        return f"not importable ({type(e).__name__}: {str(e)[:80]})"
print(", ".join(f"{n} {version(n)}" for n in ("torch", "torchvision", "transformers", "datasets", "pyarrow", "fsspec",
                                              "tensorboardX", "timm")))' 2>&1 | tail -1)"

# DeepSpeed JIT-builds its fused Adam (cifar, imagenet, squad, chat) and CPU Adam (hello): build them now, beside
# the first cases, so that its runs find them built (a run that needs one waits on torch's build lock meanwhile).
ds_build() {  # ds_build fused_adam|cpu_adam
  local t0=$SECONDS
  PYTHONPATH=$ds:$work/ds-meta${PYTHONPATH:+:$PYTHONPATH} timeout "$DEADLINE_S" "$PYTHON" -c '
import sys
from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
{"fused_adam": FusedAdamBuilder, "cpu_adam": CPUAdamBuilder}[sys.argv[1]]().load()' "$1" > "$work/ds-build-$1.log" 2>&1
  echo "exit $? after $((SECONDS - t0)) s" >> "$work/ds-build-$1.log"
}
if [ -n "$DS_CASES" ]; then
  mkdir -p "$work/ds-meta/deepspeed-0.14.5.dist-info"
  printf 'Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.14.5\n' > "$work/ds-meta/deepspeed-0.14.5.dist-info/METADATA"
  for op in ${DS_PREBUILD-fused_adam cpu_adam}; do ds_build "$op" & done
fi

losses() {  # losses CASE LOG: the losses the script printed, one a line (gan: D and G as D/G)
  local re='[Ll]oss[^0-9-]{0,4}(-?[0-9]+\.[0-9]+(e[-+][0-9]+)?)'
  case $1 in
    cifar*) re='\] loss: *([0-9.]+)' ;;
    imagenet*) re='Loss ([0-9.]+(e[-+][0-9]+)?) \(' ;;
    squad) re='bert_squad_progress: .*loss=([0-9.]+(e[-+][0-9]+)?)' ;;
    hello) re='Loss: ([0-9.]+)' ;;
    chat_z*) re='loss = ([0-9.]+)' ;;
    compress_cifar)  # tqdm's running mean, refreshed on a clock: only its last value (the epoch's mean) compares
      grep -oE 'loss=[0-9.]+' "$2" | tail -1 | cut -d= -f2; return ;;
    gan) grep -oE 'Loss_D: [0-9.]+ Loss_G: [0-9.]+' "$2" | awk '{print $2 "/" $4}'; return ;;
  esac
  grep -oE "$re" "$2" | grep -oE '[0-9]+\.[0-9]+(e[-+][0-9]+)?$'
}
compare() {  # compare CASE UCKPT_LOG DS_LOG: counts, first and last losses, the largest difference step by step;
  # every loss of both, side by side, into OUT_DIR/losses.txt
  "$PYTHON" - "$1" <(losses "$1" "$2" 2> /dev/null) <(losses "$1" "$3" 2> /dev/null) "$out/losses.txt" <<'PY'
import itertools
import sys
def read(path):
    return [[float(x) for x in l.split("/")] for l in open(path) if l.strip()]
u, d = read(sys.argv[2]), read(sys.argv[3])
def brief(v):
    return f"{len(v)} [{'/'.join(f'{x:.4g}' for x in v[0])} .. {'/'.join(f'{x:.4g}' for x in v[-1])}]" if v else "none"
text = f"losses uckpt {brief(u)}, DeepSpeed {brief(d)}"
both = min(len(u), len(d))
if both:
    diff = max(abs(a - b) for i in range(both) for a, b in zip(u[i], d[i]))
    text += f", max |diff| {diff:.3g} over {both}"
print(text)
if u or d:
    with open(sys.argv[4], "a") as f:
        f.write(f"== {sys.argv[1]}: uckpt | DeepSpeed\n")
        for a, b in itertools.zip_longest(u, d):
            f.write(f"{'/'.join(map(str, a)) if a else '-':>24} {'/'.join(map(str, b)) if b else '-':>24}\n")
PY
}

run_case() {  # run_case CASE LIMIT_S: uckpt (and DeepSpeed) on it at once; one line
  local c=$1 limit=$2 impl t0=$SECONDS
  local impls=(uckpt); [[ " $DS_CASES " == *" $c "* ]] && impls+=(deepspeed)
  for impl in "${impls[@]}"; do
    IMPL=$impl CASES=$c TIMEOUT_S=$limit DSX_END_EPOCH=$(($(date +%s) + limit)) \
      bash "$here/bench/ds-examples-gpu.sh" "$dse" "$build" "$work/$impl-$c" > "$work/$impl-$c.out" 2>&1 &
  done
  wait
  local u d="not run" line
  u=$(grep -E '^(PASS|REFUSED|GPU-ONLY|N/A|AS-DEEPSPEED|FAIL) ' "$work/uckpt-$c.out" | tail -1 | cut -c1-240)
  [ -n "$u" ] || u="no result ($(tail -1 "$work/uckpt-$c.out" | cut -c1-200))"
  if [ "${#impls[@]}" = 2 ]; then
    d=$(grep -E '^(PASS|REFUSED|GPU-ONLY|N/A|AS-DEEPSPEED|FAIL) ' "$work/deepspeed-$c.out" | tail -1 | cut -c1-240)
    [ -n "$d" ] || d="no result ($(tail -1 "$work/deepspeed-$c.out" | cut -c1-200))"
  fi
  local ulog=$work/uckpt-$c/$c.log dlog=$work/deepspeed-$c/$c.log
  [ -f "$work/uckpt-$c/$c.train.log" ] && ulog=$work/uckpt-$c/$c.train.log  # hello: its first 20 steps
  [ -f "$work/deepspeed-$c/$c.train.log" ] && dlog=$work/deepspeed-$c/$c.train.log
  line="$c ($((SECONDS - t0)) s, limit $limit s) | uckpt: $u | DeepSpeed: $d | $(compare "$c" "$ulog" "$dlog")"
  echo "$line" > "$work/$c.line"
  say "$line"
}

not_run=() running=()
alive() {  # how many cases are running
  local p n=0
  for p in "${running[@]}"; do kill -0 "$p" 2> /dev/null && n=$((n + 1)); done
  echo $n
}
for c in $CASES; do
  while [ "$(alive)" -ge "$PARALLEL" ]; do sleep 1; done
  left=$((DEADLINE_S - (SECONDS - start)))
  if [ "$left" -lt "$MIN_START_S" ]; then not_run+=("$c"); continue; fi
  limit=$((left - 10 < TIMEOUT_S ? left - 10 : TIMEOUT_S))
  run_case "$c" "$limit" &
  running+=("$!")
done
wait
[ ${#not_run[@]} = 0 ] || say "NOT RUN (deadline ${DEADLINE_S} s): ${not_run[*]}"
for op in fused_adam cpu_adam; do
  [ -f "$work/ds-build-$op.log" ] && say "DeepSpeed $op build: $(tail -1 "$work/ds-build-$op.log")"
done
say "== $((SECONDS - start)) s in all"
(cd "$work" && find . \( -name '*.log' -o -name '*.out' -o -name '*.line' -o -name '*.imports' \) -size -20M -print0 |
  tar -czf "$out/logs.tgz" --null -T -)
echo "logs: $out/logs.tgz, summary: $summary"
