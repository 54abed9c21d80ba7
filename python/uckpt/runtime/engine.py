"""deepspeed.runtime.engine: the engine class initialize() returns (for isinstance checks), and the engine
attributes that live in Python.

DeepSpeed's engine is a torch.nn.Module whose child `module` is the model: its state_dict(),
load_state_dict(), named_parameters() and named_buffers() name everything "module.<name>". uckpt's engine
answers the same. Its other attributes are the model's, except DeepSpeed's own engine names that uckpt does not
support, refused by name (_DEEPSPEED_ENGINE_ONLY)."""
import collections
import weakref

from uckpt._uckpt import Engine as DeepSpeedEngine
from uckpt.utils.timer import ThroughputTimer

_MODULE = "module."
_attrs = weakref.WeakKeyDictionary()  # engine -> its Python attributes (tput_timer, initialize's arguments, ...)
# What DeepSpeed's engine keeps of initialize()'s arguments, as the attributes it stores them in.
_ARGUMENTS = ("config", "client_optimizer", "client_lr_scheduler", "training_data", "collate_fn", "mpu")

# The public methods and attributes of DeepSpeed 0.14.5's DeepSpeedEngine that uckpt's engine does not have.
# DeepSpeed answers these itself and never asks its model, so forwarding them to the model would do something
# else (engine.compile() would be torch's Module.compile, engine.config a Hugging Face model's config), and an
# AttributeError would make hasattr() say False where DeepSpeed's engine says True: they are refused by name.
_DEEPSPEED_ENGINE_ONLY = frozenset("""
aio_config all_gather_scalar all_to_all_group allreduce_and_copy allreduce_bucket allreduce_gradients
allreduce_no_retain amp_enabled amp_params autotuning_enabled autotuning_end_profile_step autotuning_metric
autotuning_metric_path autotuning_model_info autotuning_model_info_path autotuning_profile_model_info
autotuning_start_profile_step basic_optimizer block_eigenvalue buffered_allreduce_fallback checkpoint_engine
checkpoint_tag_validation_enabled checkpoint_tag_validation_fail clip_fp32_gradients communication_data_type compile
compression_scheduler curriculum_enabled_legacy curriculum_learning_config curriculum_learning_enabled
curriculum_params_legacy curriculum_scheduler_legacy data_efficiency_config data_efficiency_enabled
data_parallel_group data_sampling_config data_sampling_enabled dataloader_drop_last deepspeed_io dist_backend
dont_change_device dump_state dynamic_loss_scale_args eigenvalue eigenvalue_enabled
eigenvalue_gas_boundary_resolution eigenvalue_layer_name eigenvalue_layer_num eigenvalue_max_iter
eigenvalue_stability eigenvalue_tol eigenvalue_verbose elasticity_enabled empty_partition_cache
enable_backward_allreduce engine_timers expert_data_parallel_group expert_parallel_group flatten flops
flops_profiler flops_profiler_detailed flops_profiler_enabled flops_profiler_module_depth flops_profiler_output_file
flops_profiler_profile_step flops_profiler_recompute_fwd_factor flops_profiler_top_modules fp16_auto_cast
fp16_master_weights_and_gradients fwd_duration gas_boundary_ctr gate_modules get_batch_info get_data_types get_mom
get_pld_theta get_type gradient_average gradient_predivide_factor graph_harvesting has_moe_layers
initial_dynamic_scale is_compiled is_elastic_model_parallel_supported is_first_weights_partition_group
is_iterable_style_dataset is_map_style_dataset load_module_state_dict load_moe_state_dict
loaded_checkpoint_dp_world_size loaded_checkpoint_mp_world_size local_all_to_all_group losses memory_breakdown
mics_shard_size module_state_dict moe_layers monitor mp_world_size num_experts optimized_linear_base_weight_sharding
optimized_linear_lora_enabled optimizer_legacy_fusion optimizer_params param_names pipeline_parallelism pld_enabled
pld_gamma pld_params pld_theta postscale_gradients print_forward_breakdown progressive_layer_drop quantize_training
quantizer random_ltd_config random_ltd_enabled random_ltd_initialize random_ltd_scheduler save_non_zero_checkpoint
save_zero_checkpoint scale_wrt_gas scheduler_name scheduler_params seq_data_parallel_group seq_dp_world_size
sequence_parallel_size set_custom_curriculum_learning_schedule set_data_post_process_func set_train_micro_batch_size
sparse_all_gather sparse_allreduce sparse_allreduce_bucket sparse_allreduce_no_retain sparse_gradients_enabled
sparse_tensor_module_names summary_events swap_tensor_config timers unflatten use_ds_comm use_node_local_storage
warn_unscaled_loss zero_allgather_bucket_size zero_allgather_partitions zero_allow_untested_optimizer
zero_contiguous_gradients zero_cpu_offload zero_elastic_checkpoint zero_force_ds_cpu_optimizer zero_grad_hooks
zero_has_nvme_offload zero_hpz_partition_size zero_ignore_unused_parameters zero_legacy_stage1
zero_load_from_fp32_weights zero_max_live_parameters zero_max_reuse_distance zero_model_persistence_threshold
zero_multi_rank_bucket_allreduce zero_offload_optimizer zero_offload_param zero_optimization_partition_gradients
zero_optimization_partition_weights zero_overlap_comm zero_param_persistence_threshold zero_partial_offload
zero_prefetch_bucket_size zero_quantized_gradients zero_quantized_nontrainable_weights zero_quantized_weights
zero_reduce_bucket_size zero_reduce_scatter zero_round_robin_gradients zero_sub_group_size zero_use_cpu_optimizer
""".split())


