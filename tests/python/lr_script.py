#!/usr/bin/env python3
"""Learning rates and backward keywords as a script uses them, run by uckpt
(`import uckpt as deepspeed`), by real DeepSpeed 0.14.5, or by a plain PyTorch
loop doing the same thing (--impl torch). One process, a small MLP, GA 2.

Scenarios (each at the ZeRO stages given; the torch loop has no stages):
  manual      a client torch.optim.AdamW with two param groups of different lr and
              weight decay, the lr set by hand through optimizer.param_groups before
              each update; the config also has an 'optimizer' section (DeepSpeed
              uses the client's)
  manual_cfg  the config's AdamW over model_parameters dicts of different lr, the
              lr set by hand through the returned optimizer's param_groups
  steplr      a client AdamW stepped by torch.optim.lr_scheduler.StepLR after each update
  steplr_resume  the same, saved after update 3 (StepLR's state in client_state) and resumed
              by a fresh model, optimizer, engine and StepLR: the saved lrs come back
  warmup      the config's AdamW + WarmupLR (linear) over two groups of different lr;
              a hand-set lr of group 1 before update 3; step(lr_kwargs=
              {"last_batch_iteration": 1}) at update 5
  no_gas      backward(loss * 0.25, scale_wrt_gas=False, retain_graph=True), then a
              second autograd pass over the same graph

Writes {scenario/stage: {"loss": [...], "lr": [[...]], "sched": [...]}} to --out.
usage: lr_script.py --impl uckpt|deepspeed|torch --out OUT.json [--fixture DIR] [--stages 0 1 3]
"""
import argparse
import json
import os
import sys

GA, MB, STEPS = 2, 4, 6
WORK = "."  # checkpoints go next to --out
BASE_LRS = (1e-2, 3e-3)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["uckpt", "deepspeed", "torch"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fixture", default="")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 3])
    p.add_argument("--scenarios", nargs="+",
                   default=["manual", "manual_cfg", "steplr", "steplr_resume", "warmup", "no_gas"])
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def import_deepspeed(impl, fixture):
    if impl == "uckpt":
        import uckpt as deepspeed
        return deepspeed
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_SIZE", "1")
    sys.path.insert(0, os.path.join(fixture, "scripts"))
    sys.path.insert(0, os.path.join(fixture, "scripts", "pyshim"))
    import deepspeed
    import ds_cpu_compat
    ds_cpu_compat.apply()
    return deepspeed


class TorchEngine:
    """What the engine does, in a plain PyTorch loop: loss / GA, an update each GA micro-steps."""

    def __init__(self, model, optimizer, ga, schedule=None):
        self.model, self.optimizer, self.ga, self.schedule, self.micro = model, optimizer, ga, schedule, 0

    def __call__(self, x):
        return self.model(x)

    def is_gradient_accumulation_boundary(self):
        return (self.micro + 1) % self.ga == 0

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        (loss / self.ga if scale_wrt_gas else loss).backward(retain_graph=retain_graph)

    def step(self, lr_kwargs=None):
        if self.is_gradient_accumulation_boundary():
            self.optimizer.step()
            self.optimizer.zero_grad()
            if self.schedule:
                self.schedule.step(**(lr_kwargs or {}))
        self.micro += 1

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]


class LinearWarmup:
    """DeepSpeed's WarmupLR (linear) as its documentation defines it, for the torch loop."""

    def __init__(self, optimizer, min_lr, max_lr, steps):
        self.optimizer, self.min_lr, self.max_lr, self.steps, self.last_batch_iteration = optimizer, min_lr, max_lr, steps, -1

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return [0.0]
        gamma = min(1.0, self.last_batch_iteration / self.steps)
        return [self.min_lr + (self.max_lr - self.min_lr) * gamma] * len(self.optimizer.param_groups)

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def step(self, last_batch_iteration=None):
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        for g, lr in zip(self.optimizer.param_groups, self.get_lr()):
            g["lr"] = lr


WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 4,
                                          "warmup_type": "linear"}}


