#!/usr/bin/env python3
"""The Python package without DeepSpeed: `import uckpt as deepspeed` on CPU.

usage: api_test.py CASE UCKPT_BINARY PYTHONPATH_OF_UCKPT FIXTURE_DIR WORK_DIR

CASE:
  vs_torch        ds_api_train.py at 2 ranks (GA 2, ZeRO 1 and 2, a client torch.optim.AdamW, no
                  schedule) against a plain PyTorch loop over the same global batches: losses
                  within 1e-6 relative (the loop sums gradients in another order).
  recorded        ds_api_train.py (ZeRO 1, 2 and 3, the config's AdamW and WarmupLR) against the
                  losses real DeepSpeed recorded in the fixture (runs/z*_ws2_baseline): 1e-6 relative.
  save_load       ZeRO 2 and 3: a run saving at step 4 and a run resuming it (client_state checked
                  by the script): steps 5..8 equal the uninterrupted run's.
  cpp_resume      `uckpt train` (the C++ engine) resumes the Python run's checkpoint: its losses of
                  steps 5..8 equal the Python run's within 1e-6 relative.
  launch_torchrun the same script started by `uckpt launch` (with --local_rank) and by
                  torch.distributed.run-style environment only (no --local_rank).
  surface         one process, no launcher: add_config_arguments + initialize(args=) with
                  --deepspeed_config, training_data -> a DataLoader of micro-batches, param-group
                  dicts, DeepSpeedCPUAdam(adamw_mode=False), the engine's attributes, pathlib save
                  dirs, get_accelerator(), deepspeed.comm, load_module_only.
  zero3           stage 3 with every parameter partitioned: a block's weights have no storage
                  outside its forward and are whole inside it (the package's hooks) and inside
                  deepspeed.zero.GatheredParameters; the losses equal DeepSpeed's recorded stage-3 run.
  unsupported     initialize() refuses ZeRO stage 4, MoE, pipeline modules, mpu, client lr
                  schedulers and SGD at stage 0 in bf16, and the engine backward(allreduce_gradients=False),
                  optimizer.step() at stage 1 and unknown lr_kwargs, naming each (load_module_strict=False
                  is honoured now: hf_calls_test.py frozen).
"""
import csv
import json
import os
import shutil
import subprocess
import sys

from testkit import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, SAVE = 8, 4


class Ctx:

    def __init__(self, argv):
        self.case, self.uckpt, self.pypath, self.fixture, self.work = argv
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.work)
        self.env = dict(os.environ, PYTHONPATH=self.pypath, OMP_NUM_THREADS="1")

    def train(self, name, stage, *extra, launcher="uckpt"):
        """ds_api_train.py at 2 ranks; returns its per-step record."""
        out = os.path.join(self.work, name + ".json")
        script = [os.path.join(HERE, "ds_api_train.py"), "--impl", "uckpt", "--fixture", self.fixture, "--stage",
                  str(stage), "--steps", str(STEPS), "--out", out, *extra]
        if launcher == "uckpt":
            cmd = [self.uckpt, "launch", "-n", "2", "--master_port", "0", "--", sys.executable, *script]
        else:  # environment only, as torchrun sets it
            cmd = [sys.executable, os.path.join(self.fixture, "scripts", "launch.py"), "2", str(free_port()), *script]
        self.check_run(cmd, name)
        return json.load(open(out))["steps"]

    def check_run(self, cmd, name, env=None):
        log = os.path.join(self.work, name + ".log")
        with open(log, "w") as f:
            rc = subprocess.run(cmd, env=env or self.env, stdout=f, stderr=subprocess.STDOUT, timeout=600).returncode
        if rc != 0:
            fail(f"{name} exited {rc}; its log {log} ends with:\n" + "".join(open(log).readlines()[-25:]))
        return open(log).read()


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def compare(what, got, want, steps, tol):
    worst = 0.0
    for s in steps:
        g, w = got[s], want[s]
        rel = abs(g - w) / abs(w)
        worst = max(worst, rel)
        if rel > tol:
            fail(f"{what}: step {s} loss {g!r} vs {w!r} (relative {rel:.3g} > {tol})")
    print(f"ok   {what}: steps {steps[0]}..{steps[-1]}, max relative difference {worst:.3g}")


