"""The calls the Hugging Face Trainer and its users make on a ZeRO-3 engine (#39), on 2 CPU ranks (Gloo).

    hf_zero3_test.py PYPATH WORK_DIR [--against uckpt|deepspeed]

In a venv where `deepspeed` is uckpt through the alias (or real DeepSpeed 0.14.5), torchrun starts 2 ranks that
train a tiny GPT-2 with `TrainingArguments(deepspeed=ds_config.json)` at ZeRO-3 (fp32, the "auto" values the
Trainer fills in, stage3_gather_16bit_weights_on_model_save true), evaluating and saving every 2 of 6 steps with
`load_best_model_at_end=True`. Checked, each against plain torch on the same weights:
  * from_pretrained under the Trainer's HfDeepSpeedConfig (zero.Init, weights loaded through
    GatheredParameters(modifier_rank=0)): every gathered parameter equals the saved model's;
  * `param.data.normal_()` on a partitioned parameter outside a gather changes nothing (DeepSpeed's data there is
    a 0-element tensor);
  * load_best_model_at_end (the Trainer's deepspeed_load_checkpoint on the best checkpoint; the metric is the
    eval loss with greater_is_better=True, so that the best is the first checkpoint, not the last): after
    train() the gathered parameters equal that checkpoint's model.safetensors;
  * trainer.evaluate() after that equals the eval loss the Trainer logged at the best checkpoint's step, and the
    eval loss of a plain model of its weights;
  * model.generate() on the ZeRO-3 engine's module (greedy, every rank) gives the plain model's tokens;
  * trainer.save_model() writes the whole state dict (model.safetensors, gathered 16-bit save): equal to the best
    checkpoint's weights, every tensor;
  * an evaluation-only Trainer (deepspeed_init(inference=True): an engine without optimizer) over that folder,
    loaded with from_pretrained under ZeRO-3 again, evaluates to the same loss.
Exit 0 when all hold, else 1 with the first failure.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_env import (cpu_data_parallel, fail_run, fresh_work, harness_parser, harness_venv,  # noqa: E402
                    tiny_gpt2_config, torchrun, trainer_ds_config, worker_args)
STEPS, EVERY = 6, 2

def fail(msg):
    print(f"FAIL: rank {os.environ.get('RANK', '0')}: {msg}", flush=True)
    sys.exit(1)


def gathered(model, deepspeed, torch):
    """Every parameter's whole value, by name (state_dict names: tied ones once, as named_parameters gives)."""
    out = {}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone()
    return out


def compare(got, want, what):
    import torch
    missing = sorted(k for k in want if k not in got)
    differ = sorted(k for k in want if k in got and not torch.equal(got[k].float(), want[k].float()))
    if missing or differ:
        fail(f"{what}: missing {missing}, differ {differ}")
    print(f"ok   {what}: {len(want)} tensors equal", flush=True)


def all_rows(torch):
    """48 synthetic samples of 32 tokens: 32 to train on, 16 to evaluate."""
    return torch.randint(0, 96, (48, 32), generator=torch.Generator().manual_seed(1234))


def eval_rows(torch):
    return all_rows(torch)[32:]


