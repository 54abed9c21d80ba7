#!/usr/bin/env bash
# Makes DEST (default /tmp/dsx-legacy-site): the older packages that eight of DeepSpeedExamples' scripts were
# written for, installed with `pip install --no-deps --target`, to be put on PYTHONPATH *before* the project's
# venv (whose transformers 5, datasets 5, huggingface_hub 1 and timm 1 they predate). Nothing of it goes into the
# venv. bench/ds-examples-gpu.sh puts it on the path of the cases that need it when DSX_LEGACY_SITE names it.
#
#   transformers 4.36.2 (+ tokenizers 0.15.2)  VisualChat (its requirements pin 4.33.3, whose tokenizers has no
#                                              wheel for Python 3.12; it imports `transformers.AdamW`),
#                                              compression/bert (`file_utils.get_full_repo_name`, its own copy
#                                              of transformers 4's BERT)
#   huggingface_hub 0.24.7                     compression/bert (`Repository`, gone in 1.0)
#   datasets 2.21.0 (+ dill, multiprocess,     MoQ and compression/bert (`load_metric`, gone in 3.0; the
#     fsspec, aiohttp and its dependencies)    stand-in of bench/ds_examples/site/dsx_datasets.py computes it)
#   timm 0.6.13                                data_efficiency/vit_finetuning (its model code is timm 0.x's)
#   scipy, scikit-learn (+ joblib,             bing_bert's and BingBertGlue's GLUE metrics
#     threadpoolctl)
#   einops, einops_exts, open_clip_torch,      VisualChat's model code
#     ftfy, wcwidth, sentencepiece
# MoQ's run_glue.py needs a Trainer from before Accelerate (transformers < 4.30): DEST/moq holds transformers
# 4.29.2 and tokenizers 0.13.3, put before DEST for that case (no tokenizers 0.13 wheel for Python 3.12: not made
# with PY_VERSION=3.12).
#
# SLIM=1 (for the GPU machine, where what is carried is limited to 64 MiB in all): only transformers, tokenizers,
# huggingface_hub, datasets (+ dill, multiprocess, fsspec, aiohttp and its dependencies) and timm, with transformers'
# models' code cut to the architectures the cases build (auto, bert, llama, clip, gpt2, opt, roberta; of the others
# only what transformers imports on its own: __init__, configuration, tokenization), no TensorFlow or Flax models;
# no scipy or scikit-learn, no MoQ folder.
#
# usage: bench/ds_examples/make_legacy_site.sh [DEST]
# env: PYTHON (whose pip installs; default python3), PY_VERSION (e.g. 3.12: wheels for that Python, for the GPU
#      machine; default the running one's), SLIM
set -euo pipefail
dest=$(realpath -m "${1:-/tmp/dsx-legacy-site}")
py=${PYTHON:-python3}
pip=("$py" -m pip install -q --no-deps --no-compile --only-binary=:all:)
[ -n "${PY_VERSION:-}" ] && pip+=(--python-version "$PY_VERSION" --platform manylinux2014_x86_64)
pip+=(--target)
rm -rf "$dest"; mkdir -p "$dest/moq"
core=(transformers==4.36.2 tokenizers==0.15.2 huggingface_hub==0.24.7
      datasets==2.21.0 dill==0.3.8 multiprocess==0.70.16 fsspec==2024.6.1
      aiohttp==3.10.11 aiosignal==1.3.1 frozenlist==1.5.0 multidict==6.1.0 yarl==1.17.2 propcache==0.2.0
      aiohappyeyeballs==2.4.4 attrs==24.2.0 timm==0.6.13)
if [ -n "${SLIM:-}" ]; then
  "${pip[@]}" "$dest" "${core[@]}"
  rmdir "$dest/moq"
  for m in "$dest"/transformers/models/*/; do
    find "$m" -maxdepth 1 \( -name 'modeling_tf_*.py' -o -name 'modeling_flax_*.py' -o -name 'convert_*.py' \) -delete
    case $(basename "$m") in auto|bert|llama|clip|gpt2|opt|roberta) continue ;; esac
    find "$m" -type f ! -name '__init__.py' ! -name 'configuration_*.py' ! -name 'tokenization_*.py' -delete
  done
else
  "${pip[@]}" "$dest" "${core[@]}" \
    requests==2.32.3 urllib3==2.2.3 idna==3.10 certifi==2024.8.30 charset_normalizer==3.4.0 \
    scipy==1.16.3 scikit-learn==1.7.2 joblib==1.5.2 threadpoolctl==3.6.0 \
    einops==0.8.0 einops_exts==0.0.4 open_clip_torch==2.26.1 ftfy==6.3.1 wcwidth==0.2.13 sentencepiece==0.2.0 \
    protobuf==3.20.3
  [ -n "${PY_VERSION:-}" ] || "${pip[@]}" "$dest/moq" transformers==4.29.2 tokenizers==0.13.3
fi
find "$dest" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$dest"
