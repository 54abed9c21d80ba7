#!/usr/bin/env python3
"""Client element-wise torch optimizers on the engine's partitions (#26), CPU, toy model (seconds).

usage: optimizers_test.py CASE PYTHONPATH_OF_UCKPT UCKPT_BINARY WORK_DIR [DEEPSPEED_SCRIPTS_DIR]

CASE:
  vs_torch   SGD (momentum, Nesterov, weight decay; and plain), Adagrad, RMSprop (momentum, centered),
             Adamax, NAdam, RAdam, AdamW(amsgrad) at ZeRO 1, 2 and 3 on 2 ranks (SGD at 2 and 3 with
             offload_optimizer too): the global losses equal a plain PyTorch loop's over the same global
             batches (fp32, 1e-6 relative).
  resume     each optimizer saved at 2 ranks (stage 1, 2 or 3), its DeepSpeed files holding the optimizer's own
             state keys; `uckpt convert` writes one universal file per key (momentum_buffer.pt, sum.pt, ...);
             resumed at 1 rank at another stage from the universal folder and from the rank files, and at 4
             ranks from the universal folder: the losses continue the uninterrupted run (1e-6 relative).
  deepspeed  real DeepSpeed 0.14.5 (UCKPT_DEEPSPEED_SRC, on CPU; else exit 77) saves SGD (momentum) at ZeRO 2
             on 2 ranks: uckpt resumes its checkpoint at 1 rank, ZeRO 1, continuing DeepSpeed's run (1e-6
             relative), and uckpt's own files of the same run hold DeepSpeed's keys.
  refused    LBFGS is refused at initialize naming it (ZeRO stage 0: stage0_optimizers_test.py); an optimizer whose state is not element-wise is refused
             at its first step naming it; an Adam run refuses a checkpoint of SGD's state.
"""
import json
import os
import shutil
import subprocess
import sys

from testkit import fail, launch

HERE = os.path.dirname(os.path.abspath(__file__))
UPDATES = 6
SAVE = 3
GLOBAL = 4  # samples per update


def optimizers(torch):
    o = torch.optim
    return {
        "sgd_momentum": lambda p: o.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
        "sgd": lambda p: o.SGD(p, lr=0.05),
        "adagrad": lambda p: o.Adagrad(p, lr=0.01, weight_decay=0.01),
        "rmsprop": lambda p: o.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
        "adamax": lambda p: o.Adamax(p, lr=0.01),
        "nadam": lambda p: o.NAdam(p, lr=0.01),
        "radam": lambda p: o.RAdam(p, lr=0.01),
        "adamw_amsgrad": lambda p: o.AdamW(p, lr=0.01, amsgrad=True),
    }


# The per-element state keys torch 1.13 keeps (the DeepSpeed files' and the universal folder's).
KEYS = {
    "sgd_momentum": ["momentum_buffer"],
    "sgd": [],
    "adagrad": ["sum"],
    "rmsprop": ["grad_avg", "momentum_buffer", "square_avg"],
    "adamax": ["exp_avg", "exp_inf"],
    "nadam": ["exp_avg", "exp_avg_sq"],
    "radam": ["exp_avg", "exp_avg_sq"],
    "adamw_amsgrad": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
}
SCALARS = {"nadam": ["mu_product"]}


def toy_net(torch):
    """testkit's toy model, its loss the mean square error to a target it cannot fit in a few updates."""
    import testkit
    net = testkit.toy_net(torch)

    class Regress(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            h = self.net.inp(x)
            for b in self.net.blocks:
                h = b(h)
            return (self.net.out(h) - 3 * x.sum(1, keepdim=True) - 1).pow(2).mean()

    return Regress()


def close(a, b, tol=1e-6):
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-30)


def sample(torch, update, i):
    g = torch.Generator().manual_seed(1000 * update + i)
    return torch.randn(1, 4, generator=g)


def batch(torch, update, first, n):
    return torch.cat([sample(torch, update, first + i) for i in range(n)])


def config(stage, micro, ga=1, **extra):
    c = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": ga,
         "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    c.update(extra)
    return c


