#!/usr/bin/env python3
"""Client element-wise torch optimizers at ZeRO stage 0 (#26), CPU, toy model (seconds).

usage: stage0_optimizers_test.py CASE PYTHONPATH_OF_UCKPT UCKPT_BINARY WORK_DIR [DEEPSPEED_SCRIPTS_DIR]

CASE:
  vs_torch    SGD (momentum, Nesterov, weight decay; and plain), Adagrad, RMSprop, Adamax, NAdam, RAdam,
              AdamW(amsgrad) at ZeRO 0 on 2 ranks, and SGD with two param groups at 1 rank with GA 2: the global
              losses equal a plain PyTorch loop's (fp32, 1e-6 relative); bf16 at stage 0 refused at
              initialize naming the optimizer, the stage and the precision (fp16 there is DeepSpeed's FP16
              wrappers: stage0_fp16_test.py), and a frozen parameter in the
              optimizer's groups (DeepSpeed's file numbers it among the state ids) naming it.
  resume      each optimizer saved at ZeRO 0 on 2 ranks: the model-states file's 'optimizer' is the plain loop's
              optimizer.state_dict() (keys, param groups, values); resumed at ZeRO 0 on 1 rank (its
              optimizer.state_dict() right after the load the file's, None states included), at ZeRO 3 on 2
              from the same folder, at ZeRO 0 on 4 from its `uckpt convert` universal folder (one file per state
              key); and a ZeRO 2 checkpoint of 1 rank resumed at ZeRO 0 on 2: each continues the uninterrupted run.
  state_dict  engine.optimizer.state_dict() at ZeRO 0 is the plain loop's optimizer.state_dict(); the returned
              optimizer's load_state_dict() of it, and a client optimizer's load_state_dict() before initialize
              (imagenet/main.py's resume), continue the run; torch's AdamW (stepped by the engine's own Adam)
              gives torch's state_dict() too; state_dict() of the config's optimizer is refused naming the case;
              at ZeRO 2 it is the ZeRO optimizer's, and load_state_dict() is refused naming the stage.
  inspect     `uckpt inspect` names each optimizer by its state keys in its ZeRO 0 and 2 folders and the universal
              one, and `uckpt verify` accepts each stage-0 folder (NAdam's 0-d mu_product included).
  hparams     load_checkpoint restores the client optimizer's own param-group entries (SGD's momentum, nesterov,
              weight_decay; Adagrad's lr_decay) at ZeRO 0 and 2, as DeepSpeed's load_state_dict does, and the
              run continues the uninterrupted one.
  deepspeed   real DeepSpeed 0.14.5 (UCKPT_DEEPSPEED_SRC, on CPU; else exit 77) runs SGD (momentum) at ZeRO 0 in
              fp32 on 2 ranks: uckpt's model-states file holds what DeepSpeed's does ('optimizer': keys, param
              groups, values), uckpt's optimizer.state_dict() is DeepSpeed's, uckpt resumes DeepSpeed's checkpoint
              (and its `uckpt convert` universal folder at ZeRO 2) and DeepSpeed resumes uckpt's, each continuing
              the run.
"""
import json
import os
import shutil
import subprocess
import sys

import optimizers_test as base
from optimizers_test import GLOBAL, SAVE, UPDATES, batch, config, optimizers, same, toy_net
from testkit import fail, launch


def engine_run(deepspeed, torch, name, stage, first, updates, ckpt=None, save_at=None, universal=False,
               make_opt=None, before_load=None, dump_state_dict=None, extra=None, after_load=None):
    """As optimizers_test.engine_run (updates `first`.. on, loading `ckpt` when given); `make_opt(params)`
    builds the optimizer (default: `name`'s), `before_load(engine)` runs before the load, and
    `dump_state_dict` (a path) receives rank 0's engine.optimizer.state_dict() at save_at."""
    import torch.distributed as dist
    world, rank = dist.get_world_size(), dist.get_rank()
    ga = 2 if world == 1 else 1
    micro = GLOBAL // (world * ga)
    model = toy_net(torch)
    extra = dict(extra or {}, **({"checkpoint": {"load_universal": True}} if universal else {}))
    opt = (make_opt or optimizers(torch)[name])(model.parameters())
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config(stage, micro, ga, **extra))
    if before_load:
        before_load(engine)
    if first > 0 and ckpt:
        path, _ = engine.load_checkpoint(ckpt)
        if path is None:
            fail(f"{name}: nothing loaded from {ckpt}")
        if after_load:
            after_load(engine, path)
    def after_update(done):
        if save_at is not None and done == save_at:
            if ckpt:
                engine.save_checkpoint(ckpt)
            if dump_state_dict and rank == 0:
                torch.save(optimizer.state_dict(), dump_state_dict)
    return base.run_updates(engine, torch, first, updates, ga, micro, after_update)


