#!/usr/bin/env python3
"""Gradient accumulation in bf16 and fp16 against real DeepSpeed 0.14.5 (#39/#40; CPU, Gloo, 2 or 4 ranks, seconds;
without DeepSpeed 0.14.5 installed beside torch: skipped, exit 77).

usage: grad_accum_test.py CASE PYPATH WORK

DeepSpeed 0.14.5's ZeRO optimizers reduce the gradients in the model's dtype (its communication_data_type defaults to
it) and, at stages 2 and 3, sum the micro-steps' reduced gradients in data_types.grad_accum_dtype, which defaults to
the model's dtype under ZeRO (engine.py get_data_types). A toy model (its partitions padded at 2 and 4 ranks) with
the config's torch AdamW, gradient clipping, gradient_accumulation_steps 3, 4 steps, each rank its own data: per step
the loss and get_global_grad_norm(), and the weights after the run, must equal DeepSpeed's bit for bit, and the
optimizer's class name DeepSpeed's.

CASE (each run is one launch of each implementation, its engines one after another):
  bf16                  bf16 at ZeRO stages 1, 2 and 3, and at 2 and 3 with grad_accum_dtype "fp32" (honoured at
                        stage 3; at stage 2 DeepSpeed sums in bf16 all the same), 2 ranks
  fp16                  fp16 at ZeRO stages 1, 2 and 3, 2 ranks: DeepSpeed's engine refuses fp16 on the CPU, its ZeRO
                        optimizers do not (the engine's check is patched in DeepSpeed's worker, as
                        zero_fp16_growth_test does)
  bf16_w4               bf16 at ZeRO stages 1, 2 and 3, 4 ranks
  <dtype>_z<S>[_w<N>][_<accum>]   one run: dtype at stage S, N ranks (2), grad_accum_dtype accum
  refused               every (stage, model dtype, grad_accum_dtype) that DeepSpeed 0.14.5 refuses, or that uckpt
                        refuses (named in docs/engine.md): uckpt's initialize raises naming the key, the value and
                        the stage (needs no DeepSpeed)
  refused_deepspeed     where DEEPSPEED_REFUSES says DeepSpeed raises, DeepSpeed's initialize is checked to raise
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import testkit  # noqa: E402
from testkit import fail, have_deepspeed  # noqa: E402

SKIP = 77
STEPS, GAS, MICRO = 4, 3, 2
# Stage 3: DeepSpeed's own run is not repeatable on the CPU from step 4 on (config() below).
STAGE3_STEPS = 3


def config(stage, dtype, accum=None, offload=False):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.05,
           "steps_per_print": 1000, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 6}
    if stage == 3:
        # DeepSpeed's stage-3 prefetch on the CPU: from step 4 on (its trace recorded) a forward sometimes read
        # parameters whose all-gather had not finished (losses inf or wrong, then NaN). uckpt's prefetch changes
        # no number. Without it DeepSpeed's step 4 still differed from run to run on a loaded 2-core machine
        # (a loss of 4.9e7 once), so stage-3 runs stop after STAGE3_STEPS.
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    if accum is not None:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def net(torch):
    torch.manual_seed(0)
    # 4*8+8 + 8*8+8 + 8*4+4 = 148 elements: the flat partitions of stages 1-2 are padded at 2 and 4 ranks; every
    # parameter's numel divides by 4 (stage 3's chunks are whole; DeepSpeed pads short ones with torch.empty).
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 4))


def import_impl(impl):
    if impl == "uckpt":
        import uckpt as deepspeed
        deepspeed.init_distributed()
        return deepspeed
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    accelerator = type(get_accelerator())
    accelerator.is_fp16_supported = lambda self: True  # its ZeRO optimizers run fp16 on the CPU
    # Stage 3's reduce asks for the devices per node (numactl's count on the CPU): one node of WORLD_SIZE ranks.
    accelerator.device_count = lambda self: int(os.environ["WORLD_SIZE"])
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def weights(deepspeed, engine, stage):
    out = {}
    for name, p in engine.module.named_parameters():
        if stage == 3:
            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.detach().float().reshape(-1).tolist()
        else:
            out[name] = p.detach().float().reshape(-1).tolist()
    return out


def train(deepspeed, stage, dtype, accum):
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    model = net(torch)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=config(stage, dtype, accum))
    half = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    steps = []
    for step in range(STAGE3_STEPS if stage == 3 else STEPS):
        losses = []
        for micro in range(GAS):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x, y = torch.randn(MICRO, 4, generator=g), torch.randn(MICRO, 4, generator=g)
            loss = (engine(x.to(half)).float() - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        steps.append([losses, None if norm is None else float(norm)])
    # The attributes DeepSpeed's optimizer has (its ZeRO optimizers: the loss scale; BF16_Optimizer: none).
    attributes = [name for name in ("overflow", "cur_scale", "loss_scale") if hasattr(optimizer, name)]
    return {"optimizer": attributes, "steps": steps, "weights": weights(deepspeed, engine, stage)}


# (stage, model dtype, grad_accum_dtype) -> what DeepSpeed 0.14.5 raises at initialize (engine.py
# _do_optimizer_sanity_check): stage 0 is not ZeRO there.
DEEPSPEED_REFUSES = {
    (0, "bf16", "bf16"): "NotImplementedError",  # "Bfloat16 wrapper must use a gradient accumulation type of fp32"
    (0, "bf16", "fp16"): "NotImplementedError",  # "unsupported mix of model dtype and gradient accumulation type"
    (0, "fp16", "fp32"): "NotImplementedError",
    (0, "fp16", "bf16"): "NotImplementedError",
    (0, "fp32", "bf16"): "NotImplementedError",
    (0, "fp32", "fp16"): "NotImplementedError",
}
# What uckpt refuses although DeepSpeed 0.14.5 trains (docs/engine.md says why for each).
UCKPT_REFUSES = [
    (1, "bf16", "fp32"),  # DeepSpeed runs its BF16_Optimizer
    (1, "bf16", "fp16"),  # stage 1 with grad_accum_dtype != the model's: DeepSpeed steps on unreduced gradients
    (1, "fp16", "fp32"),
    (1, "fp16", "bf16"),
    (1, "fp32", "bf16"),
    (1, "fp32", "fp16"),
    (2, "bf16", "fp16"),  # a 16-bit accumulation dtype other than the model's
    (2, "fp16", "bf16"),
    (3, "bf16", "fp16"),
    (3, "fp16", "bf16"),
    (2, "fp32", "bf16"),  # a 16-bit accumulation of an fp32 model
    (2, "fp32", "fp16"),
    (3, "fp32", "bf16"),
    (3, "fp32", "fp16"),
]


def refusals(impl, out):
    deepspeed = import_impl(impl)
    import torch
    cases = list(DEEPSPEED_REFUSES) if impl == "deepspeed" else list(DEEPSPEED_REFUSES) + UCKPT_REFUSES
    got = {}
    for stage, dtype, accum in cases:
        model = net(torch)
        try:
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage, dtype, accum))
            got[f"{stage} {dtype} {accum}"] = "trained"
        except Exception as e:  # noqa: BLE001
            got[f"{stage} {dtype} {accum}"] = [type(e).__name__, str(e)]
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(got, f)


GROUPS = {
    "bf16": (2, ["bf16_z1", "bf16_z2", "bf16_z3", "bf16_z2_fp32", "bf16_z3_fp32"]),
    "fp16": (2, ["fp16_z1", "fp16_z2", "fp16_z3"]),
    "bf16_w4": (4, ["bf16_z1", "bf16_z2", "bf16_z3"]),
}


def parse(run):
    """bf16_z2_w4_fp32 -> ("bf16", 2, 4, "fp32")."""
    parts = run.split("_")
    dtype, stage, world, accum = parts[0], int(parts[1][1:]), 2, None
    for p in parts[2:]:
        if p.startswith("w"):
            world = int(p[1:])
        else:
            accum = p
    return dtype, stage, world, accum


def runs_of(case):
    """(world size, the runs) of a CASE."""
    if case in GROUPS:
        return GROUPS[case]
    return parse(case)[2], [case]


def train_all(impl, case, out):
    deepspeed = import_impl(impl)
    import torch.distributed as dist
    results = {}
    for run in runs_of(case)[1]:
        dtype, stage, _, accum = parse(run)
        results[run] = train(deepspeed, stage, dtype, accum)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def check_refusals(pypath, work, impl):
    """`refused`: uckpt refuses each combination naming the key, the value and the stage. `refused_deepspeed`
    (`make test-full` only): DeepSpeed 0.14.5 raises where DEEPSPEED_REFUSES says it does."""
    out = os.path.join(work, f"refused_{impl}.json")
    testkit.launch(__file__, "refused", pypath if impl == "uckpt" else "", 2, extra=[impl, out])
    results = json.load(open(out))
    if impl == "deepspeed":
        for key, want in DEEPSPEED_REFUSES.items():
            k = " ".join(map(str, key))
            if results[k] == "trained" or results[k][0] != want:
                fail(f"{k}: DeepSpeed 0.14.5 did not raise {want} as expected: {results[k]}")
            print(f"ok   DeepSpeed refuses {k}: {results[k][0]}")
        return
    for k, got in results.items():
        stage, dtype, accum = k.split()
        if got == "trained":
            fail(f"stage {stage}, {dtype} model, grad_accum_dtype {accum}: uckpt trained; it must refuse")
        msg = got[1]
        if "grad_accum_dtype" not in msg or f'"{accum}"' not in msg or f"stage {stage}" not in msg:
            fail(f"stage {stage}, {dtype}, grad_accum_dtype {accum}: the refusal does not name the key, the value "
                 f"and the stage: {msg}")
        print(f"ok   refused: stage {stage}, {dtype} model, grad_accum_dtype {accum}: {msg}")


def main():
    if sys.argv[1] == "--worker":
        case = sys.argv[2]
        if case == "refused":
            refusals(sys.argv[3], sys.argv[4])
        else:
            train_all(sys.argv[3], case, sys.argv[4])
        return
    case, pypath, work = sys.argv[1:4]
    os.makedirs(work, exist_ok=True)
    if case == "refused":
        check_refusals(pypath, work, "uckpt")
        print(f"PASS {case}")
        return
    if not have_deepspeed():
        print("SKIP: DeepSpeed 0.14.5 is not installed beside torch; nothing was compared")
        sys.exit(SKIP)
    if case == "refused_deepspeed":
        check_refusals(pypath, work, "deepspeed")
        print(f"PASS {case}")
        return
    world, runs = runs_of(case)
    results = {}

    def run_impl(impl, attempt=""):
        out = os.path.join(work, f"{case}_{impl}{attempt}.json")
        testkit.launch(__file__, case, pypath if impl == "uckpt" else "", world, extra=[impl, out])
        return json.load(open(out))

    for impl in ("deepspeed", "uckpt"):
        results[impl] = run_impl(impl)
    errors = {run: difference(run, world, results["uckpt"][run], results["deepspeed"][run]) for run in runs}
    if any(errors.values()):
        # DeepSpeed's own stage-3 run on the CPU is not always the same (config() above): a difference is
        # uckpt's only if a second run of DeepSpeed, the reference, gives the first run's results again.
        again = run_impl("deepspeed", "_again")
        for run, error in errors.items():
            if error and not difference(run, world, results["uckpt"][run], again[run]):
                print(f"note {run}: DeepSpeed's first run differed from its second, which uckpt's equals")
                errors[run] = None
    for run, error in errors.items():
        if error:
            fail(error)
        print(f"ok   {run}: {len(results['uckpt'][run]['steps'])} steps of {GAS} micro-steps at {world} ranks, losses, norms and weights equal "
              f"to DeepSpeed's")
    print(f"PASS {case}")


def difference(run, world, got, want):
    """The first way uckpt's run differs from DeepSpeed's, or None."""
    for i, (a, b) in enumerate(zip(got["steps"], want["steps"])):
        print(f"{run} step {i + 1}: losses {a[0]} norm {a[1]!r}; DeepSpeed's {b[0]} norm {b[1]!r}")
    if got["optimizer"] != want["optimizer"]:
        return (f"{run}: the optimizer has {got['optimizer']} of overflow, cur_scale, loss_scale; DeepSpeed's "
                f"{want['optimizer']}")
    for i, (a, b) in enumerate(zip(got["steps"], want["steps"])):
        if a != b:
            return f"{run}: step {i + 1}: losses and norm {a}, DeepSpeed's {b}"
    if got["weights"] != want["weights"]:
        worst = max(abs(x - y) for k in want["weights"] for x, y in zip(got["weights"][k], want["weights"][k]))
        differing = sum(x != y for k in want["weights"] for x, y in zip(got["weights"][k], want["weights"][k]))
        return f"{run}: after {len(got['steps'])} steps {differing} weights differ from DeepSpeed's (max {worst:.3g})"
    return None


if __name__ == "__main__":
    main()
