#!/usr/bin/env python3
"""fp16 at ZeRO 1-3 across steps where the dynamic loss scale grows: uckpt against real DeepSpeed 0.14.5 (CPU, 1 rank,
seconds).

usage: zero_fp16_growth_test.py PYTHONPATH_OF_UCKPT FIXTURE_DIR WORK_DIR [STAGE...]   (default: stages 2 and 3;
ZeRO 1 takes the path of 2 in both)

DeepSpeed's ZeRO optimizers update the loss scale before they unscale the gradients (stage_1_and_2.py and
stage3.py: step() calls _update_scale, then unscale_and_clip_grads divides by self.loss_scale, the updated one), so
on a step where the scale grows the gradients are divided by the grown scale. A toy model in fp16 with
loss_scale_window 2 (the scale grows every other step), gradient clipping and torch's Adam (DeepSpeed's FusedAdam
needs CUDA), 10 steps, under real DeepSpeed (its engine refuses fp16 on the CPU, its ZeRO optimizers do not: the
engine's check is patched in the worker) and under `import uckpt as deepspeed`. Per step the loss, the scale and
get_global_grad_norm(), and the fp16 weights after the run, must be equal. DeepSpeed runs with the refrun
fixture's CPU shims (FIXTURE_DIR/scripts); without DeepSpeed the test exits 77 (skipped).
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from testkit import fail, free_port  # noqa: E402

SKIP = 77
STEPS = 10


def worker(impl, fixture, stage, out):
    if impl == "deepspeed":
        scripts = os.path.join(fixture, "scripts")
        sys.path[:0] = [scripts, os.path.join(scripts, "pyshim")]
        import deepspeed
        import ds_cpu_compat
        ds_cpu_compat.apply()
        from deepspeed.accelerator import get_accelerator
        type(get_accelerator()).is_fp16_supported = lambda self: True
    else:
        import uckpt as deepspeed
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.5, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
           "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1},
           "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(3)
    steps = []
    for _ in range(STEPS):
        x, y = torch.randn(4, 8, generator=g).half(), torch.randn(4, 1, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        norm = engine.get_global_grad_norm()
        steps.append([loss.item(), float(engine.optimizer.cur_scale), float(norm) if norm is not None else None])
    weights = {}
    for name, p in engine.module.named_parameters():
        if stage == 3:
            with deepspeed.zero.GatheredParameters([p]):
                weights[name] = p.detach().float().flatten().tolist()
        else:
            weights[name] = p.detach().float().flatten().tolist()
    with open(out, "w") as f:
        json.dump({"steps": steps, "weights": weights}, f)


def run(impl, pypath, fixture, work, stage):
    out = os.path.join(work, f"{impl}-zero{stage}.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", LOCAL_SIZE="1", RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = pypath if impl == "uckpt" else ""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", impl, fixture, str(stage), out],
                          env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        fail(f"{impl} at ZeRO {stage} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main():
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    pypath, fixture, work = sys.argv[1:4]
    stages = [int(s) for s in sys.argv[4:]] or [2, 3]
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True,
                           env=dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.path.join(fixture, "scripts",
                                                                                              "pyshim")))
    if probe.returncode != 0:
        print("SKIP: real DeepSpeed does not import here")
        sys.exit(SKIP)
    os.makedirs(work, exist_ok=True)
    for stage in stages:
        got, want = run("uckpt", pypath, fixture, work, stage), run("deepspeed", pypath, fixture, work, stage)
        scales = [s[1] for s in want["steps"]]
        if len(set(scales)) < 3:
            fail(f"ZeRO {stage}: DeepSpeed's scale grew fewer than twice ({scales}): the test does not test growth")
        for i, (a, b) in enumerate(zip(got["steps"], want["steps"])):
            print(f"ZeRO {stage} step {i + 1}: loss {a[0]:.9g} (DeepSpeed {b[0]:.9g}), scale {a[1]:g} ({b[1]:g}), "
                  f"norm {a[2]} ({b[2]})")
        for i, (a, b) in enumerate(zip(got["steps"], want["steps"])):
            if a != b:
                fail(f"ZeRO {stage} step {i + 1}: loss, scale, grad norm {a}, DeepSpeed's {b}")
        if got["weights"] != want["weights"]:
            worst = max(abs(x - y) for k in want["weights"] for x, y in zip(got["weights"][k], want["weights"][k]))
            fail(f"ZeRO {stage}: the weights after {STEPS} steps differ from DeepSpeed's (max {worst:.3g})")
        print(f"ok   ZeRO {stage}: {STEPS} steps, the scale growing {len(set(scales)) - 1} times, equal to DeepSpeed's")
    print("PASS")


if __name__ == "__main__":
    main()
