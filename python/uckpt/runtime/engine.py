"""deepspeed.runtime.engine: the engine initialize() returns.

DeepSpeedEngine is a torch.nn.Module whose child `module` is the model, as DeepSpeed's is: its state_dict(),
load_state_dict(), named_parameters() and named_buffers() name everything "module.<name>", and it holds the
attributes libraries set on it (Accelerate's _is_accelerate_prepared). Training runs in the C++ core
(uckpt._uckpt.EngineCore) it wraps. Attributes the engine lacks are the model's, except DeepSpeed's own engine
names that uckpt does not support, refused by name (runtime/_deepspeed_names.py): DeepSpeed answers those itself
and never asks its model, so forwarding them would do something else (engine.compile() would be torch's
Module.compile). The optimizer and the config's scheduler are runtime/zero_views.py's."""
import collections
import os
import shutil
import stat

import torch

from uckpt._deepspeed_api import DeepSpeedVersionAttributeError, later_message
from uckpt.runtime import _deepspeed_names
from uckpt.runtime.zero_views import EngineOptimizer, EngineScheduler
from uckpt.utils.timer import ThroughputTimer

_MODULE = "module."
# Set in __init__ before the child exists: never looked up on the model.
_OWN = frozenset(("module", "_core"))


def _refused(name):
    """A DeepSpeed engine name that torch.nn.Module also defines (so __getattr__ never sees it)."""
    def refuse(self):
        raise NotImplementedError(_refusal(name))
    return property(refuse)


def _refusal(name):
    return (f"engine.{name}: DeepSpeed 0.14.5's engine has '{name}'; uckpt's engine does not support it (and does "
            "not pass it on to the model, as DeepSpeed's would not)")


def _child_prefix(prefix):
    return prefix + ("." if prefix else "") + "module"


def _write_recovery_script(engine, save_dir):
    """DeepSpeed's save copies its utils/zero_to_fp32.py into save_dir (beside the tag folder) on rank 0 when it
    writes ZeRO files (stages 1-3), made executable; uckpt copies its own, which takes DeepSpeed's command line."""
    if engine.global_rank != 0 or engine.zero_optimization_stage() == 0:
        return
    from uckpt.utils import zero_to_fp32
    dst = os.path.join(os.fspath(save_dir), "zero_to_fp32.py")
    shutil.copyfile(zero_to_fp32.__file__, dst)
    try:
        os.chmod(dst, os.stat(dst).st_mode | stat.S_IEXEC)
    except OSError:  # as DeepSpeed's: a file share may refuse it
        pass


