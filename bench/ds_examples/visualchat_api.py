"""DeepSpeed-VisualChat's calls into DeepSpeed, run directly on a tiny Llama on the CPU (its script needs CUDA and
Llama-2-7b / CLIP / image data sets that have no stand-ins here): its own get_train_ds_config (ZeRO-3, --precision)
and get_optimizer_grouped_parameters (four groups, as its main.py builds them), transformers 4's AdamW with its
betas, get_scheduler, deepspeed.initialize(model, optimizer, args, config, lr_scheduler, dist_init_required),
engine.gradient_checkpointing_enable(), engine.backward / step, engine.tput_timer.update_epoch_count(), and
save_checkpoint / load_checkpoint with its client_state (random's, numpy's and torch's RNG states, epoch,
best_loss; not its torch.cuda RNG state: the CPU has none), restored as its main.py restores them. Each batch goes to
the engine's device, as its main.py moves its batches. Prints "step N loss X lr Y" for each step.

usage (under a launcher): visualchat_api.py --visualchat DIR --out CKPT_DIR [--resume] [--steps N]
       [--precision bf16|fp16] [--nonempty_groups] [--deepspeed]     env: IMPL=uckpt|deepspeed
  --nonempty_groups drops its empty param groups (as DeepSpeed-Chat does): with a client scheduler, torch's
  LambdaLR cannot step once ZeRO has dropped them (on DeepSpeed 0.14.5 as on uckpt)."""
import argparse
import os
import random
import sys

import numpy as np
import torch

if os.environ.get("IMPL", "uckpt") == "uckpt":
    import uckpt as deepspeed
else:
    import deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--visualchat", required=True, help="DeepSpeedExamples' applications/DeepSpeed-VisualChat")
parser.add_argument("--out", required=True)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--precision", default="bf16")
parser.add_argument("--nonempty_groups", action="store_true")
parser.add_argument("--zero_stage", type=int, default=3)  # its run scripts' ZERO_STAGE
parser.add_argument("--gradient_accumulation_steps", type=int, default=1)  # its option (1 in its run scripts)
parser.add_argument("--enable_tensorboard", action="store_true")
parser.add_argument("--output_dir", default=".")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
sys.path.insert(0, args.visualchat)
from transformers import AdamW, LlamaConfig, LlamaForCausalLM, get_scheduler  # noqa: E402 (transformers 4)
from utils.ds_utils import get_train_ds_config  # noqa: E402 (VisualChat's own)
from utils.utils import get_optimizer_grouped_parameters  # noqa: E402

deepspeed.init_distributed()
world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
ds_config = get_train_ds_config(args, offload=False, stage=args.zero_stage)
ds_config["train_micro_batch_size_per_gpu"] = 2  # as its main.py sets them, from --per_device_train_batch_size 2
ds_config["train_batch_size"] = 2 * world * args.gradient_accumulation_steps
torch.manual_seed(0)
random.seed(0)
np.random.seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64))
groups = get_optimizer_grouped_parameters(model, 0.01, small_lr=1e-4)
print("param group sizes", [len(g["params"]) for g in groups], flush=True)
if args.nonempty_groups:
    groups = [g for g in groups if g["params"]]
optimizer = AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
scheduler = get_scheduler(name="cosine", optimizer=optimizer, num_warmup_steps=2, num_training_steps=40)
engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args, config=ds_config,
                                                       lr_scheduler=scheduler, dist_init_required=True)
start = 0
if args.resume:
    _, client_state = engine.load_checkpoint(args.out)
    start = client_state["epoch"]
    random.setstate(client_state["random_rng_state"])
    np.random.set_state(client_state["np_rng_state"])
    torch.set_rng_state(client_state["torch_rng_state"])
    print(f"resumed at step {start}, best_loss {client_state['best_loss']}", flush=True)
engine.gradient_checkpointing_enable()
data = torch.Generator().manual_seed(1234 + start)
for step in range(start, start + args.steps):
    ids = torch.randint(0, 128, (world, 2, 16), generator=data)[rank]
    ids = (ids + int(np.random.randint(0, 3)) + random.randint(0, 2)) % 128  # the restored RNG states count
    ids = ids.to(engine.device)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    print(f"step {step} loss {loss.item():.6f} lr {scheduler.get_last_lr()[0]:.6g}", flush=True)
engine.tput_timer.update_epoch_count()
engine.save_checkpoint(args.out, client_state={
    "random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
    "torch_rng_state": torch.get_rng_state(), "epoch": start + args.steps, "best_loss": 1.5})
print("saved", flush=True)
