#!/usr/bin/env python3
"""A script in the style of DeepSpeedExamples' that uses the names scripts import and the engine's smaller
calls, run by real DeepSpeed (--impl deepspeed) or by uckpt (--impl uckpt: `import uckpt as deepspeed`).
It records what it sees in --out (JSON); names_test.py checks uckpt's record against DeepSpeed's semantics
and, with real DeepSpeed available, against DeepSpeed's record.

What it does, on a toy model with a frozen parameter and an integer buffer, GA 2, on the CPU, one process:
  * imports as the examples do: runtime.zero.partition_parameters.ZeroParamStatus, runtime.lr_schedules,
    runtime.utils.set_random_seed, runtime.engine.DeepSpeedEngine, get_accelerator, utils.RepeatingLoader,
    utils.logging.logger / log_dist, checkpoint.utils.clone_tensors_for_torch_save, checkpointing,
    utils.zero_to_fp32, compression.helper's recursive_getattr / recursive_setattr;
  * per ZeRO stage: trains with a block under deepspeed.checkpointing.checkpoint, recording the losses,
    optimizer_name(), steps_per_print(), wall_clock_breakdown(), was_step_applied() after every step, the
    optimizer's overflow, cur_scale and loss_scale, the engine's config and client arguments, gradient_clipping(),
    loss_scale() and dynamic_loss_scale(), whether engine.no_sync exists; drives the boundary by hand
    (set_gradient_accumulation_boundary); changes the batch (set_train_batch_size); saves a checkpoint and
    reads it back with zero_to_fp32's get_fp32_state_dict_from_zero_checkpoint; the engine's state_dict(),
    load_state_dict(), named_parameters() and named_buffers() (DeepSpeed's engine is a Module with the model
    as its child "module"), training_dataloader, tput_timer.update_epoch_count(); destroy().
"""
import argparse
import json
import os
import sys


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["deepspeed", "uckpt"], required=True)
    p.add_argument("--fixture", required=True, help="the refrun-gpt2 fixture folder (for DeepSpeed's CPU shims)")
    p.add_argument("--stages", default="0,1,2")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def import_deepspeed(impl, fixture):
    if impl == "uckpt":
        import uckpt as deepspeed
        return deepspeed
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, os.path.join(fixture, "scripts"))
    sys.path.insert(0, os.path.join(fixture, "scripts", "pyshim"))
    import deepspeed
    import ds_cpu_compat
    ds_cpu_compat.apply()
    # DeepSpeed's checkpoint() makes a transfer stream on its first call, which its CPU accelerator cannot
    # (Stream is None); the stream is used only with cpu_checkpointing: skip that first-call setup.
    deepspeed.checkpointing.cuda_device = "cpu"
    return deepspeed


