#!/usr/bin/env python3
"""Client lr schedulers and optimizers, DeepSpeed 0.14.5's config schedulers, on CPU with a toy model (seconds).

usage: sched_test.py CASE PYTHONPATH_OF_UCKPT [DEEPSPEED_PYSHIM_DIR]

CASE:
  client     initialize(lr_scheduler=...): a torch scheduler on the client optimizer, a callable given the
             optimizer (over the config's optimizer section), a Megatron-style object with lr_kwargs (and
             DeepSpeed's step(train_batch_size) fallback on a TypeError): stepped at each accumulation boundary,
             lrs and losses equal to a plain PyTorch loop; returned as given; its state_dict() saved under
             'lr_scheduler' and restored by load_checkpoint (the resumed run continues the uninterrupted one);
             a scheduler stepping another optimizer is refused.
  config     OneCycle, WarmupCosineLR, LRRangeTest from the config: save and resume continue the
             uninterrupted run; load_checkpoint(load_optimizer_states=False) keeps the fresh optimizer's lr
             until the next scheduler step, and load_lr_scheduler_states=False keeps the scheduler's position
             (DeepSpeed's), handing the saved state back in the client state.
  optimizer  a config optimizer type in any case; a client optimizer (or a callable building one) over a config
             'optimizer' section: the client's trains; ZeRO-Offload with a client torch optimizer refused as
             DeepSpeed does; initialize without any optimizer: forward, eval, save/load of the module, and
             backward/step refused by name.
  deepspeed  the config schedulers' lrs (and OneCycle's betas) over 50 updates equal real DeepSpeed's
             scheduler classes (needs UCKPT_DEEPSPEED_SRC, else exit 77).
"""
import json
import os
import subprocess
import sys
import tempfile

from testkit import fail, free_port

SKIP = 77
STEPS = 50


def close(a, b, tol=1e-6):
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-30)


# ---------------------------------------------------------------- the toy model and its data

def net(torch, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def batch(torch, update, micro):
    g = torch.Generator().manual_seed(1000 * update + micro)
    return torch.randn(2, 4, generator=g)


def config(**extra):
    c = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    c.update(extra)
    return c


ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}


def torch_loop(torch, model, opt, sched, updates, first=0):
    """A plain PyTorch loop: (lr used, loss) per update, GA 2."""
    out = []
    for u in range(first, first + updates):
        lr = opt.param_groups[0]["lr"]
        losses = []
        for m in range(2):
            loss = model(batch(torch, u, m)).pow(2).mean()
            (loss / 2).backward()
            losses.append(loss.item())
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        out.append((lr, losses))
    return out


def engine_loop(torch, engine, updates, first=0, lr_kwargs=None):
    out = []
    for u in range(first, first + updates):
        lr = engine.get_lr()[0]
        losses = []
        for m in range(2):
            loss = engine(batch(torch, u, m)).pow(2).mean()
            engine.backward(loss)
            engine.step(lr_kwargs=lr_kwargs)
            losses.append(loss.item())
        out.append((lr, losses))
    return out


def same_run(what, got, want):
    if len(got) != len(want):
        fail(f"{what}: {len(got)} updates vs {len(want)}")
    for u, ((glr, gl), (wlr, wl)) in enumerate(zip(got, want)):
        if not close(glr, wlr, 1e-12):
            fail(f"{what}: update {u + 1} used lr {glr!r}, the plain loop {wlr!r}")
        for a, b in zip(gl, wl):
            if not close(a, b):
                fail(f"{what}: update {u + 1} loss {a!r} vs {b!r}")
    print(f"ok   {what}: {len(got)} updates, lrs and losses as the reference")


# ---------------------------------------------------------------- client

def lam(step):
    return 1.0 / (1.0 + step)