def reference_state_dict(torch, name, updates, make_opt=None):
    """The plain loop's optimizer.state_dict() after `updates` updates."""
    model = toy_net(torch)
    opt = (make_opt or optimizers(torch)[name])(model.parameters())
    for u in range(updates):
        model(batch(torch, u, 0, GLOBAL)).backward()
        opt.step()
        opt.zero_grad()
    return opt.state_dict()


def same_state_dict(what, got, want, tol=1e-6):
    """Two torch optimizer state_dicts: the same ids, keys, kinds and param groups; values within tol."""
    import torch
    if sorted(got["state"]) != sorted(want["state"]):
        fail(f"{what}: state ids {sorted(got['state'])}, want {sorted(want['state'])}")
    for i, st in want["state"].items():
        g = got["state"][i]
        if list(g) != list(st):
            fail(f"{what}: state[{i}] keys {list(g)}, want {list(st)}")
        for k, v in st.items():
            a = g[k]
            if v is None or a is None:
                if not (v is None and a is None):
                    fail(f"{what}: state[{i}]['{k}'] is {a!r}, want {v!r}")
                continue
            if isinstance(v, torch.Tensor) != isinstance(a, torch.Tensor):
                fail(f"{what}: state[{i}]['{k}'] is a {type(a).__name__}, want a {type(v).__name__}")
            if isinstance(v, torch.Tensor):
                if a.shape != v.shape or a.dtype != v.dtype:
                    fail(f"{what}: state[{i}]['{k}'] {a.dtype} {tuple(a.shape)}, want {v.dtype} {tuple(v.shape)}")
                diff = (a.double() - v.double()).abs().max().item() if v.numel() else 0.0
                if diff > tol * max(v.double().abs().max().item(), 1e-30):
                    fail(f"{what}: state[{i}]['{k}'] differs by {diff:.3e}")
            elif abs(a - v) > tol * max(abs(v), 1e-30):
                fail(f"{what}: state[{i}]['{k}'] = {a!r}, want {v!r}")
    if len(got["param_groups"]) != len(want["param_groups"]):
        fail(f"{what}: {len(got['param_groups'])} param groups, want {len(want['param_groups'])}")
    for k, (a, b) in enumerate(zip(got["param_groups"], want["param_groups"])):
        if a != b:
            fail(f"{what}: param_groups[{k}] {a}, want {b}")


def two_groups_sgd(torch):
    """SGD over two param groups with their own momentum and weight decay."""
    def make(params):
        params = list(params)
        return torch.optim.SGD([{"params": params[:4], "momentum": 0.5},
                                {"params": params[4:], "weight_decay": 0.02, "nesterov": True}],
                               lr=0.05, momentum=0.9)
    return make


# ---------------------------------------------------------------- workers

