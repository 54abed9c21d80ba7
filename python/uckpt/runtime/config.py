"""deepspeed.runtime.config (also deepspeed.DeepSpeedConfig): a config parsed by uckpt's parser, the one
initialize uses (a key uckpt refuses is refused here too), answering DeepSpeedConfig's attributes from it.

DeepSpeed's config constants (TRAIN_BATCH_SIZE, LAMB_OPTIMIZER, ...) are this module's too, with their values
(uckpt/_deepspeed_api.py). DeepSpeedConfig attributes uckpt does not answer (the pydantic sub-configs:
zero_config, activation_checkpointing_config, monitor_config, ...) raise NotImplementedError naming them.
"""
import copy

from uckpt import _uckpt
from uckpt.runtime import _deepspeed_names
from uckpt.runtime import constants as C


class DeepSpeedConfigError(Exception):
    pass


def _get(d, key, default):
    """DeepSpeed's get_scalar_param: the value when the key is there, else the default."""
    return d.get(key, default) if isinstance(d, dict) else default


# The keys each sparse attention mode reads (DeepSpeed's get_sparse_*_config), besides "mode".
_SPARSE_KEYS = {
    C.SPARSE_DENSE_MODE: ("BLOCK",),
    C.SPARSE_FIXED_MODE: ("BLOCK", "DIFFERENT_LAYOUT_PER_HEAD", "NUM_LOCAL_BLOCKS", "NUM_GLOBAL_BLOCKS",
                          "ATTENTION_TYPE", "HORIZONTAL_GLOBAL_ATTENTION", "NUM_DIFFERENT_GLOBAL_PATTERNS"),
    C.SPARSE_VARIABLE_MODE: ("BLOCK", "DIFFERENT_LAYOUT_PER_HEAD", "NUM_RANDOM_BLOCKS", "LOCAL_WINDOW_BLOCKS",
                             "GLOBAL_BLOCK_INDICES", "GLOBAL_BLOCK_END_INDICES", "ATTENTION_TYPE",
                             "HORIZONTAL_GLOBAL_ATTENTION"),
    C.SPARSE_BIGBIRD_MODE: ("BLOCK", "DIFFERENT_LAYOUT_PER_HEAD", "NUM_RANDOM_BLOCKS", "NUM_SLIDING_WINDOW_BLOCKS",
                            "NUM_GLOBAL_BLOCKS"),
    C.SPARSE_BSLONGFORMER_MODE: ("BLOCK", "DIFFERENT_LAYOUT_PER_HEAD", "NUM_SLIDING_WINDOW_BLOCKS",
                                 "GLOBAL_BLOCK_INDICES", "GLOBAL_BLOCK_END_INDICES"),
}


def _sparse_attention(d):
    """DeepSpeed's DeepSpeedConfig.sparse_attention: the section's mode and the keys that mode reads, defaults
    filled in; None without the section (the parser has checked the mode). Only scripts read it, to build DeepSpeed's
    sparse attention modules, which uckpt refuses by name."""
    section = _get(d, C.SPARSE_ATTENTION, None)
    if section is None:
        return None
    mode = section.get(C.SPARSE_MODE, C.SPARSE_MODE_DEFAULT)
    out = {C.SPARSE_MODE: mode}
    for name in _SPARSE_KEYS[mode]:
        key = getattr(C, "SPARSE_" + name)
        out[key] = copy.deepcopy(section.get(key, getattr(C, "SPARSE_" + name + "_DEFAULT")))
    return out