def reference(torch, name, updates):
    """A plain PyTorch loop over the global batches: the mean loss of each update."""
    model = toy_net(torch)
    opt = optimizers(torch)[name](model.parameters())
    out = []
    for u in range(updates):
        loss = model(batch(torch, u, 0, GLOBAL))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def engine_run(deepspeed, torch, name, stage, first, updates, ckpt=None, save_at=None, universal=False,
               offload=False):
    """The engine at this world size: GLOBAL samples per update split over the ranks (GA 2 at 1 rank);
    the global mean loss of each update."""
    import torch.distributed as dist
    world = dist.get_world_size()
    ga = 2 if world == 1 else 1
    micro = GLOBAL // (world * ga)
    model = toy_net(torch)
    extra = {"checkpoint": {"load_universal": True}} if universal else {}
    if offload:  # a client optimizer under offload: DeepSpeed asks for zero_force_ds_cpu_optimizer false
        extra["zero_force_ds_cpu_optimizer"] = False
    cfg = config(stage, micro, ga, **extra)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizers(torch)[name](model.parameters()),
                                           config=cfg)
    if first > 0:
        path, _ = engine.load_checkpoint(ckpt)
        if path is None:
            fail(f"{name}: nothing loaded from {ckpt}")
    return run_updates(engine, torch, first, updates, ga, micro,
                       lambda done: engine.save_checkpoint(ckpt) if save_at is not None and done == save_at else None)


def run_updates(engine, torch, first, updates, ga, micro, after_update=None):
    """Updates first.. first+updates-1 (ga micro-steps of `micro` samples per rank each); the global mean loss of
    each. after_update(n) runs once n updates are done."""
    import torch.distributed as dist
    world, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for u in range(first, first + updates):
        total = torch.zeros(())
        for m in range(ga):
            loss = engine(batch(torch, u, (rank * ga + m) * micro, micro))
            engine.backward(loss)
            engine.step()
            total += loss.detach() / ga
        dist.all_reduce(total)
        out.append(total.item() / world)
        if after_update:
            after_update(u + 1)
    return out


def same(what, got, want, tol=1e-6):
    worst = max((abs(a - b) / max(abs(a), abs(b), 1e-30) for a, b in zip(got, want)), default=0)
    print(f"     {what}: largest relative difference {worst:.2e}")
    for u, (a, b) in enumerate(zip(got, want)):
        if not close(a, b, tol):
            fail(f"{what}: update {u + 1}: loss {a!r} vs {b!r}")
    if len(got) != len(want):
        fail(f"{what}: {len(got)} updates vs {len(want)}")


# ---------------------------------------------------------------- workers

def worker_vs_torch(deepspeed, torch, work):
    for name in optimizers(torch):
        want = reference(torch, name, UPDATES)
        for stage in (1, 2, 3):
            got = engine_run(deepspeed, torch, name, stage, 0, UPDATES)
            same(f"{name} at ZeRO {stage}", got, want)
            if name == "sgd_momentum" and stage > 1:
                got = engine_run(deepspeed, torch, name, stage, 0, UPDATES, offload=True)
                same(f"{name} at ZeRO {stage} with offload_optimizer", got, want)
        print(f"ok   {name}: ZeRO 1, 2, 3 losses as the plain PyTorch loop")


SAVE_STAGE = {"sgd_momentum": 2, "sgd": 1, "adagrad": 3, "rmsprop": 2, "adamax": 1, "nadam": 3, "radam": 2,
              "adamw_amsgrad": 3}


def worker_save(deepspeed, torch, work, only=None, prefix=""):
    import torch.distributed as dist
    for name in optimizers(torch):
        if only and name != only:
            continue
        ckpt = os.path.join(work, prefix + name)
        full = engine_run(deepspeed, torch, name, SAVE_STAGE[name], 0, UPDATES, ckpt=ckpt, save_at=SAVE)
        if dist.get_rank() == 0:
            json.dump(full, open(os.path.join(work, prefix + name + ".json"), "w"))


def worker_resume(deepspeed, torch, work, source):
    for name in optimizers(torch):
        full = json.load(open(os.path.join(work, name + ".json")))
        stage = {1: 3, 2: 1, 3: 2}[SAVE_STAGE[name]]
        got = engine_run(deepspeed, torch, name, stage, SAVE, UPDATES - SAVE, ckpt=os.path.join(work, name),
                         universal=source == "universal")
        same(f"{name}: saved at ZeRO {SAVE_STAGE[name]}, resumed from {source} at ZeRO {stage}", got, full[SAVE:])
        print(f"ok   {name}: resumed from {source} at ZeRO {stage}, the uninterrupted run's losses")