def worker_client(deepspeed, torch, work):
    from torch.optim.lr_scheduler import LambdaLR
    # An object on the client optimizer, over a config optimizer and scheduler (the client's win).
    model = net(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    sched = LambdaLR(opt, lam)
    cfg = config(optimizer={"type": "Adam", "params": {"lr": 0.5}},
                 scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 0.3, "warmup_num_steps": 2}})
    engine, _, _, returned = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    if returned is not sched or engine.lr_scheduler is not sched:
        fail("initialize did not return the client's lr_scheduler object as engine.lr_scheduler")
    got = engine_loop(torch, engine, 6)
    ref = net(torch)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)
    want = torch_loop(torch, ref, ropt, LambdaLR(ropt, lam), 6)
    same_run("a torch LambdaLR object on the client optimizer", got, want)
    if sched.last_epoch != 6:
        fail(f"the client scheduler stepped {sched.last_epoch} times in 6 updates (DeepSpeed: once per boundary)")

    # A callable of the optimizer the config's section makes; save, then resume in a new engine.
    def run(updates, load=False):
        model = net(torch, seed=5 if load else 0)
        engine, _, _, s = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               lr_scheduler=lambda o: LambdaLR(o, lam), config=config(optimizer=ADAMW))
        if not isinstance(s, LambdaLR) or engine.lr_scheduler is not s:
            fail(f"the callable's scheduler was not returned (got {type(s).__name__})")
        first = 0
        if load:
            path, _ = engine.load_checkpoint(work)
            if path is None or s.last_epoch != 3:
                fail(f"load_checkpoint did not restore the client scheduler (last_epoch {s.last_epoch}, want 3)")
            first = 3
        return engine, s, engine_loop(torch, engine, updates, first)

    engine, s, got = run(3)
    state = s.state_dict()
    engine.save_checkpoint(work, tag="t3")
    got_more = engine_loop(torch, engine, 3, first=3)
    ref = net(torch)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)
    want = torch_loop(torch, ref, ropt, LambdaLR(ropt, lam), 6)
    same_run("a callable building LambdaLR on the config's optimizer", got + got_more, want)
    saved = torch.load(os.path.join(work, "t3", "mp_rank_00_model_states.pt"), map_location="cpu")
    if saved.get("lr_scheduler") != state:
        fail(f"the model-states file's lr_scheduler is {saved.get('lr_scheduler')!r}, not state_dict() {state!r}")
    print("ok   the client scheduler's state_dict() is the checkpoint's 'lr_scheduler'")
    _, _, resumed = run(3, load=True)
    same_run("resumed from the checkpoint (client scheduler restored)", resumed, want[3:])

    # A Megatron-style scheduler: lr_kwargs go to its step(); a TypeError falls back to step(train_batch_size).
    class AnnealingLR:

        def __init__(self, optimizer):
            self.optimizer, self.num_steps = optimizer, 0

        def step(self, increment=1):
            self.num_steps += increment
            for g in self.optimizer.param_groups:
                g["lr"] = 0.01 * 0.5 ** self.num_steps

        def state_dict(self):
            return {"num_steps": self.num_steps}

        def load_state_dict(self, sd):
            self.num_steps = sd["num_steps"]

    model = net(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    meg = AnnealingLR(opt)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=meg, config=config())
    got = engine_loop(torch, engine, 2, lr_kwargs={"increment": 2})
    if meg.num_steps != 4 or got[1][0] != 0.01 * 0.5 ** 2:
        fail(f"lr_kwargs did not reach the client scheduler's step(): num_steps {meg.num_steps}, lr {got[1][0]}")
    engine_loop(torch, engine, 1, first=2, lr_kwargs={"no_such_argument": 1})
    if meg.num_steps != 4 + engine.train_batch_size():
        fail(f"a TypeError from step(**lr_kwargs) should step(train_batch_size) as DeepSpeed: {meg.num_steps}")
    print("ok   a Megatron-style scheduler gets lr_kwargs, and step(train_batch_size) after a TypeError")

    # A scheduler stepping another optimizer than the engine's is refused.
    model = net(torch)
    other = torch.optim.AdamW(model.parameters(), lr=0.01)
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), lr_scheduler=LambdaLR(other, lam),
                             config=config(optimizer=ADAMW))
        fail("a scheduler on an optimizer the engine does not use was accepted")
    except ValueError as e:
        if "lr_scheduler" not in str(e):
            fail(f"the refusal does not name lr_scheduler: {e}")
    print("ok   a scheduler on another optimizer is refused")


