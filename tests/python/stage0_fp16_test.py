#!/usr/bin/env python3
"""fp16 at ZeRO stage 0 (#40): DeepSpeed 0.14.5's FP16_Optimizer / FP16_UnfusedOptimizer, CPU, toy model (seconds).

usage: stage0_fp16_test.py CASE PYTHONPATH_OF_UCKPT UCKPT_BINARY WORK_DIR [SHARED]

The reference is real DeepSpeed 0.14.5's own wrapper classes (deepspeed.runtime.fp16), installed beside torch, driven
on the CPU as its engine drives them at stage 0 (loss.float() / GA, the fp16 gradients flattened, all-reduced and
averaged in fp16, step, zero_grad): DeepSpeed's engine refuses fp16 on the CPU, its wrappers do not. FusedAdam needs
CUDA, so the fused reference wraps torch's single-tensor AdamW, the formula uckpt's Adam runs. Without DeepSpeed
installed the cases needing it exit 77 (skipped).

CASE:
  vs, vs1      every variant at 2 ranks (vs) or at 1 (vs1; `make test-full` only);
  vs_<variant>  the variant at 1 and 2 ranks, 12 steps, against the reference: per step the loss,
                engine.optimizer.cur_scale and loss_scale, overflow, skipped_steps and get_global_grad_norm() equal
                DeepSpeed's exactly, and so do the fp32 masters after the run; engine.optimizer names DeepSpeed's
                class. Variants: fused (the config's AdamW: FP16_Optimizer; fp16 keys, window 2, clipping),
                fused_defaults (the config's Adam, no fp16 keys: FP16_Optimizer's 2^16 start), sgd (a client SGD
                with momentum, dampening and weight decay: FP16_UnfusedOptimizer's own defaults, 2^16, min 0.25),
                sgd_static (a static loss_scale), fusedadam_groups (a client FusedAdam over two param groups, as
                DeepSpeed-Chat and BingBertSquad: FP16_Optimizer), torch_adam (the config's Adam with torch_adam:
                unfused, torch's L2 Adam, GA 2). Each sees a batch whose loss overflows fp16 on rank 0 at steps 3-4.
  checkpoint_<variant> (fused, sgd)  saved at step 6 on 2 ranks: model_states['optimizer'] has FP16_Optimizer's /
                FP16_UnfusedOptimizer's keys in their order, the numbers' Python types and the masters of
                DeepSpeed's state_dict() (unfused: the wrapped torch state_dict equal to DeepSpeed's; fused:
                FusedAdam's keys as its source has them), and so has engine.optimizer.state_dict() torch.saved and
                read back with weights_only=True (imagenet's main.py); resumed at stage 0 on 2 ranks the run continues bit for
                bit, and so does a DeepSpeed-layout folder made of the reference's state_dict(); resumed at 1 rank
                (GA 2) at stage 0 and at 2 ranks at stage 1 (and 3: fused) the loss continues (5%), the scale
                carried over.
  from_stage1   a stage-1 fp16 folder of 2 ranks resumed at stage 0 on 1 rank continues, its scale carried over.
  fixture       (needs SHARED: ../shared/fixtures/deepspeed/stage0_fp16_ws2 made on a GPU by
                tests/fixtures/deepspeed_stage0_fp16.py, else exit 77) uckpt's saved 'optimizer' has the structure
                of real DeepSpeed's (FusedAdam's included), and uckpt resumes DeepSpeed's folders on the CPU.
  tools         `uckpt verify` accepts the stage-0 fp16 folders; `uckpt convert`, `inspect` and `export` read
                them (uckpt records which parameter each state id is), and the converted folder verifies.
"""
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from testkit import fail, free_port, have_deepspeed  # noqa: E402

SKIP = 77
STEPS = 12
SAVE_AT = 6
OVERFLOW_STEPS = (3, 4)
MICRO = 2