def worker_refused(deepspeed, torch, work):
    model = toy_net(torch)
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.LBFGS(model.parameters()), config=config(2, 2))
        fail("LBFGS was not refused")
    except ValueError as e:
        if "LBFGS" not in str(e):
            fail(f"LBFGS refused without its name: {e}")
        print(f"ok   refused: {e}")

    class WholeNorm(torch.optim.Optimizer):
        """Keeps one value per parameter (not element-wise)."""

        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    self.state[p]["norm"] = p.grad.norm().reshape(1, 1)
                    p.add_(p.grad, alpha=-g["lr"])

    model = toy_net(torch)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=WholeNorm(model.parameters()), config=config(2, 2))
    engine.backward(engine(batch(torch, 0, 0, 2)))
    try:
        engine.step()
        fail("WholeNorm's state was not refused")
    except ValueError as e:
        if "WholeNorm" not in str(e) or "'norm'" not in str(e):
            fail(f"WholeNorm refused without naming it and its state: {e}")
        print(f"ok   refused at the first step: {e}")

    # An Adam run does not take SGD's state.
    ckpt = os.path.join(work, "sgd_for_adam")
    engine_run(deepspeed, torch, "sgd_momentum", 2, 0, 1, ckpt=ckpt, save_at=1)
    model = toy_net(torch)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()),
                                           config=config(2, 2))
    try:
        engine.load_checkpoint(ckpt)
        fail("an Adam run loaded SGD's state")
    except Exception as e:  # noqa: BLE001 - the engine's format error
        if "momentum_buffer" not in str(e):
            fail(f"Adam's load of SGD's state refused without naming its keys: {e}")
        print(f"ok   refused: {e}")


def worker_resume_deepspeed(deepspeed, torch, work):
    full = json.load(open(os.path.join(work, "ds_sgd_momentum.json")))
    got = engine_run(deepspeed, torch, "sgd_momentum", 1, SAVE, UPDATES - SAVE, ckpt=os.path.join(work, "ds_sgd_momentum"))
    same("DeepSpeed's SGD ZeRO 2 checkpoint resumed by uckpt at ZeRO 1", got, full[SAVE:])
    print("ok   uckpt continues DeepSpeed's SGD run from its checkpoint")


def worker(case, work, *rest):
    import torch
    if case == "ds_save":  # real DeepSpeed on CPU
        import deepspeed
        import ds_cpu_compat
        ds_cpu_compat.apply()
    else:
        import uckpt as deepspeed
    deepspeed.init_distributed()
    torch.set_num_threads(1)
    if case == "ds_save":
        worker_save(deepspeed, torch, work, "sgd_momentum", "ds_")
    elif case == "save" and rest:
        worker_save(deepspeed, torch, work, rest[0])
    elif case == "resume":
        worker_resume(deepspeed, torch, work, rest[0])
    else:
        globals()["worker_" + case](deepspeed, torch, work)


# ---------------------------------------------------------------- driver

class _StubMeta(type):

    def __getattr__(cls, name):  # getattr(ZeroStageEnum, 'gradients') and the like
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Stub(metaclass=_StubMeta):
    """Any class of DeepSpeed's a file pickles (loss scalers, ZeroStageEnum)."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


class _DeepSpeedStubs:
    """An import finder that makes every deepspeed.* module one whose names are _Stub, so that
    torch.load reads DeepSpeed's files without DeepSpeed."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        import importlib.util
        if name == "deepspeed" or name.startswith("deepspeed."):
            return importlib.util.spec_from_loader(name, cls, is_package=True)
        return None

    @staticmethod
    def create_module(spec):
        import types

        class Module(types.ModuleType):

            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return _Stub

        return Module(spec.name)

    @staticmethod
    def exec_module(module):
        pass


