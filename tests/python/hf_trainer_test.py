"""A Hugging Face Trainer causal-LM run with `--deepspeed ds_config.json` on uckpt (#39), on CPU ranks (Gloo),
or on GPUs (NCCL, a rank per GPU) with UCKPT_TEST_GPU=1 (tests/python/hf_env.py: GPU mode).

    hf_trainer_test.py PYPATH WORK_DIR [--against uckpt|deepspeed|both] [--stage 1|2|3] [--lora] [--steps N]
                       [--world W] [--writer uckpt|deepspeed] [--resume W2[:S2[:GA2]]]... [--zero-to-fp32]
                       [--uckpt-data] [--dtype fp32|bf16|fp16] [--offload] [--deepspeed-resize-may-fail]

A venv over the tests' packages (tests/python/hf_env.py) where `deepspeed` is uckpt through the alias
(`python -m uckpt.alias install`), or, for `deepspeed`, one where it is real DeepSpeed 0.14.5. In it torchrun
starts W ranks (default 2) of this file's worker: a tiny GPT-2 made from a config (nothing downloaded; built by
`AutoModelForCausalLM.from_config` after the TrainingArguments, so that at ZeRO-3 transformers builds it under
`deepspeed.zero.Init` and initialises it through `GatheredParameters`), 64 synthetic samples,
`TrainingArguments(deepspeed="ds_config.json")` with the "auto" values the Trainer fills in (AdamW and WarmupLR
from the config, ZeRO 1-3, `--offload`: offload_optimizer to the CPU), a global batch of 8 (2 per rank, gradient
accumulation 4 / W), N steps (default 6) with a save halfway; then `trainer.train(resume_from_checkpoint=...)`
from that save in a new launch. `--dtype bf16|fp16`: TrainingArguments' bf16=True or fp16=True (with use_cpu=True
on a machine without GPUs), which the config's `"enabled": "auto"` takes.

The run is made by `--writer` (default: each of `--against`); each `--resume W2[:S2[:GA2]]` (default: one at
the run's size and stage) by `--against`'s package, at W2 ranks, stage S2 (default the run's), gradient
accumulation GA2 (default 4 / W2: the same global batch). Checked:
  * each run logs positive finite losses and gradient norms at every step, and its engine trains in `--dtype`;
  * the resume's losses continue the run's: equal to the last bit when the package, world size and stage are the
    run's; otherwise within 1e-3 absolute at every resumed step (fp32), or 1e-2 after the first (bf16, fp16), each
    delta printed (RESULT lines);
  * the resume trains on the run's samples, step by step (the Trainer's own data position); with another
    global batch (GA2), on the samples of the Trainer's order that follow the run's (`--uckpt-data`:
    uckpt.data.trainer_sampler with ignore_data_skip=True; the Trainer's own skipping fails this check);
  * uckpt's load checked the state fingerprint: against the manifest's record (uckpt's checkpoints) or against
    the files (DeepSpeed's), from `engine.last_load()`;
  * `--zero-to-fp32`: the run's checkpoint-N/zero_to_fp32.py gives the weights the Trainer saved beside it;
  * with `both`, the uckpt run's losses against real DeepSpeed's, within 1e-5 relative (fp32), or within the
    tolerances above, absolute, at every step (bf16, fp16: both sides get the same config).
`--deepspeed-resize-may-fail`: real DeepSpeed 0.14.5 refuses its checkpoint at another world size or stage
(ZeRORuntimeException); such a resume by DeepSpeed that fails is printed (EXPECTED-FAIL with its first error)
instead of failing the harness; one that succeeds is checked as any other.
Exit 0 when all hold, else 1 with the first failure (a run's first traceback).
"""
import argparse
import json
import math
import os
import re
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_env import (cpu_data_parallel, fail_run, first_error, harness_parser, harness_venv,  # noqa: E402
                    tiny_gpt2_config, torchrun, trainer_ds_config, worker_args)
from hf_env import run as run_python  # noqa: E402  (beside the Run objects below)
GLOBAL_BATCH, MICRO = 8, 2
# Absolute, after a change of world size or stage (#39): fp32 at every resumed step; bf16/fp16 after the first.
RESIZE_TOLERANCE = {"fp32": 1e-3, "bf16": 1e-2, "fp16": 1e-2}