def losses(record):
    return {int(s): v["loss"] for s, v in record.items()}


def torch_loop_losses(fixture, world, mb, gas):
    """The plain PyTorch loop: every rank's micro-batches of a step in one process,
    loss / (world * gas) per micro-batch, clipping, AdamW, constant lr."""
    sys.path.insert(0, os.path.join(fixture, "scripts"))
    import torch
    import data_rule
    import gpt2_ref
    variant = json.load(open(os.path.join(fixture, "variant.json")))
    tc = variant["train"]
    model = gpt2_ref.build(gpt2_ref.cfg_from_dict(variant["model"]), init_path=os.path.join(fixture, "init.pt"))
    opt = torch.optim.AdamW(model.parameters(), lr=tc["lr"], betas=tuple(tc["betas"]), eps=tc["eps"],
                            weight_decay=tc["weight_decay"])
    out = {}
    for step in range(1, STEPS + 1):
        batch = data_rule.global_batch(step, world * mb * gas, tc["seq_len"], variant["model"]["vocab_size"])
        opt.zero_grad()
        total = 0.0
        for m in range(gas):
            for r in range(world):
                a, b = data_rule.rows_for(m, r, world, mb)
                loss = model(batch[a:b])
                (loss / (world * gas)).backward()
                total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc["gradient_clipping"])
        opt.step()
        out[step] = total / (world * gas)
    return out


def case_vs_torch(c):
    want = torch_loop_losses(c.fixture, 2, 2, 2)
    for stage in (1, 2):
        got = c.train(f"z{stage}_client_adamw", stage, "--optimizer", "client", "--no-scheduler")
        compare(f"ZeRO {stage} (client AdamW) vs a plain PyTorch loop", losses(got), want, list(range(1, STEPS + 1)),
                1e-6)


def case_recorded(c):
    for stage in (1, 2, 3):
        got = c.train(f"z{stage}", stage)
        rec = json.load(open(os.path.join(c.fixture, "runs", f"z{stage}_ws2_baseline", "losses.json")))["steps"]
        compare(f"ZeRO {stage} vs real DeepSpeed's recorded losses", losses(got), losses(rec),
                list(range(1, STEPS + 1)), 1e-6)
        lr_ok = all(abs(got[s]["lr_used"] - rec[s]["lr_used"]) <= 1e-12 for s in got)
        if not lr_ok:
            fail(f"ZeRO {stage}: get_lr() differs from DeepSpeed's: " +
                 str([(s, got[s]["lr_used"], rec[s]["lr_used"]) for s in got]))
        print(f"ok   ZeRO {stage}: get_lr() before each step equals DeepSpeed's")


def case_save_load(c):
    for stage in (2, 3):
        ck = os.path.join(c.work, f"ckpt{stage}")
        full = c.train(f"full{stage}", stage, "--save-step", str(SAVE), "--ckpt-dir", ck)
        if open(os.path.join(ck, "latest")).read().strip() != f"global_step{SAVE}":
            fail("latest does not name the saved tag")
        resumed = c.train(f"resumed{stage}", stage, "--resume", "--ckpt-dir", ck)
        compare(f"ZeRO {stage}: resume of a Python-saved checkpoint", losses(resumed), losses(full),
                list(range(SAVE + 1, STEPS + 1)), 0.0)
        if resumed[str(SAVE + 1)]["global_steps"] != SAVE + 1:
            fail(f"global_steps after the resumed step {SAVE + 1} is {resumed[str(SAVE + 1)]['global_steps']}")
        if stage == 3:  # its universal conversion, loaded with checkpoint.load_universal, offload on
            tag = f"global_step{SAVE}_universal"
            c.check_run([c.uckpt, "convert", "-q", os.path.join(ck, f"global_step{SAVE}"), os.path.join(ck, tag)],
                        "convert3")
            with open(os.path.join(ck, "latest_universal"), "w") as f:
                f.write(tag)
            uni = c.train("resumed3_universal", 3, "--resume", "--universal", "--offload", "--ckpt-dir", ck)
            compare("ZeRO 3 + offload: resume of the universal conversion", losses(uni), losses(full),
                    list(range(SAVE + 1, STEPS + 1)), 1e-6)
    print("ok   client_state round trip (checked by ds_api_train.py) and global_steps after the load")


