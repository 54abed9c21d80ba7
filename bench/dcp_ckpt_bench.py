"""PyTorch DCP's checkpoint I/O on GPT-2 124M, for bench/ckpt-io-gpu.sh.

Under torchrun with several processes (one per GPU) the model is sharded with
FSDP2 (fully_shard per block and at the root) and DCP saves each rank's shards
of the model and AdamW state (torch.distributed.checkpoint.state_dict); times
are rank 0's, between barriers. One process, one GPU: the model (fp32 master weights on the GPU, as uckpt's
bf16 ZeRO-2 keeps them) and AdamW state after one step, saved with
torch.distributed.checkpoint.save (then os.sync, so it ends durable like
uckpt's save), async_save (the time the call blocks, and until its future is
done + os.sync), and loaded back with dcp.load. Prints one JSON line.
usage: dcp_ckpt_bench.py WORK_DIR [RUNS]
"""
import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_torch import GPT2, gpt2_init_  # noqa: E402

work = sys.argv[1]
runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
os.makedirs(work, exist_ok=True)
world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("cuda:nccl,cpu:gloo")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
else:  # async_save needs a process group (a 1-rank gloo one)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1)
rank = dist.get_rank()

torch.manual_seed(0)
model = GPT2(12, 12, 768, 50257, 1024, fused=True).cuda()
gpt2_init_(model, 12)
if world > 1:
    from torch.distributed.fsdp import fully_shard
    for block in model.modules():
        if type(block).__name__ == "Block":
            fully_shard(block)
    fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
ids = torch.randint(0, 50257, (4, 1024), device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    model.loss(ids).backward()
opt.step()
torch.cuda.synchronize()


def state():
    if world == 1:
        return {"model": model.state_dict(), "optim": opt.state_dict()}
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def sync_all():
    os.sync()
    dist.barrier()


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


res = {"save_s": [], "async_blocked_s": [], "async_total_s": [], "load_s": []}
for i in range(runs):
    path = os.path.join(work, f"dcp{i}")
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    sync_all()
    t0 = time.perf_counter()
    dcp.save(state(), checkpoint_id=path)
    sync_all()
    res["save_s"].append(time.perf_counter() - t0)
    res["bytes"] = folder_bytes(path)
    apath = path + "_async"
    if rank == 0:
        shutil.rmtree(apath, ignore_errors=True)
    sync_all()
    t0 = time.perf_counter()
    fut = dcp.async_save(state(), checkpoint_id=apath)
    res["async_blocked_s"].append(time.perf_counter() - t0)
    fut.result()
    sync_all()
    res["async_total_s"].append(time.perf_counter() - t0)
    target = state()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=path)
    torch.cuda.synchronize()
    dist.barrier()
    res["load_s"].append(time.perf_counter() - t0)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(apath, ignore_errors=True)
        shutil.rmtree(path, ignore_errors=True)
res["torch"] = torch.__version__
res["world"] = world
if rank == 0:
    print(json.dumps(res))
dist.destroy_process_group()
