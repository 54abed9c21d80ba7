#!/usr/bin/env python3
"""The demo's 4 -> 2 experiment through the Python API with data that resumes
(#26), scaled down to seconds: examples/python/resumable_data.py (a tiny GPT-2
on Debian's license texts; the demo's config: AdamW, WarmupLR, clipping 1.0,
ZeRO-3 with parameters and optimizer offloaded to CPU) under `uckpt launch`.
The data is cut to 6 global batches, so the 8 steps cross an epoch.

usage: demo_data_test.py CASE UCKPT_BINARY PYTHONPATH_OF_UCKPT WORK_DIR

CASE:
  sampler    ResumableSampler with the script's own DataLoader: baseline at 4 ranks, checkpoint at step 4;
             resumed at 2 ranks (accumulation 1 -> 2) from the ZeRO folder and from its `uckpt convert`
             conversion: steps 5-8 see the baseline's samples, losses within 1e-6 relative.
  config     the loader initialize(training_data=) returns, with the config's "uckpt": {"resumable_data":
             {"seed": 3}}: the same 4 -> 2 resume continues the baseline (1e-6); without the section the
             loader is DeepSpeed's, which keeps no position: the resumed run starts at the epoch's first
             batches (what a fresh 2-rank run sees first). The section's keys are strict (unknown ones refused
             by name; a malformed value refused).
  skip       not opted in, a script that skips the done steps' batches itself (as DeepSpeed scripts do):
             resumed at the same 4 ranks it continues the baseline bit for bit, with its samples; and the
             loader's order is DeepSpeed's (torch's DistributedSampler over the ranks, its epoch never set).
  deepspeed  that order against real DeepSpeed 0.14.5's DeepSpeedDataLoader (UCKPT_DEEPSPEED_SRC; else 77).
"""
import csv
import json
import os
import shutil
import subprocess
import sys

from testkit import fail

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "examples", "python", "resumable_data.py")
STEPS, MID, BATCH, MICRO, SAMPLES = 8, 4, 16, 4, 96  # 96 samples: 6 global batches of 16
SKIP = 77
CONFIG = {
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-3, "warmup_num_steps": 3}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
}