def case_cpp_resume(c):
    sys.path.insert(0, HERE)
    import ds_api_train
    ck = os.path.join(c.work, "ckpt")
    full = c.train("python", 2, "--save-step", str(SAVE), "--ckpt-dir", ck)
    variant = json.load(open(os.path.join(c.fixture, "variant.json")))
    config = os.path.join(c.work, "ds.json")
    json.dump(ds_api_train.ds_config(variant["train"], 2, 2, 2, 2, True), open(config, "w"))
    m = variant["model"]
    cmd = [c.uckpt, "launch", "-n", "2", "--master_port", "0", "--", c.uckpt, "train", "--config", config,
           "--n_layer", str(m["n_layer"]), "--n_head", str(m["n_head"]), "--n_embd", str(m["n_embd"]),
           "--vocab_size", str(m["vocab_size"]), "--n_positions", str(m["n_positions"]), "--seq_len",
           str(variant["train"]["seq_len"]), "--init", os.path.join(c.fixture, "init.pt"), "--checkpoint_dir", ck,
           "--log_dir", os.path.join(c.work, "logs"), "--run_name", "cpp", "--steps", str(STEPS), "--resume"]
    c.check_run(cmd, "cpp_resume")
    with open(os.path.join(c.work, "logs", "cpp", "metrics.csv")) as f:
        cpp = {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}
    if sorted(cpp) != list(range(SAVE + 1, STEPS + 1)):
        fail(f"uckpt train logged steps {sorted(cpp)}, expected {SAVE + 1}..{STEPS}")
    compare("C++ engine resuming the Python checkpoint", cpp, losses(full), list(range(SAVE + 1, STEPS + 1)), 1e-6)


def case_launch_torchrun(c):
    a = c.train("uckpt_launch", 1, launcher="uckpt")
    b = c.train("env_launch", 1, launcher="env")
    compare("uckpt launch vs an environment-only launcher", losses(a), losses(b), list(range(1, STEPS + 1)), 0.0)


SURFACE = r'''
import argparse, json, os, pathlib, sys, torch
import uckpt as deepspeed
from uckpt.accelerator import get_accelerator
from uckpt.ops.adam import DeepSpeedCPUAdam
import uckpt.comm as dist
work = pathlib.Path(sys.argv[1])
json.dump({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 0.01}}},
          open(work / "ds.json", "w"))
parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(work / "ds.json")])
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 1))
net[1].weight.requires_grad_(False)                       # frozen: stays out of the optimizer
decay = [p for n, p in net.named_parameters() if n.endswith("weight") and p.requires_grad]
no_decay = [p for n, p in net.named_parameters() if n.endswith("bias")]
opt = DeepSpeedCPUAdam([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                       lr=0.01, adamw_mode=False)
data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
engine, optimizer, loader, sched = deepspeed.initialize(args=args, model=net, optimizer=opt,
                                                        model_parameters=net.parameters(), training_data=data)
assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
assert engine.world_size == 1 and engine.global_rank == 0 and engine.local_rank == 0
assert engine.gradient_accumulation_steps() == 2 and engine.train_micro_batch_size_per_gpu() == 4
assert not engine.fp16_enabled() and not engine.bfloat16_enabled() and engine.zero_optimization_stage() == 0
assert engine.module is net and len(list(engine.parameters())) == 6 and engine.get_global_grad_norm() is None
assert len(optimizer.param_groups) == 2 and sched.state_dict()["last_batch_iteration"] == -1
assert get_accelerator().device_name() in ("cpu", "cuda") and get_accelerator().communication_backend_name()
engine.train()
assert net.training
x, y = next(iter(loader))
assert x.shape == (4, 3), x.shape
for epoch in range(2):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
assert engine.global_steps == 4 and engine.global_samples == 32, (engine.global_steps, engine.global_samples)
assert engine.get_global_grad_norm() > 0 and engine.get_lr() == [0.01, 0.01], engine.get_lr()
engine.eval()
assert not net.training
frozen = net[1].weight.clone()
engine.save_checkpoint(work / "ckpt", client_state={"epoch": 2})
ds_config = torch.load(work / "ckpt" / "global_step4" / "mp_rank_00_model_states.pt")["ds_config"]
assert ds_config["optimizer"]["type"] == "Adam" and ds_config["optimizer"]["params"]["torch_adam"], ds_config
before = {k: v.clone() for k, v in net.state_dict().items()}
with torch.no_grad():
    for p in net.parameters():
        p.add_(1.0)
path, cs = engine.load_checkpoint(work / "ckpt", load_module_only=True)
assert path.endswith("global_step4") and cs == {"epoch": 2}, (path, cs)
assert all(torch.equal(before[k], v) for k, v in net.state_dict().items()), "weights not restored"
assert torch.equal(net[1].weight, frozen)
assert engine.load_checkpoint(work / "nothing") == (None, None)
print("ok   the API surface a single-process script uses")
'''


