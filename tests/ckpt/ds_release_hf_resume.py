#!/usr/bin/env python3
"""The Hugging Face Trainer on uckpt resumes the Trainer's checkpoint-3 written with DeepSpeed 0.19.8.

usage: ds_release_hf_resume.py PYTHONPATH_OF_UCKPT CASE_DIR WORK

CASE_DIR: tests/fixtures/deepspeed-releases/ds0.19.8/z2_bf16_hf (2 ranks, ZeRO-2, bf16). In a venv
where `deepspeed` is uckpt through its alias (tests/python/hf_env.py), the fixture's hf_trainer.py
runs at 1 rank with `trainer.train(resume_from_checkpoint=<a copy of the checkpoint-3 folder>)` to
step 4: the Trainer must resume at the saved step (it trains exactly one step, the engine's
global_steps is 4) and log a finite positive loss.
"""
import math
import os
import re
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from hf_env import harness_venv, torchrun  # noqa: E402


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def main():
    pypath, case_dir, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    python, pypath = harness_venv("uckpt", work, pypath)
    ckpt = os.path.join(work, "checkpoint-3")
    shutil.copytree(os.path.join(case_dir, "ckpt"), ckpt)
    script = os.path.join(case_dir, "..", "..", "hf_trainer.py")
    rc, out = torchrun(python, pypath, 1, [script, os.path.join(work, "out"), "--resume", ckpt],
                       os.path.join(work, "run.log"))
    m = re.search(r"RESUMED global_steps=(\d+) losses=\[(.*)\]", out)
    if rc != 0 or not m:
        fail(f"the Trainer on uckpt did not resume (exit {rc}):\n{out[-3000:]}")
    steps = int(m.group(1))
    losses = [float(x) for x in m.group(2).split(",") if x.strip()]
    if steps != 4:
        fail(f"global_steps {steps} after resuming step 3 and training to max_steps 4")
    if len(losses) != 1 or not (math.isfinite(losses[0]) and losses[0] > 0):
        fail(f"losses logged after the resume: {losses} (one step, finite, positive)")
    print(f"OK: the Trainer on uckpt resumed DeepSpeed 0.19.8's checkpoint-3 at 1 rank: step 4, loss {losses[0]}")


if __name__ == "__main__":
    main()