# Each variant: the uckpt config (and the client optimizer it passes, if any), as DeepSpeed would be given them.
VARIANTS = {
    "fused": dict(config={"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
                          "fp16": {"enabled": True, "initial_scale_power": 6, "loss_scale_window": 2,
                                   "min_loss_scale": 2},
                          "gradient_clipping": 0.05}),
    "fused_defaults": dict(config={"optimizer": {"type": "Adam", "params": {"lr": 0.005}},
                                   "fp16": {"enabled": True}}),
    "sgd": dict(config={"fp16": {"enabled": True}, "gradient_clipping": 1.0},
                client=("SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01, "dampening": 0.1})),
    "sgd_static": dict(config={"fp16": {"enabled": True, "loss_scale": 128}},
                       client=("SGD", {"lr": 0.05, "momentum": 0.5})),
    # DeepSpeed-Chat's and BingBertSquad's shape: a client FusedAdam over two groups (decay / no decay).
    "fusedadam_groups": dict(config={"fp16": {"enabled": True, "loss_scale_window": 3}, "gradient_clipping": 1.0},
                             client=("FusedAdam", {"lr": 0.01, "betas": (0.9, 0.95)})),
    "torch_adam": dict(config={"optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.05,
                                                                         "torch_adam": True, "adam_w_mode": False}},
                               "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 2}},
                       ga=2),
}


def full_config(variant, world, stage=0, ga=None):
    v = VARIANTS[variant]
    ga = ga or v.get("ga", 1)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ga,
           "train_batch_size": MICRO * ga * world, "zero_optimization": {"stage": stage}}
    cfg.update(json.loads(json.dumps(v["config"])))
    if stage > 0 and "client" in v:  # DeepSpeed's ZeRO optimizers take a client SGD only so
        cfg["zero_allow_untested_optimizer"] = True
    return cfg


def net(torch):
    torch.manual_seed(0)

    class Net(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(4, 16)
            self.hid = torch.nn.Linear(16, 16)
            self.out = torch.nn.Linear(16, 1)

        def forward(self, x):
            h = torch.relu(self.inp(x))
            h = torch.relu(self.hid(h))
            return self.out(h).pow(2).mean()

    return Net()


def data(torch, step, slot):
    """Sample slot `slot` (rank * GA + micro-step) of `step`'s global batch, fp16; at OVERFLOW_STEPS slot 0's loss
    overflows fp16. A run resumed at another size with the same global batch sees the same samples."""
    g = torch.Generator().manual_seed(1000 * step + slot)
    x = torch.randn(MICRO, 4, generator=g)
    if step in OVERFLOW_STEPS and slot == 0:
        x = x * 3000
    return x.half()


def micro_batches(torch, step, rank, ga):
    return [data(torch, step, rank * ga + m) for m in range(ga)]


def client_optimizer(torch, variant, params, reference=False):
    """The variant's client optimizer; FusedAdam over two param groups (weights decayed, biases not) is uckpt's
    stand-in class (deepspeed.ops.adam.FusedAdam), in the reference torch's single-tensor AdamW (its formula)."""
    name, kw = VARIANTS[variant]["client"]
    if name != "FusedAdam":
        return getattr(torch.optim, name)(params, **kw)
    params = list(params)
    groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
              {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}]
    if reference:
        return torch.optim.AdamW(groups, foreach=False, **kw)
    from uckpt.ops.adam import FusedAdam
    return FusedAdam(groups, **kw)


def variant_fused(variant):
    """DeepSpeed's choice: FP16_Optimizer around its FusedAdam (the config's Adam without torch_adam, a client
    FusedAdam), FP16_UnfusedOptimizer around anything else."""
    v = VARIANTS[variant]
    if "client" in v:
        return v["client"][0] == "FusedAdam"
    return not v["config"]["optimizer"]["params"].get("torch_adam", False)


def record(out, step, loss, scale, loss_scale, overflow, skipped, norm):
    out.append({"step": step, "loss": loss, "cur_scale": scale, "loss_scale": loss_scale, "overflow": overflow,
                "skipped": skipped, "norm": norm})


# ---------------------------------------------------------------- uckpt

def uckpt_engine(deepspeed, torch, variant, world, stage=0, ga=None):
    model = net(torch)
    cfg = full_config(variant, world, stage, ga)
    opt = client_optimizer(torch, variant, model.parameters()) if "client" in VARIANTS[variant] else None
    kw = {"optimizer": opt} if opt is not None else {"model_parameters": model.parameters()}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg, **kw)
    return engine, optimizer