def case_surface(c):
    with open(os.path.join(c.work, "surface.py"), "w") as f:
        f.write(SURFACE)
    env = {k: v for k, v in c.env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    print(c.check_run([sys.executable, os.path.join(c.work, "surface.py"), c.work], "surface", env), end="")


ZERO3 = r'''
import json, sys, torch
import uckpt as deepspeed
fixture = sys.argv[-1]  # after the --local_rank=N that uckpt launch passes
sys.path.insert(0, fixture + "/scripts")
import gpt2_ref
v = json.load(open(fixture + "/variant.json"))
model = gpt2_ref.build(gpt2_ref.cfg_from_dict(v["model"]), init_path=fixture + "/init.pt")
block = model.transformer.h[1].attn.c_attn.weight
whole = block.detach().clone()
engine, _, _, _ = deepspeed.initialize(model=model, config={
    "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
inside = []
model.transformer.h[1].attn.register_forward_hook(lambda m, a, o: inside.append(m.c_attn.weight.storage().size()))
loss = engine(torch.randint(0, 97, (2, 16)))  # units stay whole until the model first enters one
engine.backward(loss)
engine.step()
assert inside == [whole.numel()], inside
assert block.storage().size() == 0, block.storage().size()
with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
    assert block.storage().size() == whole.numel() and not torch.equal(block, whole)  # whole, and trained
assert block.storage().size() == 0
print("ok   stage 3: a block's weights exist only inside its forward and GatheredParameters")
import os
ckpt = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero3_ckpt")
engine.save_checkpoint(ckpt, client_state={"epoch": 1})
with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
    saved = block.detach().clone()
engine.backward(engine(torch.randint(0, 97, (2, 16))))
engine.step()
path, cs = engine.load_checkpoint(ckpt, load_module_only=True)
assert cs == {"epoch": 1} and engine.global_steps == 2, (cs, engine.global_steps)
with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
    assert torch.equal(block, saved), "load_module_only did not restore the weights"
print("ok   stage 3: load_module_only restores the weights and nothing else")
'''


def case_zero3(c):
    with open(os.path.join(c.work, "zero3.py"), "w") as f:
        f.write(ZERO3)
    cmd = [c.uckpt, "launch", "-n", "2", "--master_port", "0", "--", sys.executable, os.path.join(c.work, "zero3.py"),
           c.fixture]
    out = c.check_run(cmd, "zero3_hooks")
    if out.count("ok   stage 3") != 4:
        fail("zero3.py did not pass on both ranks:\n" + out)
    print("ok   stage 3: a block's weights exist only inside its forward and GatheredParameters, and "
          "load_module_only restores them (both ranks)")
    got = c.train("z3_threshold0", 3, "--persistence-threshold", "0")
    rec = json.load(open(os.path.join(c.fixture, "runs", "z3_ws2_baseline", "losses.json")))["steps"]
    compare("ZeRO 3, every parameter partitioned, vs DeepSpeed's recorded stage-3 run", losses(got), losses(rec),
            list(range(1, STEPS + 1)), 1e-6)


UNSUPPORTED = r'''
import argparse, sys, torch, uckpt as deepspeed
from uckpt.moe.layer import MoE
from uckpt.pipe import PipelineModule
def cfg(**kw):
    c = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    c.update(kw)
    return c
net = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4))
class WithMoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.experts = MoE(hidden_size=4)
cases = [
    ("stage 4", dict(model=net(), config=cfg(zero_optimization={"stage": 4})), "zero_optimization.stage 4"),
    ("MoE", dict(model=WithMoE(), config=cfg()), "mixture of experts"),
    ("pipeline", dict(model=PipelineModule(layers=[torch.nn.Linear(4, 4)]), config=cfg()), "pipeline"),
    ("mpu", dict(model=net(), config=cfg(), mpu=object()), "mpu"),
    ("lr_scheduler", dict(model=net(), config=cfg(), lr_scheduler=object()), "lr_scheduler"),
    ("SGD at stage 0 in bf16", dict(model=net(), optimizer="SGD", config={"train_micro_batch_size_per_gpu": 1,
                                                                         "bf16": {"enabled": True}}),
     "SGD at ZeRO stage 0 in bf16"),
    ("pipeline config", dict(model=net(), config=cfg(pipeline={"stages": 2})), "'pipeline'"),
    # uckpt's own key, read by `uckpt train` only so far (docs/reliability.md).
    ("checkpoint.snapshot_interval", dict(model=net(), config=cfg(checkpoint={"snapshot_interval": 1})),
     "checkpoint.snapshot_interval (snapshots in host memory) is read by `uckpt train` only"),
    # DeepSpeed asserts on a config from two places; uckpt used config= and dropped the other.
    ("config= and args.deepspeed_config", dict(model=net(), config=cfg(),
                                               args=argparse.Namespace(deepspeed_config="other.json")),
     "both as config= and as args.deepspeed_config"),
    ("args.deepscale_config and deepspeed_config", dict(model=net(), args=argparse.Namespace(
        deepspeed_config="a.json", deepscale_config="b.json")), "both deepscale_config and deepspeed_config"),
]
bad = 0
for name, kw, needle in cases:
    m = kw["model"]
    if kw.get("optimizer") == "SGD":  # element-wise optimizers run at stages 0 (fp32) to 3 (optimizers_test.py)
        kw["optimizer"] = torch.optim.SGD(m.parameters(), lr=0.1)
    elif kw.get("optimizer") == "AdamW":
        kw["optimizer"] = torch.optim.AdamW(m.parameters())
    try:
        deepspeed.initialize(**kw)
        print(f"FAIL: {name}: initialize accepted it"); bad += 1
    except (ValueError, TypeError, RuntimeError) as e:
        ok = needle in str(e)
        print(("ok  " if ok else "FAIL:") + f" {name}: {type(e).__name__}: {e}"); bad += not ok
# Keywords and calls the engine does not implement, each refused by name.
sched = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
engine, optimizer, _, _ = deepspeed.initialize(model=net(), config=cfg(scheduler=sched))
_, z1_optimizer, _, _ = deepspeed.initialize(model=net(), config=cfg(zero_optimization={"stage": 1}))
loss = lambda: engine(torch.ones(1, 4)).sum()
calls = [
    ("backward(allreduce_gradients=False)", lambda: engine.backward(loss(), allreduce_gradients=False),
     "allreduce_gradients=False"),
    # (At ZeRO stage 0 in fp32 the script's own optimizer.step() is DeepSpeed's torch optimizer's:
    # deepspeed_api_test.py optimizer_step.)
    ("optimizer.step() at stage 1", lambda: z1_optimizer.step(), "call engine.step()"),
    ("step(lr_kwargs={'epoch': 1})", lambda: (engine.backward(loss()), engine.step(lr_kwargs={"epoch": 1})),
     "lr_kwargs key 'epoch'"),
]
for name, call, needle in calls:
    try:
        call()
        print(f"FAIL: {name}: accepted"); bad += 1
    except (ValueError, TypeError, RuntimeError) as e:
        ok = needle in str(e)
        print(("ok  " if ok else "FAIL:") + f" {name}: {type(e).__name__}: {e}"); bad += not ok
sys.exit(1 if bad else 0)
'''


def case_unsupported(c):
    with open(os.path.join(c.work, "unsupported.py"), "w") as f:
        f.write(UNSUPPORTED)
    print(c.check_run([sys.executable, os.path.join(c.work, "unsupported.py")], "unsupported"), end="")


def main():
    c = Ctx(sys.argv[1:6])
    globals()["case_" + c.case](c)
    print("PASS")


if __name__ == "__main__":
    main()
