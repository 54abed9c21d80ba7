#!/usr/bin/env python3
"""Host threads that fit the host, through `import uckpt as deepspeed`
(docs/python.md): 2 ranks under `uckpt launch` and under an environment-only
launcher (torchrun's variables, nothing else). After initialize each rank's
torch.get_num_threads() is its share of the cores (cores / LOCAL_WORLD_SIZE),
unless OMP_NUM_THREADS or the program's own torch.set_num_threads chose, and
rank 0 says once what uckpt chose. UCKPT_HOST_CORES=8 stands for an 8-core
host on small machines.

usage: host_threads_test.py UCKPT PYPATH LAUNCH_PY WORK_DIR
"""
import os
import re
import shutil
import subprocess
import sys

from testkit import free_port

PROBE = r'''
import os, torch
if os.environ.get("PROBE_SET_THREADS"):  # the program's own choice, before uckpt is imported
    torch.set_num_threads(int(os.environ["PROBE_SET_THREADS"]))
import uckpt as deepspeed
net = torch.nn.Linear(4, 2)
engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config={
    "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
os.write(1, f"rank {engine.global_rank} torch {torch.get_num_threads()}\n".encode())  # one write: ranks share the pipe
torch.distributed.barrier()
'''
HINT = "set OMP_NUM_THREADS or call torch.set_num_threads before initialize to change"


def fail(msg, out=""):
    sys.stderr.write(out + "\nFAIL: " + msg + "\n")
    sys.exit(1)


def run(ctx, name, launcher, **env):
    uckpt, pypath, launch_py, work = ctx
    probe = os.path.join(work, "probe.py")
    e = {k: v for k, v in os.environ.items()
         if k not in ("OMP_NUM_THREADS", "UCKPT_HOST_CORES", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MKL_NUM_THREADS")}
    e.update(PYTHONPATH=pypath, **env)
    if launcher == "uckpt":
        cmd = [uckpt, "launch", "-n", "2", "--master_port", "0", "--", sys.executable, probe]
    else:
        cmd = [sys.executable, launch_py, "2", str(free_port()), probe]
    p = subprocess.run(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    out = p.stdout
    with open(os.path.join(work, name + ".log"), "w") as f:
        f.write(out)
    if p.returncode != 0:
        fail(f"{name}: exit {p.returncode}", out)
    return [re.sub(r"^\[\d+\] ", "", line) for line in out.splitlines()]


def expect(ctx, name, launcher, threads, said, **env):
    lines = run(ctx, name, launcher, **env)
    reports = re.findall(r"rank (\d+) torch (\d+)", "\n".join(lines))  # robust to interleaved output
    for r in (0, 1):
        if (str(r), str(threads)) not in reports:
            fail(f"{name}: rank {r} does not use {threads} threads", "\n".join(lines))
    if sum(line == said for line in lines) != 1:
        fail(f"{name}: not said once: {said}", "\n".join(lines))


def main():
    uckpt, pypath, launch_py, work = sys.argv[1:]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    with open(os.path.join(work, "probe.py"), "w") as f:
        f.write(PROBE)
    ctx = (uckpt, pypath, launch_py, work)
    for launcher in ("uckpt", "env"):
        expect(ctx, "share_" + launcher, launcher, 4,
               f"uckpt: 4 host threads per rank (8 cores / 2 local ranks; {HINT})", UCKPT_HOST_CORES="8")
        expect(ctx, "omp_" + launcher, launcher, 3, "uckpt: 3 host threads per rank (OMP_NUM_THREADS=3)",
               UCKPT_HOST_CORES="8", OMP_NUM_THREADS="3")
        expect(ctx, "program_" + launcher, launcher, 6,
               "uckpt: 6 host threads per rank (set by the program (torch.set_num_threads / at::set_num_threads); "
               "above this rank's share of 4: 8 cores / 2 local ranks)", UCKPT_HOST_CORES="8", PROBE_SET_THREADS="6")
    # This machine: at most cores / 2 (less where libtorch's own default is smaller).
    cores = len(os.sched_getaffinity(0))
    lines = run(ctx, "host", "uckpt")
    for r in (0, 1):
        got = [int(t) for rank, t in re.findall(r"rank (\d+) torch (\d+)", "\n".join(lines)) if rank == str(r)]
        if len(got) != 1 or not 1 <= got[0] <= max(1, cores // 2):
            fail(f"host: rank {r} uses {got} threads, its share of {cores} cores is {max(1, cores // 2)}", "\n".join(lines))
    said = [line for line in lines if line.startswith("uckpt: ") and f"({cores} core" in line and "/ 2 local ranks" in line]
    if len(said) != 1 or not said[0].startswith(f"uckpt: {got[0]} host thread"):
        fail("host: the choice is not said once", "\n".join(lines))
    print("python host threads: OK")


if __name__ == "__main__":
    main()
