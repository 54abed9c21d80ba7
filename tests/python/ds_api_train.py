#!/usr/bin/env python3
"""A training script written against DeepSpeed's API, run by real DeepSpeed
(--impl deepspeed) or by uckpt (--impl uckpt: `import uckpt as deepspeed`).

The model is the refrun fixture's torch-only GPT-2 (scripts/gpt2_ref.py, Hugging
Face's math and names, lm_head tied to wte), its init.pt and data rule
(scripts/data_rule.py): rank r, micro step m of step s trains on rows
[m*W*MB + r*MB, m*W*MB + (r+1)*MB) of global batch s.

One process per rank (RANK, WORLD_SIZE, ... from a launcher). Rank 0 writes
--out: per step the mean of all ranks' micro losses, the lr used and the
global grad norm. --save-step S saves global_stepS with a client_state;
--resume loads --ckpt-dir's latest, checks the client_state and trains on
from the step after it.
"""
import argparse
import json
import os
import sys

# The client_state every save writes and every resume checks (beside "iteration").
EXTRA = {"note": "hello", "values": [1, 2.5, True, None, "x"], "nested": {"a": 3, "b": (4, 5)}}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["deepspeed", "uckpt"], required=True)
    p.add_argument("--fixture", required=True, help="the refrun-gpt2 fixture folder")
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--mb", type=int, default=2)
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-step", type=int, default=0)
    p.add_argument("--ckpt-dir")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--optimizer", choices=["config", "client"], default="config",
                   help="config: the config's optimizer section; client: a torch.optim.AdamW object")
    p.add_argument("--persistence-threshold", type=int, default=None,
                   help="stage 3: zero_optimization.stage3_param_persistence_threshold (0: every parameter partitioned)")
    p.add_argument("--no-scheduler", action="store_true", help="constant lr (no WarmupLR section)")
    p.add_argument("--universal", action="store_true", help="load a universal checkpoint (checkpoint.load_universal)")
    p.add_argument("--offload", action="store_true", help="offload_param and offload_optimizer to the CPU (stage 3)")
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)  # as DeepSpeed's launcher passes it
    return p.parse_args()


def import_deepspeed(impl, fixture):
    sys.path.insert(0, os.path.join(fixture, "scripts"))
    if impl == "uckpt":
        import uckpt as deepspeed
        return deepspeed
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    sys.path.insert(0, os.path.join(fixture, "scripts", "pyshim"))
    import deepspeed
    import ds_cpu_compat
    ds_cpu_compat.apply()
    return deepspeed


def ds_config(tc, stage, world, mb, gas, with_optimizer, with_scheduler=True):
    c = {
        "train_batch_size": world * mb * gas,
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": tc["gradient_clipping"],
        "steps_per_print": 1000000,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": tc["warmup_min_lr"],
                                                     "warmup_max_lr": tc["warmup_max_lr"],
                                                     "warmup_num_steps": tc["warmup_num_steps"],
                                                     "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage},
    }
    if not with_scheduler:
        del c["scheduler"]
    if with_optimizer:
        c["optimizer"] = {"type": "AdamW", "params": {"lr": tc["lr"], "betas": list(tc["betas"]), "eps": tc["eps"],
                                                      "weight_decay": tc["weight_decay"], "torch_adam": True}}
    return c


def main():
    args = parse_args()
    deepspeed = import_deepspeed(args.impl, args.fixture)
    import torch
    import gpt2_ref
    import data_rule

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    variant = json.load(open(os.path.join(args.fixture, "variant.json")))
    tc = variant["train"]
    model = gpt2_ref.build(gpt2_ref.cfg_from_dict(variant["model"]), init_path=os.path.join(args.fixture, "init.pt"))
    config = ds_config(tc, args.stage, world, args.mb, args.gas, args.optimizer == "config", not args.no_scheduler)
    if args.universal:
        config["checkpoint"] = {"load_universal": True}
    if args.offload:
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if args.persistence_threshold is not None:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = args.persistence_threshold
    optimizer = None
    if args.optimizer == "client":
        optimizer = torch.optim.AdamW(model.parameters(), lr=tc["lr"], betas=tuple(tc["betas"]), eps=tc["eps"],
                                      weight_decay=tc["weight_decay"])
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=model.parameters(),
                                           config=config)
    assert engine.module.lm_head.weight is engine.module.transformer.wte.weight
    assert engine.gradient_accumulation_steps() == args.gas and engine.world_size == world

    record = {"impl": args.impl, "stage": args.stage, "world_size": world, "steps": {}}
    first = 1
    if args.resume:
        path, client_state = engine.load_checkpoint(args.ckpt_dir)
        assert path is not None, f"nothing to resume in {args.ckpt_dir}"
        extra = client_state["extra"]
        assert extra["note"] == EXTRA["note"] and list(extra["values"]) == EXTRA["values"], extra
        assert extra["nested"]["a"] == 3 and tuple(extra["nested"]["b"]) == (4, 5), extra
        first = int(client_state["iteration"]) + 1
        record["resumed_from"] = os.path.basename(os.path.normpath(path))
        record["global_steps_after_load"] = engine.global_steps

    T, GB, V = tc["seq_len"], world * args.mb * args.gas, variant["model"]["vocab_size"]
    for step in range(first, args.steps + 1):
        batch = data_rule.global_batch(step, GB, T, V)
        lr_used = engine.get_lr()[0]
        mine = []
        for m in range(args.gas):
            a, b = data_rule.rows_for(m, rank, world, args.mb)
            loss = engine(batch[a:b])
            engine.backward(loss)
            engine.step()
            mine.append(loss.detach().float().reshape(1))
        mine = torch.cat(mine)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        torch.distributed.all_gather(gathered, mine)
        norm = engine.get_global_grad_norm()
        record["steps"][str(step)] = {"loss": torch.stack(gathered).double().mean().item(), "lr_used": lr_used,
                                      "grad_norm": float(norm.item() if torch.is_tensor(norm) else norm),
                                      "global_steps": engine.global_steps}
        if step == args.save_step:
            engine.save_checkpoint(args.ckpt_dir, tag=f"global_step{step}",
                                   client_state={"iteration": step, "extra": EXTRA})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
