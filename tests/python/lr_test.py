#!/usr/bin/env python3
"""Learning rates set through optimizer.param_groups, a torch scheduler on the
client optimizer (and its lrs restored by load_checkpoint), per-group lrs, the config's WarmupLR with lr_kwargs, and
backward(scale_wrt_gas=False, retain_graph=True): lr_script.py run by uckpt
against the same script's plain PyTorch loop (vs_torch), or against real
DeepSpeed 0.14.5 (deepspeed: needs UCKPT_DEEPSPEED_SRC, else exit 77).
Losses within 1e-6 relative, learning rates (engine.get_lr(), the scheduler's
get_lr() and last_batch_iteration) equal after every update.

usage: lr_test.py vs_torch|deepspeed PYTHONPATH_OF_UCKPT FIXTURE_DIR WORK_DIR
"""
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP = 77


def run(impl, env, work, stages, fixture, cwd=None):
    out = os.path.join(work, impl + ".json")
    log = os.path.join(work, impl + ".log")
    cmd = [sys.executable, os.path.join(HERE, "lr_script.py"), "--impl", impl, "--out", out, "--fixture", fixture,
           "--stages", *map(str, stages)]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600, cwd=cwd).returncode
    if rc != 0:
        sys.exit(f"FAIL: {impl} exited {rc}; its log, {log}, ends with:\n" + "".join(open(log).readlines()[-25:]))
    return json.load(open(out)), open(log).read()


def close(a, b, tol):
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-30)


def compare(name, got, want):
    bad = []
    for i, (g, w) in enumerate(zip(got["loss"], want["loss"])):
        if not close(g, w, 1e-6):
            bad.append(f"update {i + 1}: loss {g!r} vs {w!r}")
    for key in ("lr", "sched"):
        if len(got[key]) != len(want[key]):
            bad.append(f"{key}: {len(got[key])} records vs {len(want[key])}")
        for i, (g, w) in enumerate(zip(got[key], want[key])):
            if len(g) != len(w) or not all(close(a, b, 1e-12) for a, b in zip(g, w)):
                bad.append(f"update {i + 1}: {key} {g} vs {w}")
    if len(got["loss"]) != len(want["loss"]):
        bad.append(f"{len(got['loss'])} updates vs {len(want['loss'])}")
    print(("FAIL " if bad else "ok   ") + name + ("" if bad else f": {len(got['loss'])} updates, losses and lrs agree"))
    for b in bad[:6]:
        print("       " + b)
    return not bad


def main():
    mode, pypath, fixture, work = sys.argv[1:5]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base.update(OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()))
    src = os.environ.get("UCKPT_DEEPSPEED_SRC", "")
    if mode == "deepspeed" and not os.path.isfile(os.path.join(src, "deepspeed", "__init__.py")):
        print("SKIP: UCKPT_DEEPSPEED_SRC does not name a DeepSpeed 0.14.5 source tree")
        sys.exit(SKIP)
    got, log = run("uckpt", dict(base, PYTHONPATH=pypath), work, [0, 1, 3], fixture)
    if "the config's 'optimizer' section is not used" not in log:
        sys.exit("FAIL: uckpt did not say that the config's optimizer section gives way to the client's:\n" + log)
    if mode == "vs_torch":
        want, _ = run("torch", base, work, [0], fixture)
        # The torch loop is not interrupted: a resumed run must continue it.
        ok = all(compare(f"{k} vs a plain PyTorch loop", v, want[k.split("/")[0].replace("_resume", "")])
                 for k, v in got.items())
    else:
        env = dict(base, DS_ACCELERATOR="cpu", PYTHONPATH=src)
        # From its source tree: DeepSpeed reads its version from ./version.txt there (else "0.0.0",
        # and its ZeRO-1 load then refuses its own checkpoint as too old).
        want, _ = run("deepspeed", env, work, [0, 1, 3], fixture, cwd=src)
        ok = all(compare(f"{k} vs real DeepSpeed", v, want[k]) for k, v in got.items())
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
