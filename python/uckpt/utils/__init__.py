"""deepspeed.utils: the logger, log_dist, RepeatingLoader and the ZeRO-3 leaf-module flags that scripts and
Accelerate import."""
from uckpt.utils.logging import log_dist, logger  # noqa: F401
from uckpt.runtime.dataloader import RepeatingLoader  # noqa: F401
from uckpt.utils.z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules,  # noqa: F401
                                        z3_leaf_module, z3_leaf_parameter)