def worker_vs_torch(deepspeed, torch, work):
    import torch.distributed as dist
    if dist.get_world_size() == 1:
        make = two_groups_sgd(torch)
        model = toy_net(torch)
        want = []
        opt = make(model.parameters())
        for u in range(UPDATES):
            loss = model(batch(torch, u, 0, GLOBAL))
            loss.backward()
            opt.step()
            opt.zero_grad()
            want.append(loss.item())
        same("SGD with two param groups at ZeRO 0, 1 rank GA 2", engine_run(deepspeed, torch, "sgd", 0, 0, UPDATES,
                                                                            make_opt=make), want)
        print("ok   SGD with two param groups at ZeRO 0: losses as the plain PyTorch loop")
        # bf16 at stage 0: DeepSpeed's BF16_Optimizer around a client optimizer (fp16: stage0_fp16_test.py).
        model = toy_net(torch)
        try:
            deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 config=config(0, 4, bf16={"enabled": True}))
            fail("SGD at ZeRO 0 in bf16 was not refused")
        except ValueError as e:
            if "SGD" not in str(e) or "stage 0" not in str(e) or "bf16" not in str(e):
                fail(f"SGD at ZeRO 0 in bf16 refused without naming the optimizer, stage and precision: {e}")
            print(f"ok   refused: {e}")
        model = toy_net(torch)
        model.net.out.bias.requires_grad_(False)
        try:
            deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                 config=config(0, 4))
            fail("SGD at ZeRO 0 over a frozen parameter was not refused")
        except ValueError as e:
            if "SGD" not in str(e) or "stage 0" not in str(e) or "frozen" not in str(e):
                fail(f"SGD at ZeRO 0 over a frozen parameter refused without naming the optimizer, stage, cause: {e}")
            print(f"ok   refused: {e}")
        return
    for name in optimizers(torch):
        want = base.reference(torch, name, UPDATES)
        same(f"{name} at ZeRO 0", engine_run(deepspeed, torch, name, 0, 0, UPDATES), want)
        print(f"ok   {name}: ZeRO 0 losses as the plain PyTorch loop")


def worker_save(deepspeed, torch, work, stage):
    import torch.distributed as dist
    for name in optimizers(torch):
        ckpt = os.path.join(work, f"z{stage}_{name}")
        full = engine_run(deepspeed, torch, name, int(stage), 0, UPDATES, ckpt=ckpt, save_at=SAVE)
        if dist.get_rank() == 0:
            json.dump(full, open(ckpt + ".json", "w"))


def worker_resume(deepspeed, torch, work, saved_stage, stage, source):
    import torch.distributed as dist

    def same_as_file(engine, path):
        """At ZeRO 0 from a ZeRO 0 folder: the loaded state is the file's, None states included."""
        if saved_stage == stage == "0" and source != "universal" and dist.get_rank() == 0:
            same_state_dict(f"{name}: optimizer.state_dict() right after load_checkpoint",
                            engine.optimizer.state_dict(),
                            model_states_optimizer(os.path.join(path, "mp_rank_00_model_states.pt")))

    for name in optimizers(torch):
        ckpt = os.path.join(work, f"z{saved_stage}_{name}")
        full = json.load(open(ckpt + ".json"))
        got = engine_run(deepspeed, torch, name, int(stage), SAVE, UPDATES - SAVE, ckpt=ckpt,
                         universal=source == "universal", after_load=same_as_file)
        same(f"{name}: saved at ZeRO {saved_stage}, resumed from {source} at ZeRO {stage}", got, full[SAVE:])
    print(f"ok   every optimizer saved at ZeRO {saved_stage} resumed from {source} at ZeRO {stage}, "
          "continuing the uninterrupted run")


