#!/usr/bin/env python3
"""PyTorch's own data-parallel training of the same GPT-2, for bench/train-gpu.sh.

Run under torchrun, one process per GPU:
  ddp_zero: DistributedDataParallel + ZeroRedundancyOptimizer(AdamW), autocast bf16
            (fp32 parameters and gradients; optimizer state sharded as ZeRO-1)
  fsdp2:    fully_shard (FSDP2) per block and at the root, MixedPrecisionPolicy
            bf16 parameters, fp32 gradient reduction (parameters, gradients and
            optimizer state sharded as ZeRO-3)
Same model as `uckpt train --fused_kernels` (bench/gpt2_torch.py: scaled_dot_product_attention,
tanh GELU, tied head, loss in fp32), same synthetic data rule, micro-batch per GPU, AdamW
(fused where it runs, else foreach), clipping 1.0. The loss: --loss hf is Hugging Face's
(logits.float() then cross_entropy); --loss chunked is the same chunked fp32 loss that
`uckpt train --chunked_loss` uses (src/models/next_token_loss.cc, written again here with
torch.autograd.Function), so PyTorch gets the same memory saving. Prints one JSON line from
rank 0: tokens/s over the timed steps, max_memory_allocated/reserved per rank (GiB).

  deepspeed_z2, deepspeed_z3, deepspeed_z3_offload: DeepSpeed's engine on the same model,
            bf16, stage 2 / stage 3 / stage 3 with parameters and optimizer offloaded to
            CPU (its DeepSpeedCPUAdam, built on first use); deepspeed_z1_offload and
            deepspeed_z2_offload: stage 1 / 2 with the optimizer offloaded to CPU
            (DeepSpeedCPUAdam); the others use DeepSpeed's
            FusedAdam (--adam fused) or torch's AdamW ("torch_adam", --adam foreach).
            Needs `import deepspeed` to work (PYTHONPATH).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_torch as g  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ddp_zero", "fsdp2", "deepspeed_z2", "deepspeed_z3", "deepspeed_z3_offload",
                                     "deepspeed_z1_offload", "deepspeed_z2_offload"],
                   required=True)
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_head", type=int, default=12)
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--vocab_size", type=int, default=50257)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--adam", choices=["fused", "foreach"], default="fused")
    p.add_argument("--loss", choices=["hf", "chunked"], default="hf")
    a = p.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    torch.manual_seed(0)
    model = g.GPT2(a.n_layer, a.n_head, a.n_embd, a.vocab_size, a.seq_len, fused=True)
    g.gpt2_init_(model, a.n_layer)
    model.to(dev)
    adam = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)

    if a.mode == "ddp_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model, device_ids=[local], gradient_as_bucket_view=True)
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW,
                                      **{a.adam: True}, **adam)

        def loss_of(ids):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = net(ids)
            return model_loss(logits, ids, a.loss)
    elif a.mode.startswith("deepspeed"):
        net, opt, loss_of = deepspeed_engine(a, model, adam, world)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for blk in model.transformer.h:
            fully_shard(blk, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        net = model
        opt = torch.optim.AdamW(model.parameters(), **{a.adam: True}, **adam)

        def loss_of(ids):
            return model_loss(net(ids), ids, a.loss)

    def step(k):
        ids = g.synthetic_batch(42, k, a.micro, a.seq_len, a.vocab_size, first_row=rank * a.micro).to(dev)
        loss = loss_of(ids)
        if a.mode.startswith("deepspeed"):  # clipping, step and zeroing are the engine's
            net.backward(loss)
            net.step()
            return float(loss.detach())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())  # one host sync per step, as uckpt's loss log

    for k in range(1, a.warmup + 1):
        step(k)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for k in range(a.warmup + 1, a.warmup + a.steps + 1):
        last = step(k)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    tokens = a.steps * a.micro * world * a.seq_len
    mem = torch.tensor([torch.cuda.max_memory_allocated(dev) / 2**30, torch.cuda.max_memory_reserved(dev) / 2**30],
                       device=dev)
    allmem = [torch.zeros_like(mem) for _ in range(world)]
    dist.all_gather(allmem, mem)
    if rank == 0:
        impl = a.mode if a.loss == "hf" else a.mode + "+chunked"
        print(json.dumps({"impl": impl, "optimizer": "AdamW " + a.adam, "world": world, "tokens_per_s": tokens / secs,
                          "step_ms": 1000 * secs / a.steps, "last_loss": last,
                          "max_allocated_gib": [round(float(m[0]), 3) for m in allmem],
                          "max_reserved_gib": [round(float(m[1]), 3) for m in allmem],
                          "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


def deepspeed_engine(a, model, adam, world):
    import deepspeed
    offload = a.mode.endswith("_offload")
    stage = int(a.mode[len("deepspeed_z")])
    zero = {"stage": stage, "overlap_comm": stage >= 2, "reduce_bucket_size": 50000000}
    if offload:
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    params = {"lr": adam["lr"], "betas": list(adam["betas"]), "eps": adam["eps"], "weight_decay": adam["weight_decay"]}
    if a.adam == "foreach" and not offload:
        params["torch_adam"] = True
    cfg = {"train_batch_size": a.micro * world, "train_micro_batch_size_per_gpu": a.micro, "gradient_clipping": 1.0,
           "steps_per_print": 1000000, "bf16": {"enabled": True}, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": params}}
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def loss_of(ids):
        return model_loss(engine(ids), ids, a.loss)
    return engine, opt, loss_of


def model_loss(logits, ids, kind):
    if kind == "chunked":
        return ChunkedNextTokenLoss.apply(logits, ids[:, 1:].contiguous())
    V = logits.shape[-1]
    return torch.nn.functional.cross_entropy(logits[:, :-1, :].float().reshape(-1, V), ids[:, 1:].reshape(-1))


class ChunkedNextTokenLoss(torch.autograd.Function):
    """Mean next-token cross entropy in fp32, one sequence at a time, as uckpt's
    src/models/next_token_loss.cc: forward keeps only the (bf16) logits; backward recomputes each
    sequence's fp32 log-probabilities and applies nll_loss's and log_softmax's backward."""

    @staticmethod
    def forward(ctx, logits, labels):
        B, T1 = labels.shape
        rows = torch.empty(B, T1, device=logits.device, dtype=torch.float32)
        for b in range(B):
            logp = log_softmax_fp32(logits[b, :T1])
            rows[b] = -logp.gather(1, labels[b].unsqueeze(1)).squeeze(1)
        ctx.save_for_backward(logits, labels)
        return rows.mean()

    @staticmethod
    def backward(ctx, g):
        logits, labels = ctx.saved_tensors
        B, T1 = labels.shape
        minus_g_over_n = -(g.float() / (B * T1))
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        grad[:, T1:].zero_()
        out_dtype = torch.float16 if half_to_float(logits) else torch.float32
        for b in range(B):
            logp = log_softmax_fp32(logits[b, :T1])
            idx = labels[b].unsqueeze(1)
            nll = torch.zeros_like(logp).scatter_(1, idx, minus_g_over_n.expand(idx.shape))
            grad[b, :T1].copy_(torch._log_softmax_backward_data(nll, logp, 1, out_dtype))
        return grad, None


def half_to_float(t):  # log_softmax reads it and writes fp32 in one kernel: CUDA fp16 only
    return t.is_cuda and t.dtype == torch.float16


def log_softmax_fp32(x):
    if x.dtype == torch.float32:
        return torch._log_softmax(x, -1, False)
    if half_to_float(x):
        return torch._log_softmax(x, -1, True)
    return torch._log_softmax(x.float(), -1, False)

if __name__ == "__main__":
    main()
