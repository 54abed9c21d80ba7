"""deepspeed.runtime.utils: the helpers scripts import."""
import random

import torch


def set_random_seed(seed):
    """Seeds Python's random, numpy's global generator and torch, as DeepSpeed's does."""
    import numpy
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
