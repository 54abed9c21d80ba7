#!/usr/bin/env python3
"""One script (ds_api_train.py) under real DeepSpeed 0.14.5 and under
`import uckpt as deepspeed`: 2 ranks, gradient accumulation 2, ZeRO 1, 2 and 3.

  1. the per-step losses of the two agree within 1e-6 relative;
  2. uckpt resumes DeepSpeed's checkpoint (with its client_state) and the
     losses after it agree with DeepSpeed's own run; the reverse too.

DeepSpeed runs from a source tree named by UCKPT_DEEPSPEED_SRC (a `git archive`
of v0.14.5: deepspeed/, accelerator/, op_builder/, with a
deepspeed/git_version_info_installed.py), on CPU with the refrun fixture's
shims (scripts/ds_cpu_compat.py, scripts/pyshim). Without it this test exits 77
(ctest: skipped) and says so.

usage: deepspeed_parity_test.py PYTHONPATH_OF_UCKPT FIXTURE_DIR WORK_DIR [STAGE...]
"""
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP = 77
REL_TOL = 1e-6
STEPS, SAVE = 8, 4
SAVES = (0, 1, 2, 3)  # stages whose checkpoints are cross-resumed


def deepspeed_source(fixture):
    src = os.environ.get("UCKPT_DEEPSPEED_SRC", "")
    if not src:
        return None, "UCKPT_DEEPSPEED_SRC is not set"
    # A git archive of DeepSpeed v0.14.5, or the folder its installed package is in.
    if not os.path.isfile(os.path.join(src, "deepspeed", "__init__.py")):
        return None, f"UCKPT_DEEPSPEED_SRC={src} has no deepspeed/__init__.py"
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True,
                           env=dict(os.environ, DS_ACCELERATOR="cpu",
                                    PYTHONPATH=src + os.pathsep + os.path.join(fixture, "scripts", "pyshim")))
    if probe.returncode != 0:
        return None, f"DeepSpeed from {src} does not import: {probe.stderr.strip().splitlines()[-1:]}"
    return src, ""


def run(impl, uckpt_path, ds_src, fixture, work, name, stage, *extra):
    out = os.path.join(work, name + ".json")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = uckpt_path if impl == "uckpt" else ds_src
    cmd = [sys.executable, os.path.join(fixture, "scripts", "launch.py"), "2", str(free_port()),
           os.path.join(HERE, "ds_api_train.py"), "--impl", impl, "--fixture", fixture, "--stage", str(stage),
           "--steps", str(STEPS), "--out", out, *extra]
    log = os.path.join(work, name + ".log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600).returncode
    if rc != 0:
        sys.exit(f"FAIL: {name} exited {rc}; its log, {log}, ends with:\n" + "".join(open(log).readlines()[-25:]))
    return json.load(open(out))["steps"]


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare(what, got, want, steps):
    worst = 0.0
    for s in steps:
        g, w = got[str(s)]["loss"], want[str(s)]["loss"]
        rel = abs(g - w) / abs(w)
        worst = max(worst, rel)
        if rel > REL_TOL:
            sys.exit(f"FAIL: {what}: step {s} loss {g!r} vs {w!r} (relative {rel:.3g} > {REL_TOL})")
    print(f"ok   {what}: steps {steps[0]}..{steps[-1]}, max relative loss difference {worst:.3g}")


def main():
    uckpt_path, fixture, work = sys.argv[1:4]
    stages = [int(s) for s in sys.argv[4:]] or [1, 2, 3]
    ds_src, why = deepspeed_source(fixture)
    if ds_src is None:
        print(f"SKIPPED: real DeepSpeed is not available ({why}); nothing was compared.")
        return SKIP
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    args = (uckpt_path, ds_src, fixture, work)
    for stage in stages:
        ck = {impl: os.path.join(work, f"z{stage}_{impl}_ckpt") for impl in ("deepspeed", "uckpt")}
        save = ["--save-step", str(SAVE)] if stage in SAVES else []
        full = {impl: run(impl, *args, f"z{stage}_{impl}", stage, *save, "--ckpt-dir", ck[impl])
                for impl in ("deepspeed", "uckpt")}
        compare(f"ZeRO {stage}: uckpt vs DeepSpeed", full["uckpt"], full["deepspeed"], list(range(1, STEPS + 1)))
        if not save:
            print(f"note ZeRO {stage}: checkpoints not compared (uckpt's engine does not save stage 3 yet)")
            continue
        after = list(range(SAVE + 1, STEPS + 1))
        resumed = run("uckpt", *args, f"z{stage}_uckpt_resumes_deepspeed", stage, "--resume", "--ckpt-dir",
                      ck["deepspeed"])
        compare(f"ZeRO {stage}: uckpt resuming DeepSpeed's checkpoint", resumed, full["deepspeed"], after)
        resumed = run("deepspeed", *args, f"z{stage}_deepspeed_resumes_uckpt", stage, "--resume", "--ckpt-dir",
                      ck["uckpt"])
        compare(f"ZeRO {stage}: DeepSpeed resuming uckpt's checkpoint", resumed, full["uckpt"], after)
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
