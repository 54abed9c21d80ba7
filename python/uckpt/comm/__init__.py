"""deepspeed.comm: torch.distributed's default group, the one the engine uses. DeepSpeed's calls are
uckpt/comm/comm.py's (deepspeed.comm.comm's, the names this package has from it as DeepSpeed's has); ReduceOp is
torch's (DeepSpeed's own enum, deepspeed.comm.reduce_op.ReduceOp, is taken by those calls too)."""
import atexit
import os
import sys
import time

from torch.distributed import ReduceOp  # noqa: F401
from uckpt.comm.comm import (all_gather, all_reduce, barrier, broadcast, get_rank, get_world_size,  # noqa: F401
                             is_initialized)


def init_distributed(dist_backend=None, **kwargs):
    import uckpt
    uckpt.init_distributed(dist_backend=dist_backend, **kwargs)


def get_local_rank():
    """As DeepSpeed: LOCAL_RANK, else Open MPI's local rank, else 0."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


# ---- A clean end: the default group torn down in order at interpreter exit. ----

_EXIT_WAIT_S = 60  # how long a rank waits for the others at exit (a clean run's ranks end together)
_registered = False
_crashed = False


def _end_cleanly_at_exit():
    """Registers (once) the ordered teardown of torch.distributed's default group at exit.

    Without it the store's owner (rank 0) may leave first, and torch 2.x's NCCL heartbeat thread on the
    other ranks prints a c10d stack trace about the vanished TCPStore. Skipped after an uncaught exception:
    the other ranks may be gone.
    """
    global _registered
    if _registered:
        return
    _registered = True
    previous = sys.excepthook

    def note_crash(*exc_info):
        global _crashed
        _crashed = True
        previous(*exc_info)

    sys.excepthook = note_crash
    atexit.register(_leave_in_order)


_engines_registered = False


def _release_engines_at_exit():
    """Registers (once) the live engines' release of torch.distributed's group at exit, after their last save is
    published and durable.

    An engine holds the group from C++ and lives to the end (its module's hooks hold it), so without this the
    group -- its threads and its sockets to the other ranks -- outlives destroy_process_group (the script's, or
    _leave_in_order's) into interpreter finalization. Registered after _leave_in_order, so it runs before it.
    """
    global _engines_registered
    if _engines_registered:
        return
    _engines_registered = True
    atexit.register(_release_engines)


def _release_engines():
    from uckpt import _uckpt
    if _all_ranks_at_exit():
        _uckpt._finish_checkpoints()
    _uckpt._release_process_groups()


def _all_ranks_at_exit():
    """Whether every rank has reached its exit cleanly (within _EXIT_WAIT_S), so that the engines' last collective
    (their last save made durable) cannot wait for a rank that crashed or left early; without it the save stays
    marked unsynced, and the next load checks it by hash."""
    import torch.distributed as dist
    if _crashed:
        return False
    if not dist.is_available() or not dist.is_initialized():
        return False  # the script ended the group itself: no collective is safe any more
    if dist.get_world_size() == 1:
        return True
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("uckpt/exit/engines", 1)
        _wait_for_count(store, "uckpt/exit/engines", dist.get_world_size())
        return store.add("uckpt/exit/engines", 0) >= dist.get_world_size()
    except Exception as e:
        print(f"uckpt: at exit: not waiting for the last checkpoint to be durable: {e}", file=sys.stderr)
        return False


def _wait_for_count(store, key, n):
    deadline = time.monotonic() + _EXIT_WAIT_S
    while store.add(key, 0) < n and time.monotonic() < deadline:
        time.sleep(0.005)


def _leave_in_order():
    import torch
    import torch.distributed as dist
    if _crashed or not dist.is_available() or not dist.is_initialized():
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        dist.destroy_process_group()
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        if dist.get_backend() == "nccl":
            torch.cuda.synchronize()  # this rank's collectives are done
        # Every rank arrives; the others destroy their group (its heartbeat polls the store) and say so;
        # rank 0, whose process serves the store, leaves last.
        store.add("uckpt/exit/arrived", 1)
        _wait_for_count(store, "uckpt/exit/arrived", world)
        dist.destroy_process_group()
        if rank != 0:
            store.add("uckpt/exit/left", 1)
        else:
            _wait_for_count(store, "uckpt/exit/left", world - 1)
    except Exception as e:  # the store's owner already left: nothing to order any more
        print(f"uckpt: rank {rank}: ending the process group at exit: {e}", file=sys.stderr)
