#!/usr/bin/env python3
"""What Accelerate imports from deepspeed.ops and deepspeed.utils (#39): DeepSpeedCPUAdagrad, DeepSpeedCPULion and
the ZeRO-3 leaf-module flags, on the CPU (seconds).

usage: hf_ops_test.py CASE PYTHONPATH_OF_UCKPT WORK_DIR

CASE:
  math    DeepSpeedCPUAdagrad and DeepSpeedCPULion against DeepSpeed 0.14.5's C++ kernels' scalar loops written
          here element by element in numpy float32 (weight decay 0 and > 0; a zero gradient, which Lion's
          copysign moves by -lr): equal to the last bit over 5 steps; their state keys and step counts as
          DeepSpeed's; the constructor defaults of DeepSpeed's signatures.
  leaf    set_z3_leaf_modules / unset / get / z3_leaf_module as DeepSpeed's: the exact classes flagged, the
          modules returned, ValueError naming the classes when none is found, AssertionError for a non-type.
  engine  each optimizer as the client optimizer of uckpt's engine at 2 ranks, ZeRO 2 and 3 (and 2 with
          offload_optimizer): losses equal a plain PyTorch loop with the same optimizer (1e-6 relative); saved
          at 2 ranks with DeepSpeed's state keys in the files, resumed at 1 rank continuing the run.
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from testkit import fail, launch  # noqa: E402


def ref_adagrad(p, g, v, lr, eps, wd):
    """DeepSpeed's Adagrad_Optimizer::Step_1 scalar loop, element by element, in float32."""
    f = np.float32
    p, v = p.copy(), v.copy()
    for k in range(p.size):
        grad, param, momentum, variance = f(g[k]), f(p[k]), f(g[k]), f(v[k])
        if wd > 0:
            grad = param * f(wd) + grad
        variance = variance + grad * grad
        grad = np.sqrt(variance)
        grad = grad + f(eps)
        grad = momentum / grad
        param = grad * f(-1 * f(lr)) + param
        p[k], v[k] = param, variance
    return p, v


def ref_lion(p, g, m, lr, b1, b2, wd):
    """DeepSpeed's Lion_Optimizer::Step_1 scalar loop, element by element, in float32."""
    f = np.float32
    p, m = p.copy(), m.copy()
    b1m1, b2m1 = f(1) - f(b1), f(1) - f(b2)
    after_decay = f(1) - f(lr) * f(wd)
    for k in range(p.size):
        grad, param, momentum = f(g[k]), f(p[k]), f(m[k])
        tmp = momentum * f(b1)
        tmp = grad * b1m1 + tmp
        tmp = -np.copysign(f(lr), tmp)
        param = param * after_decay + tmp if wd > 0 else param + tmp
        momentum = momentum * f(b2)
        momentum = grad * b2m1 + momentum
        p[k], m[k] = param, momentum
    return p, m


