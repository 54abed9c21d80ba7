# The DeepSpeedExamples cases beyond the first seven (issue 40), sourced by bench/ds-examples-gpu.sh: one function
# per case, each copying the script's folder into $work, changing only its import lines (uckpt_imports), making the
# stand-ins it needs (bench/ds_examples/site, make_hub_models.py) and calling `result` once.
# Uses from the caller: $dse $work $here $PY $U $NPROC $RESUME_NPROC $cpu, uckpt_imports, result, reason, launch_n.

site=$here/bench/ds_examples/site
hub=$work/hub  # HF_HUB_CACHE with the stand-in models (make_hub_models.py)
# DSX_LEGACY_SITE: the older packages (transformers 4, datasets 2, huggingface_hub 0.x, timm 0.6, scipy) of
# bench/ds_examples/make_legacy_site.sh, on the path of the eight cases written for them; unset, they get the
# environment's own (and stop on it, FAIL (env)).
legacy=${DSX_LEGACY_SITE:+:$DSX_LEGACY_SITE}

copy_example() {  # copy_example SUBDIR NAME: $work/NAME is a copy of $dse/SUBDIR, its imports changed
  rm -rf "$work/$2"; cp -r "$dse/$1" "$work/$2"
  uckpt_imports $(find "$work/$2" -name '*.py' | sort) > "$work/$2.imports" || return 1
}
made() {  # made NAME: its stand-in is complete (a run that failed halfway leaves the folder without the config)
  compgen -G "$hub/models--${1//\//--}/snapshots/*/config.json" > /dev/null
}
hub_models() {  # hub_models NAME...: stand-ins in $hub for the models not made yet
  local m todo=()
  for m in "$@"; do made "$m" || todo+=("$m"); done
  [ ${#todo[@]} = 0 ] || HF_HUB_OFFLINE=1 $PY "$here/bench/ds_examples/make_hub_models.py" "$hub" "${todo[@]}" \
    > "$work/hub.log" 2>&1
}
# classify CASE RC: PASS on 0; else REFUSED when uckpt refused naming a feature it lacks, GPU-ONLY when the
# script needs CUDA (on the CPU), FAIL otherwise; the reason is the log's last error line.
classify() {
  local name=$1 rc=$2 log=$work/$1.log why
  why=$(reason "$log")
  if [ "$rc" = 0 ]; then result "$name" PASS "exit 0 in ${elapsed} s${3:+; $3}"
  elif [ "$rc" = 124 ]; then result "$name" FAIL "timed out after ${TIMEOUT_S} s"
  elif grep -qE "(is not supported by uckpt|which uckpt does not support|uckpt does not (have|support)|is not in DeepSpeed 0\.14\.5, whose API uckpt follows)" "$log"; then
    result "$name" REFUSED "$(grep -hoE '[^:]*(is not supported by uckpt|which uckpt does not support|uckpt does not (have|support)|is not in DeepSpeed 0\.14\.5, whose API uckpt follows)[^"]*' "$log" | head -1 | cut -c1-300)"
  elif $cpu && grep -qE "(Found no NVIDIA driver|No CUDA GPUs|ProcessGroupNCCL is only supported with GPUs|Torch not compiled with CUDA|Input type \(torch.FloatTensor\) and weight type \(torch.HalfTensor\)|can only be used on CUDA devices)" "$log"; then
    result "$name" GPU-ONLY "exit $rc: $why"
  else result "$name" FAIL "exit $rc: $why"; fi
}

case_hello() {  # HelloDeepSpeed train_bert_ds.py (run_ds.sh): 20 steps, its save_checkpoint, resume at RESUME_NPROC
  copy_example training/HelloDeepSpeed hello || { result hello FAIL "imports"; return; }
  hub_models roberta-base || { result hello FAIL "stand-ins: $(reason "$work/hub.log")"; return; }
  # a smaller model and sequence than its defaults (6 x 256, 512 tokens) so that 20 steps take a minute on a CPU
  local small=(--max_seq_length 64 --num_layers 2 --num_heads 4 --h_dim 64 --ff_dim 128 --batch_size 4 --log_every 5)
  HF_HUB_CACHE=$hub DSX_HUB_DATASETS=1 launch_n "$NPROC" hello "$work/hello" "$site" train_bert_ds.py \
    --checkpoint_dir experiment_deepspeed --num_iterations 21 --checkpoint_every 20 "${small[@]}"; local rc=$?
  [ $rc = 0 ] || { classify hello $rc; return; }
  local exp; exp=$(ls -d "$work"/hello/experiment_deepspeed/*/ | head -1)
  [ -f "$exp/latest" ] || { result hello FAIL "no checkpoint saved in $exp"; return; }
  mv "$work/hello.log" "$work/hello.train.log"
  HF_HUB_CACHE=$hub DSX_HUB_DATASETS=1 launch_n "$RESUME_NPROC" hello "$work/hello" "$site" train_bert_ds.py \
    --load_checkpoint_dir "$exp" --num_iterations 31 --checkpoint_every 20 "${small[@]}"; rc=$?
  local before after
  before=$(grep -o 'Loss: [0-9.]*' "$work/hello.train.log" | tail -1); after=$(grep -o 'Loss: [0-9.]*' "$work/hello.log" | head -1)
  classify hello $rc "steps 1-20 at $NPROC rank(s), last mean $before; resumed at $RESUME_NPROC rank(s) from step 20: first mean $after"
}

case_pipeline() {  # pipeline_parallelism/train.py (run.sh: -p 2 --steps=200), 20 steps
  copy_example training/pipeline_parallelism pipeline || { result pipeline FAIL "imports"; return; }
  local backend=(); $cpu && backend=(--backend gloo)  # its default nccl needs GPUs
  DSX_CIFAR=512 launch_n "$NPROC" pipeline "$work/pipeline" "$site" train.py --deepspeed_config=ds_config.json -p 2 \
    --steps=20 "${backend[@]}"
  classify pipeline $?
}

case_gan() {  # gan_deepspeed_train.py (gan_deepspeed_run.sh, with --dataset fake: celeba is a download)
  copy_example training/gan gan || { result gan FAIL "imports"; return; }
  DSX_FAKEDATA_SIZE=640 launch_n "$NPROC" gan "$work/gan" "$site" gan_deepspeed_train.py --dataset fake --cuda \
    --deepspeed_config gan_deepspeed_config.json --tensorboard_path ./runs/deepspeed --epochs 1
  classify gan $?
}

case_offload_states() {  # offload_states.py (run_benchmark.sh), one trial, its --hidden_dim cut to 1024
  copy_example training/offload_states offload_states || { result offload_states FAIL "imports"; return; }
  launch_n "$NPROC" offload_states "$work/offload_states" "" offload_states.py --hidden_dim 1024 --nlayers 4
  classify offload_states $?
}

case_domino() {  # DeepSpeed-Domino pretrain_gpt.py (needs Megatron-LM's megatron package)
  copy_example training/DeepSpeed-Domino domino || { result domino FAIL "imports"; return; }
  launch_n "$NPROC" domino "$work/domino" "" pretrain_gpt.py
  local rc=$? why
  if [ $rc != 0 ] && grep -q "No module named 'megatron'" "$work/domino.log"; then
    # it stops at `import megatron` first: what its domino/language_model.py's DeepSpeed import line gives
    why=$(cd "$work/domino" && PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" $PY -c \
      'from uckpt.runtime.domino.transformer import DominoTransformer' 2>&1 | tail -1 | cut -c1-250)
    result domino FAIL "exit $rc: No module named 'megatron' (Megatron-LM, not installed here); the import line of its domino/language_model.py alone gives: $why"
  else classify domino $rc; fi
}

case_moq() {  # MoQ run_glue.py (run.sh: bert-base-cased, qnli, --fp16, test.json with quantize_training)
  copy_example training/MoQ moq || { result moq FAIL "imports"; return; }
  hub_models bert-base-cased || { result moq FAIL "stand-ins: $(reason "$work/hub.log")"; return; }
  local moq_site=; [ -n "${DSX_LEGACY_SITE:-}" ] && [ -d "$DSX_LEGACY_SITE/moq" ] && moq_site=:$DSX_LEGACY_SITE/moq
  HF_HUB_CACHE=$hub TRANSFORMERS_CACHE=$hub DSX_HUB_DATASETS=1 launch_n "$NPROC" moq "$work/moq" "$site$moq_site$legacy:$work/alias" run_glue.py \
    --model_name_or_path bert-base-cased --task_name qnli --do_train --do_eval --max_seq_length 128 \
    --per_device_train_batch_size 32 --learning_rate 2e-5 --num_train_epochs 3 --output_dir ./output/qnli/ --fp16 \
    --warmup_steps 2 --deepspeed test.json
  classify moq $?
}

case_compress_cifar() {  # compression/cifar run_compress.sh's first step (train, ds_config.json), 1 epoch
  copy_example compression/cifar compress_cifar || { result compress_cifar FAIL "imports"; return; }
  local cuda=(); $cpu && cuda=(--cuda)  # a store_false flag: --cuda means the CPU
  DSX_CIFAR=512 DSX_CIFAR_TEST=64 launch_n "$NPROC" compress_cifar "$work/compress_cifar" "$site" train.py \
    --deepspeed_config config/ds_config.json --deepspeed --batch-norm --epochs 1 "${cuda[@]}"
  local rc=$?
  [ $rc != 0 ] && { classify compress_cifar $rc; return; }
  # its second step: channel pruning of that checkpoint (init_compression)
  mv "$work/compress_cifar.log" "$work/compress_cifar.train.log"
  DSX_CIFAR=512 DSX_CIFAR_TEST=64 launch_n "$NPROC" compress_cifar "$work/compress_cifar" "$site" train.py \
    --deepspeed_config config/ds_config_channel_prune.json --deepspeed --epochs 1 --batch-norm --compression \
    --path-to-model ./checkpoints/net.pkl --saving-folder ./checkpoints/ "${cuda[@]}"
  classify compress_cifar $?
}

case_compress_bert() {  # compression/bert bash_script/quant_weight.sh's command (run_glue_no_trainer.py)
  copy_example compression/bert compress_bert || { result compress_bert FAIL "imports"; return; }
  hub_models bert-base-uncased
  HF_HUB_CACHE=$hub DSX_HUB_DATASETS=1 launch_n "$NPROC" compress_bert "$work/compress_bert" "$site$legacy" \
    run_glue_no_trainer.py --seed 42 --distill_method one_stage --model_name_or_path bert-base-uncased \
    --task_name mnli --max_length 128 --pad_to_max_length --per_device_train_batch_size 32 \
    --per_device_eval_batch_size 64 --learning_rate 2e-5 --num_train_epochs 1 --num_warmup_epochs 1 --eval_step 1000 \
    --deepspeed_config config/ds_config_W1A8_Qgroup64_fp32.json --deepspeed --save_best_model \
    --clean_best_model --gradient_accumulation_steps 1 --output_dir out
  classify compress_bert $?
}

case_compress_gpt2() {  # compression/gpt2 bash_script/run_zero_quant.sh (gpt2-large stand-in)
  copy_example compression/gpt2 compress_gpt2 || { result compress_gpt2 FAIL "imports"; return; }
  hub_models gpt2-large
  HF_HUB_CACHE=$hub DSX_HUB_DATASETS=1 DSX_TRANSFORMERS4=1 launch_n "$NPROC" compress_gpt2 "$work/compress_gpt2" "$site" \
    run_clm_no_trainer.py --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 \
    --model_name_or_path gpt2-large --per_device_train_batch_size 4 --num_train_epochs 0 \
    --deepspeed_config config/ds_config_W8A8_Qgroup64_fp32.json --deepspeed --output_dir ./output/W8A8
  classify compress_gpt2 $?
}

case_de_gpt() {  # data_efficiency/gpt_finetuning run_base_random_ltd.sh (ptb_text_only: not a stand-in here)
  copy_example training/data_efficiency/gpt_finetuning de_gpt || { result de_gpt FAIL "imports"; return; }
  hub_models gpt2
  HF_HUB_CACHE=$hub DSX_HUB_DATASETS=1 DSX_TRANSFORMERS4=1 launch_n "$NPROC" de_gpt "$work/de_gpt" "$site" run_clm_no_trainer.py \
    --random_ltd --dataset_name ptb_text_only --dataset_config_name penn_treebank --model_name_or_path gpt2 \
    --per_device_train_batch_size 2 --per_device_eval_batch_size 4 --num_train_epochs 2 \
    --deepspeed_config config/ds_config_gpt_base_random_ltd.json --deepspeed --seed 1234 --num_warmup_steps 100 \
    --output_dir ./output/check_base
  classify de_gpt $?
}

case_de_vit_cifar() {  # data_efficiency/vit_finetuning run_cifar_random_ltd.sh, 1 epoch
  copy_example training/data_efficiency/vit_finetuning de_vit_cifar || { result de_vit_cifar FAIL "imports"; return; }
  mkdir -p "$work/de_vit_cifar/out/cifar"  # as its run script does first
  DSX_TIMM_SEEDED=1 DSX_CIFAR=256 DSX_CIFAR_TEST=64 launch_n "$NPROC" de_vit_cifar "$work/de_vit_cifar" "$site$legacy" main_cifar.py \
    --deepspeed_config config/ds_config_cifar_random_ltd.json --deepspeed --random_ltd --dataset cifar10vit224 \
    --seed 1234 --printfreq 400 --arch vits16r224 --optimizer sgd --lr 0.0001 --seq_len 197 --scheduler constant \
    --epochs 1 --batchsize 128 --data_outdir out/cifar/
  classify de_vit_cifar $?
}

case_de_vit_imagenet() {  # data_efficiency/vit_finetuning run_imagenet_random_ltd.sh, with the --dummy data its notes offer
  copy_example training/data_efficiency/vit_finetuning de_vit_imagenet || { result de_vit_imagenet FAIL "imports"; return; }
  mkdir -p "$work/de_vit_imagenet/out/imagenet"
  DSX_TIMM_SEEDED=1 DSX_FAKEDATA_SIZE=256 launch_n "$NPROC" de_vit_imagenet "$work/de_vit_imagenet" "$site$legacy" main_imagenet.py data --dummy \
    --seed 2345 --deepspeed_config config/ds_config_imagenet_random_ltd.json --deepspeed --random_ltd -a vits16r224 \
    --img_size 224 --print-freq 100 --batch-size 256 --lr 5e-05 --scheduler constant --epochs 1 --out_dir out/imagenet
  classify de_vit_imagenet $?
}

case_visualchat() {  # DeepSpeed-VisualChat training/training_scripts/run_7b.sh's arguments, 1 epoch, its first data set
  # Stand-ins (made with the transformers 4.36 it runs on): a tiny Llama for meta-llama/Llama-2-7b, a tiny CLIP
  # vision tower for openai/clip-vit-large-patch14, seeded images and conversations in the llava layout. On the CPU
  # the script stops at its own torch.cuda.set_device. On a GPU it trains an epoch, saves, and is run again for a
  # second epoch, which resumes from its checkpoint (out/latest). Two of its four param groups are empty for a
  # Llama: DeepSpeed 0.14.5 drops them and its first step stops in torch's LambdaLR (AS-DEEPSPEED); uckpt drops
  # them too and gives the scheduler the kept groups' entries (on uckpt that error is a FAIL). The loss of the
  # evaluation before training compares.
  [ -n "${DSX_LEGACY_SITE:-}" ] || { result visualchat FAIL "needs DSX_LEGACY_SITE (transformers 4.36)"; return; }
  copy_example applications/DeepSpeed-VisualChat visualchat || { result visualchat FAIL "imports"; return; }
  mkdir -p "$work/visualchat/training/out"
  local m todo=()
  for m in meta-llama/Llama-2-7b openai/clip-vit-large-patch14; do made "$m" || todo+=("$m"); done
  [ ${#todo[@]} = 0 ] || PYTHONPATH=$DSX_LEGACY_SITE${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 \
    $PY "$here/bench/ds_examples/make_hub_models.py" "$hub" "${todo[@]}" > "$work/hub-visualchat.log" 2>&1 ||
    { result visualchat FAIL "stand-ins: $(reason "$work/hub-visualchat.log")"; return; }
  $PY "$here/bench/ds_examples/make_visualchat_data.py" "$work/visualchat/training/data" > "$work/data-visualchat.log" 2>&1 ||
    { result visualchat FAIL "stand-in data: $(reason "$work/data-visualchat.log")"; return; }
  local epochs rc=0 eval_loss
  for epochs in 1 2; do
    HF_HUB_CACHE=$hub HF_HUB_OFFLINE=1 launch_n "$NPROC" visualchat "$work/visualchat/training" \
      "$site$legacy:$work/visualchat:$work/alias" main.py \
      --max_seq_len 4096 --data_path ./data --dataset_names llava --dataset_samples all \
      --dataset_concatenate_samples 3 --max_num_image_per_sample 8 --lm_model_name_or_path meta-llama/Llama-2-7b \
      --vision_model_name_or_path openai/clip-vit-large-patch14 --gradient_checkpointing --vis_proj baseline \
      --gradient_accumulation_steps 1 --zero_stage 3 --learning_rate 1e-3 --num_warmup_steps 0.1 \
      --per_device_train_batch_size 1 --per_device_eval_batch_size 2 --deepspeed --output_dir out \
      --num_train_epochs $epochs --enable_mmca_attention --enable_tensorboard
    rc=$?
    [ $epochs = 1 ] && eval_loss=$(grep -m1 -o 'the eval average_loss: [0-9.e+-]*' "$work/visualchat.log" | cut -d' ' -f4)
    [ $rc = 0 ] || break
    if [ $epochs = 1 ]; then
      mv "$work/visualchat.log" "$work/visualchat.train.log"
      [ -f "$work/visualchat/training/out/latest" ] || { result visualchat FAIL "epoch 1 left no out/latest"; return; }
    elif grep -q -e "Before training" -e "Epoch 1," "$work/visualchat.log"; then
      result visualchat FAIL "the second run did not resume from out/latest (it started at epoch 1)"; return
    fi
  done
  if [ "$IMPL" = deepspeed ] && [ $rc != 0 ] && [ -n "$eval_loss" ] &&
      grep -q "zip() argument 2 is longer than argument 1" "$work/visualchat.log"; then
    result visualchat AS-DEEPSPEED "exit $rc: evaluated before training ($eval_loss); its first step stops in torch's LambdaLR (two empty param groups dropped), as on DeepSpeed 0.14.5"
  else
    classify visualchat $rc "evaluated before training ($eval_loss), $(grep -m1 -o 'Epoch 1, the average_loss: [0-9.e+-]*' \
      "$work/visualchat.train.log" 2>/dev/null); resumed from its checkpoint: $(grep -m1 -o 'Epoch 2, the average_loss: [0-9.e+-]*' "$work/visualchat.log")"
  fi
}

case_visualchat_api() {  # VisualChat's DeepSpeed calls, directly (bench/ds_examples/visualchat_api.py), tiny Llama
  # First with its four param groups as main.py builds them (two are empty for a Llama), then without the empty ones:
  # NPROC ranks for 8 steps and a save, then a resume at NPROC (DeepSpeed 0.14.5 resumes ZeRO-3 at its own size
  # only) for 4 more. PASS: both ran; the first run's end is in the reason.
  [ -n "${DSX_LEGACY_SITE:-}" ] || { result visualchat_api FAIL "needs DSX_LEGACY_SITE (transformers 4's AdamW)"; return; }
  local vc=$dse/applications/DeepSpeed-VisualChat py=$here/bench/ds_examples/visualchat_api.py out=$work/visualchat_api
  # its utils/utils.py imports deepspeed itself: under IMPL=uckpt the alias answers it (no real DeepSpeed reached)
  local path=$DSX_LEGACY_SITE:$work/alias
  local prec=(--precision fp16)  # its default; DeepSpeed's CPU accelerator refuses fp16: bf16 there
  $cpu && prec=(--precision bf16)
  rm -rf "$out"; mkdir -p "$out"
  IMPL=$IMPL launch_n "$NPROC" visualchat_api "$out" "$path" "$py" --visualchat "$vc" --out "$out/as_shipped" "${prec[@]}"
  local shipped="as shipped: exit $? ($(grep -m1 -oE "zip\(\) argument 2 is longer than argument 1|^saved" "$work/visualchat_api.log"))"
  mv "$work/visualchat_api.log" "$work/visualchat_api.shipped.log"
  IMPL=$IMPL launch_n "$NPROC" visualchat_api "$out" "$path" "$py" --visualchat "$vc" --out "$out/ckpt" --nonempty_groups \
    "${prec[@]}" || { classify visualchat_api $?; return; }
  mv "$work/visualchat_api.log" "$work/visualchat_api.train.log"
  IMPL=$IMPL launch_n "$NPROC" visualchat_api "$out" "$path" "$py" --visualchat "$vc" --out "$out/ckpt" --nonempty_groups \
    --resume --steps 4 "${prec[@]}"
  classify visualchat_api $? "$shipped; $(grep -m1 '^step 7 ' "$work/visualchat_api.train.log"), resumed: $(grep -m1 '^step 8 ' "$work/visualchat_api.log")"
}

chat_step() {  # chat_step CASE DIR ARGS...: a DeepSpeed-Chat main.py with the tiny OPT and local/jsonfile data
  local name=$1 dir=$2; shift 2; chat_rc=1
  if [ ! -d "$work/chat/tiny-opt" ]; then
    make_chat_inputs > "$work/chat-inputs.log" 2>&1 || { result "$name" FAIL "making the tiny OPT: $(reason "$work/chat-inputs.log")"; return 1; }
  fi
  rm -rf "$work/$name"; mkdir -p "$work/$name"
  cp "$dse/applications/DeepSpeed-Chat/training/$dir/main.py" "$work/$name/"
  ln -s "$work/chat/dschat" "$work/$name/dschat"; ln -s "$work/chat/data" "$work/$name/data"
  uckpt_imports "$work/$name/main.py" > /dev/null || { result "$name" FAIL imports; return 1; }
  chat_rc=0
  local extra=$work/$name:$work/alias; [ -d "$work/shim-chat" ] && extra+=:$work/shim-chat
  local dtype=(); $cpu && dtype=(--dtype bf16)
  DSX_TRANSFORMERS4=1 launch_n "$NPROC" "$name" "$work/$name" "$site:$extra" main.py --data_path local/jsonfile --data_split 2,4,4 \
    --data_output_path "$work/$name/data_files" --output_dir "$work/$name/out" "${dtype[@]}" "$@"
  chat_rc=$?
}
case_chat_rm() {  # step 2, reward model (single_gpu/run_350m.sh's arguments, tiny OPT)
  chat_step chat_rm step2_reward_model_finetuning --model_name_or_path "$work/chat/tiny-opt" \
    --num_padding_at_beginning 1 --weight_decay 0.1 --dropout 0.0 --gradient_accumulation_steps 4 --zero_stage 0 \
    --per_device_train_batch_size 4 --per_device_eval_batch_size 4 --num_train_epochs 1 --deepspeed \
    --max_seq_len 64 --enable_tensorboard --tensorboard_path "$work/chat_rm/out" || return
  classify chat_rm $chat_rc "$(grep -m2 -E 'chosen_last_scores|acc' "$work/chat_rm.log" | tr '\n' ' ' | cut -c1-120)"
}
case_chat_dpo() {  # step 2, DPO (single_gpu/run_350m.sh's arguments, tiny OPT as model and reference)
  chat_step chat_dpo step2_dpo_finetuning --model_name_or_path "$work/chat/tiny-opt" --weight_decay 0.1 \
    --dropout 0.0 --gradient_accumulation_steps 4 --zero_stage 0 --per_device_train_batch_size 4 \
    --per_device_eval_batch_size 4 --num_train_epochs 1 --max_seq_len 64 --enable_tensorboard --tensorboard_path "$work/chat_dpo/out" \
    --deepspeed || return
  classify chat_dpo $chat_rc
}
case_chat_rlhf() {  # step 3 (single_gpu/run_1.3b.sh's arguments: hybrid engine, LoRA 128; tiny OPT as both)
  chat_step chat_rlhf step3_rlhf_finetuning --actor_model_name_or_path "$work/chat/tiny-opt" \
    --critic_model_name_or_path "$work/chat/tiny-opt" --actor_zero_stage 0 --critic_zero_stage 0 \
    --num_padding_at_beginning 1 --gradient_accumulation_steps 2 --deepspeed --actor_lora_dim 128 \
    --enable_hybrid_engine --actor_gradient_checkpointing --actor_dropout 0.0 --per_device_generation_batch_size 4 \
    --per_device_training_batch_size 4 --max_answer_seq_len 32 --max_prompt_seq_len 32 || return
  classify chat_rlhf $chat_rc
}

# The BERT scripts of bing_bert and BingBertGlue, with their run scripts' arguments (bing_bert's pre-training data
# folder is left empty: no stand-in; on the CPU it stops before reading it). BingBertSquad: case_squad.
# Stand-ins: the S3 vocabulary served offline (DSX_S3_BERT: make_squad_inputs.py's vocabulary, under each BERT's
# name), data/RTE in GLUE RTE's format (make_bert_inputs.py), data/model.pt an empty checkpoint (the model keeps its
# seeded initialisation). DSX_LEGACY_SITE brings scipy and scikit-learn (the GLUE metrics).
bert_case() {  # bert_case CASE SUBDIR SCRIPT ARGS...
  local name=$1 sub=$2; shift 2
  copy_example "training/$sub" "$name" || { result "$name" FAIL "imports"; return; }
  mkdir -p "$work/$name/data" "$work/$name/out"
  { $PY "$here/bench/ds_examples/make_squad_inputs.py" "$work/$name/s3" "$work/$name/squad" 4 4 &&
    cp "$work/$name/s3/bert-large-uncased-vocab.txt" "$work/$name/s3/bert-base-uncased-vocab.txt" &&
    cp "$work/$name/squad/model.pt" "$work/$name/data/model.pt" &&
    $PY "$here/bench/ds_examples/make_bert_inputs.py" "$work/$name/data/RTE" 64 16; } > "$work/$name-inputs.log" 2>&1 ||
    { result "$name" FAIL "stand-ins: $(reason "$work/$name-inputs.log")"; return; }
  DSX_S3_BERT=$work/$name/s3 PYTORCH_PRETRAINED_BERT_CACHE=$work/$name/cache \
    launch_n "$NPROC" "$name" "$work/$name" "$site$legacy${DSX_S3_SITE:+:$DSX_S3_SITE}" "$@"
  local rc=$?
  if [ $rc != 0 ] && grep -q "argument --deepscale: conflicting option string" "$work/$name.log"; then
    result "$name" AS-DEEPSPEED "exit $rc: its own --deepscale option collides with add_config_arguments' (argparse), as on DeepSpeed 0.14.5"
  elif [ $rc != 0 ] && grep -q "Failed to resolve\|NameResolutionError\|Max retries exceeded" "$work/$name.log"; then
    result "$name" FAIL "exit $rc: stops at a download (no stand-in yet): $(grep -m1 -o "url: [^ ]*" "$work/$name.log")"
  else classify "$name" $rc; fi
}
case_bing_bert() {  # bing_bert ds_train_bert_bsz64k_seq128.sh
  bert_case bing_bert bing_bert deepspeed_train.py --cf bert_large_lamb.json --max_seq_length 128 \
    --output_dir out --deepspeed --deepspeed_transformer_kernel --print_steps 100 --lr_schedule EE --lr_offset 10e-4 \
    --job_name lamb_64k_seq128 --deepspeed_config deepspeed_bsz64k_lamb_config_seq128.json --data_path_prefix data
}
case_bing_bert_glue() {  # bing_bert run_glue_bert_base_finetune.sh (RTE; its model file: none here)
  # It adds its own --deepscale option and then calls add_config_arguments, which adds DeepSpeed's --deepscale:
  # argparse refuses the second, on DeepSpeed 0.14.5 as on uckpt (seen with IMPL=deepspeed): AS-DEEPSPEED.
  bert_case bing_bert_glue bing_bert run_glue_classifier_bert_base.py --task_name RTE --do_train --do_eval \
    --deepspeed --deepspeed_config glue_bert_base.json --do_lower_case --data_dir data/RTE/ \
    --bert_model bert-large-uncased --max_seq_length 128 --train_batch_size 2 --gradient_accumulation_steps 1 \
    --learning_rate 2e-5 --num_train_epochs 3 --output_dir out --progressive_layer_drop --model_file data/model.pt
}
case_bingbertglue() {  # BingBertGlue run_glue_bert_base_finetune.sh (RTE; its checkpoint: none here)
  bert_case bingbertglue BingBertGlue run_glue_classifier_bert_base.py --task_name RTE --do_train --do_eval \
    --deepspeed --preln --deepspeed_config glue_bert_base.json --do_lower_case --data_dir data/RTE/ \
    --bert_model bert-base-uncased --max_seq_length 128 --train_batch_size 2 --gradient_accumulation_steps 1 \
    --learning_rate 2e-5 --num_train_epochs 3 --output_dir out --model_file data/model.pt
}
case_squad() {  # BingBertSquad run_squad_deepspeed.sh 1 MODEL SQUAD_DIR OUT (1 GPU: batch 24 = 3 x 8 accumulated)
  # Stand-ins (make_squad_inputs.py): its S3 vocabulary served offline (DSX_S3_BERT), SQuAD-format data of
  # SQUAD_QUESTIONS training questions (240: 10 steps an epoch at 1 GPU), an empty --model_file checkpoint.
  # Its file_utils imports boto3 (and botocore) at the start: DSX_S3_SITE, a folder holding them, joins its path.
  copy_example training/BingBertSquad squad || { result squad FAIL "imports"; return; }
  $PY "$here/bench/ds_examples/make_squad_inputs.py" "$work/squad/s3" "$work/squad/data" "${SQUAD_QUESTIONS:-240}" 24 \
    > "$work/squad-inputs.log" 2>&1 || { result squad FAIL "stand-ins: $(reason "$work/squad-inputs.log")"; return; }
  local ngpu=$NPROC per_gpu accum
  per_gpu=$((24 / ngpu)); accum=1; [ $per_gpu -ge 3 ] && accum=$((per_gpu / 3))  # as run_squad_deepspeed.sh
  DSX_S3_BERT=$work/squad/s3 PYTORCH_PRETRAINED_BERT_CACHE=$work/squad/cache \
    launch_n "$NPROC" squad "$work/squad" "$site${DSX_S3_SITE:+:$DSX_S3_SITE}" \
    nvidia_run_squad_deepspeed.py --bert_model bert-large-uncased --do_train \
    --do_lower_case --predict_batch_size 3 --do_predict --train_file data/train-v1.1.json \
    --predict_file data/dev-v1.1.json --train_batch_size $per_gpu --learning_rate 3e-5 --num_train_epochs 2.0 \
    --max_seq_length 384 --doc_stride 128 --output_dir out --job_name deepspeed_${ngpu}GPUs_24batch_size \
    --gradient_accumulation_steps $accum --fp16 --deepspeed --deepspeed_config deepspeed_bsz24_config.json \
    --dropout 0.1 --model_file data/model.pt --seed 12345 --preln
  classify squad $? "$(grep -o 'bert_squad_progress: .*' "$work/squad.log" | tail -1)"
}

case_autotuning() {  # autotuning/hf: `deepspeed --autotuning run ... run_glue.py --deepspeed ds_config_tune.json`
  # Neither its launcher (uckpt has `uckpt launch`, not DeepSpeed's) nor Hugging Face's examples run_glue.py is
  # here: what is run is uckpt.initialize with its config, as run_glue.py's Trainer would call it.
  copy_example training/autotuning autotuning || { result autotuning FAIL "imports"; return; }
  (cd "$work/autotuning/hf/bert-base" && PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" RANK=0 WORLD_SIZE=1 \
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + RANDOM % 10000)) timeout "$TIMEOUT_S" $PY -c '
import json, torch, uckpt
config = json.load(open("ds_config_tune.json"))
config["train_micro_batch_size_per_gpu"] = 64  # "auto": the Trainer fills it from --per_device_train_batch_size
model = torch.nn.Linear(4, 2)
uckpt.initialize(model=model, model_parameters=model.parameters(), config=config)') > "$work/autotuning.log" 2>&1
  classify autotuning $?
}

case_stable_diffusion() {  # stable_diffusion mytrainbash.sh: `accelerate launch train_sd_distil_lora.py ...`
  copy_example training/stable_diffusion stable_diffusion || { result stable_diffusion FAIL "imports"; return; }
  if grep -q deepspeed "$work/stable_diffusion/train_sd_distil_lora.py"; then
    result stable_diffusion FAIL "train_sd_distil_lora.py uses DeepSpeed: this case does not run it yet"
  else
    result stable_diffusion N/A "train_sd_distil_lora.py does not use DeepSpeed (accelerate without a DeepSpeed plugin); only inf_txt2img_loop.py (inference, init_inference) imports it"
  fi
}
