#!/usr/bin/env python3
"""Real DeepSpeed 0.14.5 resumes uckpt's ZeRO-3 checkpoint of a model with a frozen parameter.

uckpt (`import uckpt as deepspeed`, 3 ranks, stage 3) trains the model of
fixtures/make_ds_z3_frozen.py two steps and saves; DeepSpeed (3 ranks, Gloo on CPU)
builds the model from another seed and loads it. Every parameter, the frozen one
included (saved as DeepSpeed's per-rank slots), must equal uckpt's bit for bit.

usage: deepspeed_resumes_z3_frozen.py UCKPT PYTHON_PACKAGE_DIR SHARED WORKDIR
Needs UCKPT_DEEPSPEED_SRC (a DeepSpeed 0.14.5 source tree) and Debian's python3-torch;
otherwise exits 77 (skipped), never 0.
"""
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

COMMON = r'''
import os, sys, torch
sys.path.insert(0, HERE_FIXTURES)
from make_ds_z3_frozen import Net
def config(**optimizer_params):
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": dict(lr=0.05, weight_decay=0.01, **optimizer_params)},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
def gathered(deepspeed, net):
    with deepspeed.zero.GatheredParameters(list(net.parameters()), modifier_rank=None):
        return {n: p.detach().clone() for n, p in net.named_parameters()}
'''

SAVE = r'''
import uckpt as deepspeed
out = sys.argv[-1]
torch.manual_seed(5)
net = Net()
engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                       config=config())
rank = engine.global_rank
for step in range(2):
    engine.backward(engine((torch.arange(8).view(2, 4) * (step + 2) + 3 * rank) % 13))
    engine.step()
engine.save_checkpoint(out)
state = gathered(deepspeed, net)
if rank == 0:
    torch.save(state, os.path.join(out, "uckpt_weights.pt"))
'''

LOAD = r'''
ckpt, shared = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(shared, "fixtures", "deepspeed", "scripts"))
import deepspeed, ds_cpu_compat
ds_cpu_compat.apply()
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(99)  # other initial weights: everything must come from the checkpoint
net = Net()
engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                       config=config(torch_adam=True))
engine.load_checkpoint(ckpt)
state = gathered(deepspeed, net)
if torch.distributed.get_rank() == 0:
    torch.save(state, os.path.join(ckpt, "deepspeed_weights.pt"))
'''


def main():
    uckpt, package, shared, work = sys.argv[1:5]
    src = os.environ.get("UCKPT_DEEPSPEED_SRC", "")
    if not src or not os.path.isdir(os.path.join(src, "deepspeed")):
        print("SKIPPED: set UCKPT_DEEPSPEED_SRC to a DeepSpeed 0.14.5 source tree")
        return 77
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    prelude = COMMON.replace("HERE_FIXTURES", repr(os.path.join(HERE, "..", "engine", "fixtures")))
    for name, body in (("save.py", SAVE), ("load.py", LOAD)):
        with open(os.path.join(work, name), "w") as f:
            f.write(prelude + body)
    ckpt = os.path.join(work, "ckpt")
    env = dict(os.environ, PYTHONPATH=package, OMP_NUM_THREADS="1")
    subprocess.run([uckpt, "launch", "-n", "3", "--master_port", "0", "--", sys.executable,
                    os.path.join(work, "save.py"), ckpt], check=True, env=env, timeout=600)
    scripts = os.path.join(shared, "fixtures", "deepspeed", "scripts")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.path.join(scripts, "pyshim"), DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    subprocess.run([sys.executable, os.path.join(scripts, "launch.py"), "3", "29873", os.path.join(work, "load.py"),
                    ckpt, shared], check=True, env=env, timeout=900)
    import torch
    ours = torch.load(os.path.join(ckpt, "uckpt_weights.pt"))
    theirs = torch.load(os.path.join(ckpt, "deepspeed_weights.pt"))
    bad = [n for n in ours if n not in theirs or not torch.equal(ours[n], theirs[n])]
    for n in ours:
        print(f"{n}: {'equal' if n not in bad else 'DIFFERENT'}")
    if bad or set(ours) != set(theirs):
        print("FAILED: DeepSpeed's weights after loading differ from uckpt's:", bad)
        return 1
    print("OK: DeepSpeed loaded uckpt's ZeRO-3 checkpoint; every parameter, the frozen one too, equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
