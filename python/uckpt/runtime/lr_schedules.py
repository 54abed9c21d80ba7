"""deepspeed.runtime.lr_schedules: the names of the config schedulers uckpt's engine runs.

VALID_LR_SCHEDULES is read from the compiled config parser, so it lists exactly the "scheduler" types that
initialize() accepts (a DeepSpeed scheduler missing from it is refused by the config)."""
from uckpt import _uckpt

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"

VALID_LR_SCHEDULES = list(_uckpt.scheduler_types())