def case_math():
    import torch
    from uckpt.ops.adagrad import DeepSpeedCPUAdagrad
    from uckpt.ops.lion import DeepSpeedCPULion
    import inspect
    want = {DeepSpeedCPUAdagrad: "(model_params, lr=0.01, eps=1e-10, weight_decay=0, amsgrad=False, "
                                 "fp32_optimizer_states=True)",
            DeepSpeedCPULion: "(model_params, lr=0.001, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True)"}
    for cls, sig in want.items():
        if str(inspect.signature(cls.__init__)).replace("self, ", "") != sig:
            fail(f"{cls.__name__}{inspect.signature(cls.__init__)} is not DeepSpeed's {sig}")
    rng = np.random.default_rng(0)
    for wd in (0.0, 0.05):
        p0 = rng.standard_normal(37).astype(np.float32)
        grads = [rng.standard_normal(37).astype(np.float32) for _ in range(5)]
        for gr in grads:
            gr[3] = 0.0  # a zero gradient
        # Adagrad
        p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        opt = DeepSpeedCPUAdagrad([p], lr=0.03, eps=1e-8, weight_decay=wd)
        rp, rv = p0.copy(), np.zeros_like(p0)
        for gr in grads:
            p.grad = torch.from_numpy(gr.copy())
            opt.step()
            rp, rv = ref_adagrad(rp, gr, rv, 0.03, 1e-8, wd)
            if not (np.array_equal(p.detach().numpy(), rp) and np.array_equal(opt.state[p]["exp_avg_sq"].numpy(), rv)):
                fail(f"DeepSpeedCPUAdagrad (weight decay {wd}) differs from DeepSpeed's kernel: "
                     f"{np.abs(p.detach().numpy() - rp).max()}")
        st = opt.state[p]
        if sorted(st) != ["exp_avg_sq", "step"] or st["step"] != 5 or type(st["step"]) is not int:
            fail(f"DeepSpeedCPUAdagrad's state {sorted(st)} step {st['step']!r}: DeepSpeed's is exp_avg_sq and step 5")
        # Lion
        p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        opt = DeepSpeedCPULion([p], lr=0.01, betas=(0.9, 0.99), weight_decay=wd)
        rp, rm = p0.copy(), np.zeros_like(p0)
        for gr in grads:
            p.grad = torch.from_numpy(gr.copy())
            opt.step()
            rp, rm = ref_lion(rp, gr, rm, 0.01, 0.9, 0.99, wd)
            if not (np.array_equal(p.detach().numpy(), rp) and np.array_equal(opt.state[p]["exp_avg"].numpy(), rm)):
                fail(f"DeepSpeedCPULion (weight decay {wd}) differs from DeepSpeed's kernel: "
                     f"{np.abs(p.detach().numpy() - rp).max()}")
        st = opt.state[p]
        if sorted(st) != ["exp_avg", "exp_avg_sq", "step"] or st["step"] != 5:
            fail(f"DeepSpeedCPULion's state {sorted(st)}: DeepSpeed's is exp_avg, exp_avg_sq and step")
        if not torch.equal(st["exp_avg_sq"], torch.zeros(37)):
            fail("DeepSpeedCPULion's exp_avg_sq is not left at zero, as DeepSpeed leaves it")
    # The zero gradient moved its element by -lr at Lion's first step (copysign of +0), as DeepSpeed's kernel.
    p = torch.nn.Parameter(torch.zeros(2))
    opt = DeepSpeedCPULion([p], lr=0.25)
    p.grad = torch.tensor([0.0, -1.0])
    opt.step()
    if p.tolist() != [-0.25, 0.25]:
        fail(f"DeepSpeedCPULion with a zero gradient gave {p.tolist()}, DeepSpeed's kernel [-0.25, 0.25]")
    print("math: OK (bit for bit with the kernels' scalar loops)")


def case_leaf():
    import torch
    import uckpt as deepspeed
    from uckpt.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])

    class SubExperts(Experts):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Experts(), SubExperts(), Experts())
    got = set_z3_leaf_modules(model, [Experts])
    if got != [model[1], model[3]]:
        fail(f"set_z3_leaf_modules returned {got}, not the two Experts (a subclass is not flagged, as DeepSpeed)")
    if get_z3_leaf_modules(model) != [model[1], model[3]] or z3_leaf_module(model[2]) or not z3_leaf_module(model[1]):
        fail("get_z3_leaf_modules / z3_leaf_module do not see the flags set")
    if unset_z3_leaf_modules(model, [Experts]) != [model[1], model[3]] or get_z3_leaf_modules(model):
        fail("unset_z3_leaf_modules did not clear the flags")
    if model[1]._z3_leaf is not False:
        fail("unset_z3_leaf_modules leaves _z3_leaf False, as DeepSpeed's")
    try:
        set_z3_leaf_modules(model, [torch.nn.ReLU])
        fail("set_z3_leaf_modules without a matching module did not raise")
    except ValueError as e:
        if "No modules of type" not in str(e) or "ReLU" not in str(e):
            fail(f"ValueError does not name the classes: {e}")
    try:
        set_z3_leaf_modules(model, ["Experts"])
        fail("set_z3_leaf_modules with a class name (not a type) did not raise")
    except AssertionError as e:
        if "must be a list of types" not in str(e):
            fail(f"AssertionError says {e}")
    if deepspeed.utils.set_z3_leaf_modules is not set_z3_leaf_modules:
        fail("deepspeed.utils.set_z3_leaf_modules is not the function")
    print("leaf: OK")


