#!/usr/bin/env bash
# DeepSpeedExamples' scripts on uckpt (issue 26), each changed only in its import lines
# (`import deepspeed` -> `import uckpt as deepspeed`, `from deepspeed.X import` -> `from uckpt.X import`,
# `import deepspeed.X as Y` -> `import uckpt.X as Y`; CRLF line ends kept), run under `uckpt launch -n 1` (DeepSpeed's
# launcher's --local_rank=0) on one GPU with a time limit; one PASS/FAIL line each, with the reason.
#
#   cifar      training/cifar/cifar10_deepspeed.py with its defaults (fp16, ZeRO 0: DeepSpeed's FP16_Optimizer
#              around its config Adam), --epochs 1: PASS = trained (test accuracy printed)
#   cifar_z1   the same at --stage 1: PASS = trained
#   cifar_moe  the same with --moe: uckpt refuses mixture of experts, so PASS = refused naming it
#   imagenet   training/imagenet/main.py --dummy -a resnet18 with its config/ds_config.json, --epochs 1
#   chat_z0    DeepSpeed-Chat step 1 (applications/DeepSpeed-Chat/training/step1_supervised_finetuning/
#   chat_z2    main.py, with its dschat package) at --zero_stage 0 (fp16 with --lora_dim 8, as its single_gpu
#   chat_z3    scripts), 2 and 3: a tiny OPT made from a config,
#              local/jsonfile data written here; PASS also needs the whole weights in pytorch_model.bin
#
# What stands in for what the machine cannot download (nothing in the scripts changes):
#   * CIFAR-10: a `torchvision` package of our own first on PYTHONPATH (datasets.CIFAR10 gives
#     DSX_CIFAR_TRAIN / DSX_CIFAR_TEST synthetic 32x32 images, labels cycling over the 10 classes;
#     transforms.Compose / ToTensor / Normalize on them), for the cifar runs only;
#   * ImageNet: main.py's own --dummy (torchvision.datasets.FakeData, the real torchvision), capped at
#     DSX_FAKEDATA_SIZE images by a sitecustomize.py on PYTHONPATH (1,281,167 would take hours);
#     openpyxl (its loss table) by a stub when it is not installed;
#   * DeepSpeed-Chat: the model (OPTConfig, 2 layers x 64, saved with save_pretrained) and its tokenizer
#     (a byte-level BPE trained on the data, saved as tokenizer.json for AutoTokenizer) are made here,
#     offline; the data is
#     data/train.json and data/eval.json next to dschat (what local/jsonfile reads). At stage 3 its
#     create_hf_model builds transformers' HfDeepSpeedConfig, and transformers then imports
#     `deepspeed` itself: a `deepspeed` alias of uckpt (with 0.14.5 package metadata) is first on
#     PYTHONPATH for the chat runs, so the library gets uckpt too. `datasets` (its json loader) is
#     replaced by a small reader of JSON lines when it is not installed.
#
# usage: bench/ds-examples-gpu.sh DSE_CHECKOUT [BUILD_DIR] [WORK_DIR]
#   DSE_CHECKOUT  a microsoft/DeepSpeedExamples checkout
#   BUILD_DIR     uckpt built with the Python package (default /tmp/uckpt-gpu; built here with
#                 scripts/build-gpu.sh BUILD_DIR $UCKPT_GPU_DEPS (default build-gpu-deps) when it has none)
#   WORK_DIR      default /tmp/ds-examples
#
# More cases (issue 40; bench/ds_examples/cases.sh, one function each, with the stand-ins of
# bench/ds_examples/site and make_hub_models.py; docs/ds-examples.md has the table of what they gave):
#   imagenet_fp16 imagenet_fp16_z1 hello pipeline gan offload_states domino moq compress_cifar compress_bert
#   compress_gpt2 de_gpt de_vit_cifar de_vit_imagenet visualchat chat_rm chat_dpo chat_rlhf bing_bert
#   bing_bert_glue bingbertglue squad autotuning stable_diffusion visualchat_api
# DSX_LEGACY_SITE: the folder bench/ds_examples/make_legacy_site.sh makes (transformers 4, datasets 2, timm 0.6,
#   scipy, ...), put on the path of the cases written for those versions (bing_bert*, bingbertglue, de_vit_*, moq,
#   compress_bert, visualchat, visualchat_api); unset, they get the environment's packages.
#
# env: CASES (default "cifar cifar_z1 cifar_moe imagenet chat_z0 chat_z2 chat_z3"), TIMEOUT_S (per case, default 300;
#      DSX_END_EPOCH, a time in seconds since the epoch, cuts it so that every launch ends by then),
#      NPROC (ranks per run, default 1), RESUME_NPROC (ranks of a resume, default 2 when NPROC is 1, else 1),
#      DS_ACCELERATOR=cpu runs on the CPU (chat in bf16; for testing this script).
#      IMPL=deepspeed runs the scripts unchanged on real DeepSpeed (its source in DEEPSPEED_SRC, package metadata
#      for 0.14.5 written beside it here; TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 for its own loads), under the same
#      launcher, stand-ins and arguments, for the losses beside uckpt's (bench/ds-examples-both-gpu.sh).
# One line per case: PASS, REFUSED (uckpt named a DeepSpeed feature it lacks), GPU-ONLY (on the CPU: the script
# itself needs CUDA), N/A (the script does not use DeepSpeed), AS-DEEPSPEED (the script stops before training with
# the error it gives on DeepSpeed 0.14.5 itself, seen with IMPL=deepspeed) or FAIL, with the reason.
# Exit status: the number of FAIL cases. Logs: WORK_DIR/<case>.log.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dse=$(realpath "${1:?usage: bench/ds-examples-gpu.sh DSE_CHECKOUT [BUILD_DIR] [WORK_DIR]}")
build=$(realpath -m "${2:-/tmp/uckpt-gpu}")
work=$(realpath -m "${3:-/tmp/ds-examples}")
CASES=${CASES:-cifar cifar_z1 cifar_moe imagenet chat_z0 chat_z2 chat_z3}
TIMEOUT_S=${TIMEOUT_S:-300}
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network there: never wait for one
export PYTHONFAULTHANDLER=1  # a crash in native code prints the Python stack it came from
cpu=false; [ "${DS_ACCELERATOR:-}" = cpu ] && cpu=true
IMPL=${IMPL:-uckpt}
case $IMPL in
  uckpt) ;;
  deepspeed) ds_src=$(realpath "${DEEPSPEED_SRC:?IMPL=deepspeed needs DEEPSPEED_SRC (the source of DeepSpeed 0.14.5)}")
             [ -f "$ds_src/deepspeed/__init__.py" ] || { echo "ds-examples: no deepspeed/ in $ds_src" >&2; exit 2; } ;;
  *) echo "ds-examples: IMPL is uckpt or deepspeed, not $IMPL" >&2; exit 2 ;;
