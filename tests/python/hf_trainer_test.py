"""A Hugging Face Trainer causal-LM run with `--deepspeed ds_config.json` on uckpt (#39), on the CPU at 2 ranks.

    hf_trainer_test.py PYPATH WORK_DIR [--against uckpt|deepspeed|both] [--steps N] [--stage 2|3]

A venv over the tests' packages (tests/python/hf_env.py) where `deepspeed` is uckpt through the alias
(`python -m uckpt.alias install`), or, for `deepspeed`, one where it is real DeepSpeed 0.14.5. In it torchrun
starts 2 ranks (Gloo, DS_ACCELERATOR=cpu) of this file's worker: a tiny GPT-2 made from a config (nothing
downloaded; built by `AutoModelForCausalLM.from_config` after the TrainingArguments, so that at ZeRO-3
transformers builds it under `deepspeed.zero.Init` and initialises it through `GatheredParameters`), synthetic
tokens made here, `TrainingArguments(deepspeed="ds_config.json")` with the "auto" values the Trainer fills in
(AdamW and WarmupLR from the config, ZeRO-2 or 3; `WORK_DIR/<uckpt|deepspeed>-zero<stage>`), train for N steps with a save
halfway, then `trainer.train(resume_from_checkpoint=...)` from that save into a new Trainer. Each rank
prints its per-step losses; with `both` the uckpt run's losses are compared with real DeepSpeed's.
Exit 0 when every run finished (and, with `both`, the losses agree within 1e-5 relative); otherwise the first
failure's traceback is printed and the exit is 1.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

DS_CONFIG = {
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "allgather_bucket_size": 2e8},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def worker(args):
    sys.path.insert(0, HERE)
    from hf_env import cpu_data_parallel
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 96, (64, 32), generator=g)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return tokens.shape[0]

        def __getitem__(self, i):
            return {"input_ids": tokens[i], "labels": tokens[i].clone()}

    def model():
        # From the config through from_config, after TrainingArguments: at ZeRO-3 transformers builds it under
        # deepspeed.zero.Init and initialises it through GatheredParameters, as for from_pretrained.
        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0)
        m = AutoModelForCausalLM.from_config(cfg)
        if args.lora:  # PEFT's LoRA on the attention: the base weights frozen (requires_grad False)
            from peft import LoraConfig, get_peft_model
            m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                                             fan_in_fan_out=True))
        return m

    logged = {}

    class Losses(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs and state.is_world_process_zero:
                logged[state.global_step] = [float(logs["loss"]), float(logs.get("grad_norm", "nan"))]
                with open(os.path.join(args.work, f"losses-{args.phase}.json"), "w") as f:
                    json.dump(logged, f)

    def targs(out, steps):
        return TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_steps=steps, save_steps=args.save_at, save_strategy="steps", logging_steps=1,
                                 learning_rate=1e-3, warmup_steps=2, weight_decay=0.01, max_grad_norm=1.0,
                                 deepspeed=args.ds_config, report_to="none", dataloader_num_workers=0,
                                 seed=0, data_seed=0, disable_tqdm=True, save_only_model=False,
                                 **cpu_data_parallel())

    out = os.path.join(args.work, "out")
    if args.phase == "train":
        training_args = targs(out, args.steps)
        trainer = Trainer(model=model(), args=training_args, train_dataset=Tokens(), callbacks=[Losses()])
        trainer.train()
    else:
        training_args = targs(out + "-resumed", args.steps)
        trainer = Trainer(model=model(), args=training_args, train_dataset=Tokens(), callbacks=[Losses()])
        trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{args.save_at}"))
    engine = trainer.model_wrapped
    print(f"ENGINE {type(engine).__module__}.{type(engine).__name__} global_steps={engine.global_steps}",
          flush=True)


def run_phase(python, pypath, work, phase, args, env_extra):
    env = dict(os.environ, PYTHONPATH=pypath, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", LOCAL_SIZE="2", **env_extra)  # (DeepSpeed's CPU device count; else numactl)
    env.pop("PYTHONHOME", None)
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(args.port),
           os.path.abspath(__file__), "--worker", "--phase", phase, "--work", work,
           "--ds_config", os.path.join(work, "ds_config.json"), "--steps", str(args.steps),
           "--save_at", str(args.save_at)] + (["--lora"] if args.lora else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    with open(os.path.join(work, f"{phase}.log"), "w") as f:
        f.write(out)
    return done.returncode, out


def first_error(out):
    """The first traceback's last lines (the exception), from rank output."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line:
            block = []
            for nxt in lines[i + 1:]:
                block.append(nxt)
                if re.match(r"^(\[rank\d+\]: )?[A-Za-z_.]+(Error|Exception|Interrupt)\b", nxt):
                    break
            return "\n".join(block[-8:])
    return "\n".join(lines[-15:])


