"""deepspeed.comm: torch.distributed's default group, the one the engine uses."""
import os

from torch.distributed import (ReduceOp, all_gather, all_reduce, barrier, broadcast, get_rank,  # noqa: F401
                               get_world_size, is_initialized)


def init_distributed(dist_backend=None, **kwargs):
    import uckpt
    uckpt.init_distributed(dist_backend=dist_backend, **kwargs)


def get_local_rank():
    return int(os.environ.get("LOCAL_RANK", 0))