def uckpt_steps(torch, engine, first, last, rank, ga, out):
    for step in range(first, last):
        first = None  # the loss of sample slot rank * GA: slot 0's on rank 0 at any size
        for x in micro_batches(torch, step, rank, ga):
            loss = engine(x)
            first = float(loss.float()) if first is None else first
            engine.backward(loss)
            engine.step()
        o = engine.optimizer
        record(out, step, first, o.cur_scale, o.loss_scale, bool(o.overflow), engine.skipped_steps,
               float(engine.get_global_grad_norm()))


def masters_of(path):
    """The fp32 masters of a saved stage-0 fp16 'optimizer', flattened in order."""
    import torch
    opt = torch.load(path, weights_only=True)["optimizer"]
    groups = opt.get("fp32_groups_flat") or [t for g in opt["fp32_groups"] for t in g]
    return torch.cat([t.reshape(-1) for t in groups]).tolist()


def worker_uckpt(deepspeed, torch, work, variant, mode):
    import torch.distributed as dist
    world, rank = dist.get_world_size(), dist.get_rank()
    ga = VARIANTS[variant].get("ga", 1)
    if mode == "run":
        engine, optimizer = uckpt_engine(deepspeed, torch, variant, world)
        want = "FP16_Optimizer" if variant_fused(variant) else "FP16_UnfusedOptimizer"
        if optimizer._deepspeed_class != want:
            fail(f"{variant}: engine.optimizer stands for {optimizer._deepspeed_class}, DeepSpeed's is {want}")
        out = []
        uckpt_steps(torch, engine, 0, STEPS, rank, ga, out)
        end = os.path.join(work, f"end_{variant}")
        engine.save_checkpoint(end, tag="end")
        if rank == 0:
            out.append({"masters": masters_of(os.path.join(end, "end", "mp_rank_00_model_states.pt"))})
            json.dump(out, open(os.path.join(work, f"uckpt_{variant}_{world}.json"), "w"))
        return
    # "save": steps 0..SAVE_AT, a save, on to STEPS; "resume:<folder>:<stage>:<ga>:<label>": a load, then on.
    # "stage1save": the same at ZeRO stage 1 (into ckpt_<variant>_s1).
    label = mode
    if mode in ("save", "stage1save"):
        stage = 1 if mode == "stage1save" else 0
        engine, _ = uckpt_engine(deepspeed, torch, variant, world, stage)
        out = []
        uckpt_steps(torch, engine, 0, SAVE_AT, rank, ga, out)
        engine.save_checkpoint(os.path.join(work, f"ckpt_{variant}" + ("_s1" if stage else "")), tag="s0")
        if rank == 0 and not stage:  # what imagenet's main.py torch.saves: DeepSpeed's wrapper's state_dict()
            torch.save(engine.optimizer.state_dict(), os.path.join(work, f"state_dict_{variant}.pt"))
        uckpt_steps(torch, engine, SAVE_AT, STEPS, rank, ga, out)
    else:
        _, folder, stage, ga, label = mode.split(":")
        ga = int(ga)
        engine, _ = uckpt_engine(deepspeed, torch, variant, world, int(stage), ga)
        path, _ = engine.load_checkpoint(folder)
        if path is None:
            fail(f"{variant}: nothing loaded from {folder}")
        out = [{"after_load": {"cur_scale": engine.optimizer.cur_scale, "skipped": engine.skipped_steps,
                               "global_steps": engine.global_steps}}]
        uckpt_steps(torch, engine, SAVE_AT, STEPS, rank, ga, out)
    if rank == 0:
        json.dump(out, open(os.path.join(work, f"ck_{variant}_{label}.json"), "w"))


# ---------------------------------------------------------------- the reference: DeepSpeed's wrappers

