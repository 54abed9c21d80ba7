#!/usr/bin/env bash
# Makes DEST (default build-gpu-deps/dsx, git-ignored, carried to the GPU machine) for
# bench/ds-examples-both-gpu.sh there, where nothing can be downloaded:
#   DEST/dse      the folders of DeepSpeedExamples (commit DSE_COMMIT) that the GPU cases use, from a clone or
#                 bare mirror DSE_GIT (only the files under git: no images, no logs of its own runs)
#   DEST/site     the pure-Python packages those scripts import that the GPU machine's Python 3.12 lacks:
#                 datasets (DeepSpeed-Chat, data_efficiency, compression/gpt2, HelloDeepSpeed) with dill and
#                 multiprocess; fire, loguru, pytz, sh (HelloDeepSpeed); tensorboardX (BingBertSquad's utils)
#   DEST/site-s3  boto3 and botocore (BingBertSquad's file_utils imports them at the start), apart: accelerate
#                 imports boto3 wherever it finds it. botocore's and boto3's service data are cut to s3 and sts
#                 (the scripts import the packages and call no service; whole, botocore is 30 MB)
#   DEST/legacy   with LEGACY=1 only: make_legacy_site.sh's SLIM set for Python 3.12 (transformers 4.36, datasets
#                 2.21, timm 0.6.13, ...: about 46 MB) and the folders of the cases that use it (data_efficiency's
#                 ViT, compression/bert, VisualChat, bing_bert, BingBertGlue)
# Wheels for Python 3.12 (pip download --python-version 3.12 --only-binary=:all:), installed with --no-deps: their
# other dependencies (pyarrow, pandas, xxhash, fsspec, huggingface_hub, requests, urllib3, protobuf) are there.
#
# usage: bench/ds_examples/make_dsx_deps.sh DSE_GIT [DEST]     env: DSE_COMMIT (45b4b715), PIP (python3 -m pip), LEGACY
set -euo pipefail
git_dir=${1:?usage: make_dsx_deps.sh DSE_GIT [DEST]}
dest=$(realpath -m "${2:-build-gpu-deps/dsx}")
commit=${DSE_COMMIT:-45b4b715}
pip=${PIP:-python3 -m pip}
folders=(training/cifar training/imagenet training/HelloDeepSpeed training/pipeline_parallelism training/gan
         training/BingBertSquad training/data_efficiency/gpt_finetuning compression/cifar compression/gpt2
         applications/DeepSpeed-Chat/dschat applications/DeepSpeed-Chat/training
         training/offload_states training/DeepSpeed-Domino training/autotuning training/stable_diffusion training/MoQ)
[ -n "${LEGACY:-}" ] && folders+=(training/data_efficiency/vit_finetuning compression/bert applications/DeepSpeed-VisualChat
                                  training/bing_bert training/BingBertGlue)
rm -rf "$dest"; mkdir -p "$dest/dse"
git_dir=$(git -C "$git_dir" rev-parse --absolute-git-dir 2> /dev/null || echo "$git_dir")
git --git-dir="$git_dir" archive "$commit" -- "${folders[@]}" \
  ':(exclude)**/training_log_output/**' ':(exclude)**/*.png' ':(exclude)**/*.jpg' | tar -x -C "$dest/dse"
# (a partial mirror may lack large files elsewhere in the tree; git names them but archives these folders whole)
# (files only: DeepSpeed-Domino's Megatron-LM is a submodule, which git archive leaves out)
want=$(git --git-dir="$git_dir" ls-tree -r "$commit" -- "${folders[@]}" | awk -F'\t' '$1 ~ / blob / {print $2}' |
         grep -cvE '/training_log_output/|\.(png|jpg)$')
got=$(cd "$dest/dse" && find . -type f | wc -l)
[ "$want" = "$got" ] || { echo "make_dsx_deps: $got files of DeepSpeedExamples' $want in $dest/dse" >&2; exit 1; }
echo "$commit" > "$dest/dse/COMMIT"

wheels=$(mktemp -d)
$pip download -q --no-deps --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: -d "$wheels" \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fire termcolor loguru pytz sh tensorboardX \
  boto3 botocore s3transfer jmespath
install() {  # install DIR NAME...: the wheels of those names
  local dir=$1 name files=(); shift
  for name in "$@"; do files+=("$wheels"/"$name"-*.whl); done
  (cd "$wheels" && $pip install -q --no-deps --no-compile --python-version 3.12 --platform manylinux2014_x86_64 \
     --only-binary=:all: --target "$dir" "${files[@]}")
}
install "$dest/site" datasets dill multiprocess fire termcolor loguru pytz sh tensorboardx
install "$dest/site-s3" boto3 botocore s3transfer jmespath
for d in "$dest"/site-s3/botocore/data/*/; do case $d in */s3/ | */sts/) ;; *) rm -rf "$d" ;; esac; done
for d in "$dest"/site-s3/boto3/data/*/; do case $d in */s3/) ;; *) rm -rf "$d" ;; esac; done
if [ -n "${LEGACY:-}" ]; then
  SLIM=1 PY_VERSION=3.12 PYTHON=${pip%% -m pip*} bash "$(dirname "$0")/make_legacy_site.sh" "$dest/legacy" > /dev/null
fi
find "$dest" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$wheels"
du -sh "$dest"/* "$dest"
