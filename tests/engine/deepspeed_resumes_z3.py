#!/usr/bin/env python3
"""Real DeepSpeed 0.14.5 resumes uckpt's ZeRO-3 checkpoint.

`uckpt train` (stage 3, 2 ranks, the refrun fixture's model, data and init.pt) saves
global_step6; `uckpt verify`, `convert` and `export` read it; then the fixture's own
DeepSpeed script (scripts/train_ds.py --mode resume_zero, stage 3, 2 ranks, Gloo on CPU)
loads it and trains steps 7..12. Its losses must equal, bit for bit, those of DeepSpeed
resuming its own ZeRO-3 checkpoint (runs/z3_zero_ws2_resume).

usage: deepspeed_resumes_z3.py UCKPT SHARED WORKDIR
Needs UCKPT_DEEPSPEED_SRC (a DeepSpeed 0.14.5 source tree, importable with the fixture's
pyshim) and Debian's python3-torch; otherwise exits 77 (skipped), never 0.
"""
import json
import os
import shutil
import subprocess
import sys


def main():
    uckpt, shared, work = sys.argv[1:4]
    src = os.environ.get("UCKPT_DEEPSPEED_SRC", "")
    if not src or not os.path.isdir(os.path.join(src, "deepspeed")):
        print("SKIPPED: set UCKPT_DEEPSPEED_SRC to a DeepSpeed 0.14.5 source tree")
        return 77
    # The reference runs made on this PyTorch (ctest's UCKPT_REFRUN), else the shared ones.
    fx = os.environ.get("UCKPT_REFRUN") or os.path.join(shared, "fixtures", "refrun-gpt2")
    scripts = os.path.join(fx, "scripts")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    ds = json.load(open(os.path.join(fx, "runs", "z3_ws2_baseline", "config.json")))["ds_config_as_passed"]
    cfg = os.path.join(work, "z3.json")
    json.dump(ds, open(cfg, "w"))
    ckpt = os.path.join(work, "ckpt")
    subprocess.run([uckpt, "launch", "-n", "2", "--master_port", "0", "--", uckpt, "train", "--config", cfg,
                    "--n_layer", "2", "--n_head", "2", "--n_embd", "16", "--vocab_size", "97", "--n_positions", "16",
                    "--seq_len", "16", "--init", os.path.join(fx, "init.pt"), "--steps", "6", "--checkpoint_dir", ckpt,
                    "--log_dir", os.path.join(work, "logs"), "--run_name", "z3", "--threads", "1", "--no_progress"],
                   check=True)
    tag = open(os.path.join(ckpt, "latest")).read().strip()
    assert tag == "global_step6", tag
    subprocess.run([uckpt, "verify", ckpt], check=True)
    subprocess.run([uckpt, "convert", os.path.join(ckpt, tag), os.path.join(ckpt, tag + "_universal")], check=True)
    subprocess.run([uckpt, "export", os.path.join(ckpt, tag), os.path.join(work, "model.safetensors")], check=True)

    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.path.join(scripts, "pyshim"), DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    out = os.path.join(work, "ds_losses.json")
    subprocess.run([sys.executable, os.path.join(scripts, "launch.py"), "2", "29871", os.path.join(scripts, "train_ds.py"),
                    "--config", os.path.join(fx, "variant.json"), "--stage", "3", "--mb", "2", "--gas", "2",
                    "--mode", "resume_zero", "--init", os.path.join(fx, "init.pt"), "--total-steps", "12",
                    "--save-step", "6", "--ckpt-dir", ckpt, "--out-json", out,
                    "--final-state", os.path.join(work, "ds_final_model.pt")], check=True, env=env, timeout=900)
    got = json.load(open(out))["steps"]
    want = json.load(open(os.path.join(fx, "runs", "z3_zero_ws2_resume", "losses.json")))["steps"]
    bad = [s for s in want if s not in got or got[s]["loss"] != want[s]["loss"]]
    for s in sorted(want, key=int):
        print(f"step {s}: DeepSpeed resuming uckpt {got.get(s, {}).get('loss')}  DeepSpeed resuming its own {want[s]['loss']}")
    if bad:
        print("FAILED: losses differ at steps", bad)
        return 1
    print("OK: DeepSpeed resumed uckpt's ZeRO-3 checkpoint; steps 7..12 equal its own resume bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
