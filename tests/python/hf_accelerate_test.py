"""Accelerate's own loop with a DeepSpeed plugin on uckpt (#39), on CPU ranks (Gloo), or on GPUs (NCCL, a rank
per GPU) with UCKPT_TEST_GPU=1 (tests/python/hf_env.py: GPU mode).

    hf_accelerate_test.py PYPATH WORK_DIR [--against uckpt|deepspeed] [--stage 2|3] [--world N]
                          [--resume-world M] [--dtype fp32|bf16]

In a venv where `deepspeed` is uckpt through the alias (or real DeepSpeed 0.14.5), torchrun starts N ranks
(default 2) of this file's worker: `Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=…))` (`--dtype bf16`:
mixed_precision="bf16"), a torch AdamW, `accelerator.prepare(model, optimizer, loader)`, `accelerator.backward`,
`optimizer.step()`, `zero_grad()`, `accelerator.save_state` after 3 of 6 updates; then a second launch at M ranks
(default N) that `load_state`s it and runs the last 3. Every step takes the same 8 samples at any rank count (a
loader batch of 8 / ranks, which Accelerate hands out round-robin). The losses are printed; exit 0 when both
launches finish, every loss is finite and the resumed losses equal the uninterrupted run's (at M = N), or are
within 1e-3 absolute (fp32) or within 1e-2 after the first resumed step (bf16) at M != N, else 1 with the first
error (ctest: python_hf_accelerate_zero2, and python_hf_accelerate_zero3_4to2 at 4 -> 2 ranks).
"""
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_env import (cpu_data_parallel, fail_run, fresh_work, harness_parser, harness_venv, torchrun,  # noqa: E402
                    worker_args)
UPDATES, SAVE, GLOBAL_BATCH = 6, 3, 8
RESIZE_TOLERANCE = {"fp32": 1e-3, "bf16": 1e-2}  # absolute: fp32 at every resumed step, bf16 after the first


def worker(args):
    cpu_data_parallel()
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=args.stage, gradient_accumulation_steps=1, gradient_clipping=1.0)
    acc = Accelerator(deepspeed_plugin=plugin, **({"mixed_precision": "bf16"} if args.dtype == "bf16" else {}))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32  # the engine's module's; inputs cast to it
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // acc.num_processes, shuffle=False)
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
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
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


def check_resumed(resumed, uninterrupted, resized, dtype):
    """Exits 1 unless the resumed losses continue the uninterrupted run's: equal at the same rank count, within
    RESIZE_TOLERANCE after a resize (bf16: from the second resumed step)."""
    if not resized:
        if resumed != uninterrupted:
            print("FAIL: the resumed losses differ from the uninterrupted run's")
            sys.exit(1)
        return
    if resumed.keys() != uninterrupted.keys():
        print(f"FAIL: resumed steps {sorted(resumed)}, the uninterrupted run's after the save {sorted(uninterrupted)}")
        sys.exit(1)
    deltas = {k: resumed[k] - uninterrupted[k] for k in sorted(resumed)}
    checked = list(deltas.values())[1 if dtype == "bf16" else 0:]
    worst = max((abs(d) for d in checked), default=0.0)
    print("RESULT resized resume: loss deltas " + " ".join(f"{k}:{d:+.3g}" for k, d in deltas.items())
          + f"; max |delta| {worst:.3g}")
    if worst > RESIZE_TOLERANCE[dtype]:
        print(f"FAIL: a resumed loss differs from the uninterrupted run's by more than {RESIZE_TOLERANCE[dtype]}")
        sys.exit(1)


def main():
    p = harness_parser()
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--world", type=int, default=2, choices=[1, 2, 4, 8], help="ranks of the run that saves")
    p.add_argument("--resume-world", type=int, choices=[1, 2, 4, 8], help="ranks of the resume (default --world)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: mixed_precision=\"bf16\"")
    args = p.parse_args()
    resume_world = args.resume_world or args.world
    size = "" if (args.world, resume_world) == (2, 2) else f"-{args.world}to{resume_world}"
    work = fresh_work(args.work, f"accelerate-{args.against}-zero{args.stage}{size}"
                                 f"{'' if args.dtype == 'fp32' else '-' + args.dtype}")
    python, pypath = harness_venv(args.against, work, args.pypath)
    results = {}
    for phase, world in (("train", args.world), ("resume", resume_world)):
        log = os.path.join(work, f"{phase}.log")
        rc, out = torchrun(python, pypath, world, [os.path.abspath(__file__), "--worker", "--phase", phase, "--work",
                                                   work, "--stage", str(args.stage), "--dtype", args.dtype], log)
        if rc != 0:
            fail_run(f"{args.against} {phase} at {world} rank(s)", rc, out, log)
        with open(os.path.join(work, f"losses-{phase}.json")) as f:
            results[phase] = {int(k): v for k, v in json.load(f).items()}
        print(f"{args.against} {phase} at {world} rank(s): "
              + " ".join(f"{k}:{v:.9g}" for k, v in sorted(results[phase].items())))
        if not all(math.isfinite(v) for v in results[phase].values()):
            print(f"FAIL: {phase}: a loss is not finite")
            sys.exit(1)
    check_resumed(results["resume"], {k: v for k, v in results["train"].items() if k > SAVE},
                  resume_world != args.world, args.dtype)
    print("PASS")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(worker_args(strings=("--phase", "--work", "--dtype"), ints=("--stage",), dtype="fp32"))
    else:
        main()
