"""uckpt's training engine with DeepSpeed's Python API: ``import uckpt as deepspeed``.

Everything here forwards to the C++ extension ``uckpt._uckpt`` (see docs/python.md).
"""
import datetime
import os

import torch

# First: every module and name of DeepSpeed 0.14.5 importable from uckpt (uckpt/_deepspeed_api.py).
from uckpt import _deepspeed_api
__getattr__, __dir__ = _deepspeed_api.install(__name__)

from uckpt._uckpt import add_config_arguments  # noqa: F401,E402
from uckpt._uckpt import initialize as _initialize
from uckpt._uckpt import init_distributed as _init_distributed
from uckpt._uckpt import resolve_config as _resolve_config
from uckpt import accelerator, checkpoint, comm, compression, data, moe, ops, pipe, runtime, utils, zero  # noqa: F401
from uckpt.accelerator import get_accelerator  # noqa: F401
from uckpt.runtime.activation_checkpointing import checkpointing  # noqa: F401
from uckpt.runtime.engine import DeepSpeedEngine  # noqa: F401
from uckpt.runtime.zero.partition_parameters import mark_stage3_parameters as _mark_stage3_parameters
from uckpt.runtime.zero.partition_parameters import zero_init_partitions as _zero_init_partitions
from uckpt.utils import log_dist, logger  # noqa: F401

__version__ = "0.4.0"
__git_hash__ = "uckpt"

# DeepSpeed's module global: None until initialize() binds it to deepspeed.comm.
dist = None


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, mesh_param=None, config_params=None):
    """deepspeed.initialize: returns (engine, optimizer, training_dataloader, lr_scheduler)."""
    global dist
    if model is None:
        raise ValueError("uckpt.initialize: model is required")
    dist = comm
    # As DeepSpeed: the process group first (discovering an MPI or Slurm launcher's world).
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    given = _resolve_config(args, config if config is not None else config_params)  # kept as engine.config
    nonempty = [len(g["params"]) != 0 for g in getattr(optimizer, "param_groups", ())]
    core, loader = _initialize(model=model, optimizer=optimizer, model_parameters=model_parameters,
                               training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                               collate_fn=collate_fn, config=given,
                               partitioned=_zero_init_partitions(model) if isinstance(model, torch.nn.Module) else [])
    if not all(nonempty):  # initialize dropped the optimizer's empty groups, as DeepSpeed does
        _drop_scheduler_groups(lr_scheduler, optimizer, nonempty)
    engine = DeepSpeedEngine(core, model, config=given, client_optimizer=optimizer, client_lr_scheduler=lr_scheduler,
                             training_data=training_data, collate_fn=collate_fn, mpu=mpu)
    if engine.zero_optimization_stage() == 3:  # DeepSpeed's ds_status etc. on each parameter
        _mark_stage3_parameters(model, engine)
    resumable = data.config_loader(training_data, engine, collate_fn) if training_data is not None else None
    if resumable is not None:  # the config's "uckpt": {"resumable_data": ...} opts in
        loader = resumable
    engine.training_dataloader = loader
    return engine, engine.optimizer, loader, engine.lr_scheduler


# A torch scheduler's lists with one entry per param group.
_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "max_lrs", "min_lrs", "base_momentums", "max_momentums")


def _drop_scheduler_groups(scheduler, optimizer, kept):
    """DeepSpeed removes a client optimizer's empty param groups in place; a torch scheduler made on that optimizer
    before initialize keeps one entry per original group, and its first step then fails (torch zips them strictly)
    or, with a torch that does not, gives the kept groups the entries of others. Here its per-group lists lose the
    same entries, so that each kept group keeps its own lambda and base lr. Beyond DeepSpeed 0.14.5, which stops."""
    if getattr(scheduler, "optimizer", None) is not optimizer:
        return
    for sub in getattr(scheduler, "_schedulers", ()):  # SequentialLR, ChainedScheduler
        _drop_scheduler_groups(sub, optimizer, kept)
    for name in _PER_GROUP:
        values = getattr(scheduler, name, None)
        if isinstance(values, list) and len(values) == len(kept):
            setattr(scheduler, name, [v for v, keep in zip(values, kept) if keep])


def init_inference(model, config=None, **kwargs):
    """deepspeed.init_inference: refused (uckpt trains; it has no inference engine)."""
    raise NotImplementedError("uckpt.init_inference: DeepSpeed's inference engine is not supported by uckpt")


# DeepSpeed's default_pg_timeout: DEEPSPEED_TIMEOUT minutes (read at import), else 30.
_default_pg_timeout = datetime.timedelta(minutes=int(os.getenv("DEEPSPEED_TIMEOUT", default=30)))


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500, verbose=True,
                     timeout=_default_pg_timeout, init_method=None, dist_init_required=None, config=None,
                     rank=-1, world_size=-1):
    """deepspeed.init_distributed: torch.distributed's default group, from the arguments, the launcher's
    environment or an MPI/Slurm launcher's (see docs/python.md); the group ends in order at exit."""
    _init_distributed(dist_backend=dist_backend, auto_mpi_discovery=auto_mpi_discovery,
                      distributed_port=distributed_port, verbose=verbose, timeout=timeout, init_method=init_method,
                      dist_init_required=dist_init_required, config=config, rank=rank, world_size=world_size)
