#!/usr/bin/env python3
"""Ranks and their world in the Python package, on CPU (Gloo), 2 processes started here.

usage: dist_test.py CASE PYTHONPATH_OF_UCKPT WORK_DIR

CASE:
  discovery   uckpt.init_distributed finds the world as deepspeed.init_distributed does: from Open MPI's
              (OMPI_COMM_WORLD_*) and srun's (SLURM_PROCID, SLURM_STEP_NUM_TASKS, ...) variables with no
              RANK/WORLD_SIZE (exported as DeepSpeed's discovery does), from explicit init_method/rank/world_size;
              and refuses, naming what to set, a multi-host MPI world without MASTER_ADDR, a Slurm batch
              script's SLURM_NTASKS=2 without srun, and dist_init_required=False with no group.
  folders     two ranks (folders4: four) pass different checkpoint folders (as a script naming its folder by the
              clock does):
              the checkpoint lands whole in rank 0's, rank 1 warns naming both, and the load (again with
              different folders) restores it.
  clean_exit  a clean 2-rank run: exit codes 0, no Traceback/Exception/HeartbeatMonitor/TCPStore lines, the
              group's threads gone after uckpt's exit teardown (the engine does not keep it into finalization),
              rank 0 (which serves the store) exits after rank 1 even when rank 1 ends later, and the script's
              last save is published and made durable at exit (no unsynced marker left).
"""
import os
import re
import subprocess
import sys
import time

from testkit import free_port