def worker(args):
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 96, (64, 32), generator=g)
    index_of = {tuple(row.tolist()): i for i, row in enumerate(tokens)}
    trained = []  # the samples this rank trained on since the last optimizer step

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return tokens.shape[0]

        def __getitem__(self, i):
            return {"input_ids": tokens[i], "labels": tokens[i].clone()}

    def model():
        # From the config through from_config, after TrainingArguments: at ZeRO-3 transformers builds it under
        # deepspeed.zero.Init and initialises it through GatheredParameters, as for from_pretrained.
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(tiny_gpt2_config())
        if args.lora:  # PEFT's LoRA on the attention: the base weights frozen (requires_grad False)
            from peft import LoraConfig, get_peft_model
            m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                                             fan_in_fan_out=True))
        return m

    logged, samples = {}, {}
    rank = int(os.environ.get("RANK", "0"))

    class Record(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            samples[state.global_step] = list(trained)
            trained.clear()
            with open(os.path.join(args.work, f"samples-{rank}.json"), "w") as f:
                json.dump(samples, f)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs and state.is_world_process_zero:
                logged[state.global_step] = [float(logs["loss"]), float(logs.get("grad_norm", "nan"))]
                with open(os.path.join(args.work, "losses.json"), "w") as f:
                    json.dump(logged, f)

    class Recording(Trainer):
        def training_step(self, model, inputs, *rest, **kw):
            trained.extend(index_of[tuple(row.tolist())] for row in inputs["input_ids"])
            return super().training_step(model, inputs, *rest, **kw)

    trainer_class = Recording
    if args.uckpt_data:  # uckpt's data position instead of the Trainer's skipping (docs/hf.md)
        import uckpt.data

        class trainer_class(Recording):
            def _get_train_sampler(self, train_dataset=None):
                return uckpt.data.trainer_sampler(self, train_dataset)

    training_args = TrainingArguments(
        output_dir=os.path.join(args.work, "out"), per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=args.ga, max_steps=args.steps, save_steps=args.save_at, save_strategy="steps",
        logging_steps=1, learning_rate=1e-3, warmup_steps=2, weight_decay=0.01, max_grad_norm=1.0,
        deepspeed=args.ds_config, report_to="none", dataloader_num_workers=0, seed=0, data_seed=0, disable_tqdm=True,
        save_only_model=False, ignore_data_skip=args.uckpt_data, bf16=args.dtype == "bf16",
        fp16=args.dtype == "fp16", **cpu_data_parallel(half=args.dtype != "fp32"))
    trainer = trainer_class(model=model(), args=training_args, train_dataset=Tokens(), callbacks=[Record()])
    trainer.train(resume_from_checkpoint=args.resume_from)
    engine = trainer.model_wrapped
    print(f"ENGINE {type(engine).__module__}.{type(engine).__name__} global_steps={engine.global_steps}",
          flush=True)
    # The config's "auto" took the Trainer's bf16/fp16: the engine trains the module in that dtype.
    want = {"fp32": (False, False, torch.float32), "bf16": (True, False, torch.bfloat16),
            "fp16": (False, True, torch.float16)}[args.dtype]
    with torch.no_grad():
        dtypes = {p.dtype for p in engine.module.parameters() if p.requires_grad}
    got = (engine.bfloat16_enabled(), engine.fp16_enabled(), dtypes)
    if got != (want[0], want[1], {want[2]}):
        sys.exit(f"FAIL: --dtype {args.dtype}: engine bfloat16_enabled/fp16_enabled/trainable dtypes {got}, "
                 f"want {want}")
    if args.resume_from and hasattr(engine, "last_load"):
        print(f"LOADED {json.dumps(engine.last_load())}", flush=True)


class Run:
    """One launch of the worker: its folder, its logged losses and samples."""

    def __init__(self, work, which, world, stage, lora, ga=None, uckpt_data=False, dtype="fp32", offload=False):
        self.work, self.which, self.world, self.stage, self.lora = work, which, world, stage, lora
        self.dtype, self.offload = dtype, offload
        self.ga = ga or GLOBAL_BATCH // (MICRO * world)
        self.batch = MICRO * self.ga * world
        self.uckpt_data = uckpt_data
        self.name = (f"{which} at {world} rank(s), ZeRO-{stage}{' LoRA' if lora else ''}"
                     f"{'' if dtype == 'fp32' else ', ' + dtype}{', offload_optimizer' if offload else ''}"
                     f"{f', global batch {self.batch}' if self.batch != GLOBAL_BATCH else ''}"
                     f"{', uckpt data position' if uckpt_data else ''}")

    def launch(self, python, pypath, steps, save_at, resume_from=None, may_fail=False):
        """Runs the worker and checks its logged steps; `may_fail`: a failed launch is printed and gives None."""
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.work)
        config = os.path.join(self.work, "ds_config.json")
        with open(config, "w") as f:
            json.dump(trainer_ds_config(self.stage, self.offload), f, indent=1)
        log = os.path.join(self.work, "run.log")
        cmd = [os.path.abspath(__file__), "--worker", "--work", self.work, "--ds_config", config, "--steps",
               str(steps), "--save_at", str(save_at), "--ga", str(self.ga), "--dtype", self.dtype]
        cmd += (["--lora"] if self.lora else []) + (["--resume_from", resume_from] if resume_from else [])
        cmd += ["--uckpt_data"] if self.uckpt_data else []
        rc, self.out = torchrun(python, pypath, self.world, cmd, log)
        if rc != 0 and may_fail:
            print(f"EXPECTED-FAIL {self.name} resumed: exit {rc}; first error:\n{first_error(self.out)}\n"
                  f"(whole output: {log})", flush=True)
            return None
        if rc != 0:
            fail_run(self.name, rc, self.out, log)
        self.losses = self._json("losses.json")
        self.samples = {}  # step -> the global batch's sample indices, sorted
        for r in range(self.world):
            for step, idx in self._json(f"samples-{r}.json").items():
                self.samples.setdefault(step, []).extend(idx)
        self.samples = {k: sorted(v) for k, v in self.samples.items()}
        first = save_at + 1 if resume_from else 1
        print(f"{self.name}{' resumed' if resume_from else ''}: losses "
              + " ".join(f"{s}:{v[0]:.9g}" for s, v in sorted(self.losses.items())), flush=True)
        bad = {s: v for s, v in self.losses.items() if not (math.isfinite(v[0]) and v[0] > 0 and math.isfinite(v[1]))}
        if sorted(self.losses) != list(range(first, steps + 1)) or bad:
            print(f"FAIL: {self.name}: logged steps {sorted(self.losses)}, expected {first}..{steps}; "
                  f"not finite and positive: {bad}")
            sys.exit(1)
        return self

    def _json(self, name):
        path = os.path.join(self.work, name)
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            return {int(k): v for k, v in json.load(f).items()}

    def checkpoint(self, save_at):
        return os.path.join(self.work, "out", f"checkpoint-{save_at}")

    def check_zero_to_fp32(self, python, pypath, save_at):
        """The checkpoint folder's zero_to_fp32.py (DeepSpeed's command line) gives the weights the Trainer saved
        beside it in model.safetensors (fp32 training: the masters), every one of them, to the bit; with LoRA,
        `--exclude_frozen_parameters`: the adapter's, those of adapter_model.safetensors (PEFT's names lack the
        adapter's name, "default"), and nothing else."""
        folder = self.checkpoint(save_at)
        script, out = os.path.join(folder, "zero_to_fp32.py"), os.path.join(self.work, "fp32.bin")
        if not os.access(script, os.X_OK):
            print(f"FAIL: {self.name}: {script} is missing or not executable")
            sys.exit(1)
        done = run_python(python, [script, folder, out] + (["--exclude_frozen_parameters"] if self.lora else []), pypath)
        if done.returncode != 0:
            print(done.stdout + done.stderr + f"\nFAIL: {self.name}: {script} {folder} {out}: exit {done.returncode}")
            sys.exit(1)
        check = ("import sys, torch; from safetensors.torch import load_file\n"
                 "got = torch.load(sys.argv[1], weights_only=True); want = load_file(sys.argv[2])\n"
                 "if sys.argv[3] == 'lora':\n"
                 "    want = {k.replace('.weight', '.default.weight'): v for k, v in want.items()}\n"
                 "    if set(got) != set(want): sys.exit(f'keys {sorted(got)}, want {sorted(want)}')\n"
                 "missing = sorted(k for k in want if k not in got)\n"
                 "differ = sorted(k for k in want if k in got and not torch.equal(got[k], want[k]))\n"
                 "print(f'{len(got)} tensors; missing {missing}; differ {differ}')\n"
                 "sys.exit(1 if (missing or differ) else 0)\n")
        saved = "adapter_model.safetensors" if self.lora else "model.safetensors"
        done = run_python(python, ["-c", check, out, os.path.join(folder, saved), "lora" if self.lora else "-"], pypath)
        print(f"{self.name}: zero_to_fp32.py against {saved}: {done.stdout.strip()}", flush=True)
        if done.returncode != 0:
            print(done.stderr + f"FAIL: {self.name}: zero_to_fp32.py's weights are not the checkpoint's")
            sys.exit(1)


