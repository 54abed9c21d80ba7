"""The universal-checkpoint demo's train.py, on uckpt and on the CPU: the same
flags, the same DeepSpeed calls, with `import uckpt as deepspeed`, a torch-only
GPT-2 instead of transformers' and a metrics.csv instead of TensorBoard.

Differences from the demo's script, each deliberate:
  * each step trains on its own global batch (seeded by the step), and each
    micro-step on its micro-batch (the demo feeds the whole local batch to every
    micro-step and repeats one batch, so accumulation and resumes could not be
    told apart);
  * step i reads batch i of --steps (the demo reads one batch past its data on
    the last step);
  * a resume from global_stepN starts at step N+1;
  * the loss is averaged with all_reduce(SUM) / world size (Gloo has no AVG).

  uckpt launch -n 4 -- python3 examples/python/train.py --checkpoint_dir ckpt --steps 20 --checkpoint_interval 10
"""
import argparse
import json
import os
import re
import sys

import torch
import torch.distributed

import uckpt as deepspeed
from uckpt.ops.adam import DeepSpeedCPUAdam

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt2 import TinyGPT2  # noqa: E402

torch.random.manual_seed(42)

parser = argparse.ArgumentParser()
parser.add_argument("--resume", action="store_true")
parser.add_argument("--checkpoint_dir", type=str)
parser.add_argument("--checkpoint_tag", type=str)
parser.add_argument("--universal_checkpoint", action="store_true", help="If True, load the universal checkpoint")
parser.add_argument("--no_load_optimizer_states", action="store_true")
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--train_micro_batch_size_per_gpu", type=int, default=8)
parser.add_argument("--train_batch_size", type=int, default=32, help="global batch size")
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--checkpoint_interval", type=int, default=100)
parser.add_argument("--run_name", type=str, default="default")
parser.add_argument("--log_dir", type=str, default="logs")
parser.add_argument("--deepspeed_config", type=str, default="deepspeed_config.json")
parser.add_argument("--seq_len", type=int, default=64)
parser.add_argument("--lr", type=float, default=2e-3)
args = parser.parse_args()

VOCAB = 256


def global_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (args.train_batch_size, args.seq_len), generator=g)


model = TinyGPT2(vocab_size=VOCAB, n_positions=args.seq_len)

local_rank = int(os.getenv("LOCAL_RANK", -1))
assert local_rank != -1, "LOCAL_RANK environment variable must be set"

with open(args.deepspeed_config) as f:
    ds_config = json.load(f)
ds_config["train_micro_batch_size_per_gpu"] = args.train_micro_batch_size_per_gpu
ds_config["train_batch_size"] = args.train_batch_size
ds_config.setdefault("checkpoint", {})["load_universal"] = args.universal_checkpoint
world_size = int(os.getenv("WORLD_SIZE", 1))
ds_config["gradient_accumulation_steps"] = args.train_batch_size // (args.train_micro_batch_size_per_gpu * world_size)
ga = ds_config["gradient_accumulation_steps"]

optimizer = DeepSpeedCPUAdam(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
model_engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                     model_parameters=model.parameters(), config=ds_config)

start_step = 1
if args.resume:
    assert model_engine.load_universal_checkpoint() == args.universal_checkpoint
    path, _ = model_engine.load_checkpoint(args.checkpoint_dir, tag=args.checkpoint_tag,
                                           load_optimizer_states=not args.no_load_optimizer_states)
    assert path is not None, f"no checkpoint in {args.checkpoint_dir}"
    match = re.match(r"global_step(\d+)(?:_universal)?", os.path.basename(os.path.normpath(path)))
    if match:
        start_step = int(match.group(1)) + 1
    print(f"Resuming from step {start_step}")

assert torch.distributed.is_initialized(), "torch.distributed must be initialized"
global_rank = torch.distributed.get_rank()
metrics = None
if global_rank == 0:
    run_dir = os.path.join(args.log_dir, args.run_name)
    os.makedirs(run_dir, exist_ok=True)
    metrics = open(os.path.join(run_dir, "metrics.csv"), "w")
    metrics.write("step,loss\n")
torch.distributed.barrier()

mb = args.train_micro_batch_size_per_gpu
for i in range(start_step, args.steps + 1):
    batch = global_batch(i)
    losses = []
    for j in range(ga):
        rows = slice(j * world_size * mb + global_rank * mb, j * world_size * mb + (global_rank + 1) * mb)
        micro = batch[rows]
        loss = model_engine(micro, labels=micro).loss
        losses.append(loss.item())
        model_engine.backward(loss)
        model_engine.step()
    mean = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
    torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.SUM)
    if global_rank == 0:
        metrics.write(f"{i},{mean.item() / world_size:.17g}\n")
        metrics.flush()
    if i % args.checkpoint_interval == 0:
        model_engine.save_checkpoint(save_dir=args.checkpoint_dir, tag=f"global_step{i}")
    torch.distributed.barrier()

if global_rank == 0:
    metrics.close()