class Runs:

    def __init__(self, uckpt, pypath, work):
        self.uckpt, self.pypath, self.work = uckpt, pypath, work
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        self.config = os.path.join(work, "ds_config.json")
        with open(self.config, "w") as f:
            json.dump(CONFIG, f)

    def train(self, ranks, name, *flags, expect_ok=True):
        cmd = [self.uckpt, "launch", "-n", str(ranks), "--master_port", "0", "--", sys.executable, SCRIPT,
               "--deepspeed_config", self.config, "--log_dir", os.path.join(self.work, "logs"), "--run_name", name,
               "--steps", str(STEPS), "--train_batch_size", str(BATCH), "--train_micro_batch_size_per_gpu",
               str(MICRO), "--max_samples", str(SAMPLES), *flags]
        env = dict(os.environ, PYTHONPATH=self.pypath, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if (p.returncode == 0) != expect_ok:
            fail(f"{name} at {ranks} ranks exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        return p.stdout + p.stderr

    def ckpt(self, name):
        return os.path.join(self.work, "ckpt", name)

    def metrics(self, name):
        """step -> (loss text, samples text)"""
        with open(os.path.join(self.work, "logs", name, "metrics.csv")) as f:
            return {int(r["step"]): (r["loss"], r["samples"]) for r in csv.DictReader(f)}

    def convert(self, src, dst):
        p = subprocess.run([self.uckpt, "convert", "-q", src, dst], capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            fail(f"uckpt convert {src}: {p.stdout}{p.stderr}")
        with open(os.path.join(os.path.dirname(dst), "latest_universal"), "w") as f:
            f.write(os.path.basename(dst))


def continues(base, run, what, exact=False):
    """The run's steps MID+1.. have the baseline's samples and losses (bit for bit, or within 1e-6 relative)."""
    worst = 0.0
    for step in range(MID + 1, STEPS + 1):
        if step not in run or step not in base:
            fail(f"{what}: step {step} missing")
        (bl, bs), (rl, rs) = base[step], run[step]
        if rs != bs:
            fail(f"{what}: step {step} trained on samples [{rs}], the uninterrupted run on [{bs}]")
        b, r = float(bl), float(rl)
        rel = abs(r - b) / abs(b)
        worst = max(worst, rel)
        if (exact and rl != bl) or rel > 1e-6:
            fail(f"{what}: step {step} loss {rl}, uninterrupted {bl} (relative {rel:.3g})")
    print(f"ok   {what}: steps {MID + 1}-{STEPS} on the uninterrupted run's samples, losses "
          f"{'bit-identical' if exact else f'within {worst:.2g} relative (limit 1e-6)'}")


def case_sampler(runs):
    runs.train(4, "base", "--checkpoint_dir", runs.ckpt("base"), "--checkpoint_interval", str(MID))
    base = runs.metrics("base")
    if base[STEPS - 1][1] == base[1][1]:
        fail("the second epoch repeats the first's order (the epoch's seed is not used)")
    zero = runs.ckpt("zero2")
    shutil.copytree(os.path.join(runs.ckpt("base"), f"global_step{MID}"), os.path.join(zero, f"global_step{MID}"))
    runs.train(2, "zero_2ranks", "--checkpoint_dir", zero, "--resume", "--checkpoint_tag", f"global_step{MID}")
    continues(base, runs.metrics("zero_2ranks"), "ZeRO folder, 4 -> 2 ranks (GA 2)")
    runs.convert(os.path.join(runs.ckpt("base"), f"global_step{MID}"),
                 os.path.join(runs.ckpt("universal"), f"global_step{MID}_universal"))
    runs.train(2, "universal_2ranks", "--checkpoint_dir", runs.ckpt("universal"), "--resume", "--universal_checkpoint",
               "--checkpoint_tag", f"global_step{MID}_universal")
    continues(base, runs.metrics("universal_2ranks"), "universal conversion, 4 -> 2 ranks (GA 2)")


def distributed_order(world, epoch_batches_per_rank):
    """What DeepSpeed 0.14.5's loader gives rank r: DistributedSampler(dataset, world, r) (seed 0, shuffle, epoch 0
    at every iterator), in micro-batches; the steps' samples, each step one micro-batch per rank (GA 1)."""
    import torch
    data = list(range(SAMPLES))
    per_rank = [list(torch.utils.data.DistributedSampler(data, num_replicas=world, rank=r)) for r in range(world)]
    steps = []
    for s in range(epoch_batches_per_rank):
        steps.append(" ".join(str(i) for i in sorted(i for r in range(world) for i in per_rank[r][s * MICRO:(s + 1) * MICRO])))
    return steps


def case_config(runs):
    runs.train(4, "base", "--data", "initialize", "--resumable_data", "--seed", "3",
               "--checkpoint_dir", runs.ckpt("base"), "--checkpoint_interval", str(MID))
    base = runs.metrics("base")
    runs.train(2, "config_2ranks", "--data", "initialize", "--resumable_data", "--seed", "3",
               "--checkpoint_dir", runs.ckpt("base"), "--resume", "--checkpoint_tag", f"global_step{MID}")
    continues(base, runs.metrics("config_2ranks"), "initialize's loader with the uckpt section, 4 -> 2 ranks (GA 2)")
    # Without the section: DeepSpeed's loader, no position kept.
    runs.train(2, "plain_2ranks", "--data", "initialize", "--checkpoint_dir", runs.ckpt("base"), "--resume",
               "--checkpoint_tag", f"global_step{MID}")
    plain = runs.metrics("plain_2ranks")
    mine = sorted(int(x) for x in plain[MID + 1][1].split())
    # At 2 ranks with GA 2 a step takes two micro-batches per rank: DeepSpeed's epoch's first two.
    first, second = distributed_order(2, 2)
    want = sorted(int(x) for x in (first + " " + second).split())
    if mine != want:
        fail(f"without the uckpt section the resumed loader gave {mine} first, DeepSpeed's loader the epoch's "
             f"first batches {want} (no position kept)")
    print("ok   without the uckpt section: the resumed loader starts at the epoch's first batches (DeepSpeed's, "
          "no position kept)")
    check_section_keys(runs)


def check_section_keys(runs):
    """Unknown keys of the uckpt section, and malformed values, refused by name at initialize."""
    bad = [({"resumable_data": {"sed": 1}}, "'uckpt.resumable_data.sed' is not a key of uckpt's section"),
           ({"resumable": {}}, "'uckpt.resumable' is not a key of uckpt's section 'uckpt'"),
           ({"resumable_data": {"seed": "one"}}, "'uckpt.resumable_data.seed' must be an integer"),
           ({"resumable_data": True}, "'uckpt.resumable_data' must be an object"),
           ({"resumable_data": {}, "iterable": True}, "Stream is an iterable dataset; resumable data needs a map-style")]
    code = """
import json, sys, torch
import uckpt as deepspeed
class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.zeros(8, 4))
model = torch.nn.Linear(4, 1)
data = torch.utils.data.TensorDataset(torch.zeros(8, 4))
answers = []
for section in json.loads(sys.argv[1]):
    iterable = section.pop("iterable", False)  # the sampler given an iterable dataset (initialize's own loader
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "uckpt": section}
    try:                                       # refuses one before it, as DeepSpeed's does)
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                      training_data=None if iterable else data)[0]
        if iterable:
            deepspeed.data.ResumableSampler(Stream(), engine)
        answers.append("accepted")
    except (ValueError, RuntimeError) as e:
        answers.append("refused: " + str(e))
print(json.dumps(answers))
"""
    env = dict(os.environ, PYTHONPATH=runs.pypath, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WORLD_SIZE="1",
               RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    p = subprocess.run([sys.executable, "-c", code, json.dumps([section for section, _ in bad])], env=env,
                       capture_output=True, text=True, timeout=120)
    try:
        answers = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        fail(f"the uckpt section checks did not run:\n{p.stdout}{p.stderr[-2000:]}")
    for (section, want), got in zip(bad, answers):
        if not got.startswith("refused:") or want not in got:
            fail(f"the uckpt section {section}: want initialize to refuse it saying \"{want}\", got: {got}")
    print(f"ok   the uckpt section: {len(bad)} unknown keys, malformed values and an iterable dataset refused by name")


def case_skip(runs):
    runs.train(4, "base", "--data", "initialize", "--checkpoint_dir", runs.ckpt("base"),
               "--checkpoint_interval", str(MID))
    base = runs.metrics("base")
    epoch = SAMPLES // 4 // MICRO  # micro-batches per rank in an epoch: 6
    want = distributed_order(4, epoch)
    got = [base[s][1] for s in range(1, STEPS + 1)]
    if got != want + want[:STEPS - epoch]:
        fail(f"not opted in, the loader's steps saw {got}; DeepSpeed's loader (DistributedSampler, epoch never set) "
             f"gives {want} each epoch")
    print("ok   not opted in: initialize's loader gives DeepSpeed's order (DistributedSampler, each epoch the same)")
    runs.train(4, "skip_4ranks", "--data", "initialize", "--skip_batches", "--checkpoint_dir", runs.ckpt("base"),
               "--resume", "--checkpoint_tag", f"global_step{MID}")
    continues(base, runs.metrics("skip_4ranks"), "a script skipping its done batches itself, 4 -> 4 ranks", exact=True)
    with open(os.path.join(runs.work, "order.json"), "w") as f:
        json.dump(want, f)


def case_deepspeed(runs):
    src = os.environ.get("UCKPT_DEEPSPEED_SRC")
    if not src:
        print("skipped: UCKPT_DEEPSPEED_SRC (real DeepSpeed's source) is not set")
        sys.exit(SKIP)
    code = """
import json, sys, torch
from deepspeed.runtime.dataloader import DeepSpeedDataLoader
samples, micro, world = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
data = torch.utils.data.TensorDataset(torch.arange(samples))
per_rank = []
for r in range(world):
    loader = DeepSpeedDataLoader(data, batch_size=micro, pin_memory=False, local_rank=r, tput_timer=None,
                                 num_local_io_workers=0, data_parallel_world_size=world, data_parallel_rank=r)
    per_rank.append([b[0].tolist() for b in loader] + [b[0].tolist() for b in loader][:1])  # a second epoch's first
print(json.dumps(per_rank))
"""
    shim = os.path.join(os.environ.get("UCKPT_SHARED", "/work/shared"), "fixtures", "deepspeed", "scripts", "pyshim")
    env = dict(os.environ, PYTHONPATH=f"{src}:{shim}", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code, str(SAMPLES), str(MICRO), "4"], env=env, capture_output=True,
                       text=True, timeout=300)
    if p.returncode != 0:
        fail(f"real DeepSpeed's DeepSpeedDataLoader: {p.stdout[-2000:]}{p.stderr[-3000:]}")
    per_rank = json.loads(p.stdout.strip().splitlines()[-1])
    epoch = len(per_rank[0]) - 1
    theirs = [" ".join(str(i) for i in sorted(i for r in range(4) for i in per_rank[r][s])) for s in range(epoch + 1)]
    ours = distributed_order(4, epoch)
    if theirs[:epoch] != ours or theirs[epoch] != ours[0]:
        fail(f"DeepSpeed's loader steps {theirs}, uckpt's expectation {ours}")
    runs.train(4, "base", "--data", "initialize", "--checkpoint_dir", runs.ckpt("base"))
    got = [r[1] for _, r in sorted(runs.metrics("base").items())]
    if got != theirs[:epoch] + theirs[:STEPS - epoch]:
        fail(f"uckpt's initialize loader steps {got}, real DeepSpeed's loader {theirs}")
    print("ok   initialize's loader (not opted in) gives real DeepSpeed 0.14.5's DeepSpeedDataLoader order, "
          "and its second epoch repeats the first as DeepSpeed's does")


def main():
    case, uckpt, pypath, work = sys.argv[1:5]
    cases = {"sampler": case_sampler, "config": case_config, "skip": case_skip, "deepspeed": case_deepspeed}
    if case not in cases:
        fail(f"unknown case {case}")
    cases[case](Runs(uckpt, pypath, work))


if __name__ == "__main__":
    main()