def worker_state_dict(deepspeed, torch, work):
    import torch.distributed as dist
    rank = dist.get_rank()
    for name in optimizers(torch):
        dump = os.path.join(work, f"{name}.sd.pt")
        full = engine_run(deepspeed, torch, name, 0, 0, UPDATES, save_at=SAVE, dump_state_dict=dump)
        dist.barrier()
        if rank == 0:
            same_state_dict(f"{name}: engine.optimizer.state_dict() at ZeRO 0", torch.load(dump),
                            reference_state_dict(torch, name, SAVE))
        # The returned optimizer's load_state_dict on a fresh engine (weights from the plain loop's run).
        weights = reference_weights(torch, name, SAVE)

        def load_into_engine(engine):
            engine.module.load_state_dict(weights)
            engine.optimizer.load_state_dict(torch.load(dump))

        got = engine_run(deepspeed, torch, name, 0, SAVE, UPDATES - SAVE, before_load=load_into_engine,
                         make_opt=shifted(torch, name))
        same(f"{name}: engine.optimizer.load_state_dict() at ZeRO 0", got, full[SAVE:])

        # imagenet/main.py's resume: the client optimizer's load_state_dict before initialize.
        def client_loaded(params):
            params = list(params)
            opt = optimizers(torch)[name](params)
            opt.load_state_dict(torch.load(dump))
            return opt

        def load_weights(engine):
            engine.module.load_state_dict(weights)

        got = engine_run(deepspeed, torch, name, 0, SAVE, UPDATES - SAVE, before_load=load_weights,
                         make_opt=client_loaded)
        same(f"{name}: the client optimizer's load_state_dict before initialize at ZeRO 0", got, full[SAVE:])
        print(f"ok   {name}: state_dict() is torch's; load_state_dict() continues the run")
    # torch's AdamW, which the engine's own Adam steps: its state_dict() is torch's too.
    adamw = lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.01)  # noqa: E731
    dump = os.path.join(work, "adamw.sd.pt")
    engine_run(deepspeed, torch, "adamw", 0, 0, SAVE, save_at=SAVE, dump_state_dict=dump, make_opt=adamw)
    dist.barrier()
    if rank == 0:
        same_state_dict("torch AdamW (the engine's Adam): engine.optimizer.state_dict() at ZeRO 0", torch.load(dump),
                        reference_state_dict(torch, "adamw", SAVE, make_opt=adamw))
        print("ok   AdamW: state_dict() is torch's")
    # The optimizer the config's section made: DeepSpeed's is that class's, which uckpt does not write.
    model = toy_net(torch)
    _, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                        config=config(0, 2, optimizer={"type": "AdamW", "params": {"lr": 0.01}}))
    try:
        opt.state_dict()
        fail("optimizer.state_dict() of the config's optimizer was not refused")
    except RuntimeError as e:
        if "'optimizer' section" not in str(e):
            fail(f"optimizer.state_dict() of the config's optimizer refused without naming the case: {e}")
        print(f"ok   refused: {e}")
    # A client optimizer whose parameters' states are not alike (torch skipped a parameter without a gradient):
    # refused, not collapsed into one value per group.
    for uneven in ("a parameter without state", "steps that differ"):
        model = toy_net(torch)
        params = list(model.parameters())
        opt = torch.optim.Adagrad(params, lr=0.01)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        if uneven == "a parameter without state":
            opt.state.pop(params[0])
        else:
            opt.state[params[0]]["step"] = opt.state[params[0]]["step"] + 1
        try:
            deepspeed.initialize(model=model, optimizer=opt, config=config(0, 2))
            fail(f"a client optimizer with {uneven} was taken at ZeRO 0")
        except ValueError as e:
            if "param group 0" not in str(e):
                fail(f"a client optimizer with {uneven} refused without naming the group: {e}")
            print(f"ok   refused ({uneven}): {e}")
    model = toy_net(torch)
    _, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        config=config(2, 2))
    # At ZeRO 2 state_dict() is DeepSpeed's ZeRO optimizer's (zero_optimizer_state_dict_test.py compares it);
    # load_state_dict() is refused.
    sd = opt.state_dict()
    if sd["base_optimizer_state"]["param_groups"][0]["lr"] != 0.1 or int(sd["zero_stage"]) != 2:
        fail(f"optimizer.state_dict() at ZeRO 2 is not the ZeRO optimizer's: {sd}")
    try:
        opt.load_state_dict([sd] * dist.get_world_size())
        fail("optimizer.load_state_dict() at ZeRO 2 was not refused")
    except RuntimeError as e:
        if "load_state_dict()" not in str(e) or "stage 2" not in str(e):
            fail(f"optimizer.load_state_dict() at ZeRO 2 refused without naming the call and the stage: {e}")
        print(f"ok   refused: {e}")


def reference_weights(torch, name, updates):
    """The module's state_dict after the plain loop's `updates` updates."""
    model = toy_net(torch)
    opt = optimizers(torch)[name](model.parameters())
    for u in range(updates):
        model(batch(torch, u, 0, GLOBAL)).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def shifted(torch, name):
    """`name`'s optimizer with other hyper-parameters (a load must bring back the saved ones)."""
    def make(params):
        opt = optimizers(torch)[name](params)
        for g in opt.param_groups:
            g["lr"] = g["lr"] * 3
            if "momentum" in g and g["momentum"]:
                g["momentum"] = 0.3
        return opt
    return make