def make_model(seed):
    import torch
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    groups = [{"params": list(model[0].parameters()), "lr": BASE_LRS[0], "weight_decay": 0.1},
              {"params": list(model[2].parameters()), "lr": BASE_LRS[1], "weight_decay": 0.0}]
    return model, groups


def run(deepspeed, impl, scenario, stage):
    import tempfile
    import torch
    model, groups = make_model(0)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(MB, 8, generator=gen), torch.randn(MB, 4, generator=gen)) for _ in range(STEPS * GA)]
    config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GA,
              "zero_optimization": {"stage": stage}}
    adamw = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1, "torch_adam": True}}
    client = scenario in ("manual", "steplr", "steplr_resume", "no_gas")
    if scenario == "manual":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.5}}  # not used: the client's is
    if not client:
        config["optimizer"] = adamw
    if scenario == "warmup":
        config["scheduler"] = WARMUP

    sched = None
    if impl == "torch":
        opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)
        if scenario == "warmup":
            sched = LinearWarmup(opt, 0.001, 0.02, 4)
        engine = TorchEngine(model, opt, GA, sched)
    else:
        kw = dict(model=model, config=config)
        if client:
            kw["optimizer"] = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)
        else:
            kw["model_parameters"] = groups
        engine, opt, _, sched = deepspeed.initialize(**kw)
    torch_sched = torch.optim.lr_scheduler.StepLR(opt if impl == "torch" else kw["optimizer"], step_size=2,
                                                  gamma=0.5) if scenario.startswith("steplr") else None

    rec = {"loss": [], "lr": [], "sched": []}
    total, update = 0.0, 0
    for i, (x, y) in enumerate(batches):
        boundary = engine.is_gradient_accumulation_boundary()
        if scenario in ("manual", "manual_cfg") and boundary:
            for g, base in zip(opt.param_groups, BASE_LRS):
                g["lr"] = base * 0.5 ** update
        if scenario == "warmup" and boundary and update == 2:
            opt.param_groups[1]["lr"] = 0.005
        if scenario == "no_gas":
            x = x.clone().requires_grad_(True)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        if scenario == "no_gas":
            engine.backward(loss * 0.25, retain_graph=True, scale_wrt_gas=False)
            (gx,) = torch.autograd.grad(loss, x)  # the graph is still there
            assert gx.shape == x.shape
        else:
            engine.backward(loss)
        engine.step(lr_kwargs={"last_batch_iteration": 1} if scenario == "warmup" and update == 4 else None)
        total += loss.item()
        if boundary:
            update += 1
            if torch_sched:
                torch_sched.step()
            if scenario == "steplr_resume" and impl != "torch" and update == 3:
                ckpt = tempfile.mkdtemp(prefix=f"ckpt_{stage}_", dir=WORK)
                engine.save_checkpoint(ckpt, client_state={"sched": torch_sched.state_dict()})
                model, groups = make_model(7)  # other weights and the initial lrs: the load must restore them
                kw.update(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1))
                engine, opt, _, sched = deepspeed.initialize(**kw)
                torch_sched = torch.optim.lr_scheduler.StepLR(kw["optimizer"], step_size=2, gamma=0.5)
                _, client_state = engine.load_checkpoint(ckpt)
                torch_sched.load_state_dict(client_state["sched"])
            rec["loss"].append(total / GA)
            rec["lr"].append([float(v) for v in engine.get_lr()])
            if sched is not None:
                rec["sched"].append([float(v) for v in sched.get_lr()] + [sched.state_dict()["last_batch_iteration"]])
            total = 0.0
    return rec


def main():
    args = parse_args()
    global WORK
    WORK = os.path.dirname(os.path.abspath(args.out))
    deepspeed = None
    if args.impl != "torch":
        deepspeed = import_deepspeed(args.impl, args.fixture)
        deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for scenario in args.scenarios:
        for stage in ([None] if args.impl == "torch" else args.stages):
            out[scenario if stage is None else f"{scenario}/{stage}"] = run(deepspeed, args.impl, scenario, stage)
    json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