esac

for f in training/cifar/cifar10_deepspeed.py training/imagenet/main.py \
         applications/DeepSpeed-Chat/training/step1_supervised_finetuning/main.py applications/DeepSpeed-Chat/dschat; do
  [ -e "$dse/$f" ] || { echo "ds-examples: $dse has no $f (not a DeepSpeedExamples checkout?)" >&2; exit 2; }
done
if [ ! -f "$build/python/uckpt/__init__.py" ]; then
  echo "== building uckpt and its Python package in $build"
  (cd "$here" && scripts/build-gpu.sh "$build" "${UCKPT_GPU_DEPS:-build-gpu-deps}" > /dev/null &&
     cmake --build "$build" -j"$(nproc)" --target python > "$build.python.log" 2>&1) ||
    { echo "ds-examples: building uckpt failed (see $build.*.log)" >&2; exit 2; }
fi
U=$build/src/cli/uckpt
[ -x "$U" ] || { echo "ds-examples: no $U" >&2; exit 2; }
rm -rf "$work"; mkdir -p "$work"
export HF_DATASETS_CACHE=${HF_DATASETS_CACHE:-$work/hf-datasets}  # runs beside each other share no cache
on="uckpt ($build)"; [ "$IMPL" = deepspeed ] && on="DeepSpeed ($ds_src)"
echo "== DeepSpeedExamples $(git -C "$dse" log -1 --format=%h 2>/dev/null || echo '(not a git checkout)') on $on, work in $work"

