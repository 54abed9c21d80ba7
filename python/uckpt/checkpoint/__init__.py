"""deepspeed.checkpoint: the names scripts import."""
from uckpt.checkpoint import utils  # noqa: F401

# The client_state key DeepSpeed's universal-checkpoint tools read.
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
