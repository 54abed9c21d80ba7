"""One Hugging Face Trainer causal-LM run for bench/hf-trainer-gpu.sh (#39): a model made from a config, synthetic
tokens, only `deepspeed=ds_config.json` given, under whatever `deepspeed` this Python imports (real DeepSpeed or
uckpt's alias). Run under a launcher (RANK, WORLD_SIZE, LOCAL_RANK set).

    hf_trainer_bench.py --model llama1b|gpt2|tiny --stage 2|3 [--offload] --world W --steps N --warmup K --seq S
                        --work DIR --label NAME --results FILE [--save_at N] [--resume_from DIR] [--global_batch B]

Rank 0 appends one JSON line to FILE: the label, the world size, the steps timed (those after
--warmup, steps already taken by a resume excluded), tokens/s over them, s/step, each logged loss, the peak GPU
memory, and `deepspeed.__version__` (which package ran).
"""
import argparse
import json
import os
import time

MODELS = {  # (config class, keywords): about 1.0B and 124M parameters
    "llama1b": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16,
                                    num_attention_heads=16, num_key_value_heads=16, vocab_size=32000)),
    "gpt2": ("GPT2Config", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0)),
    "tiny": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=2, vocab_size=512)),  # to try the script on a CPU
}


def ds_config(stage, offload):
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto",
                    stage3_gather_16bit_weights_on_model_save=True)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW",
                          "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupLR",
                          "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
            "zero_optimization": zero, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), default="llama1b")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--global_batch", type=int, default=4)
    p.add_argument("--save_at", type=int, default=0)
    p.add_argument("--resume_from")
    p.add_argument("--work", required=True)
    p.add_argument("--label", required=True)
    p.add_argument("--results", required=True, help="the JSON-lines file rank 0 appends its row to")
    p.add_argument("--phase_times", action="store_true",
                   help="also time the engine's forward, backward and step calls after --warmup (each call's end "
                        "waits for the device, which slows the run a little): mean ms per call in the row")
    args = p.parse_args()

    import deepspeed
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if args.global_batch % world:
        raise SystemExit(f"hf_trainer_bench: --global_batch {args.global_batch} is not a multiple of {world} GPUs")
    cls, kw = MODELS[args.model]
    cfg = getattr(transformers, cls)(max_position_embeddings=args.seq, **kw) if cls == "LlamaConfig" else \
        getattr(transformers, cls)(n_positions=args.seq, **kw)
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, cfg.vocab_size, (args.global_batch * (args.steps + 1), args.seq), generator=g)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return tokens.shape[0]

        def __getitem__(self, i):
            return {"input_ids": tokens[i], "labels": tokens[i].clone()}

    ends, losses, phases = {}, {}, {}

    def timed_calls(engine, state):
        """Wraps the engine's forward, backward and step with wall clocks that wait for the device (after the
        warm-up steps only), summing ms per call name into `phases`."""
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        for name in ("forward", "backward", "step"):
            call = getattr(engine, name)

            def clocked(*a, _call=call, _name=name, **k):
                if state.global_step < args.warmup:
                    return _call(*a, **k)
                sync()
                t0 = time.perf_counter()
                out = _call(*a, **k)
                sync()
                total, n = phases.get(_name, (0.0, 0))
                phases[_name] = (total + (time.perf_counter() - t0) * 1e3, n + 1)
                return out
            setattr(engine, name, clocked)

    class Clock(TrainerCallback):
        def on_train_begin(self, a, state, control, model=None, **kw):
            if args.phase_times:
                timed_calls(trainer.model_wrapped, state)

        def on_step_end(self, a, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends[state.global_step] = time.perf_counter()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])

    ds = os.path.join(args.work, "ds_config.json")
    if rank == 0:
        os.makedirs(args.work, exist_ok=True)
        with open(ds, "w") as f:
            json.dump(ds_config(args.stage, args.offload), f, indent=1)
    else:
        while not os.path.exists(ds):
            time.sleep(0.1)
    targs = TrainingArguments(
        output_dir=os.path.join(args.work, "out"), per_device_train_batch_size=1,
        gradient_accumulation_steps=args.global_batch // world, max_steps=args.steps, logging_steps=1,
        learning_rate=1e-4, warmup_steps=2, weight_decay=0.01, max_grad_norm=1.0, bf16=True, deepspeed=ds,
        report_to="none", dataloader_num_workers=0, seed=0, data_seed=0, disable_tqdm=True,
        save_strategy="steps" if args.save_at else "no", save_steps=args.save_at or 500,
        use_cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")  # after TrainingArguments: zero.Init
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=[Clock()])
    trainer.train(resume_from_checkpoint=args.resume_from)
    timed = sorted(s for s in ends if s > args.warmup and s - 1 in ends)
    if rank == 0:
        span = ends[timed[-1]] - ends[timed[0] - 1] if timed else float("nan")
        row = dict(label=args.label, model=args.model, stage=args.stage, offload=args.offload, world=world,
                   seq=args.seq, global_batch=args.global_batch, steps_timed=len(timed),
                   s_per_step=span / max(len(timed), 1),
                   tokens_per_s=len(timed) * args.global_batch * args.seq / span if timed else 0.0,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0, deepspeed=deepspeed.__version__,
                   resumed_from=args.resume_from,
                   phase_ms={k: [round(t / n, 2), n] for k, (t, n) in phases.items()}, losses={str(k): v for k, v in sorted(losses.items())})
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
        print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