# ---------------------------------------------------------------- config

SCHEDULERS = {
    "OneCycle": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 3, "cycle_second_step_size": 4,
                 "decay_step_size": 2, "decay_lr_rate": 0.5, "decay_mom_rate": 0.05, "cycle_min_mom": 0.85,
                 "cycle_max_mom": 0.95},
    "WarmupCosineLR": {"total_num_steps": 30, "warmup_num_steps": 5, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01,
                       "warmup_type": "linear"},
    "LRRangeTest": {"lr_range_test_min_lr": 0.002, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 0.7,
                    "lr_range_test_staircase": True},
    "WarmupLR": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 6},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5, "total_num_steps": 30,
                      "warmup_type": "linear"},
}


def sched_engine(deepspeed, torch, name, seed=0):
    model = net(torch, seed)
    groups = [{"params": list(model[0].parameters()), "lr": 0.01}, {"params": list(model[2].parameters()), "lr": 0.02}]
    cfg = config(optimizer={"type": "Adam", "params": {"lr": 0.01}},
                 scheduler={"type": name, "params": SCHEDULERS[name]})
    return deepspeed.initialize(model=model, model_parameters=groups, config=cfg)


def worker_config(deepspeed, torch, work):
    for name in ("OneCycle", "WarmupCosineLR", "LRRangeTest"):
        engine, opt, _, sched = sched_engine(deepspeed, torch, name)
        whole = engine_loop(torch, engine, 8)
        engine, opt, _, sched = sched_engine(deepspeed, torch, name)
        engine_loop(torch, engine, 4)
        betas = opt.param_groups[0]["betas"]
        engine.save_checkpoint(os.path.join(work, name), tag="t4")
        engine, opt, _, sched = sched_engine(deepspeed, torch, name, seed=3)
        engine.load_checkpoint(os.path.join(work, name))
        if sched.state_dict() != {"last_batch_iteration": 3}:
            fail(f"{name}: restored state {sched.state_dict()}, want last_batch_iteration 3")
        if tuple(opt.param_groups[0]["betas"]) != tuple(betas):
            fail(f"{name}: betas after the load {opt.param_groups[0]['betas']} vs saved {betas}")
        same_run(f"{name} resumed after 4 of 8 updates", engine_loop(torch, engine, 4, first=4), whole[4:])

    # DeepSpeed's load_state_dict sets the position only: without the optimizer's state, the fresh optimizer's
    # lr is used until the next scheduler step.
    warm = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                                           "warmup_type": "linear"}}
    cfg = config(optimizer={"type": "Adam", "params": {"lr": 0.004}}, scheduler=warm)
    engine, _, _, _ = deepspeed.initialize(model=net(torch), config=cfg)
    engine_loop(torch, engine, 3)
    engine.save_checkpoint(os.path.join(work, "warm"), tag="t3")
    engine, _, _, sched = deepspeed.initialize(model=net(torch), config=cfg)
    engine.load_checkpoint(os.path.join(work, "warm"), load_optimizer_states=False)
    if sched.state_dict()["last_batch_iteration"] != 2 or engine.get_lr() != [0.004]:
        fail(f"load_optimizer_states=False: position {sched.state_dict()}, lr {engine.get_lr()} (DeepSpeed: 2 and "
             "the fresh optimizer's 0.004 until the next scheduler step, not the schedule's 0.005)")
    engine_loop(torch, engine, 1, first=3)
    if not close(engine.get_lr()[0], 0.01 * 3 / 4, 1e-12):
        fail(f"after the next step the schedule's lr at iteration 3 (0.0075), got {engine.get_lr()}")
    print("ok   load_optimizer_states=False keeps the fresh optimizer's lr until the next scheduler step")
    engine, _, _, sched = deepspeed.initialize(model=net(torch), config=cfg)
    _, client = engine.load_checkpoint(os.path.join(work, "warm"), load_lr_scheduler_states=False)
    if sched.state_dict()["last_batch_iteration"] != -1:
        fail(f"load_lr_scheduler_states=False moved the scheduler to {sched.state_dict()} (DeepSpeed keeps -1)")
    if client.get("lr_scheduler") != {"last_batch_iteration": 2}:
        fail(f"load_lr_scheduler_states=False: the client state's lr_scheduler is {client.get('lr_scheduler')!r}")
    print("ok   load_lr_scheduler_states=False keeps the scheduler's position and returns the saved state")