class DeepSpeedEngine(torch.nn.Module):
    """DeepSpeed 0.14.5's engine API over uckpt's C++ engine (see docs/python.md)."""

    def __init__(self, core, model, config=None, client_optimizer=None, client_lr_scheduler=None,
                 training_data=None, collate_fn=None, mpu=None, training_dataloader=None):
        """initialize() builds it: `core` the C++ engine of `model`, the rest initialize()'s arguments."""
        super().__init__()
        self._core = core
        self.module = model
        self.training = getattr(model, "training", True)
        # What DeepSpeed's engine keeps of initialize()'s arguments (config: the dict or path it was given).
        self.config = config
        self.client_optimizer = client_optimizer
        self.client_lr_scheduler = client_lr_scheduler
        self.training_data = training_data
        self.collate_fn = collate_fn
        self.mpu = mpu
        self.training_dataloader = training_dataloader
        # The parsed config, typed (DeepSpeed's engine keeps its DeepSpeedConfig as _config).
        self._config = core.parsed_config()
        self.tput_timer = ThroughputTimer(core.train_batch_size())  # only the epoch count is kept
        self.optimizer = EngineOptimizer(core) if core.has_optimizer() else None
        if core.client_scheduler() is not None:
            self.lr_scheduler = core.client_scheduler()
        else:
            self.lr_scheduler = EngineScheduler(core) if core.has_config_scheduler() else None

    compile = _refused("compile")

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)  # the child module
        except AttributeError:
            if name in _OWN or name.startswith("__"):
                raise
        if name in _deepspeed_names.ENGINE:
            raise NotImplementedError(_refusal(name))
        try:
            return getattr(self.module, name)
        except AttributeError:
            version = _deepspeed_names.later("ENGINE", name)
            if version is None:
                raise
        # A later DeepSpeed's engine name (engine.offload_states): as DeepSpeed 0.14.5's engine, which asks its
        # module, an AttributeError (hasattr() is False), naming the release that has it.
        raise DeepSpeedVersionAttributeError(later_message(f"engine.{name} (DeepSpeedEngine.{name})", version))

    # ---- Training ----

    def forward(self, *inputs, **kwargs):
        if self._config.fp16_auto_cast:  # as DeepSpeed's: the positional inputs only
            inputs = self._cast_inputs_half(inputs)
        return self.module(*inputs, **kwargs)

    def _cast_inputs_half(self, inputs):
        """DeepSpeed's fp16.auto_cast: every tensor among the positional inputs (in lists, tuples and dicts)
        made half, integer ones too, as DeepSpeed 0.14.5 casts anything with a .half()."""
        if isinstance(inputs, (list, tuple)):
            return inputs.__class__([self._cast_inputs_half(v) for v in inputs])
        if isinstance(inputs, dict):
            return {k: self._cast_inputs_half(v) for k, v in inputs.items()}
        if hasattr(inputs, "half"):
            return inputs.half()
        return inputs

    def backward(self, loss, allreduce_gradients=True, release_loss=False, retain_graph=False, scale_wrt_gas=True):
        """Returns the loss scaled by 1/GA (fp32), as DeepSpeed's; release_loss does nothing there either."""
        if not allreduce_gradients:  # DeepSpeed skips its reduction then; uckpt always reduces
            raise ValueError("engine.backward: allreduce_gradients=False is not supported by uckpt (the gradients "
                             "are always reduced)")
        return self._core.backward(loss, retain_graph, scale_wrt_gas)

    def step(self, lr_kwargs=None):
        self._core.step(lr_kwargs)

    def zero_grad(self):
        """Every module parameter's .grad set to None (the engine re-attaches its views at the next backward)."""
        for p in self.module.parameters():
            p.grad = None

    def is_gradient_accumulation_boundary(self):
        return self._core.is_gradient_accumulation_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary):
        """None: the micro-step count decides again."""
        self._core.set_gradient_accumulation_boundary(is_boundary)

    def was_step_applied(self):
        return self._core.was_step_applied()

    def train(self, mode=True):
        self._core.train(mode)  # the module's train(mode) too
        self.training = mode

    def eval(self):
        self.train(False)

    def destroy(self):
        """DeepSpeed's removes its optimizer's gradient hooks; uckpt's engine stays usable for forward."""

    # ---- Checkpoints and weights ----

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """exclude_frozen_parameters: as DeepSpeed's, the frozen parameters are left out of the model-states file
        (its 'module', and no frozen_param_shapes/frozen_param_fragments); resume with load_module_strict=False."""
        if not save_latest:
            raise ValueError("engine.save_checkpoint: save_latest=False is not supported (latest is always written)")
        saved = self._core.save_checkpoint(save_dir, tag, client_state, bool(exclude_frozen_parameters))
        _write_recovery_script(self, save_dir)
        return saved

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """load_module_strict=False: as DeepSpeed's load_state_dict(strict=False), frozen parameters and buffers
        the model-states file lacks (a save with exclude_frozen_parameters) keep the model's values."""
        if custom_load_fn is not None:
            raise ValueError("engine.load_checkpoint: custom_load_fn is not supported by uckpt")
        return self._core.load_checkpoint(load_dir, tag, bool(load_module_strict), load_optimizer_states,
                                          load_lr_scheduler_states, load_module_only)

    def last_load(self):
        """uckpt's own: what the last load_checkpoint did, a dict: 'fingerprint' says how the loaded state was
        checked (\"recorded\": against the state fingerprint the save recorded; \"computed from the files\": a
        checkpoint without one, DeepSpeed's; \"unchecked: why\"; empty: nothing loaded), 'fingerprint_s' the
        check's seconds, 'optimizer_bytes_read' this rank's optimizer-state bytes read from ZeRO rank files."""
        return self._core.last_load()

    def load_universal_checkpoint(self):
        return self._config.load_universal_checkpoint

    def load_weights(self, path, name_map=None, strict=True, strip_prefix="", add_prefix=""):
        return self._core.load_weights(path, name_map, strict, strip_prefix, add_prefix)

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
        return self._core.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    def save_fp16_model(self, save_dir, save_filename="pytorch_model.bin"):
        return self._core.save_16bit_model(save_dir, save_filename, False)

    def zero_gather_16bit_weights_on_model_save(self):
        return self._core.zero_gather_16bit_weights_on_model_save()

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        return self._core.consolidated_16bit_state_dict(exclude_frozen_parameters)

    # ---- The engine as the Module DeepSpeed's is: names "module.<name>" ----

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
                                                      for k, v in metadata.items()
                                                      if k == "module" or k.startswith(_MODULE))
        result = self.module.load_state_dict(inner, strict=False)
        missing = [_MODULE + k for k in result.missing_keys]
        unexpected = ([k for k in state_dict if not k.startswith(_MODULE)] +
                      [_MODULE + k for k in result.unexpected_keys])
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: missing keys {missing}, "
                               f"unexpected keys {unexpected}")
        return type(result)(missing, unexpected)

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        return self._named(self.module.named_parameters, prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
        return self._named(self.module.named_buffers, prefix, recurse, remove_duplicate)

    @staticmethod
    def _named(members, prefix, recurse, remove_duplicate):
        if not recurse:  # the engine's own parameters and buffers: none, its model's are its child's
            return iter(())
        return members(prefix=_child_prefix(prefix), recurse=True, remove_duplicate=remove_duplicate)

    # ---- What DeepSpeed's engine answers from its config and its state ----

    @property
    def device(self):
        return torch.device(self._core.device())

    @property
    def local_rank(self):
        return self._core.local_rank()

    @property
    def global_rank(self):
        return self._core.global_rank()

    @property
    def world_size(self):
        return self._core.world_size()

    @property
    def dp_world_size(self):
        return self._core.world_size()

    @property
    def global_steps(self):
        return self._core.global_steps()

    @property
    def global_samples(self):
        return self._core.global_samples()

    @property
    def micro_steps(self):
        return self._core.micro_steps()

    @property
    def skipped_steps(self):
        return self._core.skipped_steps()

    def get_lr(self):
        """Each param group's 'lr'."""
        return self._core.get_lr()

    def get_global_grad_norm(self):
        return self._core.get_global_grad_norm()

    def gradient_accumulation_steps(self):
        return self._core.gradient_accumulation_steps()

    def train_batch_size(self):
        return self._core.train_batch_size()

    def train_micro_batch_size_per_gpu(self):
        return self._core.train_micro_batch_size_per_gpu()

    def set_train_batch_size(self, train_batch_size):
        self._core.set_train_batch_size(train_batch_size)

    def fp16_enabled(self):
        return self._config.fp16_enabled

    def bfloat16_enabled(self):
        return self._config.bfloat16_enabled

    def fp16_auto_cast(self):
        """The config's fp16.auto_cast (None when fp16 is off, as DeepSpeed's)."""
        return self._config.fp16_auto_cast

    def zero_optimization(self):
        return self._config.zero_enabled

    def zero_optimization_stage(self):
        return self._config.zero_optimization_stage

    def optimizer_name(self):
        """The client optimizer's class name, else the config's type (lower-cased: DeepSpeed's own), else None."""
        return self._core.client_optimizer_class() or self._config.optimizer_name

    def steps_per_print(self):
        return self._config.steps_per_print

    def wall_clock_breakdown(self):
        return self._config.wall_clock_breakdown

    def gradient_clipping(self):
        return self._config.gradient_clipping

    def loss_scale(self):
        return self._config.loss_scale

    def dynamic_loss_scale(self):
        return self._config.loss_scale == 0

    def _parameter_partitions(self):
        """(parameter, this rank's partition) at stage 3: DeepSpeed's ds_tensor (uckpt.zero)."""
        return self._core.parameter_partitions()

    def _uckpt_config(self):
        """The config's "uckpt" section (checked by the parser), for the pure-Python modules."""
        return self._config.uckpt_section