def worker_reference(torch, work, variant, save_dir):
    import torch.distributed as dist
    import deepspeed
    from deepspeed.runtime.config import get_dynamic_loss_scale_args, get_initial_dynamic_scale
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.utils.timer import NoopTimer
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = full_config(variant, world)
    ga = cfg["gradient_accumulation_steps"]
    model = net(torch).half()
    params = list(model.parameters())
    v = VARIANTS[variant]
    fused = variant_fused(variant)
    if "client" in v:
        inner = client_optimizer(torch, variant, params, reference=True)
    else:
        p = dict(cfg["optimizer"]["params"])
        p.pop("torch_adam", None)
        decoupled = p.pop("adam_w_mode", True) or cfg["optimizer"]["type"] == "AdamW"
        p.setdefault("weight_decay", 0.0)
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        inner = cls(params, foreach=False, **p)

    class Engine:  # what the wrappers read of DeepSpeed's engine
        pipeline_parallelism = False
        enable_backward_allreduce = True

    fp16 = cfg["fp16"]
    static = fp16.get("loss_scale", 0)
    clip = cfg.get("gradient_clipping", 0.0)
    args = get_dynamic_loss_scale_args(cfg)
    if fused and static == 0:
        opt = FP16_Optimizer(inner, deepspeed=Engine(), dynamic_loss_scale=True,
                             initial_dynamic_scale=get_initial_dynamic_scale(cfg), dynamic_loss_args=args,
                             clip_grad=clip, timers=NoopTimer())
    elif fused:
        opt = FP16_Optimizer(inner, deepspeed=Engine(), static_loss_scale=static, clip_grad=clip, timers=NoopTimer())
    else:
        opt = FP16_UnfusedOptimizer(inner, deepspeed=Engine(), static_loss_scale=static,
                                    dynamic_loss_scale=static == 0, dynamic_loss_args=args, clip_grad=clip)
    skipped, global_steps, out = 0, 0, []
    for step in range(STEPS):
        first = None
        for x in micro_batches(torch, step, rank, ga):
            loss = model(x)
            first = float(loss.float()) if first is None else first
            opt.backward(loss.float() / ga if ga > 1 else loss)
        # engine.allreduce_gradients at the boundary: buffered_allreduce_fallback over the fp16 grads
        for q in params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        grads = [q.grad.data for q in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        if world != 1:
            flat.mul_(1.0 / world)
        for g, s in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(s)
        opt.step()
        global_steps += 1
        skipped += bool(opt.overflow)
        opt.zero_grad()
        record(out, step, first, opt.cur_scale, opt.loss_scale, bool(opt.overflow), skipped,
               float(opt._global_grad_norm))
        if step + 1 == SAVE_AT and save_dir and rank == 0:
            state = dict(module=model.state_dict(), buffer_names=[], optimizer=opt.state_dict(), param_shapes=None,
                         frozen_param_shapes=None, shared_params=None, frozen_param_fragments=None, lr_scheduler=None,
                         data_sampler=None, random_ltd=None, sparse_tensor_module_names=set(), skipped_steps=skipped,
                         global_steps=global_steps, global_samples=global_steps * MICRO * ga * world,
                         dp_world_size=world, mp_world_size=1, ds_config=cfg, ds_version="0.14.5")
            os.makedirs(os.path.join(save_dir, "ds"), exist_ok=True)
            torch.save(state, os.path.join(save_dir, "ds", "mp_rank_00_model_states.pt"))
            with open(os.path.join(save_dir, "latest"), "w") as f:
                f.write("ds")
            torch.save(opt.state_dict(), os.path.join(work, f"ref_state_{variant}.pt"))
    if rank == 0:
        groups = opt.fp32_groups_flat if fused else [t for g in opt.fp32_groups for t in g]
        out.append({"masters": torch.cat([t.detach().reshape(-1) for t in groups]).tolist()})
        json.dump(out, open(os.path.join(work, f"ref_{variant}_{world}.json"), "w"))


# ---------------------------------------------------------------- launching

def launch(pypath, world, args, reference=False):
    """This file's worker at `world` ranks: uckpt's (PYTHONPATH the build's), or the reference (real DeepSpeed)."""
    port = str(free_port())
    procs = []
    for r in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DS_ACCELERATOR="cpu")
        if reference:
            env.pop("PYTHONPATH", None)
        else:
            env["PYTHONPATH"] = pypath
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "reference" if reference else "uckpt",
                                       *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    failed = False
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=300)
        if p.returncode != 0 or os.environ.get("VERBOSE"):
            sys.stdout.write("".join(f"[{r}/{world}] {line}\n" for line in out.splitlines()[-40:]))
        failed |= p.returncode != 0
    if failed:
        fail(f"{'reference' if reference else 'uckpt'} {args} at {world} rank(s): a rank failed (output above)")