def check_position(run, resumed, save_at):
    """With another global batch: the resumed steps take the samples of the Trainer's order that follow the
    run's, batch after batch (uckpt's data position; the Trainer's own skipping counts steps, not samples)."""
    import torch
    g = torch.Generator()
    g.manual_seed(0)  # data_seed 0, epoch 0
    order = torch.randperm(64, generator=g).tolist()
    want = {s: sorted(order[(s - 1) * run.batch:s * run.batch]) for s in range(1, save_at + 1)}
    at = save_at * run.batch
    for s in sorted(resumed.samples):
        want[s] = sorted(order[at:at + resumed.batch])
        at += resumed.batch
    got = {**{k: v for k, v in run.samples.items() if k <= save_at}, **resumed.samples}
    what = f"{resumed.name} from {run.name}'s checkpoint-{save_at}"
    if got != want:
        print(f"FAIL: {what}: the samples per step are not the order's, continued:\n got  {got}\n want {want}")
        sys.exit(1)
    print(f"RESULT {what}: the resumed steps took samples {save_at * run.batch}..{at - 1} of the order, "
          f"{resumed.batch} a step, after the run's {save_at * run.batch}", flush=True)


def check_resume(run, resumed, save_at, exact):
    """The resume continues `run`: its samples step by step, its losses (to the bit when `exact`), and uckpt's
    load checked the state fingerprint."""
    what = f"{resumed.name} from {run.name}'s checkpoint-{save_at}"
    theirs = {k: v for k, v in run.losses.items() if k > save_at}
    if {k: v for k, v in run.samples.items() if k > save_at} != resumed.samples:
        print(f"FAIL: {what}: the resumed steps trained on other samples than the run's:\n run     "
              f"{ {k: v for k, v in run.samples.items() if k > save_at} }\n resumed {resumed.samples}")
        sys.exit(1)
    deltas = {k: resumed.losses[k][0] - theirs[k][0] for k in sorted(theirs)}
    # fp32: every resumed step; bf16/fp16: after the first (the tolerances), the first printed
    checked = list(deltas.values()) if run.dtype == "fp32" else list(deltas.values())[1:]
    tolerance = RESIZE_TOLERANCE[run.dtype]
    worst = max(abs(d) for d in checked)
    print(f"RESULT {what}: same samples per step; loss deltas "
          + " ".join(f"{k}:{d:+.3g}" for k, d in deltas.items()) + f"; max |delta| {worst:.3g}", flush=True)
    if exact and resumed.losses != theirs:
        print(f"FAIL: {what}: the resumed losses (and gradient norms) differ from the run's; exact expected")
        sys.exit(1)
    if worst > tolerance:
        print(f"FAIL: {what}: a resumed loss differs from the run's by more than {tolerance}")
        sys.exit(1)
    if resumed.which == "uckpt":
        found = re.findall(r"LOADED (\{.*\})", resumed.out)
        want = "recorded" if run.which == "uckpt" else "computed from the files"
        got = {json.loads(f)["fingerprint"] for f in found}
        if not found or got != {want}:
            print(f"FAIL: {what}: the load's state fingerprint check: {got or 'not reported'}, expected {want!r}")
            sys.exit(1)
        print(f"ok   {what}: the state fingerprint checked ({want})")


