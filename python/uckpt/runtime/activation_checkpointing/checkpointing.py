"""deepspeed.checkpointing: activation checkpointing on torch.utils.checkpoint.

DeepSpeed's engine does not read the config's activation_checkpointing section; a script applies it with
configure(mpu, deepspeed_config=...). Its settings are honoured where uckpt's data-parallel world gives
them meaning, and refused by name where it would not do what they ask (see configure)."""
import json
import os

import torch
import torch.utils.checkpoint

from uckpt.utils.logging import logger

_SECTION = "activation_checkpointing"
# The section's keys (DeepSpeed's names) -> configure()'s argument names.
_CONFIG_KEYS = {
    "partition_activations": "partition_activations",
    "contiguous_memory_optimization": "contiguous_checkpointing",
    "number_checkpoints": "num_checkpoints",
    "cpu_checkpointing": "checkpoint_in_cpu",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}
_DEFAULTS = {"partition_activations": False, "contiguous_checkpointing": False, "num_checkpoints": None,
             "checkpoint_in_cpu": False, "synchronize": False, "profile": False}

# DeepSpeed's module globals, which a script may read: configure() sets them as DeepSpeed's does; they are
# the module's only state.
deepspeed_checkpointing_enabled = False
mpu = None
num_layers = None
PARTITION_ACTIVATIONS = False
CONTIGUOUS_CHECKPOINTING = False
CPU_CHECKPOINT = False
SYNCHRONIZE = False
PROFILE_TIME = False


def _section_of(deepspeed_config):
    if isinstance(deepspeed_config, (str, os.PathLike)):
        with open(deepspeed_config) as f:
            deepspeed_config = json.load(f)
    if not isinstance(deepspeed_config, dict):
        raise TypeError("uckpt.checkpointing.configure: deepspeed_config must be a dict or the path of a JSON file, "
                        f"got {type(deepspeed_config).__name__}")
    section = deepspeed_config.get(_SECTION) or {}
    return {_CONFIG_KEYS[k]: v for k, v in section.items() if k in _CONFIG_KEYS}


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None):
    """DeepSpeed's configure: the config's activation_checkpointing section, then the arguments given.

    Honoured: partition_activations (across the model-parallel ranks; uckpt has one, so each activation stays
    whole, as DeepSpeed's partition of one), synchronize (the accelerator is synchronised at the start and end
    of each checkpointed forward), num_checkpoints. Refused: mpu_ (model parallelism),
    contiguous_checkpointing and checkpoint_in_cpu (uckpt does not move checkpointed activations). profile
    (timing logs only) is warned about."""
    global deepspeed_checkpointing_enabled, num_layers
    global PARTITION_ACTIVATIONS, CONTIGUOUS_CHECKPOINTING, CPU_CHECKPOINT, SYNCHRONIZE, PROFILE_TIME
    settings = dict(_DEFAULTS)
    deepspeed_checkpointing_enabled = True
    if mpu_ is not None:
        raise ValueError("uckpt.checkpointing.configure: mpu_ (model parallelism) is not supported by uckpt; pass None")
    if deepspeed_config is not None:
        settings.update(_section_of(deepspeed_config))
    given = dict(partition_activations=partition_activations, contiguous_checkpointing=contiguous_checkpointing,
                 num_checkpoints=num_checkpoints, checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize,
                 profile=profile)
    settings.update({k: v for k, v in given.items() if v is not None})
    PARTITION_ACTIVATIONS = settings["partition_activations"]
    CONTIGUOUS_CHECKPOINTING = settings["contiguous_checkpointing"]
    CPU_CHECKPOINT, SYNCHRONIZE = settings["checkpoint_in_cpu"], settings["synchronize"]
    PROFILE_TIME = settings["profile"]
    # num_layers: the argument, else the config's number_checkpoints (None when absent), else False.
    num_layers = settings["num_checkpoints"] if deepspeed_config is not None or num_checkpoints is not None else False
    if settings["contiguous_checkpointing"]:
        if not settings["partition_activations"]:  # DeepSpeed's own assertions first
            raise AssertionError("Contiguous Checkpointing is only available with partitioned activations. "
                                 "Set partitioned activations to true in deepspeed config")
        if settings["num_checkpoints"] is None:
            raise AssertionError("Must specify the number of layers with contiguous memory checkpointing")
        raise ValueError("uckpt.checkpointing.configure: contiguous_checkpointing (contiguous_memory_optimization) "
                         "is not supported by uckpt")
    if settings["checkpoint_in_cpu"]:
        raise ValueError("uckpt.checkpointing.configure: checkpoint_in_cpu (cpu_checkpointing) is not supported by "
                         "uckpt: checkpointed activations stay on the device")
    if settings["profile"]:
        logger.warning("uckpt.checkpointing: profile is ignored: uckpt does not time checkpointed calls "
                       "(training is unchanged)")


def is_configured():
    """True once configure() was called, as DeepSpeed's."""
    return deepspeed_checkpointing_enabled


def reset():
    """DeepSpeed frees its contiguous buffers here; uckpt keeps none."""


def _synchronize():
    if SYNCHRONIZE and torch.cuda.is_available():
        torch.cuda.synchronize()


def _as_outputs(outputs):
    """DeepSpeed's result: one tensor alone, several as a tuple."""
    if torch.is_tensor(outputs):
        return outputs
    outputs = tuple(outputs)
    return outputs[0] if len(outputs) == 1 else outputs


def _run(function, args, use_reentrant):
    def run(*inputs):
        _synchronize()
        out = function(*inputs)
        _synchronize()
        return out if torch.is_tensor(out) else tuple(out)

    return _as_outputs(torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=use_reentrant,
                                                         preserve_rng_state=True))


def checkpoint(function, *args):
    """Runs function(*args) without keeping its activations; backward runs it again (the CPU and CUDA random
    states restored, as DeepSpeed's CheckpointFunction does)."""
    return _run(function, args, use_reentrant=True)


def non_reentrant_checkpoint(function, *args):
    """checkpoint() through autograd's saved-tensor hooks (torch's use_reentrant=False)."""
    return _run(function, args, use_reentrant=False)