def load(path):
    with open(path) as f:
        return json.load(f)


def compare_runs(what, got, want, exact=True, rtol=0.02):
    """Per step: the scale, overflow and skipped count equal; the loss and norm equal (exact), else the loss
    within rtol."""
    got = [r for r in got if "step" in r]
    want = [r for r in want if "step" in r]
    if [r["step"] for r in got] != [r["step"] for r in want]:
        fail(f"{what}: steps {[r['step'] for r in got]}, want {[r['step'] for r in want]}")
    for a, b in zip(got, want):
        for key in ("cur_scale", "loss_scale", "overflow", "skipped"):
            if a[key] != b[key]:
                fail(f"{what}: step {a['step']}: {key} {a[key]!r}, want {b[key]!r}")
        if exact:
            for key in ("loss", "norm"):
                if a[key] != b[key] and not (a[key] != a[key] and b[key] != b[key]):  # (nan == nan)
                    fail(f"{what}: step {a['step']}: {key} {a[key]!r}, want {b[key]!r}")
        elif not b["overflow"] and abs(a["loss"] - b["loss"]) > rtol * max(abs(b["loss"]), 1e-6):
            fail(f"{what}: step {a['step']}: loss {a['loss']!r}, the uninterrupted run's {b['loss']!r}")
    print(f"ok   {what}: {len(got)} steps, scales {[r['cur_scale'] for r in got]}, skipped {got[-1]['skipped']}")


# ---------------------------------------------------------------- cases

def case_vs(pypath, work, variants, worlds=(1, 2)):
    """Each variant's run against DeepSpeed's wrapper at 1 and 2 ranks; one process group runs every variant
    (a group's start, importing torch and DeepSpeed, costs more than a variant's steps)."""
    for world in worlds:
        launch(pypath, world, [work, ",".join(variants), ""], reference=True)
        launch(pypath, world, [work, ",".join(variants), "run"])
        for variant in variants:
            got = load(os.path.join(work, f"uckpt_{variant}_{world}.json"))
            want = load(os.path.join(work, f"ref_{variant}_{world}.json"))
            compare_runs(f"{variant} at {world} rank(s)", got, want)
            if not any(r.get("overflow") for r in got):
                fail(f"{variant}: no step overflowed; the test does not test the skip")
            if got[-1]["masters"] != want[-1]["masters"]:
                diff = max(abs(a - b) for a, b in zip(got[-1]["masters"], want[-1]["masters"]))
                fail(f"{variant} at {world}: the fp32 masters differ from DeepSpeed's (max {diff:.3e})")
            print(f"ok   {variant} at {world} rank(s): the fp32 masters are DeepSpeed's")


