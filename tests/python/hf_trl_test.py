"""TRL's SFTTrainer and DPOTrainer with `deepspeed=ds_config.json` on uckpt (#39), on the CPU at 2 ranks (Gloo),
or on 2 GPUs (NCCL) with UCKPT_TEST_GPU=1 (tests/python/hf_env.py: GPU mode).

    hf_trl_test.py PYPATH WORK_DIR [--trainer sft|dpo] [--against uckpt|deepspeed|both] [--stage 2|3]
                   [--dtype fp32|bf16]

In a venv where `deepspeed` is uckpt through the alias (or real DeepSpeed 0.14.5), torchrun starts 2 ranks of
this file's worker: a character-level tokenizer and a tiny GPT-2 made here (nothing downloaded), a few lines of
text (SFT) or prompt/chosen/rejected triples (DPO, whose reference model TRL prepares as a second DeepSpeed
engine without an optimizer), the ZeRO config of hf_trainer_test.py, 4 steps with a save at step 2, in fp32 or
(`--dtype bf16`) the config's "auto" taking the trainer's bf16=True (TRL's own default, on a GPU). Exit 0 when
the run finishes with positive finite losses and finite gradient norms (`both`: each package's run, and uckpt's
losses within 1e-5 relative of real DeepSpeed's in fp32, 1e-2 absolute in bf16), else 1 with the first error
(ctest: python_hf_trl_dpo, python_hf_trl_sft).
"""
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_env import (cpu_data_parallel, fail_run, fresh_work, harness_parser, harness_venv, torchrun,  # noqa: E402
                    trainer_ds_config, worker_args)
CHARS = list("abcdefghijklmnopqrstuvwxyz .,")
PACKAGE_TOLERANCE = {"fp32": ("relative", 1e-5), "bf16": ("absolute", 1e-2)}  # uckpt's losses against DeepSpeed's


def worker(args):
    import torch
    from datasets import Dataset
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedTokenizerFast, TrainerCallback

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + CHARS)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    words = ["the cat sat on the mat", "a dog ran far", "zero is a stage", "ranks save shards, then load them",
             "any world size resumes", "the loss goes down"]

    logged = {}

    class Losses(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs and state.is_world_process_zero:
                logged[state.global_step] = [float(logs["loss"]), float(logs.get("grad_norm", "nan"))]
                with open(os.path.join(args.work, "losses.json"), "w") as f:
                    json.dump(logged, f)

    bf16 = args.dtype == "bf16"  # (TRL defaults to bf16; fp32 unless asked, as on the CPU)
    common = dict(**cpu_data_parallel(half=bf16), output_dir=os.path.join(args.work, "out"),
                  per_device_train_batch_size=2, max_steps=4, save_steps=2, logging_steps=1, learning_rate=1e-3,
                  deepspeed=args.ds_config, report_to="none", seed=0, disable_tqdm=True, bf16=bf16)

    def model():
        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, eos_token_id=1, bos_token_id=1)
        return AutoModelForCausalLM.from_config(cfg)

    if args.trainer == "sft":
        from trl import SFTConfig, SFTTrainer
        conf = SFTConfig(max_length=48, **common)
        data = Dataset.from_dict({"text": [words[i % len(words)] for i in range(32)]})
        trainer = SFTTrainer(model=model(), args=conf, train_dataset=data, processing_class=tok, callbacks=[Losses()])
    else:
        from trl import DPOConfig, DPOTrainer
        conf = DPOConfig(max_length=48, **common)
        data = Dataset.from_dict({"prompt": [words[i % 6][:8] for i in range(32)],
                                  "chosen": [words[i % 6][8:] for i in range(32)],
                                  "rejected": [words[(i + 1) % 6][8:] for i in range(32)]})
        trainer = DPOTrainer(model=model(), ref_model=model(), args=conf, train_dataset=data, processing_class=tok,
                             callbacks=[Losses()])
    trainer.train()
    print(f"ENGINE {type(trainer.model_wrapped).__module__}.{type(trainer.model_wrapped).__name__}", flush=True)


def train(args, which):
    """One launch of the worker on `which`'s venv; exits 1 unless it logs 4 steps of positive finite losses and
    finite gradient norms. Returns {step: [loss, grad_norm]}."""
    work = fresh_work(args.work, f"trl-{args.trainer}-{which}-zero{args.stage}"
                                 f"{'' if args.dtype == 'fp32' else '-' + args.dtype}")
    with open(os.path.join(work, "ds_config.json"), "w") as f:
        json.dump(trainer_ds_config(args.stage), f, indent=1)
    python, pypath = harness_venv(which, work, args.pypath)
    log = os.path.join(work, "train.log")
    rc, out = torchrun(python, pypath, 2, [os.path.abspath(__file__), "--worker", "--trainer", args.trainer, "--work",
                                           work, "--ds_config", os.path.join(work, "ds_config.json"),
                                           "--dtype", args.dtype], log)
    if rc != 0:
        fail_run(f"{args.trainer} on {which}", rc, out, log)
    with open(os.path.join(work, "losses.json")) as f:
        losses = {int(k): v for k, v in json.load(f).items()}
    print(f"{args.trainer} on {which}: " + " ".join(f"{k}:{v[0]:.9g}" for k, v in sorted(losses.items())))
    if sorted(losses) != [1, 2, 3, 4] or not all(math.isfinite(v[0]) and v[0] > 0 and math.isfinite(v[1])
                                                 for v in losses.values()):
        print(f"FAIL: the logged steps, losses or gradient norms are not a training run's: {losses}")
        sys.exit(1)
    return losses


def main():
    p = harness_parser(against=("uckpt", "deepspeed", "both"))
    p.add_argument("--trainer", choices=["sft", "dpo"], default="sft")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the trainer's bf16=True")
    args = p.parse_args()
    runs = {which: train(args, which) for which in
            (["uckpt", "deepspeed"] if args.against == "both" else [args.against])}
    if args.against == "both":
        a, b = runs["uckpt"], runs["deepspeed"]
        what, tolerance = PACKAGE_TOLERANCE[args.dtype]
        worst = max(abs(a[k][0] - b[k][0]) / (max(abs(b[k][0]), 1e-12) if what == "relative" else 1) for k in a)
        print(f"max {what} loss difference uckpt vs DeepSpeed {worst:.3g}")
        if worst > tolerance:
            print(f"FAIL: uckpt's {args.trainer} losses differ from real DeepSpeed's beyond {tolerance:g} {what}")
            sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(worker_args(strings=("--trainer", "--work", "--ds_config", "--dtype"), dtype="fp32"))
    else:
        main()
