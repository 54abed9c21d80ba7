"""deepspeed.zero: stage 3's construction and gathering contexts."""
import contextlib

import torch

from uckpt import _uckpt


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):
    """As DeepSpeed's: the stage-3 parameters among `params` (a tensor or an
    iterable of them) are whole inside the block (collective: all ranks enter
    it with the same parameters). On exit, with modifier_rank set, that rank's
    values become every rank's (partitions and the next forward; the fp32
    master weights are not written, as DeepSpeed's); with modifier_rank None,
    writes made inside the block are discarded. Parameters of an engine at
    stages 0-2, or of no engine, are left alone (DeepSpeed's context does
    nothing for them)."""
    if not enabled:
        yield
        return
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    rank = -1 if modifier_rank is None else int(modifier_rank)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if modifier_rank is not None and not 0 <= rank < world:
        raise ValueError(f"uckpt.zero.GatheredParameters: modifier_rank {modifier_rank} is not a rank "
                         f"(world size {world})")
    partitioned = _uckpt.gather_parameters(params, True)
    if fwd_module is not None and partitioned:
        _uckpt.gather_parameters(params, False)
        raise ValueError("uckpt.zero.GatheredParameters: fwd_module= (registering external parameters) is not "
                         "supported by uckpt at ZeRO stage 3")
    try:
        yield
    finally:
        _uckpt.gather_parameters(params, False, rank)


class Init(contextlib.nullcontext):
    """Accepted for scripts that build their model under it: uckpt partitions the
    model when initialize() wraps it, so the model is built whole first."""

    def __init__(self, *args, **kwargs):
        super().__init__()
