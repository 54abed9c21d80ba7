"""deepspeed.zero: stage 3's construction and gathering contexts."""
import contextlib

from uckpt import _uckpt


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):
    """At stage 3: every parameter of the last initialized engine is whole inside
    the block (collective: all ranks enter it). At stages 0-2 there is nothing to do."""
    if not enabled:
        yield
        return
    _uckpt.gather_parameters(True)
    try:
        yield
    finally:
        _uckpt.gather_parameters(False)


class Init(contextlib.nullcontext):
    """Accepted for scripts that build their model under it: uckpt partitions the
    model when initialize() wraps it, so the model is built whole first."""

    def __init__(self, *args, **kwargs):
        super().__init__()
