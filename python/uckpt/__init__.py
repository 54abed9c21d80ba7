"""uckpt's training engine with DeepSpeed's Python API: ``import uckpt as deepspeed``.

Everything here forwards to the C++ extension ``uckpt._uckpt`` (see docs/python.md).
"""
import datetime

from uckpt._uckpt import Engine as DeepSpeedEngine  # noqa: F401
from uckpt._uckpt import add_config_arguments  # noqa: F401
from uckpt._uckpt import initialize as _initialize
from uckpt._uckpt import init_distributed as _init_distributed
from uckpt import accelerator, checkpoint, comm, moe, ops, pipe, utils, zero  # noqa: F401

__version__ = "0.4.0"
__git_hash__ = "uckpt"


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, mesh_param=None, config_params=None):
    """deepspeed.initialize: returns (engine, optimizer, training_dataloader, lr_scheduler)."""
    return _initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                       training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu, collate_fn=collate_fn,
                       config=config if config is not None else config_params)


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500, verbose=True,
                     timeout=datetime.timedelta(minutes=30), init_method=None, dist_init_required=None, config=None,
                     rank=-1, world_size=-1):
    """deepspeed.init_distributed: torch.distributed from the launcher's environment."""
    _init_distributed(dist_backend or "", max(1, int(timeout.total_seconds() // 60)))