def build(torch, checkpoint):
    torch.manual_seed(0)

    class Block(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.drop = torch.nn.Dropout(0.25)

        def forward(self, x):
            return self.drop(torch.tanh(self.fc(x)))

    class Net(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(4, 8)
            self.blocks = torch.nn.ModuleList([Block(), Block()])
            self.out = torch.nn.Linear(8, 1)
            self.register_buffer("seen", torch.zeros(2, dtype=torch.int64))

        def forward(self, x):
            h = self.inp(x)
            for b in self.blocks:
                h = checkpoint(b, h)
            return self.out(h).pow(2).mean()

    net = Net()
    net.inp.bias.requires_grad_(False)  # frozen
    return net


def config(stage, **extra):
    c = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 3,
         "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "torch_adam": True}},
         "zero_optimization": {"stage": stage}}
    c.update(extra)
    return c


def batch(torch, step, micro):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(2, 4, generator=g)


def train_stage(deepspeed, torch, zero_to_fp32, stage, work):
    rec = {}
    torch.manual_seed(1)  # the dropout masks: the same draws under both implementations
    model = build(torch, deepspeed.checkpointing.checkpoint)
    cfg = config(stage)
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rec["isinstance"] = isinstance(engine, deepspeed.runtime.engine.DeepSpeedEngine)
    # What the engine keeps of initialize()'s arguments, and its loss-scale and clipping getters.
    rec["initialize_arguments"] = [engine.config is cfg] + [getattr(engine, n) is None for n in (
        "client_optimizer", "client_lr_scheduler", "training_data", "collate_fn", "mpu")]
    rec["scale_getters"] = [engine.gradient_clipping(), engine.loss_scale(), engine.dynamic_loss_scale()]
    rec["optimizer_scale"] = [opt.cur_scale, opt.loss_scale] if hasattr(opt, "cur_scale") else "absent"
    rec["optimizer_name"] = engine.optimizer_name()
    rec["steps_per_print"] = engine.steps_per_print()
    rec["wall_clock_breakdown"] = engine.wall_clock_breakdown()
    rec["has_no_sync"] = hasattr(engine, "no_sync")
    rec["has_overflow"] = hasattr(opt, "overflow")
    losses, applied, boundary = [], [], []
    for step in range(3):
        for micro in range(2):
            boundary.append(engine.is_gradient_accumulation_boundary())
            loss = engine(batch(torch, step, micro))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
            applied.append(engine.was_step_applied())
    if rec["has_overflow"]:
        rec["overflow"] = bool(opt.overflow)
    # The boundary by hand (Accelerate's way): an update after one micro-step, then after three.
    for pattern in ([True], [False, False, True]):
        for k, is_boundary in enumerate(pattern):
            engine.set_gradient_accumulation_boundary(is_boundary)
            loss = engine(batch(torch, 10, k))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
            applied.append(engine.was_step_applied())
            boundary.append(engine.is_gradient_accumulation_boundary())
    engine.set_gradient_accumulation_boundary(None)
    # A larger global batch: GA 2 -> 3.
    engine.set_train_batch_size(6)
    rec["after_set_train_batch_size"] = [engine.train_batch_size(), engine.gradient_accumulation_steps()]
    for micro in range(3):
        boundary.append(engine.is_gradient_accumulation_boundary())
        loss = engine(batch(torch, 20, micro))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        applied.append(engine.was_step_applied())
    try:
        engine.set_train_batch_size(5)
        rec["set_train_batch_size_5"] = "accepted"
    except ValueError:
        rec["set_train_batch_size_5"] = "ValueError"
    rec.update(losses=losses, applied=applied, boundary=boundary, global_steps=engine.global_steps)
    # The engine as the torch Module DeepSpeed's is: its model is the child "module".
    sd = engine.state_dict()
    rec["state_dict_keys"] = sorted(sd)
    rec["named_parameters"] = [n for n, _ in engine.named_parameters()]
    rec["named_buffers"] = [n for n, _ in engine.named_buffers(prefix="top")]
    rec["own_parameters"] = [n for n, _ in engine.named_parameters(recurse=False)]
    back = engine.load_state_dict(sd)
    rec["load_state_dict"] = [list(back.missing_keys), list(back.unexpected_keys)]
    try:
        engine.load_state_dict({k[len("module."):]: v for k, v in sd.items()})
        rec["load_unprefixed"] = "accepted"
    except RuntimeError:
        rec["load_unprefixed"] = "RuntimeError"
    rec["training_dataloader"] = engine.training_dataloader is None  # initialize got no training_data
    engine.tput_timer.update_epoch_count()  # DeepSpeed-Chat's, after each epoch
    rec["epoch_count"] = engine.tput_timer.epoch_count
    ckpt = os.path.join(work, f"z{stage}")
    engine.save_checkpoint(ckpt)
    try:
        sd = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    except FileNotFoundError:  # DeepSpeed's needs ZeRO's optimizer files: stages 1-3
        rec["fp32_state_dict"] = "FileNotFoundError"
    else:
        rec["fp32_state_dict"] = {k: [str(v.dtype), list(v.shape), float(v.double().sum())] for k, v in sd.items()}
        params = dict(model.named_parameters())
        rec["fp32_matches_module"] = all(torch.equal(sd[k].float(), p.detach().float())
                                         for k, p in params.items() if k in sd)
    engine.destroy()
    return rec


def main():
    args = parse_args()
    deepspeed = import_deepspeed(args.impl, args.fixture)
    import torch
    import random
    import numpy
    # The examples' import lines (`from deepspeed.x import y`), of the package under test.
    from importlib import import_module
    zero_to_fp32 = import_module(deepspeed.__name__ + ".utils.zero_to_fp32")
    ZeroParamStatus = import_module(deepspeed.__name__ + ".runtime.zero.partition_parameters").ZeroParamStatus
    lr_schedules = import_module(deepspeed.__name__ + ".runtime.lr_schedules")
    set_random_seed = import_module(deepspeed.__name__ + ".runtime.utils").set_random_seed
    utils = import_module(deepspeed.__name__ + ".utils")
    clone = import_module(deepspeed.__name__ + ".checkpoint.utils").clone_tensors_for_torch_save

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    out["ZeroParamStatus"] = {s.name: s.value for s in ZeroParamStatus}
    out["VALID_LR_SCHEDULES"] = list(lr_schedules.VALID_LR_SCHEDULES)
    set_random_seed(7)
    out["seeded"] = [random.random(), float(numpy.random.rand()), float(torch.rand(1))]
    out["accelerator"] = deepspeed.get_accelerator().device_name()
    out["repeating"] = [int(x) for _, x in zip(range(5), utils.RepeatingLoader([1, 2, 3]))]
    big = torch.arange(10.0)
    cloned = clone({"a": [big[2:4], (big[5:6], 3)], "b": "text"})
    out["clone"] = [cloned["a"][0].tolist(), cloned["a"][0].storage().size(), cloned["a"][1][1], cloned["b"]]
    out["checkpointing_configured"] = [deepspeed.checkpointing.is_configured()]
    ck = deepspeed.checkpointing

    def ck_globals():  # DeepSpeed's module globals, as a script reads them
        return [ck.PARTITION_ACTIVATIONS, ck.CONTIGUOUS_CHECKPOINTING, ck.CPU_CHECKPOINT, ck.SYNCHRONIZE,
                ck.PROFILE_TIME, ck.num_layers, ck.deepspeed_checkpointing_enabled, ck.mpu is None]
    out["checkpointing_globals"] = [ck_globals()]
    deepspeed.checkpointing.configure(None, partition_activations=False)
    out["checkpointing_configured"].append(deepspeed.checkpointing.is_configured())
    out["checkpointing_globals"].append(ck_globals())
    deepspeed.checkpointing.configure(None, deepspeed_config={
        "train_batch_size": 2 * torch.distributed.get_world_size(), "train_micro_batch_size_per_gpu": 2,
        "activation_checkpointing": {"partition_activations": True, "synchronize_checkpoint_boundary": True}})
    out["checkpointing_globals"].append(ck_globals())
    deepspeed.checkpointing.configure(None, partition_activations=True, num_checkpoints=3)
    out["checkpointing_globals"].append(ck_globals())
    deepspeed.checkpointing.configure(None, partition_activations=False)
    helper = import_module(deepspeed.__name__ + ".compression.helper")  # DeepSpeed-Chat's LoRA
    tiny = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 3)))
    inner = helper.recursive_getattr(tiny, "1.0")
    helper.recursive_setattr(tiny, "1.0", torch.nn.Identity())
    out["compression_helper"] = [type(inner).__name__, inner.out_features, type(tiny[1][0]).__name__]
    split = import_module(deepspeed.__name__ + ".moe.utils").split_params_into_different_moe_groups_for_optimizer
    group = {"params": list(tiny.parameters()), "name": "parameters"}  # cifar10_deepspeed.py's --moe-param-group
    out["moe_split"] = [len(split(group)), len(split((group, group))), split([group])[0]["name"]]
    try:
        split(p for p in tiny.parameters())
        out["moe_split"].append("accepted")
    except ValueError:
        out["moe_split"].append("ValueError")
    utils.log_dist("log_dist on rank 0", ranks=[0])
    utils.logger.info("logger works")
    os.makedirs(args.work, exist_ok=True)
    out["stages"] = {str(s): train_stage(deepspeed, torch, zero_to_fp32, s, args.work) for s in map(int, args.stages.split(","))}
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