# ---- the scripts, changed in their import lines only
uckpt_imports() {  # FILE...: rewrite the deepspeed imports; print the changed lines; fail if one is left
  local f
  [ "$IMPL" = deepspeed ] && return 0  # real DeepSpeed: the scripts as shipped
  for f in "$@"; do
    cp "$f" "$f.orig"
    sed -E -i -e 's/^([[:space:]]*)import deepspeed(\r?)$/\1import uckpt as deepspeed\2/' \
              -e 's/^([[:space:]]*)import deepspeed\.([A-Za-z0-9_.]+) as /\1import uckpt.\2 as /' \
              -e 's/^([[:space:]]*)from deepspeed(\.[A-Za-z0-9_.]+)? import /\1from uckpt\2 import /' \
              -e 's/^([[:space:]]*)from deepspeed(\.[A-Za-z0-9_.]+)?([[:space:]]*\\\r?)$/\1from uckpt\2\3/' "$f"
    diff "$f.orig" "$f" | sed -n "s|^> |   $(basename "$f"): |p"
    rm "$f.orig"
    if grep -nE $'^[[:space:]]*(import|from)[[:space:]]+deepspeed([. \r]|$)' "$f"; then
      echo "ds-examples: $f still imports deepspeed (above)" >&2; return 1
    fi
  done
}
mkdir -p "$work/cifar" "$work/imagenet" "$work/chat"
cp "$dse/training/cifar/cifar10_deepspeed.py" "$work/cifar/"
cp "$dse/training/imagenet/main.py" "$work/imagenet/"; cp -r "$dse/training/imagenet/config" "$work/imagenet/"
cp "$dse/applications/DeepSpeed-Chat/training/step1_supervised_finetuning/main.py" "$work/chat/"
cp -r "$dse/applications/DeepSpeed-Chat/dschat" "$work/chat/"
echo "== the changed lines"
uckpt_imports "$work/cifar/cifar10_deepspeed.py" "$work/imagenet/main.py" "$work/chat/main.py" \
  $(find "$work/chat/dschat" -name '*.py' | sort) || exit 2

# ---- stand-ins (see the header)
mkdir -p "$work/shim-cifar/torchvision"
cat > "$work/shim-cifar/torchvision/__init__.py" <<'PY'
"""Stands in for torchvision in the cifar runs: synthetic CIFAR-10 (no download)."""
from torchvision import datasets, transforms  # noqa: F401
PY
cat > "$work/shim-cifar/torchvision/datasets.py" <<'PY'
import os

import torch


class CIFAR10(torch.utils.data.Dataset):
    """Synthetic CIFAR-10: uint8 32x32x3 images (seeded), labels cycling over the 10 classes."""

    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        n = int(os.environ.get("DSX_CIFAR_TRAIN" if train else "DSX_CIFAR_TEST", 512 if train else 64))
        g = torch.Generator().manual_seed(0 if train else 1)
        self.data = torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g)
        self.targets = [i % 10 for i in range(n)]
        self.transform, self.target_transform = transform, target_transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        img, target = self.data[i], self.targets[i]
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target
PY
cat > "$work/shim-cifar/torchvision/transforms.py" <<'PY'
import torch


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    """An HxWxC uint8 image as a CxHxW float tensor in [0, 1], as torchvision's."""
    def __call__(self, img):
        return img.permute(2, 0, 1).float().div(255)


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std
PY
mkdir -p "$work/shim-imagenet"
cat > "$work/shim-imagenet/sitecustomize.py" <<'PY'
"""Caps torchvision.datasets.FakeData at DSX_FAKEDATA_SIZE images (main.py --dummy asks for ImageNet's count)."""
import os

