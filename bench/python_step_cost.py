#!/usr/bin/env python3
"""Where a Python step's time goes beyond the model's own forward and backward.

A small RoBERTa-shaped masked LM in plain torch (no transformers needed), one
process, trained three ways with the same batches:
  torch   forward, loss.backward(), torch.optim.Adam step, zero_grad(set_to_none)
  uckpt   engine(...), engine.backward(loss), engine.step() through `import uckpt as deepspeed`
  (--impl deepspeed: the same under real DeepSpeed)
Prints, per implementation, the mean seconds of each phase (a device
synchronisation after each phase on CUDA, so phases do not overlap) and of a
whole step without the synchronisations. --profile prints torch.profiler's
table of the engine's calls (what the C++ engine dispatches shows as aten ops).

--model roberta uses bench/roberta_mlm.py's model and batches instead (transformers needed).

usage: PYTHONPATH=build/python /usr/bin/python3 bench/python_step_cost.py [--device cpu|cuda]
       [--dtype bf16|fp16|fp32] [--stage 1] [--offload 1] [--steps 20] [--warmup 3]
       [--model small|roberta] [--impl torch,uckpt] [--profile]
"""
import argparse
import json
import time

import torch


class MaskedLM(torch.nn.Module):
    def __init__(self, vocab, hidden, layers, heads, ffn, max_len):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(max_len, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        layer = torch.nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.1, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, layers)
        self.dense = torch.nn.Linear(hidden, hidden)
        self.head_norm = torch.nn.LayerNorm(hidden)
        self.bias = torch.nn.Parameter(torch.zeros(vocab))

    def forward(self, tokens, attention_mask, targets):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.norm(self.tok(tokens) + self.pos(pos))
        h = self.enc(h, src_key_padding_mask=attention_mask == 0)
        masked = targets != 1
        x = self.head_norm(torch.nn.functional.gelu(self.dense(h[masked])))
        logits = x @ self.tok.weight.t() + self.bias  # decoder tied to the word embeddings
        return torch.nn.functional.cross_entropy(logits.float(), targets[masked])


def batch(gen, micro, width, vocab):
    tokens = torch.randint(5, vocab, (micro, width), generator=gen)
    targets = torch.full((micro, width), 1, dtype=torch.long)
    chosen = torch.rand(micro, width, generator=gen) < 0.15
    chosen[:, 1] = True
    targets[chosen] = tokens[chosen]
    tokens[chosen] = 4
    return tokens, torch.ones(micro, width, dtype=torch.long), targets


def roberta():
    """bench/roberta_mlm.py's MaskedLM (the BERT tutorial's shapes)."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from roberta_mlm import masked_lm
    return masked_lm()


def roberta_batch(gen, micro):
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from transformers import RobertaConfig
    from roberta_mlm import batch as rb
    return rb(gen, micro, RobertaConfig())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", default="torch,uckpt")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--offload", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps before the timed ones (fp16: the scaler's early skips)")
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--vocab", type=int, default=50265)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--model", choices=["small", "roberta"], default="small",
                   help="roberta: bench/roberta_mlm.py's model and batches (needs transformers)")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    dev = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    results = {}
    for impl in a.impl.split(","):
        torch.manual_seed(0)
        model = MaskedLM(a.vocab, a.hidden, a.layers, 8, 2 * a.hidden, 512) if a.model == "small" else roberta()
        if impl == "torch":
            model = model.to(dev, dtype)
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)

            def fwd(*xs):
                return model(*xs)

            def bwd(loss):
                loss.backward()

            def step():
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            ds = __import__("uckpt" if impl == "uckpt" else "deepspeed")
            if not torch.distributed.is_initialized():
                ds.init_distributed()
            zero = {"stage": a.stage}
            if a.offload:
                zero["offload_optimizer"] = {"device": "cpu"}
            cfg = {"train_micro_batch_size_per_gpu": a.micro, "steps_per_print": 10**9,
                   "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "zero_optimization": zero}
            if a.dtype != "fp32":
                cfg[a.dtype] = {"enabled": True}
            engine, _, _, _ = ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            fwd, bwd, step = engine, engine.backward, engine.step
        gen = torch.Generator().manual_seed(1)
        make = (lambda: batch(gen, a.micro, a.width, a.vocab)) if a.model == "small" else (lambda: roberta_batch(gen, a.micro))
        batches = [tuple(t.to(dev) for t in make()) for _ in range(a.steps + a.warmup)]
        phases = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        for i, b in enumerate(batches):  # phases, synchronised
            sync()
            t0 = time.perf_counter()
            loss = fwd(*b)
            sync()
            t1 = time.perf_counter()
            bwd(loss)
            sync()
            t2 = time.perf_counter()
            step()
            sync()
            t3 = time.perf_counter()
            if i >= a.warmup:
                phases["forward"] += t1 - t0
                phases["backward"] += t2 - t1
                phases["step"] += t3 - t2
        sync()
        t0 = time.perf_counter()
        for b in batches[a.warmup:]:  # whole steps, unsynchronised
            loss = fwd(*b)
            bwd(loss)
            step()
        sync()
        whole = (time.perf_counter() - t0) / a.steps
        r = {k: round(v / a.steps, 5) for k, v in phases.items()}
        r["whole_step"] = round(whole, 5)
        r["loss"] = round(float(loss), 4)
        results[impl] = r
        print(json.dumps({"impl": impl, "device": a.device, "dtype": a.dtype, "threads": torch.get_num_threads(), **r}),
              flush=True)
        if a.profile and impl != "torch":
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with profile(activities=acts) as prof:
                for b in batches[a.warmup:a.warmup + 5]:
                    loss = fwd(*b)
                    bwd(loss)
                    step()
                sync()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)


if __name__ == "__main__":
    main()