def check_files(uckpt, work):
    """The rank files hold each optimizer's keys; the universal folder one file per key."""
    import torch
    sys.meta_path.insert(0, _DeepSpeedStubs)
    for name in KEYS:
        tag = os.path.join(work, name, f"global_step{SAVE}")
        sd = torch.load(os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"), map_location="cpu")
        osd = sd["optimizer_state_dict"]
        base = osd["optimizer_state_dict"] if SAVE_STAGE[name] == 3 else osd["base_optimizer_state"]
        state = base["state"].get(0, {})
        keys = sorted(k for k, v in state.items() if hasattr(v, "dim") and v.dim() == 1)
        if keys != KEYS[name]:
            fail(f"{name}: the rank file's state keys are {keys}, torch's are {KEYS[name]}")
        if name == "sgd":  # as torch's own state_dict (DeepSpeed's file): 1.13 keeps momentum_buffer None, 2.x nothing
            p = torch.nn.Parameter(torch.ones(2))
            sgd = torch.optim.SGD([p], lr=0.1)
            p.grad = torch.ones(2)
            sgd.step()
            want = sgd.state_dict()["state"].get(0, {})
            if state != want:
                fail(f"sgd without momentum: the rank file's state[0] is {state}, torch's {want}")
        out = os.path.join(work, name, f"global_step{SAVE}_universal")
        p = subprocess.run([uckpt, "convert", "-q", tag, out], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
        if p.returncode != 0:
            fail(f"{name}: uckpt convert failed:\n{p.stdout}")
        with open(os.path.join(work, name, "latest_universal"), "w") as f:
            f.write(f"global_step{SAVE}_universal")
        pdir = os.path.join(out, "zero", "net.inp.weight")
        files = sorted(os.listdir(pdir))
        want = sorted(["fp32.pt"] + [k + ".pt" for k in KEYS[name] + SCALARS.get(name, [])] +
                      (["step.pt"] if name not in ("sgd", "sgd_momentum") else []))
        if files != want:
            fail(f"{name}: universal files {files}, want {want}")
        for k in KEYS[name]:
            t = torch.load(os.path.join(pdir, k + ".pt"), map_location="cpu")
            t = t["param"] if isinstance(t, dict) else t
            if t.numel() != 32:
                fail(f"{name}: {k}.pt holds {t.numel()} elements, inp.weight has 32")
        print(f"ok   {name}: rank files hold {keys}; universal files {files}")


def zero2_optimizer_state(torch, path):
    sys.meta_path.insert(0, _DeepSpeedStubs)
    sd = torch.load(path, map_location="cpu")
    return sd["optimizer_state_dict"]["base_optimizer_state"]


def compare_deepspeed_keys(work):
    """uckpt's ZeRO 2 optimizer file of SGD holds DeepSpeed's keys: the state entry and the param group."""
    import torch
    name = f"global_step{SAVE}/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    ds = zero2_optimizer_state(torch, os.path.join(work, "ds_sgd_momentum", name))
    ours = zero2_optimizer_state(torch, os.path.join(work, "sgd_momentum", name))
    for what, a, b in (("state[0]", ours["state"][0], ds["state"][0]),
                       ("param_groups[0]", ours["param_groups"][0], ds["param_groups"][0])):
        if sorted(a) != sorted(b):
            fail(f"uckpt's base_optimizer_state {what} keys {sorted(a)}, DeepSpeed's {sorted(b)}")
    print(f"ok   uckpt's SGD file holds DeepSpeed's keys: state {sorted(ours['state'][0])}, "
          f"param group {sorted(ours['param_groups'][0])}")


def deepspeed_available(scripts):
    src = os.environ.get("UCKPT_DEEPSPEED_SRC", "")
    if not os.path.isfile(os.path.join(src, "deepspeed", "__init__.py")):
        print("SKIP: UCKPT_DEEPSPEED_SRC does not name a DeepSpeed 0.14.5 source tree")
        sys.exit(77)
    return os.pathsep.join([src, os.path.join(scripts, "pyshim"), scripts])


def main():
    if sys.argv[1] == "--worker":
        worker(*sys.argv[2:])
        return
    case, pypath, uckpt, work = sys.argv[1:5]
    shutil.rmtree(work, ignore_errors=True)  # a fresh folder each run (convert refuses to replace its output)
    os.makedirs(work)
    script = os.path.abspath(__file__)
    if case == "vs_torch":
        launch(script, "vs_torch", pypath, 2, [work])
    elif case == "deepspeed":
        ds_path = deepspeed_available(sys.argv[5])
        launch(script, "ds_save", ds_path, 2, [work])
        launch(script, "save", pypath, 2, [work, "sgd_momentum"])
        compare_deepspeed_keys(work)
        launch(script, "resume_deepspeed", pypath, 1, [work])
    elif case == "refused":
        launch(script, "refused", pypath, 1, [work])
    elif case == "resume":
        launch(script, "save", pypath, 2, [work])
        check_files(uckpt, work)
        launch(script, "resume", pypath, 1, [work, "universal"])
        launch(script, "resume", pypath, 1, [work, "rank files"])
        launch(script, "resume", pypath, 4, [work, "universal"])
    else:
        fail(f"unknown case {case}")
    print(f"PASS {case}")


if __name__ == "__main__":
    main()