# ---------------------------------------------------------------- optimizer

def worker_optimizer(deepspeed, torch, work):
    def reference(wd=0.0):
        ref = net(torch)
        ropt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=wd)
        return torch_loop(torch, ref, ropt, None, 4)

    # DeepSpeed lower-cases the type: "adamw", "ADAM" (Adam with adam_w_mode: decoupled decay).
    for t in ("adamw", "ADAM", "AdamW"):
        engine, _, _, _ = deepspeed.initialize(
            model=net(torch), config=config(optimizer={"type": t, "params": {"lr": 0.01, "weight_decay": 0.1}}))
        same_run(f"config optimizer type {t!r}", engine_loop(torch, engine, 4), reference(0.1))

    # A client optimizer, or a callable building it, over a config section: the client's trains.
    cfg = config(optimizer={"type": "Adam", "params": {"lr": 0.5, "weight_decay": 0.3}})
    model = net(torch)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01,
                                                                                     weight_decay=0.0), config=cfg)
    same_run("a client optimizer over a config 'optimizer' section", engine_loop(torch, engine, 4), reference())
    engine, _, _, _ = deepspeed.initialize(model=net(torch),
                                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.0),
                                           config=cfg)
    same_run("a client optimizer callable", engine_loop(torch, engine, 4), reference())

    # ZeRO-Offload with a client torch optimizer: refused unless zero_force_ds_cpu_optimizer is false.
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    model = net(torch)
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                             config=config(zero_optimization=offload))
        fail("ZeRO-Offload with a client torch.optim.AdamW was accepted (DeepSpeed 0.14.5 refuses it)")
    except ValueError as e:
        if "zero_force_ds_cpu_optimizer" not in str(e):
            fail(f"the refusal does not name zero_force_ds_cpu_optimizer: {e}")
    deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                         config=config(zero_optimization=offload, zero_force_ds_cpu_optimizer=False))
    print("ok   ZeRO-Offload with a client torch optimizer: refused, accepted with zero_force_ds_cpu_optimizer false")

    # No optimizer at all: an engine for forward, eval and the module's save/load.
    for stage in (0, 2):
        cfg = config(zero_optimization={"stage": stage},
                     scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 3}})
        model = net(torch)
        engine, opt, _, sched = deepspeed.initialize(model=model, config=cfg, lr_scheduler=lambda o: None)
        if opt is not None or sched is not None or engine.optimizer is not None or engine.lr_scheduler is not None:
            fail(f"stage {stage}: without an optimizer DeepSpeed's engine has no optimizer and no scheduler")
        x = batch(torch, 0, 0)
        engine.eval()
        with torch.no_grad():
            if not torch.equal(engine(x), net(torch)(x)):
                fail(f"stage {stage}: the engine's forward differs from the module's")
        for call, args in (("backward", (engine(x).sum(),)), ("step", ())):
            try:
                getattr(engine, call)(*args)
                fail(f"stage {stage}: engine.{call}() without an optimizer was accepted")
            except AssertionError as e:
                if "must provide optimizer" not in str(e):
                    fail(f"stage {stage}: engine.{call}()'s refusal: {e}")
        folder = os.path.join(work, f"noopt{stage}")
        engine.save_checkpoint(folder)
        other, _, _, _ = deepspeed.initialize(model=net(torch, seed=7), config=cfg)
        other.load_checkpoint(folder)
        with torch.no_grad():
            if not torch.equal(other(x), engine(x)):
                fail(f"stage {stage}: the module saved without an optimizer did not load")
        print(f"ok   stage {stage}: no optimizer: forward, eval, save/load; backward and step refused by name")