if os.environ.get("DSX_FAKEDATA_SIZE"):
    try:
        import torchvision.datasets as _datasets
    except ImportError:
        pass
    else:
        _init = _datasets.FakeData.__init__

        def _capped(self, size=1000, *args, **kwargs):
            _init(self, min(size, int(os.environ["DSX_FAKEDATA_SIZE"])), *args, **kwargs)

        _datasets.FakeData.__init__ = _capped
PY
if ! $PY -c 'import openpyxl' 2> /dev/null; then
  mkdir -p "$work/shim-imagenet/openpyxl"
  cat > "$work/shim-imagenet/openpyxl/__init__.py" <<'PY'
"""Stands in for openpyxl (not installed): main.py's loss table goes to a CSV-like text file."""


class _Sheet:
    def __init__(self):
        self.cells = {}

    def cell(self, row, column, value=None):
        self.cells[(row, column)] = value


class Workbook:
    def __init__(self):
        self.active = _Sheet()

    def save(self, path):
        with open(path, "w") as f:
            for (r, c), v in sorted(self.active.cells.items()):
                f.write(f"{r},{c},{v}\n")
PY
  echo "   (openpyxl is not installed: a stub writes main.py's table as text)"
fi
mkdir -p "$work/alias/deepspeed-0.14.5.dist-info"
# IMPL=deepspeed: only the package metadata (transformers checks DeepSpeed's version); the package is DEEPSPEED_SRC
[ "$IMPL" = uckpt ] && mkdir -p "$work/alias/deepspeed" && cat > "$work/alias/deepspeed/__init__.py" <<'PY'
"""`deepspeed` for libraries that import it themselves (transformers' DeepSpeed integration): uckpt, and
deepspeed.X is uckpt.X (the same module objects)."""
import importlib
import importlib.abc
import importlib.util
import sys

import uckpt


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name.startswith("deepspeed.") else None

    def create_module(self, spec):
        return importlib.import_module("uckpt" + spec.name[len("deepspeed"):])

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Alias())
sys.modules["deepspeed"] = uckpt
PY
printf 'Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.14.5\n' > "$work/alias/deepspeed-0.14.5.dist-info/METADATA"
if ! $PY -c 'import datasets' 2> /dev/null; then
  mkdir -p "$work/shim-chat/datasets"
  cat > "$work/shim-chat/datasets/__init__.py" <<'PY'
"""Stands in for Hugging Face datasets (not installed): load_dataset("json", data_files={split: path}) as lists of
dicts, read from JSON lines or a JSON array (what DeepSpeed-Chat's local/jsonfile reads)."""
import json


def load_dataset(kind, data_files=None, **kwargs):
    if kind != "json" or not isinstance(data_files, dict):
        raise NotImplementedError(f"the datasets stand-in reads only load_dataset('json', data_files={{...}})")
    out = {}
    for split, path in data_files.items():
        text = open(path).read().strip()
        out[split] = json.loads(text) if text.startswith("[") else [json.loads(l) for l in text.splitlines() if l]
    return out


def load_from_disk(path, **kwargs):
    raise NotImplementedError("the datasets stand-in has no load_from_disk")
PY
  echo "   (datasets is not installed: a JSON-lines reader stands in for load_dataset('json'))"
fi

# ---- DeepSpeed-Chat's data and model (offline)
make_chat_inputs() {
  mkdir -p "$work/chat/data"
  $PY - "$work/chat" <<'PY' || return 1
import json, os, random, sys
chat = sys.argv[1]
rng = random.Random(0)
words = "the a model data train step loss rank shard save load weight learn token batch gpu fast small".split()
def sentence(n):
    return " ".join(rng.choice(words) for _ in range(n))
for split, n in (("train", 160), ("eval", 40)):
    with open(os.path.join(chat, "data", f"{split}.json"), "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": "Human: " + sentence(8) + " Assistant:", "chosen": sentence(10),
                                "rejected": sentence(10)}) + "\n")
