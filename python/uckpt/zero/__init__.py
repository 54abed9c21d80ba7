"""deepspeed.zero: the same module as deepspeed.runtime.zero."""
from uckpt.runtime.zero import partition_parameters  # noqa: F401
from uckpt.runtime.zero.partition_parameters import GatheredParameters, Init, ZeroParamStatus  # noqa: F401
