"""deepspeed.runtime.activation_checkpointing."""
from uckpt.runtime.activation_checkpointing import checkpointing  # noqa: F401