def losses(work, phase):
    path = os.path.join(work, f"losses-{phase}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {int(k): v for k, v in json.load(f).items()}


def sane(logged, steps):
    """Why the logged (loss, grad norm) of `steps` are not a training run's, or None."""
    if sorted(logged) != list(steps):
        return f"logged steps {sorted(logged)}, expected {list(steps)}"
    bad = {s: v for s, v in logged.items() if not (math.isfinite(v[0]) and v[0] > 0 and math.isfinite(v[1]))}
    return f"losses or gradient norms not finite and positive: {bad}" if bad else None


def main():
    sys.path.insert(0, HERE)
    from hf_env import make_venv, run
    p = argparse.ArgumentParser()
    p.add_argument("pypath")
    p.add_argument("work")
    p.add_argument("--against", choices=["uckpt", "deepspeed", "both"], default="uckpt")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter (frozen base weights)")
    args = p.parse_args()
    args.save_at = args.steps // 2
    results = {}
    for which in (["uckpt", "deepspeed"] if args.against == "both" else [args.against]):
        work = os.path.join(os.path.abspath(args.work), f"{which}-zero{args.stage}{'-lora' if args.lora else ''}")
        os.makedirs(work, exist_ok=True)
        for sub in ("out", "out-resumed", "losses-train.json", "losses-resume.json"):
            subprocess.run(["rm", "-rf", os.path.join(work, sub)])
        cfg = json.loads(json.dumps(DS_CONFIG))
        cfg["zero_optimization"]["stage"] = args.stage
        if args.stage == 3:  # the keys Hugging Face's ZeRO-3 examples set, "auto" where the Trainer fills them
            cfg["zero_optimization"].update({"stage3_prefetch_bucket_size": "auto",
                                             "stage3_param_persistence_threshold": "auto",
                                             "stage3_gather_16bit_weights_on_model_save": True})
        with open(os.path.join(work, "ds_config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        if which == "uckpt":
            python = make_venv(os.path.join(work, "venv"))
            done = run(python, ["-m", "uckpt.alias", "install"], args.pypath)
            if done.returncode != 0:
                print(done.stdout + done.stderr)
                print(f"FAIL: uckpt: the alias did not install")
                sys.exit(1)
            pypath = args.pypath
        else:
            python = make_venv(os.path.join(work, "venv"), with_deepspeed=True)
            pypath = ""
        ok = True
        for phase in ("train", "resume"):
            rc, out = run_phase(python, pypath, work, phase, args, {})
            results[(which, phase)] = losses(work, phase)
            if rc != 0:
                print(f"FAIL: {which} {phase}: exit {rc}; first error:\n{first_error(out)}\n"
                      f"(whole output: {os.path.join(work, phase + '.log')})")
                ok = False
                break
            engines = re.findall(r"ENGINE (\S+)", out)
            print(f"{which} {phase}: finished; engine {engines[:1]}; losses "
                  + " ".join(f"{s}:{v[0]:.9g}" for s, v in sorted(results[(which, phase)].items())))
            why = sane(results[(which, phase)], range(1 if phase == "train" else args.save_at + 1, args.steps + 1))
            if why:
                print(f"FAIL: {which} {phase}: {why}")
                sys.exit(1)
        if not ok:
            sys.exit(1)
        if results[(which, "resume")] != {k: v for k, v in results[(which, "train")].items() if k > args.save_at}:
            print(f"FAIL: {which}: the resumed steps' losses differ from the uninterrupted run's")
            sys.exit(1)
    if args.against == "both":
        for phase in ("train", "resume"):
            a, b = results[("uckpt", phase)], results[("deepspeed", phase)]
            if a.keys() != b.keys():
                print(f"FAIL: {phase}: logged steps differ: uckpt {sorted(a)} deepspeed {sorted(b)}")
                sys.exit(1)
            worst = max(abs(a[k][0] - b[k][0]) / max(abs(b[k][0]), 1e-12) for k in a)
            print(f"{phase}: max relative loss difference uckpt vs DeepSpeed {worst:.3g}")
            if worst > 1e-5:
                print(f"FAIL: {phase}: losses differ beyond 1e-5 relative")
                sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        wp = argparse.ArgumentParser()
        wp.add_argument("--worker", action="store_true")
        for k in ("--phase", "--work", "--ds_config"):
            wp.add_argument(k)
        wp.add_argument("--steps", type=int)
        wp.add_argument("--save_at", type=int)
        wp.add_argument("--lora", action="store_true")
        worker(wp.parse_args())
    else:
        main()
