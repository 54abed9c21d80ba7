#!/usr/bin/env python3
"""uckpt converts DeepSpeed's ZeRO stage-0 checkpoints (which DeepSpeed's converter cannot: #7200).

usage: ds_release_stage0_check.py UCKPT CASE_DIR WORKDIR

CASE_DIR: a stage-0 fixture of tests/fixtures/deepspeed-releases (z0_<dtype>, 2 ranks). Its file
names no parameter: torch numbers the optimizer's states 0..N-1 over its param groups, which
train.py built as [matrices in module order], [vectors in module order], the frozen parameter in
neither. `uckpt convert` must give each parameter its own values, read here with torch from the
file and that knowledge (not from uckpt): fp32.pt the master (fp32: the module's weight; bf16/fp16:
FP16_UnfusedOptimizer's `fp32_groups`), each optimizer state and step.pt its own; the frozen
parameter no folder; zero/optimizer_state.pt the optimizer's param_groups; and the converted
folder's model states `param_shapes`, per group. Then the same file with one vector moved to the
matrices' group (a shape in two groups: which id is which parameter is no longer told by the
shapes) must be refused, naming the groups and the shape.
"""
import os
import shutil
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "deepspeed-releases"))
import train  # noqa: E402


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def ambiguous_refused(uckpt, sd, work):
    opt = sd["optimizer"]
    inner = opt.get("optimizer_state_dict", opt)
    g0, g1 = inner["param_groups"]
    g0["params"], g1["params"] = g0["params"] + g1["params"][:1], g1["params"][1:]
    if "fp32_groups" in opt:
        opt["fp32_groups"] = [opt["fp32_groups"][0] + opt["fp32_groups"][1][:1], opt["fp32_groups"][1][1:]]
    tag = os.path.join(work, "ambiguous", "global_step3")
    os.makedirs(tag)
    torch.save(sd, os.path.join(tag, "mp_rank_00_model_states.pt"))
    done = subprocess.run([uckpt, "convert", tag, os.path.join(work, "ambiguous_u"), "-q"], capture_output=True,
                          text=True)
    if done.returncode == 0:
        fail("a stage-0 file whose groups share a parameter shape was converted (the names are a guess there)")
    if "param groups 0 and 1 both hold parameters of shape [10]" not in done.stderr:
        fail(f"the refusal names neither the groups nor the shape: {done.stderr.strip()}")


def main():
    uckpt, case_dir, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    tag = os.path.join(case_dir, "ckpt", "global_step3")
    out = os.path.join(work, "universal")
    subprocess.run([uckpt, "convert", tag, out, "-q"], check=True)
    sd = load(os.path.join(tag, "mp_rank_00_model_states.pt"))
    opt = sd["optimizer"]
    inner = opt.get("optimizer_state_dict", opt)  # FP16_UnfusedOptimizer's wraps torch's
    model = train.Net()
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = [[name_of[id(p)] for p in g["params"]] for g in train.param_groups(model, "AdamW")]
    checked = 0
    sid = 0
    for g, names in enumerate(groups):
        for k, n in enumerate(names):
            master = opt["fp32_groups"][g][k] if "fp32_groups" in opt else sd["module"][n]
            want = {"fp32": master}
            want.update({key: v for key, v in inner["state"][sid].items() if key != "step"})
            folder = os.path.join(out, "zero", n)
            have = sorted(f[:-3] for f in os.listdir(folder) if f != "step.pt")
            if have != sorted(want):
                fail(f"{n} (state id {sid}): files {have}, its states are {sorted(want)}")
            for key, w in want.items():
                t = load(os.path.join(folder, key + ".pt"))["param"]
                if t.dtype != w.dtype or t.shape != w.shape or not torch.equal(t, w):
                    fail(f"{n}/{key}.pt is not state id {sid}'s {key} (another parameter's?)")
            step = load(os.path.join(folder, "step.pt"))
            if not torch.equal(torch.as_tensor(step), torch.as_tensor(inner["state"][sid]["step"])):
                fail(f"{n}/step.pt {step}, the file's {inner['state'][sid]['step']}")
            sid += 1
            checked += 1
    if os.path.exists(os.path.join(out, "zero", "frozen.weight")):
        fail("the frozen parameter (no optimizer state) has a zero/ folder")
    groups_out = load(os.path.join(out, "zero", "optimizer_state.pt"))["param_groups"]
    if [dict(g, params=None) for g in groups_out] != [dict(g, params=None) for g in inner["param_groups"]]:
        fail("zero/optimizer_state.pt's param_groups differ from the optimizer's")
    shapes = load(os.path.join(out, "mp_rank_00_model_states.pt"))["param_shapes"]
    if [list(s) for s in shapes] != groups:
        fail(f"the converted model states' param_shapes {[list(s) for s in shapes]}, the groups {groups}")
    ambiguous_refused(uckpt, sd, work)
    print(f"OK: {checked} parameters of {case_dir} in 2 param groups named by shape, each with its own states")


if __name__ == "__main__":
    main()
