"""The public names (methods, properties and attributes) of DeepSpeed 0.14.5's classes that uckpt's objects stand
in for, read from DeepSpeed's class definitions by scripts/deepspeed_api.py (uckpt/_deepspeed_tree.py's CLASSES;
tests/python/deepspeed_api_test.py compares them with the installed DeepSpeed). Each object looks a name up here
only when it has none of its own: uckpt refuses those by name (NotImplementedError, which hasattr() does not
swallow) instead of answering something else or letting hasattr() say False where DeepSpeed's object says True.
A name that only a later DeepSpeed's class has is an AttributeError naming that release (later())."""
from uckpt._deepspeed_api import later_member
from uckpt._deepspeed_tree import CLASSES

# deepspeed.runtime.engine.DeepSpeedEngine's.
ENGINE = CLASSES["ENGINE"]

# The optimizer initialize() returns, per DeepSpeed class (its base classes' names included); at ZeRO stage 0
# without bf16 it is the torch optimizer itself (torch.optim.Optimizer's names, read at run time).
OPTIMIZER = {key: CLASSES[key] for key in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3",
                                           "BF16_Optimizer", "FP16_Optimizer", "FP16_UnfusedOptimizer")}

# The scheduler a config "scheduler" section makes, per deepspeed.runtime.lr_schedules class.
SCHEDULER = {key: CLASSES[key] for key in ("LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR",
                                           "WarmupLR")}

# deepspeed.accelerator's DeepSpeedAccelerator (get_accelerator()'s class) and deepspeed.DeepSpeedConfig.
ACCELERATOR = CLASSES["ACCELERATOR"]
CONFIG = CLASSES["CONFIG"]


def later(key, name):
    """The DeepSpeed release after 0.14.5 whose class (a key above: "ENGINE", an OPTIMIZER or SCHEDULER key,
    "ACCELERATOR", "CONFIG") first has `name`, else None."""
    return later_member(key, name)
