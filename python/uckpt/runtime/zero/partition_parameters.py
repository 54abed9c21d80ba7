"""deepspeed.runtime.zero.partition_parameters: stage 3's parameter status, construction and gathering contexts."""
import contextlib
from enum import Enum

import torch

from uckpt import _uckpt


class ZeroParamStatus(Enum):
    AVAILABLE = 1  # whole on this rank
    NOT_AVAILABLE = 2  # only this rank's partition is held
    INFLIGHT = 3  # being gathered (uckpt's gathers complete before a call returns: never seen)


def _holds_storage(p):
    storage = p.untyped_storage() if hasattr(p, "untyped_storage") else p.storage()
    return storage.size() > 0 or p.numel() == 0


class _Stage3Parameter(torch.nn.Parameter):
    """A stage-3 engine's parameter (its class is switched to this one by initialize): ds_status says, as
    DeepSpeed's does, whether the parameter is whole on this rank now (outside a gather unit's forward and
    GatheredParameters, uckpt holds only its partition once the unit has run)."""

    @property
    def ds_status(self):
        return ZeroParamStatus.AVAILABLE if _holds_storage(self) else ZeroParamStatus.NOT_AVAILABLE


def mark_stage3_parameters(module):
    """Gives a stage-3 engine's parameters DeepSpeed's ds_id, ds_shape, ds_numel and ds_status, which scripts
    read to find what to gather (`p.ds_status == ZeroParamStatus.NOT_AVAILABLE`). Parameters of a subclass of
    torch.nn.Parameter are left as they are."""
    for i, p in enumerate(module.parameters()):
        if type(p) is not torch.nn.Parameter:
            continue
        p.__class__ = _Stage3Parameter
        p.ds_id = i
        p.ds_shape = p.shape
        p.ds_numel = p.numel()


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
