"""What the Python tests share: failing with a message, running a test
script's worker at N ranks on the CPU with the environment torchrun gives
(RANK, LOCAL_RANK, WORLD_SIZE, a free MASTER_PORT; each rank's output
prefixed with its rank), the main() of a test made of worker_<case>
functions, and a toy model."""
import glob
import os
import socket
import subprocess
import sys


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


_reserved_ports = []


def free_port():
    """A port for the ranks' store, held by this process until it exits: closing it at once let a
    concurrent test's ranks take it and join the wrong store. The store binds it all the same
    (c10d sets SO_REUSEADDR, as this socket does)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    _reserved_ports.append(s)
    return s.getsockname()[1]


def sweep_deepspeed_shm(port):
    """Removes the /dev/shm buffers real DeepSpeed's CPU all-reduce made for the run on MASTER_PORT `port`
    (deepspeed_allreduce_buffer_<n>_<addr>_<port>_<rank>, 64 MiB each): DeepSpeed 0.14.5 never unlinks them, so
    a test run would leave gigabytes of host memory behind. Call it once every rank of that run has exited."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def have_deepspeed():
    """Whether real DeepSpeed 0.14.5 is installed beside this Python's torch (the tests comparing with it skip
    otherwise). Read from the package metadata: importing DeepSpeed to ask costs 20 CPU seconds, and an install
    that is there but does not import should fail the test, not skip it. uckpt's `deepspeed` alias carries
    another version string, so it does not count."""
    from importlib import metadata
    try:
        return metadata.version("deepspeed") == "0.14.5"
    except metadata.PackageNotFoundError:
        return False


def launch(script, case, pypath, world, extra=(), env=None):
    """`script --worker case *extra` at `world` ranks; fails when any rank does."""
    port = str(free_port())
    procs = []
    for r in range(world):
        rank_env = dict(os.environ, PYTHONPATH=pypath, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r),
                        WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DS_ACCELERATOR="cpu",
                        **(env or {}))
        procs.append(subprocess.Popen([sys.executable, script, "--worker", case, *extra], env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    failed = False
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=300)
        sys.stdout.write("".join(f"[{r}/{world}] {line}\n" for line in out.splitlines()))
        failed |= p.returncode != 0
    sweep_deepspeed_shm(port)
    if failed:
        fail(f"{case} at {world} rank(s): a rank failed (output above)")


def case_main(module_globals, worlds=None, after=None):
    """The main() of a test file whose CASE is a function worker_<CASE>(deepspeed, torch) of that file:
    `FILE CASE PYPATH ...` runs it at each rank count of worlds[CASE] (default 1) with testkit.launch, then
    after(CASE, argv) if given, and prints PASS; `FILE --worker CASE` (what launch starts) is one rank: uckpt
    imported as deepspeed, init_distributed(), the function."""
    if sys.argv[1] == "--worker":
        import torch
        import uckpt as deepspeed
        deepspeed.init_distributed()
        module_globals["worker_" + sys.argv[2]](deepspeed, torch)
        return
    case, pypath = sys.argv[1], sys.argv[2]
    for world in (worlds or {}).get(case, (1,)):
        launch(module_globals["__file__"], case, pypath, world)
    if after is not None:
        after(case, sys.argv)
    print(f"PASS {case}")


def toy_net(torch):
    """Linear(4, 8), two tanh(Linear(8, 8)) blocks, Linear(8, 1); the mean square of the output as the loss."""
    torch.manual_seed(0)

    class Block(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.fc(x))

    class Net(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(4, 8)
            self.blocks = torch.nn.ModuleList([Block(), Block()])
            self.out = torch.nn.Linear(8, 1)

        def forward(self, x):
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.out(h).pow(2).mean()

    return Net()
