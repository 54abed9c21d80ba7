#!/usr/bin/env python3
"""The masked language model of DeepSpeed's BERT tutorial (HelloDeepSpeed's train_bert_ds.py),
trained through DeepSpeed's Python API: the same script under real DeepSpeed (--impl deepspeed)
and under uckpt (--impl uckpt: `import uckpt as deepspeed`), for bench/python-gpu.sh.

Model: transformers' RobertaModel (6 layers, hidden 256, intermediate 512, 8 heads, RobertaConfig's
default vocabulary of 50,265) with transformers' RobertaLMHead, its decoder tied to the word
embeddings, applied to the masked positions only. Data: synthetic sequences of 64-256 tokens,
15% masked, padded per batch (the same batches for every implementation and rank count: each rank
draws from its own seeded generator). Configuration: the tutorial's (Adam lr 1e-4, ZeRO stage 1,
optimizer offloaded to CPU) with bf16 or fp16.

Run one process per GPU (torchrun). Rank 0 prints one JSON line: seconds per step over steps
FIRST..LAST (after a device synchronisation), the mean loss over them, peak GPU memory, the mean
host time between step ends on batch widths new to cuDNN and on widths seen before ("lap_ms"),
and the steps skipped for fp16 overflows (all, and among the timed ones).
"""
import argparse
import json
import os
import time

import torch


def masked_lm():
    """The tutorial's model: RoBERTa with its LM head (decoder tied to the word
    embeddings) applied to the masked positions only; returns the loss."""
    from transformers import RobertaConfig, RobertaModel
    from transformers.models.roberta.modeling_roberta import RobertaLMHead
    cfg = RobertaConfig(num_hidden_layers=6, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                        max_position_embeddings=258)

    class MaskedLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.roberta = RobertaModel(cfg, add_pooling_layer=False)
            self.lm_head = RobertaLMHead(cfg)
            self.lm_head.decoder.weight = self.roberta.embeddings.word_embeddings.weight  # tied

        def forward(self, tokens, attention_mask, targets):
            h = self.roberta(tokens, attention_mask=attention_mask).last_hidden_state
            masked = targets != cfg.pad_token_id
            logits = self.lm_head(h[masked])
            return torch.nn.functional.cross_entropy(logits.float(), targets[masked])

    return MaskedLM()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["uckpt", "deepspeed"], required=True)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--offload", type=int, default=1)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--first", type=int, default=50)
    p.add_argument("--last", type=int, default=100)
    p.add_argument("--phases", action="store_true",
                   help="also time each phase (batch, forward, backward, step) with a device synchronisation "
                        "after each, in separate steps after LAST; medians, and the forward's over new and seen widths")
    p.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher passes it
    a = p.parse_args()
    if a.impl == "uckpt":
        import uckpt as deepspeed
    else:
        import deepspeed

    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    torch.manual_seed(0)
    model = masked_lm()
    cfg = model.roberta.config
    zero = {"stage": a.stage}
    if a.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": a.micro, "steps_per_print": 1000000,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
              "zero_optimization": zero}
    config["bf16" if a.dtype == "bf16" else "fp16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dev = torch.device("cuda", local)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses, t0, widths, new_widths = [], None, set(), 0
    laps = {True: [], False: []}  # host time between step ends (the offloaded step waits for the device)
    for step in range(1, a.last + 1):
        tokens, mask, targets = batch(gen, a.micro, cfg)
        new = tokens.shape[1] not in widths  # a shape cuDNN has no plan for yet
        new_widths += step > a.first and new
        widths.add(tokens.shape[1])
        loss = engine(tokens.to(dev), mask.to(dev), targets.to(dev))
        engine.backward(loss)
        engine.step()
        if step == a.first:
            torch.cuda.synchronize()
            t0 = last = time.perf_counter()
            skipped_before = engine.skipped_steps
        if step > a.first:
            losses.append(loss.detach())
            now = time.perf_counter()
            laps[new].append(now - last)
            last = now
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    lap_ms = {("new" if k else "seen"): round(1000 * sum(v) / len(v), 2) if v else None for k, v in laps.items()}
    phases = time_phases(engine, gen, a, cfg, dev, widths) if a.phases else None
    mean_loss = float(torch.stack([x.float() for x in losses]).mean())
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=dev)
    peaks = [torch.zeros_like(peak) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(peaks, peak)
    if rank == 0:
        print(json.dumps({"impl": a.impl, "dtype": a.dtype, "stage": a.stage, "offload": a.offload,
                          "world": torch.distributed.get_world_size(), "threads": torch.get_num_threads(),
                          "s_per_step": round(elapsed / (a.last - a.first), 5), "mean_loss": round(mean_loss, 5),
                          "new_widths": new_widths, "lap_ms": lap_ms, "skipped_steps": engine.skipped_steps,
                          "skipped_timed": engine.skipped_steps - skipped_before,
                          "max_allocated_gib": [round(float(x), 3) for x in peaks], "torch": torch.__version__,
                          **({"phases": phases} if phases else {})}),
              flush=True)


def time_phases(engine, gen, a, cfg, dev, seen):
    """Steps LAST+1..2*LAST-FIRST again, each phase timed alone (synchronised): median seconds of
    each, and the forward's median over batches of a width seen before and of a new one (cuDNN
    builds its attention plans per shape)."""
    import statistics
    rows = []
    for step in range(a.last - a.first):
        t = [time.perf_counter()]
        tokens, mask, targets = batch(gen, a.micro, cfg)
        tokens, mask, targets = tokens.to(dev), mask.to(dev), targets.to(dev)
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        loss = engine(tokens, mask, targets)
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        engine.backward(loss)
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        engine.step()
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        rows.append((tokens.shape[1] in seen, [t[i + 1] - t[i] for i in range(4)]))
        seen.add(tokens.shape[1])
    med = lambda xs: round(statistics.median(xs), 5) if xs else None
    out = {name: med([r[1][i] for r in rows]) for i, name in enumerate(["batch", "forward", "backward", "step"])}
    out["forward_seen_width"] = med([r[1][1] for r in rows if r[0]])
    out["forward_new_width"] = med([r[1][1] for r in rows if not r[0]])
    out["new_widths"] = sum(1 for r in rows if not r[0])
    out["mean_total"] = round(sum(sum(r[1]) for r in rows) / len(rows), 5)
    return out


def batch(gen, micro, cfg):
    """Sequences of 64-256 tokens (<s> ... </s>), padded to the batch's longest; 15% of the
    inner tokens masked (replaced by <mask>, their originals the targets; pad elsewhere)."""
    lengths = torch.randint(64, 257, (micro,), generator=gen)
    width = int(lengths.max())
    tokens = torch.full((micro, width), cfg.pad_token_id, dtype=torch.long)
    targets = torch.full((micro, width), cfg.pad_token_id, dtype=torch.long)
    mask = torch.zeros((micro, width), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        seq = torch.randint(5, cfg.vocab_size, (n,), generator=gen)
        seq[0], seq[-1] = cfg.bos_token_id, cfg.eos_token_id
        chosen = torch.rand(n, generator=gen) < 0.15
        chosen[0] = chosen[-1] = False
        chosen[1] = True  # at least one target per sequence
        targets[i, :n][chosen] = seq[chosen]
        seq[chosen] = 4  # RoBERTa's <mask>
        tokens[i, :n] = seq
        mask[i, :n] = 1
    return tokens, mask, targets


if __name__ == "__main__":
    main()