def check_layout(variant, ours, ref, what="model_states['optimizer']"):
    """The saved 'optimizer' (or engine.optimizer.state_dict()) against DeepSpeed's state_dict() of the same run."""
    import torch
    if list(ours) != list(ref):
        fail(f"{variant}: 'optimizer' keys {list(ours)}, DeepSpeed's {list(ref)}")
    for k in ("dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window",
              "clip_grad"):
        if k in ref and (ours[k] != ref[k] or type(ours[k]) is not type(ref[k])):
            fail(f"{variant}: optimizer['{k}'] = {ours[k]!r}, DeepSpeed's {ref[k]!r}")
    masters = "fp32_groups_flat" if "fp32_groups_flat" in ref else "fp32_groups"
    flat = lambda m: [t for g in m for t in (g if isinstance(g, list) else [g])]  # noqa: E731
    for a, b in zip(flat(ours[masters]), flat(ref[masters])):
        if a.dtype != torch.float32 or a.shape != b.shape or not torch.equal(a, b) or a.requires_grad != b.requires_grad:
            fail(f"{variant}: optimizer['{masters}'] differs from DeepSpeed's")
    inner, ref_inner = ours["optimizer_state_dict"], ref["optimizer_state_dict"]
    if masters == "fp32_groups":  # torch's optimizer inside: its state_dict is DeepSpeed's
        if sorted(inner["state"]) != sorted(ref_inner["state"]) or inner["param_groups"] != ref_inner["param_groups"]:
            fail(f"{variant}: optimizer_state_dict {inner['param_groups']}, DeepSpeed's {ref_inner['param_groups']}")
        for i, st in ref_inner["state"].items():
            for k, v in st.items():
                a = inner["state"][i][k]
                if type(a) is not type(v) or (torch.is_tensor(v) and not torch.equal(a, v)) or \
                        (not torch.is_tensor(v) and a != v):
                    fail(f"{variant}: optimizer_state_dict.state[{i}]['{k}'] differs from DeepSpeed's")
    else:  # FusedAdam's, as its source keeps it: one state per group over the flat master
        want_group = ["lr", "bias_correction", "betas", "eps", "weight_decay", "step", "params"]
        for g, group in enumerate(inner["param_groups"]):
            if list(group) != want_group or group["params"] != [g] or group["step"] != 0:
                fail(f"{variant}: param_groups[{g}] {group}, FusedAdam's keys are {want_group}")
        for i, st in inner["state"].items():
            if list(st) != ["step", "exp_avg", "exp_avg_sq"] or type(st["step"]) is not int:
                fail(f"{variant}: FusedAdam's state[{i}] is {{'step': int, 'exp_avg', 'exp_avg_sq'}}, got {st}")
            ref_st = ref_inner["state"][i]
            if st["step"] != int(ref_st["step"]) or not torch.equal(st["exp_avg"], ref_st["exp_avg"]):
                fail(f"{variant}: state[{i}] differs from the reference's")
    print(f"ok   {variant}: {what} is {'FP16_Optimizer' if masters != 'fp32_groups' else 'FP16_UnfusedOptimizer'}'s state_dict")


def case_checkpoint(pypath, work, variant):
    import torch
    ref_dir = os.path.join(work, f"ds_{variant}")
    launch(pypath, 2, [work, variant, ref_dir], reference=True)
    launch(pypath, 2, [work, variant, "save"])
    ckpt = os.path.join(work, f"ckpt_{variant}")
    saved = torch.load(os.path.join(ckpt, "s0", "mp_rank_00_model_states.pt"), weights_only=True)
    ref_state = torch.load(os.path.join(work, f"ref_state_{variant}.pt"), weights_only=False)
    check_layout(variant, saved["optimizer"], ref_state)
    # engine.optimizer.state_dict(), torch.saved and read back with weights_only=True, is the same.
    check_layout(variant, torch.load(os.path.join(work, f"state_dict_{variant}.pt"), weights_only=True), ref_state,
                 "engine.optimizer.state_dict()")
    whole = load(os.path.join(work, f"ck_{variant}_save.json"))
    ref = load(os.path.join(work, f"ref_{variant}_2.json"))
    compare_runs(f"{variant}: the saving run against DeepSpeed's", whole, ref)
    tail = [r for r in whole if r.get("step", -1) >= SAVE_AT]
    saved_scale = whole[SAVE_AT - 1]["cur_scale"]
    # Same size and stage: bit for bit; DeepSpeed's folder continues DeepSpeed's run bit for bit.
    ref_tail = [r for r in ref if r.get("step", -1) >= SAVE_AT]
    for folder, want, label in ((ckpt, tail, "own"), (ref_dir, ref_tail, "deepspeed")):
        launch(pypath, 2, [work, variant, f"resume:{folder}:0:1:{label}"])
        got = load(os.path.join(work, f"ck_{variant}_{label}.json"))
        after = got[0]["after_load"]
        if after["cur_scale"] != saved_scale or after["global_steps"] != SAVE_AT:
            fail(f"{variant}: after loading {label}: {after}, saved scale {saved_scale}, {SAVE_AT} steps")
        compare_runs(f"{variant}: {label} folder resumed at stage 0 on 2 ranks", got, want)
    # Other sizes and stages: the run continues with the scale carried over.
    for world, stage, ga in ((1, 0, 2), (2, 1, 1)) + (((2, 3, 1),) if variant == "fused" else ()):
        label = f"w{world}s{stage}"
        launch(pypath, world, [work, variant, f"resume:{ckpt}:{stage}:{ga}:{label}"])
        got = load(os.path.join(work, f"ck_{variant}_{label}.json"))
        if got[0]["after_load"]["cur_scale"] != saved_scale:
            fail(f"{variant}: resumed at stage {stage} on {world}: cur_scale {got[0]['after_load']}, "
                 f"saved {saved_scale}")
        check_loss_continues(f"{variant}: resumed at stage {stage} on {world} rank(s)", got, tail)