from tokenizers import ByteLevelBPETokenizer
import torch
from transformers import OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast
texts = [json.loads(l)[k] for s in ("train", "eval") for l in open(os.path.join(chat, "data", f"{s}.json"))
         for k in ("prompt", "chosen", "rejected")]
bpe = ByteLevelBPETokenizer()
bpe.train_from_iterator(texts, vocab_size=400, min_frequency=1, special_tokens=["</s>"])
model_dir = os.path.join(chat, "tiny-opt")
os.makedirs(model_dir, exist_ok=True)
# tokenizer.json + tokenizer_config.json (AutoTokenizer reads them; the same in transformers 4 and 5)
tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="</s>", eos_token="</s>", unk_token="</s>",
                              pad_token="</s>")
assert len(tok) > 100, f"the tokenizer has {len(tok)} tokens"
tok.save_pretrained(model_dir)
# As OPT's own folders: vocab.json and merges.txt beside tokenizer.json, and the GPT-2 tokenizer class, so
# AutoTokenizer gives a tokenizer with a vocab_file (DeepSpeed-Chat's save_hf_format saves the vocabulary).
bpe.save_model(model_dir)
path = os.path.join(model_dir, "tokenizer_config.json")
c = json.load(open(path)); c["tokenizer_class"] = "GPT2Tokenizer"; json.dump(c, open(path, "w"), indent=1)
eos = tok.convert_tokens_to_ids("</s>")
config = OPTConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4,
                   max_position_embeddings=256, word_embed_proj_dim=64, bos_token_id=eos, eos_token_id=eos,
                   pad_token_id=eos)
torch.manual_seed(0)  # the same tiny OPT in every run: uckpt's and DeepSpeed's losses start from one model
OPTForCausalLM(config).save_pretrained(model_dir)
# dschat's load_hf_tokenizer loads the tokenizer named by config.json's _name_or_path: this folder.
path = os.path.join(model_dir, "config.json")
c = json.load(open(path)); c["_name_or_path"] = model_dir; json.dump(c, open(path, "w"), indent=1)
print(f"   tiny OPT ({sum(p.numel() for p in OPTForCausalLM(config).parameters())} parameters, vocab {len(tok)}) in {model_dir}")
PY
}

