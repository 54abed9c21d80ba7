"""deepspeed.runtime: the submodules scripts import."""
from uckpt.runtime import activation_checkpointing, data_pipeline, dataloader, engine, lr_schedules, utils, zero  # noqa: F401