# ---------------------------------------------------------------- deepspeed

def uckpt_schedules(deepspeed, torch):
    out = {}
    for name in SCHEDULERS:
        engine, opt, _, _ = sched_engine(deepspeed, torch, name)
        rec = []
        for u in range(STEPS):
            rec.append([[g["lr"], list(g["betas"])] for g in opt.param_groups])
            for m in range(2):
                engine.backward(engine(batch(torch, u, m)).pow(2).mean())
                engine.step()
        out[name] = rec
    return out


def deepspeed_schedules():
    import torch
    from deepspeed.runtime import lr_schedules
    out = {}
    for name, params in SCHEDULERS.items():
        model = net(torch)
        opt = torch.optim.Adam([{"params": list(model[0].parameters()), "lr": 0.01},
                                {"params": list(model[2].parameters()), "lr": 0.02}], lr=0.01)
        sched = getattr(lr_schedules, name)(opt, **params)
        rec = []
        for _ in range(STEPS):
            rec.append([[g["lr"], list(g["betas"])] for g in opt.param_groups])
            sched.step()
        out[name] = rec
    return out


def compare_deepspeed(src, shim, work):
    # DeepSpeed's own imports (hjson) come from the fixtures' shim when the host lacks them.
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + shim, DS_ACCELERATOR="cpu")
    out = os.path.join(work, "deepspeed.json")
    p = subprocess.run([sys.executable, __file__, "--deepspeed", out], env=env, cwd=src, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300)
    if p.returncode != 0:
        fail("real DeepSpeed's schedulers did not run:\n" + p.stdout[-3000:])
    want = json.load(open(out))
    got = json.load(open(os.path.join(work, "uckpt.json")))
    for name in SCHEDULERS:
        for u, (g, w) in enumerate(zip(got[name], want[name])):
            if g != w:
                fail(f"{name}: update {u + 1}: uckpt's [lr, betas] per group {g} vs DeepSpeed's {w}")
        print(f"ok   {name}: {len(want[name])} updates, every group's lr and betas equal DeepSpeed's")


# ---------------------------------------------------------------- driver

def worker(case, work):
    import torch
    import uckpt as deepspeed
    deepspeed.init_distributed()
    if case == "deepspeed":
        json.dump(uckpt_schedules(deepspeed, torch), open(os.path.join(work, "uckpt.json"), "w"))
        return
    globals()["worker_" + case](deepspeed, torch, work)


def main():
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return
    if sys.argv[1] == "--deepspeed":
        json.dump(deepspeed_schedules(), open(sys.argv[2], "w"))
        return
    case, pypath = sys.argv[1], sys.argv[2]
    src = os.environ.get("UCKPT_DEEPSPEED_SRC", "")
    if case == "deepspeed" and not os.path.isfile(os.path.join(src, "deepspeed", "__init__.py")):
        print("SKIP: UCKPT_DEEPSPEED_SRC does not name a DeepSpeed 0.14.5 source tree")
        sys.exit(SKIP)
    with tempfile.TemporaryDirectory() as work:
        env = dict(os.environ, PYTHONPATH=pypath, OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu")
        p = subprocess.run([sys.executable, __file__, "--worker", case, work], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=300)
        sys.stdout.write(p.stdout)
        if p.returncode != 0:
            fail(f"{case}: the worker failed (output above)")
        if case == "deepspeed":
            compare_deepspeed(src, sys.argv[3] if len(sys.argv) > 3 else "", work)
    print(f"PASS {case}")


if __name__ == "__main__":
    main()