# ---- the runs
failures=0
NPROC=${NPROC:-1} RESUME_NPROC=${RESUME_NPROC:-$((NPROC == 1 ? 2 : 1))}
source "$here/bench/ds_examples/cases.sh"
result() {  # result CASE PASS|REFUSED|GPU-ONLY|FAIL REASON (REFUSED: uckpt named a DeepSpeed feature it lacks;
  echo "$2 $1: $3"                         # GPU-ONLY: on the CPU, the script itself needs CUDA)
  case $2 in PASS|REFUSED|GPU-ONLY|N/A|AS-DEEPSPEED) ;; *) failures=$((failures + 1)) ;; esac
}
reason() {  # the last error line of a log
  grep -E '(Error|Exception|refused|not supported|Traceback)' "$1" | grep -v '^\s*File ' | tail -1 | cut -c1-300
}
launch() {  # launch CASE DIR PYTHONPATH_EXTRA SCRIPT ARGS...: NPROC processes, DeepSpeed's --local_rank, time limit
  launch_n "$NPROC" "$@"
}
launch_n() {  # launch_n N CASE DIR PYTHONPATH_EXTRA SCRIPT ARGS...
  local n=$1 name=$2 dir=$3 extra=$4; shift 4
  local t0=$SECONDS visible=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((n - 1)))} pkg=$build/python impl_env=()
  local limit=$TIMEOUT_S rest  # DSX_END_EPOCH: every launch of the case ends by then (a case may launch twice)
  if [ -n "${DSX_END_EPOCH:-}" ]; then
    rest=$((DSX_END_EPOCH - $(date +%s))); [ "$rest" -lt "$limit" ] && limit=$((rest > 1 ? rest : 1))
  fi
  [ "$IMPL" = deepspeed ] && pkg=$ds_src:$work/alias && impl_env=(TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1)
  # DeepSpeed's CPU accelerator counts devices with numactl unless LOCAL_SIZE says how many (ZeRO-3 asks)
  [ "$IMPL" = deepspeed ] && $cpu && impl_env+=(LOCAL_SIZE=$n)
  (cd "$dir" && env "${impl_env[@]}" CUDA_VISIBLE_DEVICES=$visible PYTHONPATH="$extra${extra:+:}$pkg${PYTHONPATH:+:$PYTHONPATH}" \
     timeout "$limit" "$U" launch -n "$n" --master_port 0 -- "$PY" "$@") > "$work/$name.log" 2>&1
  local rc=$?
  elapsed=$((SECONDS - t0))
  return $rc
}
ran() {  # ran CASE RC: PASS/FAIL from the exit status (124: the time limit)
  local name=$1 rc=$2 check=${3:-}
  if [ "$rc" = 124 ]; then result "$name" FAIL "timed out after ${TIMEOUT_S} s (log: $work/$name.log)"
  elif [ "$rc" != 0 ]; then result "$name" FAIL "exit $rc: $(reason "$work/$name.log")"
  else result "$name" PASS "exit 0 in ${elapsed} s${check:+; $check}"; fi
}