def case_from_stage1(pypath, work):
    """A stage-1 fp16 folder (2 ranks) resumed at stage 0 (FP16_Optimizer) on 1 rank continues its run."""
    launch(pypath, 2, [work, "fused", "stage1save"])
    whole = load(os.path.join(work, "ck_fused_stage1save.json"))
    launch(pypath, 1, [work, "fused", f"resume:{os.path.join(work, 'ckpt_fused_s1')}:0:2:from_s1"])
    got = load(os.path.join(work, "ck_fused_from_s1.json"))
    if got[0]["after_load"]["cur_scale"] != whole[SAVE_AT - 1]["cur_scale"]:
        fail(f"the stage-1 folder's scale {whole[SAVE_AT - 1]['cur_scale']} became {got[0]['after_load']}")
    check_loss_continues("fused: a stage-1 fp16 folder resumed at stage 0 on 1 rank", got,
                         [r for r in whole if r.get("step", -1) >= SAVE_AT])


def check_loss_continues(what, got, want, rtol=0.05, atol=2e-4):
    """Another size or stage sums in another order (and another stage scales by other rules): the first loss
    after the load equal (the weights are the saved ones), the later ones within rtol or atol, the overflowing
    steps the same."""
    got = [r for r in got if "step" in r]
    if got[0]["loss"] != want[0]["loss"]:
        fail(f"{what}: the first loss after the load {got[0]['loss']!r}, the uninterrupted run's {want[0]['loss']!r}")
    for a, b in zip(got, want):
        if a["overflow"] != b["overflow"]:
            fail(f"{what}: step {a['step']}: overflow {a['overflow']}, the uninterrupted run's {b['overflow']}")
        if not b["overflow"] and abs(a["loss"] - b["loss"]) > max(rtol * abs(b["loss"]), atol):
            fail(f"{what}: step {a['step']}: loss {a['loss']!r}, the uninterrupted run's {b['loss']!r}")
    print(f"ok   {what}: losses {[round(r['loss'], 4) for r in got]}")


