"""The demo's training (scripts/demo.sh) through the Python API, with data
that resumes at any world size: a tiny GPT-2 on the bytes of Debian's license
texts, the demo's config (AdamW, WarmupLR, gradient clipping, ZeRO-3 with
parameters and optimizer offloaded to CPU), `import uckpt as deepspeed`.

Where the batches come from (--data):
  sampler     uckpt.data.ResumableSampler with the script's own DataLoader
              (opt-in: the loader starts at the engine's data position);
  initialize  the loader initialize(training_data=...) returns; it resumes
              when the config opts in ("uckpt": {"resumable_data": {...}},
              --resumable_data), else it is DeepSpeed's (no position kept).
--skip_batches: after a load the script skips the micro-batches of the steps
it has done itself, as DeepSpeed scripts that resume do (only right at the
same world size and without the opt-in: opted in, it would skip twice).

Rank 0 writes LOG_DIR/RUN_NAME/metrics.csv: step, the mean loss over the
step's micro-batches and ranks, and the indices of the step's samples.

  uckpt launch -n 4 -- python3 examples/python/resumable_data.py --deepspeed_config ds_config.json \
      --checkpoint_dir ckpt --steps 8 --checkpoint_interval 4
  uckpt launch -n 2 -- python3 examples/python/resumable_data.py --deepspeed_config ds_config.json \
      --checkpoint_dir ckpt --steps 8 --resume --checkpoint_tag global_step4
"""
import argparse
import json
import os
import re
import sys

import torch
import torch.distributed

import uckpt as deepspeed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt2 import TinyGPT2  # noqa: E402

# The demo's data (scripts/demo.sh): these texts, concatenated, as bytes.
LICENSES = ["Apache-2.0", "Artistic", "BSD", "GFDL-1.3", "GPL-2", "GPL-3", "LGPL-2.1", "LGPL-3", "MPL-1.1", "MPL-2.0"]

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config", type=str, required=True)
parser.add_argument("--data", choices=["sampler", "initialize"], default="sampler")
parser.add_argument("--resumable_data", action="store_true",
                    help="with --data initialize: add the config's uckpt.resumable_data section")
parser.add_argument("--skip_batches", action="store_true", help="after a load, skip the done steps' batches")
parser.add_argument("--seed", type=int, default=0, help="the resumable data order's seed")
parser.add_argument("--max_samples", type=int, default=0, help="use only this many sequences (0: all)")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--checkpoint_dir", type=str, default="ckpt")
parser.add_argument("--checkpoint_tag", type=str)
parser.add_argument("--universal_checkpoint", action="store_true")
parser.add_argument("--checkpoint_interval", type=int, default=1000)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--train_batch_size", type=int, default=16)
parser.add_argument("--train_micro_batch_size_per_gpu", type=int, default=4)
parser.add_argument("--seq_len", type=int, default=32)
parser.add_argument("--n_layer", type=int, default=2)
parser.add_argument("--n_embd", type=int, default=32)
parser.add_argument("--n_head", type=int, default=4)
parser.add_argument("--log_dir", type=str, default="logs")
parser.add_argument("--run_name", type=str, default="default")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()


def license_bytes(seq_len, max_samples):
    """(index, sequence) pairs: the texts cut into rows of seq_len bytes."""
    data = b"".join(open(os.path.join("/usr/share/common-licenses", n), "rb").read() for n in LICENSES)
    rows = len(data) // seq_len
    if max_samples:
        rows = min(rows, max_samples)
    tokens = torch.frombuffer(bytearray(data[:rows * seq_len]), dtype=torch.uint8).long().view(rows, seq_len)
    return torch.utils.data.TensorDataset(torch.arange(rows), tokens)


with open(args.deepspeed_config) as f:
    ds_config = json.load(f)
ds_config["train_batch_size"] = args.train_batch_size
ds_config["train_micro_batch_size_per_gpu"] = args.train_micro_batch_size_per_gpu
ds_config.setdefault("checkpoint", {})["load_universal"] = args.universal_checkpoint
if args.resumable_data:
    ds_config["uckpt"] = {"resumable_data": {"seed": args.seed}}

torch.manual_seed(42)
model = TinyGPT2(vocab_size=256, n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.n_layer,
                 n_head=args.n_head)
dataset = license_bytes(args.seq_len, args.max_samples)
engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                            training_data=dataset if args.data == "initialize" else None)
if args.data == "sampler":
    sampler = deepspeed.data.ResumableSampler(dataset, engine, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler)

start_step = 1
if args.resume:
    path, _ = engine.load_checkpoint(args.checkpoint_dir, tag=args.checkpoint_tag)
    assert path is not None, f"no checkpoint in {args.checkpoint_dir}"
    match = re.match(r"global_step(\d+)(?:_universal)?", os.path.basename(os.path.normpath(path)))
    start_step = int(match.group(1)) + 1
    print(f"resuming from step {start_step}: data position {engine.global_samples} samples")

ga = engine.gradient_accumulation_steps()
rank, world = engine.global_rank, engine.world_size
batches = iter(loader)  # after the load: a resumable loader starts at the engine's data position
if args.resume and args.skip_batches:
    for _ in range((start_step - 1) * ga):
        next(batches)


def next_batch():
    global batches
    try:
        return next(batches)
    except StopIteration:  # the epoch ended: a new iterator (a resumable one continues from the position)
        batches = iter(loader)
        return next(batches)


metrics = None
if rank == 0:
    run_dir = os.path.join(args.log_dir, args.run_name)
    os.makedirs(run_dir, exist_ok=True)
    metrics = open(os.path.join(run_dir, "metrics.csv"), "w")
    metrics.write("step,loss,samples\n")

for step in range(start_step, args.steps + 1):
    losses, seen = [], []
    for _ in range(ga):
        index, ids = next_batch()
        loss = engine(ids, labels=ids).loss
        losses.append(loss.item())
        seen += index.tolist()
        engine.backward(loss)
        engine.step()
    mean = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
    torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.SUM)
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, seen)
    if rank == 0:
        samples = " ".join(str(i) for i in sorted(i for part in everyone for i in part))
        metrics.write(f"{step},{mean.item() / world:.17g},{samples}\n")
        metrics.flush()
    if step % args.checkpoint_interval == 0:
        engine.save_checkpoint(args.checkpoint_dir, tag=f"global_step{step}")

if rank == 0:
    metrics.close()