class DeepSpeedConfig:
    """deepspeed.runtime.config.DeepSpeedConfig(config, mpu=None, mesh_device=None): `config` a dict or the path of
    a JSON file. The batch sizes are resolved for torch.distributed's world (1 process when it is not
    initialised), as DeepSpeed's."""

    def __init__(self, config, mpu=None, mesh_device=None):
        if mpu is not None:
            raise ValueError("uckpt: DeepSpeedConfig(mpu=...): model parallelism is not supported by uckpt")
        if mesh_device is not None:
            raise ValueError("uckpt: DeepSpeedConfig(mesh_device=...): device meshes are not supported by uckpt")
        parsed = _uckpt.parse_config(config)
        self._parsed = parsed
        self._param_dict = parsed.raw
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        else:
            self.global_rank, self.world_size = 0, 1
        (self.train_batch_size, self.train_micro_batch_size_per_gpu,
         self.gradient_accumulation_steps) = parsed.batch_sizes(self.world_size)
        d = self._param_dict
        self.steps_per_print = parsed.steps_per_print
        self.dump_state = _get(d, "dump_state", False)
        self.disable_allgather = _get(d, "disable_allgather", False)
        self.communication_data_type = None
        self.seq_parallel_communication_data_type = None
        self.prescale_gradients = parsed.prescale_gradients
        self.gradient_predivide_factor = parsed.gradient_predivide_factor
        self.sparse_gradients_enabled = _get(d, "sparse_gradients", False)
        self.zero_optimization_stage = parsed.zero_optimization_stage
        self.zero_enabled = parsed.zero_enabled
        self.zero_allow_untested_optimizer = parsed.zero_allow_untested_optimizer
        self.zero_force_ds_cpu_optimizer = parsed.zero_force_ds_cpu_optimizer
        self.gradient_clipping = parsed.gradient_clipping
        self.fp16_enabled = parsed.fp16_enabled
        self.fp16_auto_cast = parsed.fp16_auto_cast
        self.bfloat16_enabled = parsed.bfloat16_enabled
        self.bfloat16_immediate_grad_update = False
        self.fp16_master_weights_and_gradients = False
        self.amp_enabled = False
        self.amp_params = False
        self.loss_scale = parsed.loss_scale
        fp16 = _get(d, "fp16", {})
        # DeepSpeed's get_initial_dynamic_scale: 2**fp16.initial_scale_power (16), 2**0 in bf16.
        power = _get(fp16, "initial_scale_power", 16) if self.fp16_enabled else (0 if self.bfloat16_enabled else 16)
        self.initial_dynamic_scale = 2**power
        self.dynamic_loss_scale_args = parsed.dynamic_loss_scale_args
        optimizer = _get(d, "optimizer", None)
        self.optimizer_name = parsed.optimizer_name
        self.optimizer_params = copy.deepcopy(_get(optimizer, "params", None)) if optimizer else None
        self.optimizer_legacy_fusion = _get(optimizer, "legacy_fusion", False) if optimizer else False
        scheduler = _get(d, "scheduler", None)
        self.scheduler_name = parsed.scheduler_name
        self.scheduler_params = copy.deepcopy(_get(scheduler, "params", None)) if scheduler else None
        self.wall_clock_breakdown = parsed.wall_clock_breakdown
        self.memory_breakdown = _get(d, "memory_breakdown", False)
        self.sparse_attention = _sparse_attention(d)
        self.pipeline = copy.deepcopy(_get(d, "pipeline", {}))
        self.pld_enabled, self.pld_params = False, False
        self.curriculum_enabled_legacy, self.curriculum_params_legacy = False, False
        self.data_efficiency_enabled = False
        self.eigenvalue_enabled = False
        self.elasticity_enabled = False
        self.load_universal_checkpoint = parsed.load_universal_checkpoint
        self.use_node_local_storage = False
        self.dataloader_drop_last = parsed.dataloader_drop_last
        validation = str(_get(_get(d, "checkpoint", {}), "tag_validation", "Warn")).upper()
        self.checkpoint_tag_validation_enabled = validation != "IGNORE"
        self.checkpoint_tag_validation_fail = validation == "FAIL"
        self.checkpoint_parallel_write_pipeline = False
        self.graph_harvesting = False
        self.use_data_before_expert_parallel_ = False
        self.mics_shard_size = -1
        self.mics_hierarchial_params_gather = False
        # data_types.grad_accum_dtype as given (None: DeepSpeed's default; parse_config checked it).
        self.grad_accum_dtype = _get(_get(d, "data_types", {}), "grad_accum_dtype", None)

    def print_user_config(self):
        import json
        print(json.dumps(self._param_dict, sort_keys=True, indent=4, separators=(",", ":")))

    def print(self, name):
        print(f"{name}:", flush=True)
        for key in sorted(vars(self)):
            if not key.startswith("_"):
                print(f"  {key} {'.' * (29 - len(key))} {getattr(self, key)}")
        print("  json = ", end="")
        self.print_user_config()

    def __getattr__(self, name):
        if not name.startswith("_") and name in _deepspeed_names.CONFIG:
            raise NotImplementedError(f"DeepSpeedConfig.{name}: DeepSpeed 0.14.5's DeepSpeedConfig has '{name}' (one "
                                      "of its pydantic sub-configs or a setting of a feature uckpt does not have); "
                                      "uckpt's does not support it")
        version = _deepspeed_names.later("CONFIG", name) if not name.startswith("_") else None
        if version is not None:
            from uckpt._deepspeed_api import DeepSpeedVersionAttributeError, later_message
            raise DeepSpeedVersionAttributeError(later_message(f"DeepSpeedConfig.{name}", version))
        raise AttributeError(f"'DeepSpeedConfig' object has no attribute '{name}'")