def compare_packages(a, b, dtype):
    """uckpt's run's losses `a` against real DeepSpeed's `b` on the same config: 1e-5 relative in fp32; in bf16 and
    fp16 (other kernels and reduction orders on a GPU) RESIZE_TOLERANCE's absolute one."""
    if dtype == "fp32":
        worst = max(abs(a[k][0] - b[k][0]) / max(abs(b[k][0]), 1e-12) for k in a)
        what, tolerance = "relative", 1e-5
    else:
        worst = max(abs(a[k][0] - b[k][0]) for k in a)
        what, tolerance = "absolute", RESIZE_TOLERANCE[dtype]
    print(f"max {what} loss difference uckpt vs DeepSpeed {worst:.3g}")
    if a.keys() != b.keys() or worst > tolerance:
        print(f"FAIL: the uckpt run's losses differ from real DeepSpeed's beyond {tolerance:g} {what}")
        sys.exit(1)


def resume_spec(text):
    """W[:S[:GA]]: a resume at W ranks, stage S (default the run's), gradient accumulation GA (default: the
    global batch kept)."""
    parts = [int(x) for x in text.split(":")]
    if not 1 <= len(parts) <= 3 or parts[0] not in (1, 2, 4):
        raise argparse.ArgumentTypeError(f"{text!r} is not W[:S[:GA]] with W in 1, 2, 4")
    return parts + [None] * (3 - len(parts))