for c in $CASES; do
  case $c in
    cifar)
      args=(--epochs 1 ${CIFAR_ARGS:-})
      launch cifar "$work/cifar" "$work/shim-cifar" cifar10_deepspeed.py "${args[@]}"; rc=$?
      if [ $rc = 0 ] && ! grep -q "Accuracy of the network" "$work/cifar.log"; then
        result cifar FAIL "exit 0 but no test accuracy printed"
      else ran cifar $rc "$(grep -m1 'Accuracy of the network' "$work/cifar.log")"; fi ;;
    cifar_z1)
      args=(--epochs 1 --stage 1 ${CIFAR_ARGS:-})
      launch cifar_z1 "$work/cifar" "$work/shim-cifar" cifar10_deepspeed.py "${args[@]}"; rc=$?
      if [ $rc = 0 ] && ! grep -q "Accuracy of the network" "$work/cifar_z1.log"; then
        result cifar_z1 FAIL "exit 0 but no test accuracy printed"
      else ran cifar_z1 $rc "$(grep -m1 'Accuracy of the network' "$work/cifar_z1.log")"; fi ;;
    cifar_moe)
      args=(--epochs 1 --moe); $cpu && args+=(--dtype fp32)
      launch cifar_moe "$work/cifar" "$work/shim-cifar" cifar10_deepspeed.py "${args[@]}"; rc=$?
      if [ $rc != 0 ] && grep -q "mixture of experts (MoE) is not supported by uckpt" "$work/cifar_moe.log"; then
        result cifar_moe PASS "refused as expected: $(grep -m1 -o 'uckpt.initialize: .*mixture of experts (MoE) is not supported by uckpt' "$work/cifar_moe.log")"
      elif [ $rc = 0 ] && [ "$IMPL" = deepspeed ]; then result cifar_moe PASS "--moe trained (DeepSpeed's MoE)"
      elif [ $rc = 0 ]; then result cifar_moe FAIL "--moe trained: uckpt must refuse mixture of experts"
      else ran cifar_moe $rc; fi ;;
    imagenet)
      if ! $PY -c 'import torchvision.models' 2> /dev/null; then
        result imagenet FAIL "torchvision is not installed (main.py builds torchvision.models.resnet18 and FakeData)"; continue
      fi
      DSX_FAKEDATA_SIZE=${DSX_FAKEDATA_SIZE:-512} launch imagenet "$work/imagenet" "$work/shim-imagenet" main.py \
        --dummy -a resnet18 -b 64 --epochs 1 -j 2 -p 4 --deepspeed --deepspeed_config config/ds_config.json; rc=$?
      classify imagenet $rc "$(grep -m1 'Acc@1' "$work/imagenet.log" | cut -c1-120)" ;;
    chat_z0|chat_z2|chat_z3)
      stage=${c#chat_z}
      if ! $PY -c 'import transformers, tokenizers' 2> /dev/null; then
        result "$c" FAIL "transformers (and tokenizers) are not installed"; continue
      fi
      if [ ! -d "$work/chat/tiny-opt" ]; then
        make_chat_inputs > "$work/chat-inputs.log" 2>&1 || { result "$c" FAIL "making the tiny OPT: $(reason "$work/chat-inputs.log")"; continue; }
        cat "$work/chat-inputs.log"
      fi
      # Stage 0 as its single-GPU scripts: fp16 (FusedAdam in DeepSpeed's FP16_Optimizer) with LoRA, on the CPU too.
      dtype=(); $cpu && [ "$stage" != 0 ] && dtype=(--dtype bf16)
      [ "$stage" = 0 ] && dtype+=(--lora_dim 8)
      out=$work/chat/out_z$stage
      extra=$site:$work/chat:$work/alias; [ -d "$work/shim-chat" ] && extra+=:$work/shim-chat
      DSX_TRANSFORMERS4=1 launch "$c" "$work/chat" "$extra" main.py \
        --data_path local/jsonfile --data_split 2,4,4 --model_name_or_path "$work/chat/tiny-opt" \
        --per_device_train_batch_size 4 --per_device_eval_batch_size 4 --max_seq_len 64 --learning_rate 1e-3 \
        --num_train_epochs 1 --zero_stage "$stage" "${dtype[@]}" --data_output_path "$work/chat/data_files_z$stage" \
        --output_dir "$out" --print_loss; rc=$?
      if [ $rc = 0 ]; then  # the whole weights saved (stage 3: gathered by save_zero_three_model)
        check=$($PY - "$out/pytorch_model.bin" <<'PY' 2>&1
import sys, torch
sd = torch.load(sys.argv[1], map_location="cpu")
empty = [k for k, v in sd.items() if v.numel() == 0]
print(f"{len(sd)} tensors, {len(empty)} empty" + (f" ({empty[0]} ...)" if empty else ""))
sys.exit(1 if empty or not sd else 0)
PY
) || { result "$c" FAIL "pytorch_model.bin: $check"; continue; }
        ran "$c" 0 "$(grep 'ppl:' "$work/$c.log" | tr '\n' ' ' | cut -c1-120)pytorch_model.bin $check"
      else ran "$c" $rc; fi ;;
    imagenet_fp16|imagenet_fp16_z1)  # its other configs (run_ds_fp16.sh, ds_fp16_z1_config.json)
      if ! $PY -c 'import torchvision.models' 2> /dev/null; then
        result $c FAIL "torchvision is not installed"; continue
      fi
      config=config/ds_fp16_config.json; [ $c = imagenet_fp16_z1 ] && config=config/ds_fp16_z1_config.json
      DSX_FAKEDATA_SIZE=${DSX_FAKEDATA_SIZE:-512} launch $c "$work/imagenet" "$site:$work/shim-imagenet" main.py \
        --dummy -a resnet18 -b 64 --epochs 1 -j 2 -p 4 --deepspeed --deepspeed_config $config; rc=$?
      classify $c $rc "$(grep -m1 'Acc@1' "$work/$c.log" | cut -c1-120)" ;;
    *) if declare -F "case_$c" > /dev/null; then "case_$c"
       else echo "ds-examples: unknown case $c" >&2; failures=$((failures + 1)); fi ;;
  esac
done
echo "== ds-examples: $failures failed of $(echo $CASES | wc -w)"
exit $failures
