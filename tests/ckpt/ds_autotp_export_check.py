#!/usr/bin/env python3
"""uckpt export of DeepSpeed 0.19.8 AutoTP checkpoints holds the model's whole weights.

usage: ds_autotp_export_check.py UCKPT CASE_DIR WORKDIR

CASE_DIR: a fixture of tests/fixtures/deepspeed-releases/autotp (tensor-parallel 2). Its
full_weights.safetensors is what DeepSpeed gathered across the TP ranks after training
(engine._consolidated_16bit_state_dict(): the module's weights, fp32 or bf16). `uckpt export`
of the tag folder, and of its universal conversion, must hold the same tensors: the same names
and shapes and, written in the training dtype, the same values (bf16: the fp32 masters rounded
to nearest even, as DeepSpeed's bf16 weights are).
"""
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def compare(what, got, want):
    if sorted(got) != sorted(want):
        fail(f"{what}: names differ: {sorted(set(got) ^ set(want))}")
    for name, w in want.items():
        g = got[name]
        if g.shape != w.shape or g.dtype != w.dtype:
            fail(f"{what}: {name} is {tuple(g.shape)} {g.dtype}, DeepSpeed's {tuple(w.shape)} {w.dtype}")
        if not torch.equal(g, w):
            fail(f"{what}: {name} differs from DeepSpeed's by up to {(g.float() - w.float()).abs().max().item()}")
    print(f"ok   {what}: {len(want)} tensors equal to DeepSpeed's gathered weights", flush=True)


def main():
    uckpt, case_dir, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    want = load_file(os.path.join(case_dir, "full_weights.safetensors"))
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[next(iter(want.values())).dtype]
    tag = os.path.join(case_dir, "ckpt", "global_step3")
    out = os.path.join(work, "tag.safetensors")
    subprocess.run([uckpt, "export", tag, out, "--dtype", dtype, "-q"], check=True)
    compare("export of the TP tag folder", load_file(out), want)
    universal = os.path.join(work, "universal")
    subprocess.run([uckpt, "convert", tag, universal, "-q"], check=True)
    out = os.path.join(work, "universal.safetensors")
    subprocess.run([uckpt, "export", universal, out, "--dtype", dtype, "-q"], check=True)
    compare("export of its universal conversion", load_file(out), want)
    # DeepSpeed's strict check: a pattern of universal_checkpoint_info that no parameter matches
    # stops the conversion, unless --no_strict.
    bad = os.path.join(work, "unused_pattern")
    shutil.copytree(tag, bad)
    model = next(f for f in sorted(os.listdir(bad)) if f.endswith("model_states.pt"))
    states = torch.load(os.path.join(bad, model), map_location="cpu", weights_only=False)
    states["universal_checkpoint_info"]["tp_replicated_parameter_patterns"].append(r"^no\.such\.weight$")
    torch.save(states, os.path.join(bad, model))
    r = subprocess.run([uckpt, "convert", bad, os.path.join(work, "bad_u"), "-q"], capture_output=True, text=True)
    if r.returncode == 0 or "no\\.such\\.weight" not in r.stderr or "--no_strict" not in r.stderr:
        fail(f"an unused pattern: convert exit {r.returncode}, {r.stderr!r}")
    r = subprocess.run([uckpt, "ds_to_universal", "--input_folder", bad, "--output_folder",
                        os.path.join(work, "bad_d"), "--no_strict"], capture_output=True, text=True)
    if r.returncode != 0 or "unused pattern" not in r.stderr:
        fail(f"an unused pattern with --no_strict: exit {r.returncode}, {r.stderr!r}")
    print("ok   an unused pattern is refused, and accepted with --no_strict", flush=True)
    # The lm_head is split unevenly (vocabulary 67 over 2 ranks): its shards are 34 and 33 rows.
    if want["lm_head.weight"].shape[0] != 67:
        fail("the fixture's lm_head is not the 67-row vocabulary")


if __name__ == "__main__":
    main()