CASE, PYPATH, WORK = sys.argv[1:4]


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def base_env():
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("OMPI_", "PMI_", "PMIX_", "MV2_", "SLURM_"))}
    env.update(PYTHONPATH=PYPATH, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    return env


def write(name, text):
    path = os.path.join(WORK, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def run_ranks(script, envs, args=(), timeout=120):
    """Starts one process per env; returns [(rc, stdout+stderr, finish time)] in rank order."""
    procs, logs = [], []
    for r, env in enumerate(envs):
        log = open(os.path.join(WORK, f"{os.path.basename(script)}.{r}.log"), "w+")
        procs.append(subprocess.Popen([sys.executable, script, WORK, *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
        logs.append(log)
    done = [None] * len(procs)
    deadline = time.monotonic() + timeout
    while None in done:
        for r, p in enumerate(procs):
            if done[r] is None and p.poll() is not None:
                done[r] = time.monotonic()
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            fail(f"{script} did not end within {timeout} s")
        time.sleep(0.01)
    out = []
    for r, p in enumerate(procs):
        logs[r].seek(0)
        out.append((p.returncode, logs[r].read(), done[r]))
    return out


def expect_ok(results, what):
    for r, (rc, log, _) in enumerate(results):
        if rc != 0:
            fail(f"{what}: rank {r} exited {rc}:\n{log[-3000:]}")


# ---- discovery ----

WORLD = r'''
import os, sys, torch
import uckpt as deepspeed
import torch.distributed as dist
kw = eval(sys.argv[2]) if len(sys.argv) > 2 else {}
deepspeed.init_distributed(**kw)
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("world", dist.get_rank(), dist.get_world_size(), t.item(),
      os.environ.get("RANK"), os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_RANK"),
      os.environ.get("MASTER_PORT"), deepspeed.comm.get_local_rank())
'''

REFUSED = r'''
import sys
import uckpt as deepspeed
kw = eval(sys.argv[2]) if len(sys.argv) > 2 else {}
try:
    deepspeed.init_distributed(**kw)
except (ValueError, TypeError) as e:
    print("refused:", e)
    sys.exit(3)
print("accepted")
'''


def check_world(results, what, port=None):
    expect_ok(results, what)
    for r, (_, log, _) in enumerate(results):
        line = [l for l in log.splitlines() if l.startswith("world ")]
        if not line:
            fail(f"{what}: rank {r} printed no world:\n{log}")
        f = line[0].split()
        if f[1:4] != [str(r), "2", "3.0"]:
            fail(f"{what}: rank {r} saw rank/world/sum {f[1:4]}, expected {r} 2 3.0")
        if port is not None and f[4:9] != [str(r), "2", str(r), str(port), str(r)]:
            fail(f"{what}: rank {r} exported RANK/WORLD_SIZE/LOCAL_RANK/MASTER_PORT/local rank {f[4:9]}, "
                 f"expected {r} 2 {r} {port} {r}")
    print(f"ok   {what}")


def expect_refusal(script, env, kw, what, needle):
    (rc, log, _), = run_ranks(script, [env], [repr(kw)])
    if rc != 3 or needle not in log:
        fail(f"{what}: expected a refusal naming {needle!r}, got exit {rc}:\n{log[-2000:]}")
    print(f"ok   {what}: {log.strip().splitlines()[-1][:160]}")


def case_discovery():
    world, refused = write("world.py", WORLD), write("refused.py", REFUSED)
    port = free_port()
    ompi = [dict(base_env(), OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK=str(r),
                 OMPI_COMM_WORLD_LOCAL_SIZE="2") for r in range(2)]
    check_world(run_ranks(world, ompi, [repr({"distributed_port": port})]), "Open MPI's variables (mpirun)", port)
    port = free_port()
    slurm = [dict(base_env(), SLURM_PROCID=str(r), SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2", SLURM_LOCALID=str(r),
                  SLURM_STEP_NUM_NODES="1") for r in range(2)]
    check_world(run_ranks(world, slurm, [repr({"distributed_port": port})]), "srun's variables", port)
    port = free_port()
    explicit = [repr({"init_method": f"tcp://127.0.0.1:{port}", "rank": r, "world_size": 2}) for r in range(2)]
    procs = [run_ranks_async(world, base_env(), explicit[r], r) for r in range(2)]
    check_world([finish(p) for p in procs], "explicit init_method, rank and world_size")

    two_hosts = dict(ompi[1], OMPI_COMM_WORLD_LOCAL_SIZE="1", OMPI_COMM_WORLD_LOCAL_RANK="0")
    expect_refusal(refused, two_hosts, {}, "an MPI world over two hosts without MASTER_ADDR", "MASTER_ADDR")
    batch = dict(base_env(), SLURM_PROCID="0", SLURM_NTASKS="2")
    expect_refusal(refused, batch, {}, "SLURM_NTASKS=2 in a batch script, not under srun", "srun")
    expect_refusal(refused, base_env(), {"dist_init_required": False}, "dist_init_required=False with no group",
                   "dist_init_required")


def run_ranks_async(script, env, arg, r):
    log = open(os.path.join(WORK, f"explicit.{r}.log"), "w+")
    return subprocess.Popen([sys.executable, script, WORK, arg], env=env, stdout=log, stderr=subprocess.STDOUT), log


def finish(pl):
    p, log = pl
    p.wait(timeout=120)
    log.seek(0)
    return p.returncode, log.read(), 0


# ---- folders ----

TRAIN = r'''
import atexit, os, sys, time, torch
import uckpt as deepspeed
work, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
threads = lambda: len(os.listdir("/proc/self/task"))
at_start = threads()
# Registered before uckpt's, so it runs after them: the group's threads must be gone by then.
atexit.register(lambda: print(f"threads at start {at_start}, after uckpt's teardown {threads()}", flush=True))
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config={
    "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2}})
g = torch.Generator().manual_seed(rank)
for _ in range(3):
    engine.backward(torch.nn.functional.mse_loss(engine(torch.randn(2, 4, generator=g)), torch.zeros(2, 1)))
    engine.step()
if mode == "folders":
    # Each rank names its folder itself, as a script naming it by the current second does.
    engine.save_checkpoint(os.path.join(work, f"run_{rank}"), tag=f"step3_r{rank}", client_state={"r": rank})
    saved = [p.detach().clone() for p in net.parameters()]
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    path, cs = engine.load_checkpoint(os.path.join(work, f"run_{rank}"), tag=f"step3_r{rank}")
    assert path is not None and cs == {"r": 0}, (path, cs)
    assert all(torch.equal(a, b) for a, b in zip(saved, net.parameters())), "weights not restored"
    print("loaded", path)
else:
    # The script's last call is a save: it returns published, and is durable (its unsynced marker gone) once the
    # interpreter has exited.
    engine.save_checkpoint(os.path.join(work, "last"))
    if rank == 1:
        time.sleep(3)  # ends later than rank 0, which serves the store
    print("done")
'''


def rank_envs(port, world=2):
    return [dict(base_env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port)) for r in range(world)]


def case_folders(world=2):
    script = write("train.py", TRAIN)
    results = run_ranks(script, rank_envs(free_port(), world), ["folders"])
    expect_ok(results, f"{world} ranks passing different checkpoint folders")
    folder = os.path.join(WORK, "run_0", "step3_r0")
    files = sorted(os.listdir(folder))
    want = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    if not all(w in files for w in want) or "mp_rank_00_model_states.pt" not in files:
        fail(f"rank 0's folder {folder} is not whole: {files}")
    for r in range(1, world):
        if os.path.exists(os.path.join(WORK, f"run_{r}")):
            fail(f"rank {r}'s folder was written: {os.listdir(os.path.join(WORK, f'run_{r}'))}")
    if open(os.path.join(WORK, "run_0", "latest")).read().strip() != "step3_r0":
        fail("run_0/latest does not name step3_r0")
    for r in range(1, world):
        log = results[r][1]
        for what in ("save_checkpoint", "load_checkpoint"):
            # The whole line: the rank's number is streamed in the middle (issue 38 crashed there).
            warn = [l for l in log.splitlines() if "warning" in l and what in l]
            if not warn or f"rank {r} was given folder" not in warn[0] or f"run_{r}" not in warn[0] \
                    or "run_0" not in warn[0] or not warn[0].endswith("(the ranks must agree for the checkpoint to be whole)"):
                fail(f"rank {r} printed no whole {what} warning naming both folders:\n{log}")
    if "warning" in results[0][1]:
        fail(f"rank 0 (whose folder is used) warned:\n{results[0][1]}")
    print(f"ok   different folders on each of {world} ranks: one whole checkpoint in rank 0's, loaded; the others "
          "warned:\n     " + [l for l in results[1][1].splitlines() if "warning" in l][0])


def case_clean_exit():
    script = write("train.py", TRAIN)
    # As on two hosts: no rank's own sync vouches for the other's files, only the wait at exit does.
    envs = [dict(env, UCKPT_MACHINE_ID=f"machine{r}") for r, env in enumerate(rank_envs(free_port()))]
    results = run_ranks(script, envs, ["exit"])
    expect_ok(results, "a clean 2-rank run")
    for r, (_, log, _) in enumerate(results):
        bad = [l for l in log.splitlines()
               if any(w in l for w in ("Traceback", "Exception", "HeartbeatMonitor", "TCPStore"))]
        if bad:
            fail(f"rank {r}'s output at a clean end has:\n" + "\n".join(bad))
        # The engine's share of the group is released at exit too: it ends before finalization, not during it.
        m = re.search(r"threads at start (\d+), after uckpt's teardown (\d+)", log)
        if not m or int(m.group(2)) > int(m.group(1)):
            fail(f"rank {r}: torch.distributed's group outlived uckpt's teardown at exit (its threads remain): "
                 f"{m.group(0) if m else 'no thread count printed'}")
    last = os.path.join(WORK, "last")
    if open(os.path.join(last, "latest")).read().strip() != "global_step3":
        fail("the last save is not published")
    if os.path.exists(os.path.join(last, ".global_step3.uckpt-unsynced")):
        fail(f"the last save's unsynced marker outlived the run (its durability was not awaited at exit): "
             f"{sorted(os.listdir(last))}")
    # Rank 1 trains 3 s longer; rank 0 must wait for it (allowing rank 1's interpreter teardown after it signed off).
    if results[0][2] < results[1][2] - 1.5:
        fail(f"rank 0 (the store's owner) exited {results[1][2] - results[0][2]:.2f} s before rank 1")
    print("ok   a clean 2-rank end: exit codes 0, no stack trace, the group ended before finalization, rank 0 left "
          "last")


def main():
    os.makedirs(WORK, exist_ok=True)
    for name in os.listdir(WORK):
        p = os.path.join(WORK, name)
        if os.path.isdir(p):
            import shutil
            shutil.rmtree(p)
    {"discovery": case_discovery, "folders": case_folders, "folders4": lambda: case_folders(4),
     "clean_exit": case_clean_exit}[CASE]()


if __name__ == "__main__":
    main()