class Tokens:
    """A map-style dataset of token rows, each its own labels."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


def plain_model(weights):
    """A GPT-2 without DeepSpeed holding `weights`, in eval mode (its class called directly: from_config would
    build it under zero.Init while the Trainer's ZeRO-3 config is set)."""
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel(tiny_gpt2_config())
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        fail("the plain model was built partitioned")
    model.load_state_dict(weights, strict=False)  # lm_head.weight: tied to wte
    model.tie_weights()
    return model.eval()


def plain_eval_loss(model, rows, torch):
    """The Trainer's eval loss over `rows` (batches of 4, all equal), as transformers 5.17 computes it: each
    batch's token losses summed and divided by its count of labels (every token, 32 a row, though 31 a row are
    predicted), then the batches' mean. Real DeepSpeed 0.14.5 gives the same number under the same script."""
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(rows), 4):
            batch = rows[i:i + 4]
            logits = model(input_ids=batch).logits
            token_losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                             batch[:, 1:].reshape(-1), reduction="sum")
            total += (token_losses / batch.numel()).item()
    return total / (len(rows) // 4)


def worker(args):
    import deepspeed
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    tokens = all_rows(torch)

    training_args = TrainingArguments(
        output_dir=os.path.join(args.work, "out"), per_device_train_batch_size=2, per_device_eval_batch_size=4,
        gradient_accumulation_steps=2, max_steps=STEPS, save_steps=EVERY, save_strategy="steps", eval_steps=EVERY,
        eval_strategy="steps", load_best_model_at_end=True, metric_for_best_model="eval_loss",
        greater_is_better=True, logging_steps=1, learning_rate=1e-2, warmup_steps=1, weight_decay=0.01,
        max_grad_norm=1.0, deepspeed=args.ds_config, report_to="none", dataloader_num_workers=0, seed=0,
        data_seed=0, disable_tqdm=True, **cpu_data_parallel())
    pretrained = os.path.join(args.work, "pretrained")
    model = AutoModelForCausalLM.from_pretrained(pretrained)  # under HfDeepSpeedConfig: zero.Init
    if not all(hasattr(p, "ds_id") for p in model.parameters()):
        fail("from_pretrained under the Trainer's ZeRO-3 config did not build the model partitioned")
    saved = load_file(os.path.join(pretrained, "model.safetensors"))
    compare(gathered(model, deepspeed, torch), saved, "from_pretrained under zero.Init: the gathered parameters "
            "against the saved model")

    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(tokens[:32]),
                      eval_dataset=Tokens(tokens[32:]))
    trainer.train()
    engine = trainer.model_wrapped
    best = trainer.state.best_model_checkpoint
    last = os.path.join(args.work, "out", f"checkpoint-{STEPS}")
    if best is None or os.path.abspath(best) == os.path.abspath(last):
        fail(f"the best checkpoint is {best}; the harness wants an earlier one than {last}")
    best_weights = load_file(os.path.join(best, "model.safetensors"))
    compare(gathered(engine.module, deepspeed, torch), best_weights,
            f"load_best_model_at_end: the engine's parameters against {os.path.basename(best)}/model.safetensors")

    # In-place init on a partitioned parameter, as 7 of transformers' _init_weights write it.
    p = engine.module.transformer.h[0].mlp.c_fc.weight
    p.data.normal_(mean=0.0, std=0.02)
    with deepspeed.zero.GatheredParameters([p]):
        if not torch.equal(p.detach(), best_weights["transformer.h.0.mlp.c_fc.weight"]):
            fail("p.data.normal_() outside a gather changed the partitioned parameter")
    print("ok   p.data.normal_() on a partitioned parameter outside a gather changes nothing", flush=True)

    plain = plain_model(best_weights)  # the best checkpoint's weights, on every rank
    step = int(os.path.basename(best).split("-")[1])
    logged = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h and h.get("step") == step]
    metrics = trainer.evaluate()
    plain_loss = plain_eval_loss(plain, tokens[32:], torch)
    print(f"evaluate: {metrics['eval_loss']:.9g}; logged at step {step}: {logged}; plain model {plain_loss:.9g}",
          flush=True)
    if logged != [metrics["eval_loss"]] or abs(metrics["eval_loss"] - plain_loss) > 1e-5 * abs(plain_loss):
        fail(f"trainer.evaluate() {metrics['eval_loss']} against the logged {logged} and the plain model's "
             f"{plain_loss}")
    print("ok   trainer.evaluate() after load_best_model_at_end: the best step's logged eval loss, the plain "
          "model's", flush=True)

    prompt = tokens[40:42, :8]
    kw = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    out, want = trainer.model.generate(**kw), plain.generate(**kw)
    worst = max((a - b).abs().max().item() for a, b in zip(out.scores, want.scores))
    if not torch.equal(out.sequences, want.sequences) or worst > 1e-4:
        fail(f"generate on the ZeRO-3 engine's module: {out.sequences.tolist()}, the plain model's "
             f"{want.sequences.tolist()}; scores differ by up to {worst}")
    print(f"ok   model.generate() at ZeRO-3: the plain model's tokens {out.sequences[:, 8:].tolist()}, its scores "
          f"within {worst:.2g}", flush=True)

    final = os.path.join(args.work, "final")
    trainer.save_model(final)
    if int(os.environ.get("RANK", "0")) == 0:  # the Trainer's rank 0 writes it
        compare(load_file(os.path.join(final, "model.safetensors")), best_weights,
                "trainer.save_model(): model.safetensors against the best checkpoint's")
        with open(os.path.join(args.work, "eval_loss.json"), "w") as f:
            json.dump(metrics["eval_loss"], f)
    print("WORKER DONE", flush=True)


def worker_eval(args):
    """An evaluation-only Trainer over save_model's folder, built under ZeRO-3 again (a new launch: Accelerate
    takes one DeepSpeed plugin a process): the Trainer's deepspeed_init(inference=True), an engine without
    optimizer. Its loss is the training run's last evaluate()'s. (Evaluating before train() in a Trainer that
    then trains fails under real DeepSpeed 0.14.5 too: Accelerate's engine wrapper is left None.)"""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    rows = eval_rows(torch)
    training_args = TrainingArguments(output_dir=os.path.join(args.work, "eval-out"), per_device_eval_batch_size=4,
                                      deepspeed=args.ds_config, report_to="none", disable_tqdm=True,
                                      **cpu_data_parallel())
    model = AutoModelForCausalLM.from_pretrained(os.path.join(args.work, "final"))
    evaluator = Trainer(model=model, args=training_args, eval_dataset=Tokens(rows))
    alone = evaluator.evaluate()["eval_loss"]
    with open(os.path.join(args.work, "eval_loss.json")) as f:
        want = json.load(f)
    if abs(alone - want) > 1e-6 * abs(want):
        fail(f"an evaluation-only Trainer: eval loss {alone}, the training run's {want}")
    print(f"ok   evaluate() in an evaluation-only Trainer ({type(evaluator.model_wrapped).__name__}, no optimizer "
          f"given) over save_model's folder: {alone:.9g}, the training run's", flush=True)
    print("WORKER DONE", flush=True)


def main():
    args = harness_parser().parse_args()
    work = fresh_work(args.work, f"zero3-calls-{args.against}")
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_gpt2_config()).save_pretrained(os.path.join(work, "pretrained"))
    config = os.path.join(work, "ds_config.json")
    with open(config, "w") as f:
        json.dump(trainer_ds_config(3), f, indent=1)
    python, pypath = harness_venv(args.against, work, args.pypath)
    for phase in ("train", "eval"):
        log = os.path.join(work, f"{phase}.log")
        rc, out = torchrun(python, pypath, 2, [os.path.abspath(__file__), "--worker", phase, "--work", work,
                                               "--ds_config", config], log)
        print("\n".join(line for line in out.splitlines() if line.startswith(("ok ", "evaluate:", "FAIL"))))
        if rc != 0 or out.count("WORKER DONE") != 2:
            fail_run(f"{args.against}, ZeRO-3 at 2 ranks, {phase}", rc, out, log)
    print("PASS")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        parsed = worker_args(strings=("--work", "--ds_config"), worker=("train", "eval"))
        (worker if parsed.worker == "train" else worker_eval)(parsed)
    else:
        main()