def structure(v):
    """A value's shape for comparing layouts: dict keys in order, list lengths, tensors' dtype and shape, numbers'
    Python types."""
    import torch
    if isinstance(v, dict):
        return {k: structure(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [type(v).__name__] + [structure(x) for x in v]
    if torch.is_tensor(v):
        return f"tensor {v.dtype} {tuple(v.shape)} requires_grad={v.requires_grad}"
    return type(v).__name__


def case_fixture(pypath, work, shared):
    """Real DeepSpeed 0.14.5's stage-0 fp16 checkpoints, made on a GPU by tests/fixtures/deepspeed_stage0_fp16.py
    (2 ranks): uckpt's saved 'optimizer' has their structure (keys, types, shapes), and uckpt resumes them on the
    CPU at 2 ranks with their scale and step counters, the loss continuing theirs (GPU against CPU: 2%, 1e-3)."""
    import torch
    base = os.path.join(shared, "fixtures", "deepspeed", "stage0_fp16_ws2")
    if not os.path.isfile(os.path.join(base, "fused", "losses.json")):
        print(f"SKIPPED: no {base} (make it on a GPU with tests/fixtures/deepspeed_stage0_fp16.py)")
        sys.exit(SKIP)
    for variant in ("fused", "sgd"):
        ds = os.path.join(base, variant)
        runs = load(os.path.join(ds, "losses.json"))["steps"]
        ds_opt = torch.load(os.path.join(ds, "s0", "mp_rank_00_model_states.pt"), weights_only=False,
                            map_location="cpu")["optimizer"]
        launch(pypath, 2, [work, variant, "save"])
        ours = torch.load(os.path.join(work, f"ckpt_{variant}", "s0", "mp_rank_00_model_states.pt"),
                          weights_only=True)["optimizer"]
        if structure(ours) != structure(ds_opt):
            fail(f"{variant}: uckpt's 'optimizer' {structure(ours)}\nDeepSpeed's {structure(ds_opt)}")
        print(f"ok   {variant}: the saved 'optimizer' has the structure of DeepSpeed's (GPU-made)")
        launch(pypath, 2, [work, variant, f"resume:{ds}:0:1:fixture"])
        got = load(os.path.join(work, f"ck_{variant}_fixture.json"))
        after = got[0]["after_load"]
        if after["cur_scale"] != runs[SAVE_AT - 1]["cur_scale"] or after["global_steps"] != SAVE_AT or \
                after["skipped"] != runs[SAVE_AT - 1]["skipped"]:
            fail(f"{variant}: after loading DeepSpeed's folder: {after}, DeepSpeed's step {SAVE_AT - 1}: "
                 f"{runs[SAVE_AT - 1]}")
        got = [r for r in got if "step" in r]
        for a, b in zip(got, runs[SAVE_AT:]):
            if a["overflow"] != b["overflow"] or abs(a["loss"] - b["loss"]) > max(0.02 * abs(b["loss"]), 1e-3):
                fail(f"{variant}: step {a['step']}: {a}, DeepSpeed's on the GPU {b}")
        print(f"ok   {variant}: DeepSpeed's GPU-made folder resumes on the CPU, losses {[r['loss'] for r in got]}")


def case_tools(pypath, uckpt_bin, work):
    import torch  # noqa: F401
    for variant in ("fused", "sgd"):
        launch(pypath, 2, [work, variant, "save"])
        folder = os.path.join(work, f"ckpt_{variant}", "s0")
        r = subprocess.run([uckpt_bin, "verify", folder], capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"uckpt verify {folder}: {r.stdout}{r.stderr}")
        print(f"ok   uckpt verify accepts the {variant} stage-0 fp16 folder")
        # uckpt's folder records which parameter each state id is: convert, inspect and export read it.
        universal = os.path.join(work, f"universal_{variant}")
        for cmd in (["convert", folder, universal], ["inspect", folder], ["verify", universal],
                    ["export", folder, os.path.join(work, f"{variant}.safetensors")]):
            r = subprocess.run([uckpt_bin, *cmd], capture_output=True, text=True)
            if r.returncode != 0:
                fail(f"uckpt {cmd[0]} of uckpt's stage-0 fp16 folder: {r.stdout}{r.stderr}")
            print(f"ok   uckpt {cmd[0]} reads uckpt's {variant} stage-0 fp16 folder")
        names = sorted(os.listdir(os.path.join(universal, "zero")))
        if "optimizer_state.pt" not in names or len(names) < 2 or not all(
                os.path.exists(os.path.join(universal, "zero", n, "fp32.pt")) for n in names
                if n != "optimizer_state.pt"):
            fail(f"uckpt convert of the {variant} folder wrote {names}")


def worker_main():
    kind = sys.argv[2]
    import torch
    if kind == "reference":
        work, variants, save_dir = sys.argv[3:6]
        for variant in variants.split(","):
            worker_reference(torch, work, variant, save_dir or None)
        return
    work, variants, mode = sys.argv[3:6]
    import uckpt as deepspeed
    deepspeed.init_distributed()
    for variant in variants.split(","):
        worker_uckpt(deepspeed, torch, work, variant, mode)


def main():
    if sys.argv[1] == "--worker":
        worker_main()
        return
    case, pypath, uckpt_bin, work = sys.argv[1:5]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    if case != "tools" and not have_deepspeed():
        print("SKIPPED: DeepSpeed 0.14.5 is not installed beside torch; nothing was compared.")
        sys.exit(SKIP)
    if case in ("vs", "vs1"):
        case_vs(pypath, work, list(VARIANTS), worlds=(2,) if case == "vs" else (1,))
    elif case.startswith("vs_"):
        case_vs(pypath, work, case[len("vs_"):].split(","))
    elif case.startswith("checkpoint_"):
        case_checkpoint(pypath, work, case[len("checkpoint_"):])
    elif case == "from_stage1":
        case_from_stage1(pypath, work)
    elif case == "tools":
        case_tools(pypath, uckpt_bin, work)
    elif case == "fixture":
        case_fixture(pypath, work, sys.argv[5])
    else:
        fail(f"no case {case}")
    print(f"PASS {case}")


if __name__ == "__main__":
    main()
