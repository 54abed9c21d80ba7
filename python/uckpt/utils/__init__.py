"""deepspeed.utils: the logger, log_dist and RepeatingLoader that scripts import."""
from uckpt.utils.logging import log_dist, logger  # noqa: F401
from uckpt.runtime.dataloader import RepeatingLoader  # noqa: F401
