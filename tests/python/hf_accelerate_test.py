"""Accelerate's own loop with a DeepSpeed plugin on uckpt (#39), on the CPU at 2 ranks.

    hf_accelerate_test.py PYPATH WORK_DIR [--against uckpt|deepspeed] [--stage 2|3]

In a venv where `deepspeed` is uckpt through the alias (or real DeepSpeed 0.14.5), torchrun starts 2 ranks of
this file's worker: `Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=…))`, a torch AdamW,
`accelerator.prepare(model, optimizer, loader)`, `accelerator.backward`, `optimizer.step()`, `zero_grad()`,
`accelerator.save_state` after 3 of 6 updates; then a second launch that `load_state`s it and runs the last 3.
The losses are printed; exit 0 when both launches finish, every loss is finite and the resumed losses equal the
uninterrupted run's, else 1 with the first error (ctest: python_hf_accelerate_zero2; ZeRO-3 unregistered).
"""
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_env import (cpu_data_parallel, fail_run, fresh_work, harness_parser, harness_venv, torchrun,  # noqa: E402
                    worker_args)
UPDATES, SAVE = 6, 3


def worker(args):
    cpu_data_parallel()
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=args.stage, gradient_accumulation_steps=1, gradient_clipping=1.0)
    acc = Accelerator(deepspeed_plugin=plugin)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    ckpt = os.path.join(args.work, "state")
    losses = {}
    first = 0
    if args.phase == "resume":
        acc.load_state(ckpt)
        first = SAVE
    for step, (x, y) in enumerate(loader):
        if step < first:
            continue  # the batches the saved run consumed (Accelerate's skip_first_batches does the same)
        if step >= UPDATES:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        total = acc.reduce(loss.detach(), reduction="mean")
        losses[step + 1] = total.item()
        if args.phase == "train" and step + 1 == SAVE:
            acc.save_state(ckpt)
    if acc.is_main_process:
        with open(os.path.join(args.work, f"losses-{args.phase}.json"), "w") as f:
            json.dump(losses, f)
    print(f"ENGINE {type(model).__module__}.{type(model).__name__}", flush=True)


def main():
    p = harness_parser()
    p.add_argument("--stage", type=int, default=2)
    args = p.parse_args()
    work = fresh_work(args.work, f"accelerate-{args.against}-zero{args.stage}")
    python, pypath = harness_venv(args.against, work, args.pypath)
    results = {}
    for phase in ("train", "resume"):
        log = os.path.join(work, f"{phase}.log")
        rc, out = torchrun(python, pypath, 2, [os.path.abspath(__file__), "--worker", "--phase", phase, "--work", work,
                                               "--stage", str(args.stage)], log)
        if rc != 0:
            fail_run(f"{args.against} {phase}", rc, out, log)
        with open(os.path.join(work, f"losses-{phase}.json")) as f:
            results[phase] = {int(k): v for k, v in json.load(f).items()}
        print(f"{args.against} {phase}: " + " ".join(f"{k}:{v:.9g}" for k, v in sorted(results[phase].items())))
        if not all(math.isfinite(v) for v in results[phase].values()):
            print(f"FAIL: {phase}: a loss is not finite")
            sys.exit(1)
    if results["resume"] != {k: v for k, v in results["train"].items() if k > SAVE}:
        print("FAIL: the resumed losses differ from the uninterrupted run's")
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(worker_args(strings=("--phase", "--work"), ints=("--stage",)))
    else:
        main()