# ---------------------------------------------------------------- engine (2 ranks, then 1)
UPDATES, SAVE = 6, 3


def make(torch, name, params):
    from uckpt.ops.adagrad import DeepSpeedCPUAdagrad
    from uckpt.ops.lion import DeepSpeedCPULion
    if name == "adagrad":
        return DeepSpeedCPUAdagrad(params, lr=0.02, weight_decay=0.01)
    return DeepSpeedCPULion(params, lr=0.003, betas=(0.9, 0.99), weight_decay=0.01)


def worker_engine(work, phase):
    import json
    import torch
    import torch.distributed as dist
    import uckpt as deepspeed
    import optimizers_test as ot
    deepspeed.init_distributed()
    ot.optimizers = lambda torch: {n: (lambda p, n=n: make(torch, n, p)) for n in ("adagrad", "lion")}
    for name in ("adagrad", "lion"):
        ckpt = os.path.join(work, name)
        if phase == "train":
            want = ot.reference(torch, name, UPDATES)
            for stage, offload in ((2, False), (3, False), (2, True)):
                got = ot.engine_run(deepspeed, torch, name, stage, 0, UPDATES, offload=offload)
                ot.same(f"{name} at ZeRO {stage}{' offload' if offload else ''}", got, want)
            full = ot.engine_run(deepspeed, torch, name, 2, 0, UPDATES, ckpt=ckpt, save_at=SAVE)
            if dist.get_rank() == 0:
                json.dump(full, open(ckpt + ".json", "w"))
                sd = torch.load(os.path.join(ckpt, f"global_step{SAVE}", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                                weights_only=False)
                state = sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
                keys = {"adagrad": ["exp_avg_sq", "step"], "lion": ["exp_avg", "exp_avg_sq", "step"]}[name]
                if sorted(state) != keys:
                    fail(f"{name}: the optimizer states file keeps {sorted(state)}, DeepSpeed's keys are {keys}")
                print(f"ok   {name}: losses as the plain loop at ZeRO 2, 3 and 2 with offload; files keep {keys}")
        else:
            full = json.load(open(ckpt + ".json"))
            got = ot.engine_run(deepspeed, torch, name, 2, SAVE, UPDATES - SAVE, ckpt=ckpt)
            ot.same(f"{name}: saved at 2 ranks, resumed at 1", got, full[SAVE:])
            print(f"ok   {name}: resumed at 1 rank, the uninterrupted run's losses")


def main():
    if sys.argv[1] == "--worker":
        phase, pypath, work = sys.argv[2:5]
        sys.path.insert(0, pypath)
        worker_engine(work, phase)
        return
    case, pypath, work = sys.argv[1:4]
    sys.path.insert(0, pypath)
    if case == "math":
        case_math()
    elif case == "leaf":
        case_leaf()
    elif case == "engine":
        work = os.path.join(work, "hf_ops_engine")
        os.makedirs(work, exist_ok=True)
        launch(os.path.abspath(__file__), "train", pypath, 2, extra=(pypath, work))
        launch(os.path.abspath(__file__), "resume", pypath, 1, extra=(pypath, work))
        print("engine: OK")
    else:
        fail(f"unknown case {case}")


if __name__ == "__main__":
    main()
