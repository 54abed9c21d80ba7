"""client_state values that are not dicts, lists, tuples, numbers, str, None or tensors (numpy arrays, a
dataclass, np.random.get_state()'s array): saved as DeepSpeed saves them, pickled into the model-states file
(torch.save's protocol 2), and given back on load as follows:

* numpy arrays, numpy dtypes and numpy scalars are rebuilt by a restricted unpickler that can make nothing else
  but the DeepSpeed state objects uckpt itself writes (the loss scalers, ZeroStageEnum, fragment_address of
  engine.optimizer.state_dict() and the optimizer files), rebuilt as uckpt's classes of DeepSpeed's names, and torch
  dtypes;
* any other object is refused, naming its class, unless the environment sets UCKPT_TRUST_PICKLED_CLIENT_STATE=1:
  then Python's own pickle rebuilds it, running whatever code the checkpoint names (what torch.load with
  weights_only=False does under DeepSpeed). Set it only for checkpoints you trust.

The C++ reader never runs pickle code: it reads such values as inert objects (format/pickle_reader.h) and hands
them here as protocol-2 pickles.
"""
import io
import os
import pickle

TRUST_ENV = "UCKPT_TRUST_PICKLED_CLIENT_STATE"

# What the restricted unpickler may make: numpy's array, dtype and scalar rebuilders (numpy 1.x and 2.x names),
# and the plain builders Python's protocol-2 pickler writes.
_NUMPY = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
}
_PLAIN = {("_codecs", "encode"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"),
          ("builtins", "complex"), ("collections", "OrderedDict"), ("__builtin__", "set"),
          ("__builtin__", "frozenset"), ("__builtin__", "bytearray"), ("__builtin__", "complex")}

# DeepSpeed's classes whose objects uckpt's optimizer state holds (src/ckpt/deepspeed_state.cc writes them): plain
# data, rebuilt as uckpt's classes of the same DeepSpeed names (python/uckpt/_deepspeed_tree.py).
_DEEPSPEED_STATE = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"), ("deepspeed.utils.tensor_fragment", "fragment_address"),
}


def _deepspeed_class(module, name):
    import importlib
    from uckpt._deepspeed_api import uckpt_name
    return getattr(importlib.import_module(uckpt_name(module)), name)


def _enum_member(cls, name):
    """getattr(ZeroStageEnum, 'gradients'), as DeepSpeed's pickles name an enum member, and nothing else."""
    import enum
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
        raise pickle.UnpicklingError(f"a pickle calls getattr on {cls!r}, which uckpt does not rebuild")
    return cls[name]


def trusted():
    return os.environ.get(TRUST_ENV, "") not in ("", "0")


class _NoTensors(pickle.Pickler):
    """Python's protocol-2 pickler, refusing tensors inside an object (uckpt saves tensors in dicts, lists and
    tuples only; torch's pickling of a tensor outside torch.save is not a checkpoint's)."""

    def __init__(self, file, where):
        super().__init__(file, protocol=2)
        self._where = where

    def persistent_id(self, obj):
        import torch
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            raise TypeError(f"{self._where}: a tensor inside a {type(self._root).__name__} cannot be saved by uckpt "
                            "(put tensors in dicts, lists or tuples of the client_state)")
        return None

    def dump(self, obj):
        self._root = obj
        return super().dump(obj)


def dumps(obj, where):
    """The protocol-2 pickle of `obj` (a client_state value uckpt does not write natively)."""
    buf = io.BytesIO()
    try:
        _NoTensors(buf, where).dump(obj)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        if isinstance(e, TypeError) and str(e).startswith(where):
            raise
        raise TypeError(f"{where}: a {type(obj).__name__} cannot be pickled, so it cannot be saved ({e})") from e
    return buf.getvalue()


class _Restricted(pickle.Unpickler):

    def __init__(self, file, where):
        super().__init__(file)
        self._where = where

    def find_class(self, module, name):
        if (module, name) in _NUMPY or (module == "numpy.dtypes" and name.endswith("DType")):
            import numpy  # noqa: F401
            return super().find_class(module, name)
        if (module, name) in _PLAIN:
            return super().find_class(module, name)
        if (module, name) in _DEEPSPEED_STATE:
            return _deepspeed_class(module, name)
        if (module, name) in (("builtins", "getattr"), ("__builtin__", "getattr")):
            return _enum_member
        if module == "torch" and isinstance(getattr(__import__("torch"), name, None), __import__("torch").dtype):
            return getattr(__import__("torch"), name)
        raise pickle.UnpicklingError(
            f"{self._where} holds a {module}.{name}, which uckpt does not rebuild from a checkpoint: only numpy "
            f"arrays, dtypes and scalars are rebuilt safely. If you trust this checkpoint, set {TRUST_ENV}=1 to have "
            "Python's pickle rebuild it (running the code it names, as torch.load(weights_only=False) does under "
            "DeepSpeed); see docs/python.md")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(f"{self._where}: holds a tensor inside an object, which uckpt cannot give back")


def loads(data, where):
    """A pickled client_state value: numpy's by the restricted unpickler, anything else only when trusted."""
    if trusted():
        return pickle.loads(data)
    return _Restricted(io.BytesIO(data), where).load()
