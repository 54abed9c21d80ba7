"""deepspeed.runtime.utils: the helpers scripts import."""
import random

import torch


def set_random_seed(seed):
    """Seeds Python's random, numpy's global generator and torch, as DeepSpeed's does."""
    import numpy
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def see_memory_usage(message, force=False):
    """As DeepSpeed's: with force, rank 0 logs `message` and the accelerator's and host's memory use."""
    if not force:
        return
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    from uckpt.utils.logging import logger
    gib = 1024**3
    logger.info(message)
    if torch.cuda.is_available():
        logger.info(f"MA {round(torch.cuda.memory_allocated() / gib, 2)} GB "
                    f"Max_MA {round(torch.cuda.max_memory_allocated() / gib, 2)} GB "
                    f"CA {round(torch.cuda.memory_reserved() / gib, 2)} GB "
                    f"Max_CA {round(torch.cuda.max_memory_reserved() / gib)} GB ")
        torch.cuda.reset_peak_memory_stats()
    try:
        import psutil
    except ImportError:
        return
    vm = psutil.virtual_memory()
    logger.info(f"CPU Virtual Memory:  used = {round((vm.total - vm.available) / gib, 2)} GB, percent = {vm.percent}%")
