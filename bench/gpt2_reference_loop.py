#!/usr/bin/env python3
"""The plain-PyTorch training loop that `uckpt train` must reproduce (fp32, 1 process).

GPT-2 (bench/gpt2_torch.py: uckpt's math, HF names), initial weights from a
safetensors file (`uckpt train --steps 0` + `uckpt export`), the synthetic
data rule, torch.optim.AdamW, torch's clip_grad_norm_ and DeepSpeed's WarmupLR
as DeepSpeed applies it (step 1 uses the optimizer's lr; step s >= 2 the
schedule at iteration s-2). Gradient accumulation as DeepSpeed: each micro loss
/ GA, micro-batch m = rows [m*MB, (m+1)*MB) of the step's global batch. The
logged loss is the float64 mean of the micro losses.

With --compare METRICS_CSV it prints the max relative loss difference against
uckpt's metrics.csv over the steps it ran and exits 1 unless it is < --rtol.
Runs under torch 1.13 (CPU) and 2.x (CPU or CUDA).
"""
import argparse
import csv
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_torch as g  # noqa: E402


def warmup_lr(it, a):
    """DeepSpeed WarmupLR at iteration `it` (warmup_num_steps floored at 2)."""
    w = max(2, a.warmup_num_steps)
    if it < w:
        gamma = it / w if a.warmup_type == "linear" else math.log(it + 1) / math.log(w)
    else:
        gamma = 1.0
    return a.warmup_min_lr + (a.lr - a.warmup_min_lr) * gamma


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init", required=True, help="safetensors with HF-named GPT-2 weights")
    for k, v in [("n_layer", 4), ("n_head", 4), ("n_embd", 128), ("vocab_size", 50257), ("n_positions", 128),
                 ("seq_len", 128), ("batch", 32), ("micro", 16), ("steps", 20), ("seed", 42),
                 ("warmup_num_steps", 20)]:
        p.add_argument("--" + k, type=int, default=v)
    for k, v in [("lr", 6e-4), ("beta1", 0.9), ("beta2", 0.95), ("eps", 1e-8), ("weight_decay", 0.01),
                 ("clip", 1.0), ("warmup_min_lr", 0.0), ("rtol", 1e-5)]:
        p.add_argument("--" + k, type=float, default=v)
    p.add_argument("--warmup_type", default="log", choices=["log", "linear"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--compare", help="uckpt's metrics.csv")
    p.add_argument("--out", help="write step,loss,lr,grad_norm here")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.batch % a.micro:
        sys.exit(f"--batch {a.batch} is not a multiple of --micro {a.micro}")
    ga = a.batch // a.micro
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # uckpt's libtorch default: true fp32 matmuls
        torch.backends.cudnn.allow_tf32 = False

    model = g.GPT2(a.n_layer, a.n_head, a.n_embd, a.vocab_size, a.n_positions, fused=False)
    g.load_weights_(model, g.read_safetensors(a.init), a.init)
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps,
                            weight_decay=a.weight_decay, foreach=False)
    rows = []
    for step in range(1, a.steps + 1):
        lr = a.lr if step == 1 else warmup_lr(step - 2, a)
        for group in opt.param_groups:
            group["lr"] = lr
        total = 0.0
        for m in range(ga):
            ids = g.synthetic_batch(a.seed, step, a.micro, a.seq_len, a.vocab_size, first_row=m * a.micro).to(dev)
            loss = model.loss(ids)
            total += float(loss.item())
            (loss / ga if ga > 1 else loss).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip) if a.clip > 0 else torch.zeros([])
        opt.step()
        opt.zero_grad(set_to_none=False)
        rows.append((step, total / ga, lr, float(norm)))
        print(f"step {step} loss {total / ga:.9g} lr {lr:.6g} grad_norm {float(norm):.6g}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("step,loss,lr,grad_norm\n")
            f.writelines(f"{s},{l:.17g},{r:.17g},{n:.9g}\n" for s, l, r, n in rows)
    if not a.compare:
        return 0
    theirs = {int(r["step"]): r for r in csv.DictReader(open(a.compare))}
    missing = [s for s, *_ in rows if s not in theirs]
    if missing:
        print(f"FAIL: {a.compare} has no step {missing[0]}")
        return 1
    worst, worst_step = 0.0, 0
    for s, loss, lr, _ in rows:
        rel = abs(float(theirs[s]["loss"]) - loss) / abs(loss)
        if rel > worst or math.isnan(rel):
            worst, worst_step = rel, s
        if abs(float(theirs[s]["lr"]) - lr) > 1e-12 * max(1.0, lr):
            print(f"FAIL: step {s} lr: uckpt {theirs[s]['lr']}, reference {lr}")
            return 1
    ok = worst < a.rtol
    print(f"uckpt vs PyTorch ({a.device}, fp32, {len(rows)} steps): max rel loss diff {worst:.3g} "
          f"(step {worst_step}), limit {a.rtol:g}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
