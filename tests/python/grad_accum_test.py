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

CASE:
  bf16_z<S>[_w4]        bf16 at ZeRO stage S (0-3), 2 ranks (_w4: 4 ranks)
  fp16_z<S>             fp16 at ZeRO stage S (1-3): DeepSpeed's engine refuses fp16 on the CPU, its ZeRO optimizers
                        do not (the engine's check is patched in DeepSpeed's worker, as zero_fp16_growth_test does)
  bf16_z<S>_<dtype>     the same with data_types.grad_accum_dtype = dtype (fp32, bf16, fp16) where DeepSpeed 0.14.5
                        trains with it
  refused               every (stage, model dtype, grad_accum_dtype) that DeepSpeed 0.14.5 refuses, or that uckpt
                        refuses (named in docs/engine.md): uckpt's initialize raises naming the key, the value and
                        the stage; where DeepSpeed raises, DeepSpeed's initialize is checked to raise too.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import testkit  # noqa: E402
from testkit import fail, have_deepspeed  # noqa: E402

SKIP = 77
STEPS, GAS, MICRO = 4, 3, 2


def config(stage, dtype, accum=None, offload=False):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.05,
           "steps_per_print": 1000, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 6}
    if accum is not None:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def net(torch):
    torch.manual_seed(0)
    # 5*7+7 + 7*7+7 + 7*3+3 = 122 elements: padded partitions at 2 and 4 ranks.
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 7), torch.nn.Tanh(),
                               torch.nn.Linear(7, 3))


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


def train(impl, stage, dtype, accum, out):
    deepspeed = import_impl(impl)
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    model = net(torch)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=config(stage, dtype, accum))
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    steps = []
    for step in range(STEPS):
        losses = []
        for micro in range(GAS):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x, y = torch.randn(MICRO, 5, generator=g), torch.randn(MICRO, 3, generator=g)
            loss = (engine(x.to(half)).float() - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        steps.append([losses, None if norm is None else float(norm)])
    # The attributes DeepSpeed's optimizer has (its ZeRO optimizers: the loss scale; BF16_Optimizer: none).
    attributes = [name for name in ("overflow", "cur_scale", "loss_scale") if hasattr(optimizer, name)]
    result = {"optimizer": attributes, "steps": steps, "weights": weights(deepspeed, engine, stage)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


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


def parse(case):
    """bf16_z2_w4_fp32 -> ("bf16", 2, 4, "fp32")."""
    parts = case.split("_")
    dtype, stage, world, accum = parts[0], int(parts[1][1:]), 2, None
    for p in parts[2:]:
        if p.startswith("w"):
            world = int(p[1:])
        else:
            accum = p
    return dtype, stage, world, accum


def check_refusals(pypath, work):
    outs = {impl: os.path.join(work, f"refused_{impl}.json") for impl in ("deepspeed", "uckpt")}
    for impl, out in outs.items():
        testkit.launch(__file__, "refused", pypath if impl == "uckpt" else "", 2, extra=[impl, out])
    theirs, ours = (json.load(open(outs[i])) for i in ("deepspeed", "uckpt"))
    for key, want in DEEPSPEED_REFUSES.items():
        k = " ".join(map(str, key))
        if theirs[k] == "trained" or theirs[k][0] != want:
            fail(f"{k}: DeepSpeed 0.14.5 did not raise {want} as expected: {theirs[k]}")
    for k, got in ours.items():
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
            dtype, stage, _, accum = parse(case)
            train(sys.argv[3], stage, dtype, accum, sys.argv[4])
        return
    case, pypath, work = sys.argv[1:4]
    if not have_deepspeed():
        print("SKIP: DeepSpeed 0.14.5 is not installed beside torch; nothing was compared")
        sys.exit(SKIP)
    os.makedirs(work, exist_ok=True)
    if case == "refused":
        check_refusals(pypath, work)
        print(f"PASS {case}")
        return
    dtype, stage, world, accum = parse(case)
    results = {}
    for impl in ("deepspeed", "uckpt"):
        out = os.path.join(work, f"{case}_{impl}.json")
        testkit.launch(__file__, case, pypath if impl == "uckpt" else "", world, extra=[impl, out])
        results[impl] = json.load(open(out))
    want, got = results["deepspeed"], results["uckpt"]
    for i, (a, b) in enumerate(zip(got["steps"], want["steps"])):
        print(f"step {i + 1}: losses {a[0]} norm {a[1]!r}; DeepSpeed's {b[0]} norm {b[1]!r}")
    if got["optimizer"] != want["optimizer"]:
        fail(f"{case}: the optimizer has {got['optimizer']} of overflow, cur_scale, loss_scale; DeepSpeed's "
             f"{want['optimizer']}")
    for i, (a, b) in enumerate(zip(got["steps"], want["steps"])):
        if a != b:
            fail(f"{case}: step {i + 1}: losses and norm {a}, DeepSpeed's {b}")
    if got["weights"] != want["weights"]:
        worst = max(abs(x - y) for k in want["weights"] for x, y in zip(got["weights"][k], want["weights"][k]))
        differing = sum(x != y for k in want["weights"] for x, y in zip(got["weights"][k], want["weights"][k]))
        fail(f"{case}: after {STEPS} steps {differing} weights differ from DeepSpeed's (max {worst:.3g})")
    print(f"ok   {case}: {STEPS} steps of {GAS} micro-steps at {world} ranks, losses, norms and weights equal to "
          f"DeepSpeed's")
    print(f"PASS {case}")


if __name__ == "__main__":
    main()
