#!/usr/bin/env python3
"""One rank of a one-step GPT-2 run of the installed DeepSpeed on the CPU (Gloo), saved as a ZeRO checkpoint.

The input of bench/ds-to-universal.sh: GPT-2 from transformers' config (124M parameters at the
defaults; --n-layer/--n-embd make it smaller), bf16, ZeRO-2, torch's AdamW, one step on random
tokens, then save_checkpoint(CKPT_DIR) with no client state (as the Hugging Face Trainer saves).
Launched once per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.

usage: ds_gpt2_ckpt.py [--n-layer 12] [--n-embd 768] CKPT_DIR
"""
import argparse
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("LOCAL_SIZE", os.environ.get("WORLD_SIZE", "1"))  # else the CPU accelerator asks numactl

import torch  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("ckpt")
    args = p.parse_args()

    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel
    # The shared-memory collectives op (inference all-reduce only) would be JIT-built per rank.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()

    torch.manual_seed(0)
    heads = max(1, args.n_embd // 64)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=heads))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    tokens = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()
    engine.save_checkpoint(args.ckpt)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"saved {args.ckpt}: {n / 1e6:.1f}M parameters, DeepSpeed {deepspeed.__version__}, "
              f"torch {torch.__version__}, {world} ranks")


if __name__ == "__main__":
    main()