def _own(engine):
    if engine not in _attrs:
        _attrs[engine] = {"tput_timer": ThroughputTimer(engine.train_batch_size()), "training_dataloader": None,
                          **dict.fromkeys(_ARGUMENTS)}
    return _attrs[engine]


def set_training_dataloader(engine, loader):
    _own(engine)["training_dataloader"] = loader


def set_initialize_arguments(engine, **arguments):
    """initialize()'s arguments as DeepSpeed's engine keeps them (engine.config: the config it was given, a
    dict or the path from args.deepspeed_config)."""
    assert set(arguments) == set(_ARGUMENTS), arguments
    _own(engine).update(arguments)


_model_attribute = DeepSpeedEngine.__getattr__


def _engine_getattr(self, name):
    if name in _DEEPSPEED_ENGINE_ONLY:
        raise NotImplementedError(f"engine.{name}: DeepSpeed 0.14.5's engine has '{name}'; uckpt's engine does not "
                                  "support it (and does not pass it on to the model, as DeepSpeed's would not)")
    return _model_attribute(self, name)


def _child_prefix(prefix):
    return prefix + ("." if prefix else "") + "module"


def _named(members, prefix, recurse, remove_duplicate):
    if not recurse:  # the engine's own parameters and buffers: none, its model's are its child's
        return iter(())
    kwargs = {} if remove_duplicate else {"remove_duplicate": False}  # (torch 1.13 has no such argument)
    return members(prefix=_child_prefix(prefix), recurse=True, **kwargs)


def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
    if args:
        raise TypeError("engine.state_dict: pass destination, prefix and keep_vars by keyword")
    return self.module.state_dict(destination=destination, prefix=prefix + _MODULE, keep_vars=keep_vars)


def load_state_dict(self, state_dict, strict=True):
    """torch's Module.load_state_dict on the engine: keys "module.<name>"."""
    inner = collections.OrderedDict((k[len(_MODULE):], v) for k, v in state_dict.items() if k.startswith(_MODULE))
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # versions per module path, for the modules' own loading rules
        inner._metadata = collections.OrderedDict((k[len(_MODULE):] if k != "module" else "", v)
                                                  for k, v in metadata.items() if k == "module" or k.startswith(_MODULE))
    result = self.module.load_state_dict(inner, strict=False)
    missing = [_MODULE + k for k in result.missing_keys]
    unexpected = [k for k in state_dict if not k.startswith(_MODULE)] + [_MODULE + k for k in result.unexpected_keys]
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: missing keys {missing}, "
                           f"unexpected keys {unexpected}")
    return type(result)(missing, unexpected)


DeepSpeedEngine.state_dict = state_dict
DeepSpeedEngine.load_state_dict = load_state_dict
DeepSpeedEngine.named_parameters = lambda self, prefix="", recurse=True, remove_duplicate=True: _named(
    self.module.named_parameters, prefix, recurse, remove_duplicate)
DeepSpeedEngine.named_buffers = lambda self, prefix="", recurse=True, remove_duplicate=True: _named(
    self.module.named_buffers, prefix, recurse, remove_duplicate)
# DeepSpeed's ThroughputTimer (only the epoch count is kept), and the loader initialize built (or None).
DeepSpeedEngine.tput_timer = property(lambda self: _own(self)["tput_timer"])
DeepSpeedEngine.training_dataloader = property(lambda self: _own(self)["training_dataloader"])
for _name in _ARGUMENTS:
    setattr(DeepSpeedEngine, _name, property(lambda self, name=_name: _own(self)[name]))
DeepSpeedEngine.__getattr__ = _engine_getattr