def main():
    p = harness_parser(against=("uckpt", "deepspeed", "both"),
                       help="who resumes (both: each, from its own run unless --writer)")
    p.add_argument("--writer", choices=["uckpt", "deepspeed"], help="who makes the run that is resumed")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="TrainingArguments' bf16=True or fp16=True, the config's \"auto\" taking it")
    p.add_argument("--world", type=int, default=2, choices=[1, 2, 4])
    p.add_argument("--resume", type=resume_spec, action="append",
                   help="W[:S[:GA]], repeatable: resume at W ranks, stage S, accumulation GA (default: the run's)")
    p.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter (frozen base weights)")
    p.add_argument("--offload", action="store_true", help="offload_optimizer to the CPU (DeepSpeedCPUAdam)")
    p.add_argument("--zero-to-fp32", action="store_true", help="run each run's checkpoint's zero_to_fp32.py")
    p.add_argument("--uckpt-data", action="store_true",
                   help="uckpt.data.trainer_sampler and ignore_data_skip=True (uckpt's data position)")
    p.add_argument("--deepspeed-resize-may-fail", action="store_true",
                   help="a resume by real DeepSpeed at another world size or stage that fails is printed, not a "
                        "failure (DeepSpeed 0.14.5 refuses one)")
    args = p.parse_args()
    save_at = args.steps // 2
    work = os.path.abspath(args.work)
    venvs, runs = {}, {}

    def venv(which):
        if which not in venvs:
            os.makedirs(work, exist_ok=True)
            venvs[which] = harness_venv(which, work, args.pypath)
        return venvs[which]

    def tag(which, world, stage, ga=None):
        return (f"{which}-zero{stage}-w{world}{f'-ga{ga}' if ga else ''}{'-lora' if args.lora else ''}"
                f"{'' if args.dtype == 'fp32' else '-' + args.dtype}{'-offload' if args.offload else ''}")

    for which in (["uckpt", "deepspeed"] if args.against == "both" else [args.against]):
        writer = args.writer or which
        if writer not in runs:
            run = Run(os.path.join(work, tag(writer, args.world, args.stage)), writer, args.world, args.stage,
                      args.lora, uckpt_data=args.uckpt_data, dtype=args.dtype, offload=args.offload)
            runs[writer] = run.launch(*venv(writer), args.steps, save_at)
            if args.zero_to_fp32:
                run.check_zero_to_fp32(*venv(writer), save_at)
        run = runs[writer]
        for world, stage, ga in args.resume or [[args.world, None, None]]:
            stage = args.stage if stage is None else stage
            resumed = Run(os.path.join(run.work + "-resumed", tag(which, world, stage, ga)), which, world, stage,
                          args.lora, ga=ga, uckpt_data=args.uckpt_data, dtype=args.dtype, offload=args.offload)
            may_fail = (args.deepspeed_resize_may_fail and which == "deepspeed"
                        and (world, stage) != (args.world, args.stage))
            if resumed.launch(*venv(which), args.steps, save_at, resume_from=run.checkpoint(save_at),
                              may_fail=may_fail) is None:
                continue
            if resumed.batch != run.batch:
                check_position(run, resumed, save_at)
            else:
                check_resume(run, resumed, save_at, exact=(writer, world, stage) == (which, args.world, args.stage))
    if args.against == "both" and args.writer is None:
        compare_packages(runs["uckpt"].losses, runs["deepspeed"].losses, args.dtype)
    print("PASS")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(worker_args(strings=("--work", "--ds_config", "--resume_from", "--dtype"),
                           ints=("--steps", "--save_at", "--ga"), flags=("--lora", "--uckpt_data"), dtype="fp32"))
    else:
        main()