HPARAMS = {
    "sgd_momentum": lambda torch, p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                     dampening=0.0),
    "adagrad": lambda torch, p: torch.optim.Adagrad(p, lr=0.01, lr_decay=0.05, weight_decay=0.01),
}
HPARAMS_OTHER = {
    "sgd_momentum": lambda torch, p: torch.optim.SGD(p, lr=0.05, momentum=0.5, weight_decay=0.0),
    "adagrad": lambda torch, p: torch.optim.Adagrad(p, lr=0.01, lr_decay=0.0, weight_decay=0.0),
}


def worker_hparams(deepspeed, torch, work):
    import torch.distributed as dist
    for stage in (0, 2):
        for name in HPARAMS:
            ckpt = os.path.join(work, f"hp_z{stage}_{name}")
            full = engine_run(deepspeed, torch, name, stage, 0, UPDATES, ckpt=ckpt, save_at=SAVE,
                              make_opt=lambda p, name=name: HPARAMS[name](torch, p))
            want = {k: v for k, v in HPARAMS[name](torch, [torch.zeros(1, requires_grad=True)]).param_groups[0].items()
                    if k != "params"}
            seen = {}

            def check_after(engine):
                seen["engine"] = engine

            got = engine_run(deepspeed, torch, name, stage, SAVE, UPDATES - SAVE, ckpt=ckpt, before_load=check_after,
                             make_opt=lambda p, name=name: HPARAMS_OTHER[name](torch, p))
            group = {k: v for k, v in seen["engine"].optimizer.param_groups[0].items() if k not in ("params", "lr")}
            want.pop("lr")
            if group != want:
                fail(f"{name} at ZeRO {stage}: param group after load_checkpoint {group}, saved {want}")
            same(f"{name} at ZeRO {stage}: resumed with other hyper-parameters in the client optimizer", got,
                 full[SAVE:])
            if dist.get_rank() == 0:
                print(f"ok   {name} at ZeRO {stage}: load_checkpoint restored {sorted(want)}")


# imagenet/main.py's config: an Adam section that DeepSpeed does not use beside the client's SGD.
IMAGENET_STYLE = {"optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                           "weight_decay": 3e-7}}}


def worker_save_small(deepspeed, torch, work):
    """NAdam at ZeRO 0 on a Linear(4, 8) alone (no one-element tensor): saved after one update."""
    model = torch.nn.Linear(4, 8)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.NAdam(model.parameters(), lr=0.01),
                                           config=config(0, 2, 2))
    for m in range(2):
        engine.backward(engine(batch(torch, 0, 2 * m, 2)).pow(2).mean())
        engine.step()
    engine.save_checkpoint(os.path.join(work, "small_nadam"))


def worker_ds_run(deepspeed, torch, work, who):
    """`who`'s SGD (momentum) run at ZeRO 0, fp32: save at SAVE, its optimizer.state_dict() dumped, losses kept."""
    import torch.distributed as dist
    ckpt = os.path.join(work, f"{who}_sgd")
    full = engine_run(deepspeed, torch, "sgd_momentum", 0, 0, UPDATES, ckpt=ckpt, save_at=SAVE,
                      dump_state_dict=os.path.join(work, f"{who}.sd.pt"), extra=IMAGENET_STYLE)
    if dist.get_rank() == 0:
        json.dump(full, open(ckpt + ".json", "w"))


def worker_ds_resume(deepspeed, torch, work, saver, stage="0", source="the folder"):
    """Resume `saver`'s checkpoint at `stage` from `source` and continue its run."""
    ckpt = os.path.join(work, f"{saver}_sgd")
    full = json.load(open(ckpt + ".json"))
    got = engine_run(deepspeed, torch, "sgd_momentum", int(stage), SAVE, UPDATES - SAVE, ckpt=ckpt,
                     extra=IMAGENET_STYLE, universal=source == "universal")
    same(f"{saver}'s ZeRO 0 SGD checkpoint resumed from {source} at ZeRO {stage}", got, full[SAVE:])


