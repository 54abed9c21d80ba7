#!/usr/bin/env python3
"""uckpt converts DeepSpeed's Muon and Adagrad checkpoints (which DeepSpeed's own converter cannot: #8608).

usage: ds_release_muon_check.py UCKPT CASE_DIR WORKDIR

CASE_DIR: a Muon or Adagrad fixture of tests/fixtures/deepspeed-releases (z<stage>_<dtype>_muon|_adagrad,
2 ranks); an Adagrad one must give each parameter its own `sum.pt`.
`uckpt convert` must write, per parameter, the states of its own group: `momentum_buffer.pt` for
the parameters Muon treats as matrices, `exp_avg.pt`/`exp_avg_sq.pt` (+ `step.pt` at ZeRO 1/2)
for those it leaves to Adam; every tensor equal to the rank files' values, read here with torch
independently of uckpt: at ZeRO 1/2 Muon's momentum is whole per parameter on each rank touching
it (concatenated in flat order), the Adam moments and fp32 masters are flat partitions.
"""
import os
import shutil
import subprocess
import sys

import torch


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def main():
    uckpt, case_dir, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    tag = os.path.join(case_dir, "ckpt", "global_step3")
    out = os.path.join(work, "universal")
    subprocess.run([uckpt, "convert", tag, out, "-q"], check=True)
    model_files = sorted(f for f in os.listdir(tag) if f.endswith("model_states.pt"))
    optim_files = sorted(f for f in os.listdir(tag) if f.endswith("optim_states.pt"))
    ranks = [load(os.path.join(tag, f))["optimizer_state_dict"] for f in optim_files]
    shapes = load(os.path.join(tag, model_files[0]))["param_shapes"]
    stage3 = "fp32_flat_groups" in ranks[0]
    checked = 0
    for g, group in enumerate(shapes):
        names = list(group)
        numels = [group[n].numel() for n in names]
        if stage3:
            states = [r["optimizer_state_dict"]["state"][g] for r in ranks]
            flats = [r["fp32_flat_groups"][g] for r in ranks]
            for i, n in enumerate(names):
                ps = -(-numels[i] // len(ranks))
                at = sum(-(-numels[k] // len(ranks)) for k in range(i))
                def whole(per_rank):
                    return torch.cat([t[at:at + ps] for t in per_rank])[:numels[i]]
                want = {"fp32": whole(flats)}
                for key in states[0]:
                    if torch.is_tensor(states[0][key]) and states[0][key].dim() == 1:
                        want[key] = whole([s[key] for s in states])
                check(out, n, want, stage3)
                checked += 1
            continue
        states = [r["base_optimizer_state"]["state"].get(g, {}) for r in ranks]
        flat = [r["single_partition_of_fp32_groups"][g] for r in ranks]
        maps = [r["param_slice_mappings"][g] for r in ranks]
        for i, n in enumerate(names):
            want = {"fp32": torch.cat([flat[r][m[n].start:m[n].start + m[n].numel] for r, m in enumerate(maps)
                                       if n in m])}
            for key, v in states[0].items():
                if not torch.is_tensor(v) or v.dim() != 1:
                    continue
                if key == "momentum_buffer":  # whole per parameter touched, from the first rank holding n
                    r = next(r for r, m in enumerate(maps) if n in m)
                    at = sum(numels[names.index(k)] for k in maps[r] if names.index(k) < i)
                    want[key] = states[r][key][at:at + numels[i]]
                else:
                    want[key] = torch.cat([states[r][key][m[n].start:m[n].start + m[n].numel]
                                           for r, m in enumerate(maps) if n in m])
            check(out, n, want, stage3)
            checked += 1
    print(f"OK: {checked} parameters of {case_dir} converted with their own group's states, values equal")


def check(out, name, want, stage3):
    folder = os.path.join(out, "zero", name)
    have = sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".pt") and f != "step.pt")
    if have != sorted(want):
        fail(f"{name}: files {have}, its group's states are {sorted(want)}")
    for key, w in want.items():
        v = load(os.path.join(folder, key + ".pt"))
        t = v if stage3 else v["param"]
        if t.dtype != w.dtype or not torch.equal(t.flatten(), w):
            fail(f"{name}/{key}.pt differs from the rank files")


if __name__ == "__main__":
    main()
