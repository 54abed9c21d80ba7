"""deepspeed.compression: only the helpers scripts import (DeepSpeed-Chat's LoRA); compression training itself
is refused (the config's compression_training section)."""
from uckpt.compression import helper  # noqa: F401
