"""deepspeed.runtime.engine: the engine class initialize() returns (for isinstance checks), and the engine
attributes that live in Python.

DeepSpeed's engine is a torch.nn.Module whose child `module` is the model: its state_dict(),
load_state_dict(), named_parameters() and named_buffers() name everything "module.<name>". uckpt's engine
answers the same (its other attributes are the model's)."""
import collections
import weakref

from uckpt._uckpt import Engine as DeepSpeedEngine
from uckpt.utils.timer import ThroughputTimer

_MODULE = "module."
_attrs = weakref.WeakKeyDictionary()  # engine -> its Python attributes (tput_timer, training_dataloader)


def _own(engine):
    if engine not in _attrs:
        _attrs[engine] = {"tput_timer": ThroughputTimer(engine.train_batch_size()), "training_dataloader": None}
    return _attrs[engine]


def set_training_dataloader(engine, loader):
    _own(engine)["training_dataloader"] = loader


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