def worker(case, work, *rest):
    import torch
    if case.startswith("ds_") and rest and rest[0] == "deepspeed_runs":  # real DeepSpeed on CPU
        import deepspeed
        import ds_cpu_compat
        ds_cpu_compat.apply()
        rest = rest[1:]
    else:
        import uckpt as deepspeed
    deepspeed.init_distributed()
    torch.set_num_threads(1)
    globals()["worker_" + case](deepspeed, torch, work, *rest)


# ---------------------------------------------------------------- driver

def model_states_optimizer(path):
    import torch
    sys.meta_path.insert(0, base._DeepSpeedStubs)
    return torch.load(path, map_location="cpu")["optimizer"]


def check_stage0_files(uckpt, work):
    """The model-states file holds the plain loop's state_dict; convert writes one universal file per key."""
    import torch
    for name in optimizers(torch):
        tag = os.path.join(work, f"z0_{name}", f"global_step{SAVE}")
        got = model_states_optimizer(os.path.join(tag, "mp_rank_00_model_states.pt"))
        same_state_dict(f"{name}: the ZeRO 0 model-states file's 'optimizer'", got,
                        reference_state_dict(torch, name, SAVE))
        out = tag + "_universal"
        p = subprocess.run([uckpt, "convert", "-q", tag, out], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
        if p.returncode != 0:
            fail(f"{name}: uckpt convert of the ZeRO 0 folder failed:\n{p.stdout}")
        with open(os.path.join(work, f"z0_{name}", "latest_universal"), "w") as f:
            f.write(os.path.basename(out))
        pdir = os.path.join(out, "zero", "net.inp.weight")
        files = sorted(os.listdir(pdir))
        want = sorted(["fp32.pt"] + [k + ".pt" for k in base.KEYS[name] + base.SCALARS.get(name, [])] +
                      (["step.pt"] if name not in ("sgd", "sgd_momentum") else []))
        if files != want:
            fail(f"{name}: universal files of the ZeRO 0 folder {files}, want {want}")
        print(f"ok   {name}: ZeRO 0 file holds torch's state_dict; universal files {files}")


# What `uckpt inspect` must call each optimizer's state (its keys fit these torch optimizers).
LABELS = {
    "sgd_momentum": "SGD with momentum",
    "sgd": "none (no optimizer state: before the first step, or SGD without momentum)",
    "adagrad": "Adagrad",
    "rmsprop": "RMSprop (centered, with momentum)",
    "adamax": "Adamax",
    "nadam": "NAdam",
    "radam": "Adam, AdamW or RAdam",
    "adamw_amsgrad": "Adam or AdamW with amsgrad",
}


def inspect_label(uckpt, folder):
    p = subprocess.run([uckpt, "inspect", "--json", folder], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    if p.returncode != 0:
        fail(f"uckpt inspect {folder} failed:\n{p.stdout}")
    return json.loads(p.stdout)


def check_inspect(uckpt, work):
    """Each optimizer's ZeRO 0 and 2 folders, and the universal folder of the first, named by their state keys."""
    for name, label in LABELS.items():
        for stage in ("0", "2"):
            tag = os.path.join(work, f"z{stage}_{name}", f"global_step{SAVE}")
            folders = [tag]
            if stage == "0":
                out = tag + "_universal"
                subprocess.run([uckpt, "convert", "-q", tag, out], check=True, stdout=subprocess.DEVNULL)
                folders.append(out)
            for folder in folders:
                info = inspect_label(uckpt, folder)
                if info["optimizer"] != label:
                    fail(f"uckpt inspect {folder}: optimizer {info['optimizer']!r}, want {label!r}")
                if stage == "0" and folder == tag and info["zero_stage"] != 0:
                    fail(f"uckpt inspect {folder}: zero_stage {info['zero_stage']}, want 0")
        print(f"ok   {name}: uckpt inspect says {label!r} (ZeRO 0, ZeRO 2, universal)")


def main():
    if sys.argv[1] == "--worker":
        worker(*sys.argv[2:])
        return
    case, pypath, uckpt, work = sys.argv[1:5]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    pypath = os.pathsep.join([pypath, os.path.dirname(os.path.abspath(__file__))])
    script = os.path.abspath(__file__)
    if case == "vs_torch":
        launch(script, "vs_torch", pypath, 2, [work])
        launch(script, "vs_torch", pypath, 1, [work])
    elif case == "resume":
        launch(script, "save", pypath, 2, [work, "0"])
        check_stage0_files(uckpt, work)
        launch(script, "resume", pypath, 1, [work, "0", "0", "the folder"])
        launch(script, "resume", pypath, 4, [work, "0", "0", "universal"])
        launch(script, "resume", pypath, 2, [work, "0", "3", "the folder"])
        launch(script, "save", pypath, 1, [work, "2"])
        launch(script, "resume", pypath, 2, [work, "2", "0", "the folder"])
    elif case == "state_dict":
        launch(script, "state_dict", pypath, 2, [work])
    elif case == "inspect":
        launch(script, "save", pypath, 1, [work, "0"])
        launch(script, "save", pypath, 1, [work, "2"])
        check_inspect(uckpt, work)
        # uckpt verify takes every stage-0 folder, NAdam's 0-d mu_product of a model with no 1-element tensor too.
        launch(script, "save_small", pypath, 1, [work])
        for folder in [os.path.join(work, f"z0_{n}") for n in LABELS] + [os.path.join(work, "small_nadam")]:
            p = subprocess.run([uckpt, "verify", folder], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if p.returncode != 0:
                fail(f"uckpt verify {folder}:\n{p.stdout}")
        print("ok   uckpt verify accepts every optimizer's stage-0 folder")
    elif case == "hparams":
        launch(script, "hparams", pypath, 2, [work])
    elif case == "deepspeed":
        ds_path = base.deepspeed_available(sys.argv[5])
        launch(script, "ds_run", ds_path + os.pathsep + os.path.dirname(script), 2, [work, "deepspeed_runs", "ds"])
        launch(script, "ds_run", pypath, 2, [work, "uckpt"])
        import torch
        tag = f"global_step{SAVE}/mp_rank_00_model_states.pt"
        same_state_dict("uckpt's ZeRO 0 model-states 'optimizer' vs DeepSpeed's",
                        model_states_optimizer(os.path.join(work, "uckpt_sgd", tag)),
                        model_states_optimizer(os.path.join(work, "ds_sgd", tag)))
        same_state_dict("uckpt's optimizer.state_dict() vs DeepSpeed's", torch.load(os.path.join(work, "uckpt.sd.pt")),
                        torch.load(os.path.join(work, "ds.sd.pt")))
        print("ok   uckpt's ZeRO 0 file and optimizer.state_dict() hold DeepSpeed's")
        label = inspect_label(uckpt, os.path.join(work, "ds_sgd", f"global_step{SAVE}"))["optimizer"]
        if not label.startswith("SGD with momentum by its state keys") or "Adam" not in label:
            fail(f"uckpt inspect of DeepSpeed's ZeRO 0 SGD folder (config section Adam): {label!r}")
        print(f"ok   uckpt inspect of DeepSpeed's folder: {label!r}")
        launch(script, "ds_resume", pypath, 1, [work, "ds"])
        # DeepSpeed's stage-0 folder (one param group, no record of its ids' parameters) through uckpt convert.
        tag = os.path.join(work, "ds_sgd", f"global_step{SAVE}")
        p = subprocess.run([uckpt, "convert", "-q", tag, tag + "_universal"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        if p.returncode != 0:
            fail(f"uckpt convert of DeepSpeed's ZeRO 0 folder failed:\n{p.stdout}")
        launch(script, "ds_resume", pypath, 1, [work, "ds", "2", "universal"])
        launch(script, "ds_resume", ds_path + os.pathsep + os.path.dirname(script), 2,
               [work, "deepspeed_runs", "uckpt"])
        print("ok   uckpt resumes DeepSpeed's ZeRO 0 SGD checkpoint and DeepSpeed resumes uckpt's")
    else:
        fail(f"unknown case {case}")
    print(f"PASS {case}")


if __name__ == "__main__":
    main()
