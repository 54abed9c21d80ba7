"""deepspeed.runtime.engine: the engine class initialize() returns (for isinstance checks), and the engine
attributes that live in Python.

DeepSpeed's engine is a torch.nn.Module whose child `module` is the model: its state_dict(),
load_state_dict(), named_parameters() and named_buffers() name everything "module.<name>". uckpt's engine
answers the same. Its other attributes are the model's, except DeepSpeed's own engine names that uckpt does not
support, refused by name (runtime/_deepspeed_names.py): DeepSpeed answers those itself and never asks its model,
so forwarding them would do something else (engine.compile() would be torch's Module.compile). The optimizer
and the config's scheduler initialize() returns refuse the names of DeepSpeed's class for the same run that they
lack."""
import collections
import weakref

import torch

from uckpt._uckpt import Engine as DeepSpeedEngine
from uckpt._uckpt import EngineOptimizer, EngineScheduler
from uckpt.runtime import _deepspeed_names
from uckpt.utils.timer import ThroughputTimer

_MODULE = "module."
_attrs = weakref.WeakKeyDictionary()  # engine -> its Python attributes (tput_timer, initialize's arguments, ...)
# What DeepSpeed's engine keeps of initialize()'s arguments, as the attributes it stores them in.
_ARGUMENTS = ("config", "client_optimizer", "client_lr_scheduler", "training_data", "collate_fn", "mpu")


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
    if name in _deepspeed_names.ENGINE:
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


# DeepSpeed's optimizer at stage 0 outside bf16: the torch optimizer itself.
_TORCH_OPTIMIZER = frozenset(n for n in dir(torch.optim.Optimizer) if not n.startswith("_")) | {"defaults", "state"}


def _optimizer_getattr(self, name):
    attribute = type(self).__dict__.get(name)
    if attribute is not None:  # a property that raised AttributeError: its own message
        return attribute.__get__(self, type(self))
    cls = self._deepspeed_class
    names = _deepspeed_names.OPTIMIZER.get(cls, _TORCH_OPTIMIZER)
    if name in names:
        raise NotImplementedError(f"optimizer.{name}: DeepSpeed 0.14.5's optimizer here ({cls}) has '{name}'; "
                                  "uckpt's optimizer does not support it")
    raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


EngineOptimizer.__getattr__ = _optimizer_getattr


def _scheduler_getattr(self, name):
    cls = self._deepspeed_class
    if name in _deepspeed_names.SCHEDULER.get(cls, ()):
        raise NotImplementedError(f"lr_scheduler.{name}: DeepSpeed 0.14.5's {cls} has '{name}'; uckpt's scheduler "
                                  "does not support it")
    raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


EngineScheduler.__getattr__ = _scheduler_getattr
