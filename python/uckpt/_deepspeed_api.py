"""Every module and name of DeepSpeed 0.14.5 importable from uckpt: implemented, or refused by name when used.

The tree of modules and names is uckpt/_deepspeed_tree.py, generated from DeepSpeed 0.14.5's own source by
scripts/deepspeed_api.py (a test regenerates it from the installed DeepSpeed and compares). Here it becomes modules:

* uckpt.X for each deepspeed.X: uckpt's own module where it has one, else a module made from the tree;
* in either, each name of DeepSpeed's module that uckpt's lacks: a literal constant is its value, a simple enum is
  the enum, a name DeepSpeed imports from another of its modules is that module's (so re-exports of what uckpt
  implements are uckpt's), and any other class, function or value is a placeholder that imports and refuses
  when used (called, instantiated, its attributes read), with NotImplementedError naming it and its feature;
* a module or name that first appeared in a DeepSpeed release after 0.14.5 raises an error naming that release
  (ModuleNotFoundError for a module; for a name, ImportError in `from ... import`, else AttributeError, so that
  hasattr() answers False, as DeepSpeed 0.14.5's does);
* anything else is Python's own error, as for DeepSpeed 0.14.5.

The finder is installed by `import uckpt` (first on sys.meta_path, for uckpt's names only).
"""
import copy
import dis
import enum
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

from uckpt import _deepspeed_tree as _tree

VERSION = _tree.VERSION
_IMPORT_FROM = dis.opmap["IMPORT_FROM"]

# What each part of DeepSpeed is, for the refusals (the longest matching module prefix wins).
_FEATURES = (
    ("deepspeed", "this part of DeepSpeed"),
    ("deepspeed.accelerator", "DeepSpeed's accelerator classes (uckpt has get_accelerator() for CUDA and the CPU)"),
    ("deepspeed.autotuning", "autotuning"),
    ("deepspeed.checkpoint", "DeepSpeed's checkpoint tools (`uckpt convert`, `inspect` and `export` do this "
                             "for uckpt)"),
    ("deepspeed.comm", "this part of deepspeed.comm"),
    ("deepspeed.compression", "compression (DeepSpeed Compression)"),
    ("deepspeed.elasticity", "elastic training"),
    ("deepspeed.env_report", "DeepSpeed's environment report"),
    ("deepspeed.inference", "DeepSpeed's inference engine"),
    ("deepspeed.launcher", "DeepSpeed's launcher (use `uckpt launch` or torchrun)"),
    ("deepspeed.linear", "optimized linear layers (LoRA, quantized linear)"),
    ("deepspeed.model_implementations", "DeepSpeed's inference engine"),
    ("deepspeed.module_inject", "kernel injection (module_inject, DeepSpeed's inference and fused transformer "
                                "kernels)"),
    ("deepspeed.moe", "mixture of experts (MoE)"),
    ("deepspeed.monitor", "DeepSpeed's monitors (TensorBoard, Weights & Biases, CSV, Comet)"),
    ("deepspeed.nebula", "Nebula checkpointing"),
    ("deepspeed.ops", "DeepSpeed's compiled ops"),
    ("deepspeed.ops.aio", "NVMe offload (async I/O)"),
    ("deepspeed.ops.deepspeed4science", "DeepSpeed4Science kernels"),
    ("deepspeed.ops.fp_quantizer", "quantization kernels"),
    ("deepspeed.ops.lamb", "the LAMB optimizer"),
    ("deepspeed.ops.op_builder", "DeepSpeed's op builders (compiled kernels)"),
    ("deepspeed.ops.quantizer", "quantization kernels"),
    ("deepspeed.ops.random_ltd", "random-LTD (random layerwise token dropping)"),
    ("deepspeed.ops.sparse_attention", "sparse attention"),
    ("deepspeed.ops.transformer", "DeepSpeed's fused transformer kernels (DeepSpeedTransformerLayer)"),
    ("deepspeed.ops.transformer.inference", "DeepSpeed's inference kernels"),
    ("deepspeed.pipe", "pipeline parallelism"),
    ("deepspeed.profiling", "the flops profiler"),
    ("deepspeed.runtime", "this part of DeepSpeed's runtime"),
    ("deepspeed.runtime.activation_checkpointing", "this part of DeepSpeed's activation checkpointing"),
    ("deepspeed.runtime.bf16_optimizer", "DeepSpeed's BF16_Optimizer (uckpt's engine runs bf16 itself)"),
    ("deepspeed.runtime.checkpoint_engine", "DeepSpeed's checkpoint engines"),
    ("deepspeed.runtime.comm", "compressed communication (1-bit)"),
    ("deepspeed.runtime.compiler", "DeepSpeed's torch.compile integration"),
    ("deepspeed.runtime.config", "DeepSpeed's config classes"),
    ("deepspeed.runtime.data_pipeline", "data efficiency (curriculum learning, data sampling)"),
    ("deepspeed.runtime.data_pipeline.data_routing", "random-LTD (random layerwise token dropping)"),
    ("deepspeed.runtime.eigenvalue", "eigenvalue computation"),
    ("deepspeed.runtime.fp16", "DeepSpeed's fp16 optimizer classes (uckpt's engine runs fp16 itself)"),
    ("deepspeed.runtime.fp16.onebit", "1-bit optimizers"),
    ("deepspeed.runtime.hybrid_engine", "the hybrid engine (DeepSpeed-Chat's RLHF generation)"),
    ("deepspeed.runtime.pipe", "pipeline parallelism"),
    ("deepspeed.runtime.progressive_layer_drop", "progressive layer drop"),
    ("deepspeed.runtime.quantize", "quantize training (MoQ)"),
    ("deepspeed.runtime.sparse_tensor", "sparse gradients"),
    ("deepspeed.runtime.swap_tensor", "NVMe offload (tensor swapping)"),
    ("deepspeed.runtime.zero", "this part of DeepSpeed's ZeRO (uckpt's engine runs ZeRO itself)"),
    ("deepspeed.runtime.zero.mics", "MiCS"),
    ("deepspeed.runtime.zero.tiling", "tiled linear layers (TiledLinear)"),
    ("deepspeed.sequence", "sequence parallelism (DeepSpeed-Ulysses)"),
    ("deepspeed.utils", "this DeepSpeed utility"),
    ("deepspeed.utils.groups", "DeepSpeed's model/expert-parallel groups"),
)
_FEATURE = dict(_FEATURES)


class DeepSpeedVersionAttributeError(AttributeError):
    """A name DeepSpeed added after 0.14.5, read as an attribute: hasattr() answers False, as on DeepSpeed 0.14.5,
    and the message names the release that has it."""


class DeepSpeedVersionImportError(ImportError):
    """A name DeepSpeed added after 0.14.5, imported with `from ... import`."""


class DeepSpeedVersionModuleNotFoundError(ModuleNotFoundError):
    """A module DeepSpeed added after 0.14.5."""


def deepspeed_name(module):
    """uckpt.X -> deepspeed.X (and deepspeed.X -> itself)."""
    if module == "uckpt" or module.startswith("uckpt."):
        return "deepspeed" + module[len("uckpt"):]
    return module


def uckpt_name(module):
    if module == "deepspeed" or module.startswith("deepspeed."):
        return "uckpt" + module[len("deepspeed"):]
    return module


def feature(ds_module):
    """The feature a DeepSpeed module belongs to, in words."""
    parts = ds_module.split(".")
    for i in range(len(parts), 0, -1):
        found = _FEATURE.get(".".join(parts[:i]))
        if found:
            return found
    return _FEATURE["deepspeed"]


def _release(version):
    return "its development branch (no release yet)" if version == "HEAD" else f"DeepSpeed {version}"


def later_message(what, version):
    return (f"{what} is not in DeepSpeed {VERSION}, whose API uckpt follows: it first appears in "
            f"{_release(version)}")


# ---------------------------------------------------------------------------------------------------------------
# The tree, decoded


_names_cache = {}


def names(ds_module):
    """{name: entry} of a DeepSpeed 0.14.5 module (entries as scripts/deepspeed_api.py records them), its
    `import *` sources' names included; None for a module 0.14.5 does not have."""
    if ds_module in _names_cache:
        return _names_cache[ds_module]
    record = _tree.MODULES.get(ds_module)
    if record is None:
        return None
    out = {}
    _names_cache[ds_module] = out  # (an import * cycle sees what is there so far)
    for kind in ("c", "f", "v"):
        for n in record.get(kind, "").split():
            out[n] = kind
    for n, v in record.get("k", {}).items():
        out[n] = ("k", v)
    for n, v in record.get("e", {}).items():
        out[n] = ("e",) + tuple(v)
    for n, v in record.get("m", {}).items():
        out[n] = ("m", v)
    for src, listed in record.get("i", {}).items():
        for item in listed.split():
            alias, _, orig = item.partition("=")
            out[alias] = ("i", src, orig or alias)
    for src in record.get("*", ()):
        for n in list(names(src) or ()):
            if n not in out:
                sub = src + "." + n
                out[n] = ("m", sub) if sub in _tree.MODULES else ("i", src, n)
    return out


def later_name(ds_module, name):
    """The release after 0.14.5 where `name` first appears in `ds_module`, else None."""
    for version, listed in _tree.LATER_NAMES.get(ds_module, {}).items():
        if name in listed.split():
            return version
    return None


def later_module(ds_module):
    """The release after 0.14.5 where `ds_module` (or a package above it) first appears, else None."""
    parts = ds_module.split(".")
    for i in range(len(parts), 1, -1):
        found = _tree.LATER_MODULES.get(".".join(parts[:i]))
        if found:
            return found
    return None


def later_member(key, name):
    """The release after 0.14.5 where DeepSpeed's class (CLASSES key) first has `name`, else None."""
    for version, listed in _tree.LATER_MEMBERS.get(key, {}).items():
        if name in listed.split():
            return version
    return None


# ---------------------------------------------------------------------------------------------------------------
# Placeholders: importable, refused when used


def refusal(qualname, ds_module):
    return (f"uckpt: {qualname} is part of {feature(ds_module)}, which uckpt does not support (DeepSpeed "
            f"{VERSION} has the name, so it imports; using it is refused)")


def _refused_member(self, name):
    """An object of a refused class (rebuilt from DeepSpeed's pickles: optimizer state's loss scalers) holds
    DeepSpeed's fields; any other attribute, its methods, is refused naming the class and the member."""
    if name.startswith("__"):
        raise AttributeError(name)
    cls = type(self)
    raise NotImplementedError(f"{cls._uckpt_refusal} [{cls.__name__}.{name}]")


class _RefusedClassMeta(type):
    """A DeepSpeed class uckpt does not implement: it imports and can be named (isinstance is False); making one,
    or reading its attributes, raises NotImplementedError naming it. Its objects (rebuilt from a pickle, never
    made by calling it) give their fields and refuse the rest."""

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(cls._uckpt_refusal)

    def __getattr__(cls, name):
        if name.startswith("__") or name == "_uckpt_refusal":
            raise AttributeError(name)
        raise NotImplementedError(f"{cls._uckpt_refusal} [{cls.__name__}.{name}]")


def _refused_class(name, ds_module, module):
    return _RefusedClassMeta(name, (), {"__module__": module, "__qualname__": name, "__getattr__": _refused_member,
                                        "_uckpt_refusal": refusal(f"{ds_module}.{name}", ds_module),
                                        "__doc__": f"Refused by uckpt: {ds_module}.{name} ({feature(ds_module)})."})


def _refused_function(name, ds_module, module):
    message = refusal(f"{ds_module}.{name}", ds_module)

    def refused(*args, **kwargs):
        raise NotImplementedError(message)

    refused.__name__ = refused.__qualname__ = name
    refused.__module__ = module
    refused.__doc__ = f"Refused by uckpt: {ds_module}.{name} ({feature(ds_module)})."
    return refused


class RefusedValue:
    """A DeepSpeed value uckpt does not have (an object made at import: a registry, a logger of its own, ...):
    it imports; any use (calling it, reading its attributes, iterating, testing its truth) raises
    NotImplementedError naming it."""

    def __init__(self, qualname, ds_module):
        object.__setattr__(self, "_uckpt_refusal", refusal(qualname, ds_module))
        object.__setattr__(self, "_uckpt_name", qualname)

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError(object.__getattribute__(self, "_uckpt_refusal"))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._refuse()

    def __repr__(self):
        return f"<refused by uckpt: {object.__getattribute__(self, '_uckpt_name')}>"

    __call__ = __iter__ = __len__ = __getitem__ = __setitem__ = __contains__ = __bool__ = _refuse
    __enter__ = __exit__ = __setattr__ = _refuse
    __add__ = __radd__ = __sub__ = __mul__ = __truediv__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __int__ = __float__ = __index__ = _refuse


def _enum(name, mixin, members, module):
    base = {"int": enum.IntEnum, "str": None, "": enum.Enum}[mixin]
    if base is None:
        return enum.Enum(name, list(members), module=module, qualname=name, type=str)
    return base(name, list(members), module=module, qualname=name)


_resolving = set()


def value_of(ds_module, name, entry, module):
    """The object uckpt gives for `name` of DeepSpeed's `ds_module` (uckpt's module `module`)."""
    kind = entry if isinstance(entry, str) else entry[0]
    if kind == "c":
        return _refused_class(name, ds_module, module)
    if kind == "f":
        return _refused_function(name, ds_module, module)
    if kind == "k":
        return copy.deepcopy(entry[1])
    if kind == "e":
        return _enum(name, entry[1], entry[2], module)
    if kind == "m":
        return importlib.import_module(uckpt_name(entry[1]))
    if kind == "i":
        key = (entry[1], entry[2])
        if key not in _resolving:
            _resolving.add(key)
            try:
                return getattr(importlib.import_module(uckpt_name(entry[1])), entry[2])
            except (AttributeError, ImportError):
                pass  # not a name 0.14.5's source module has as recorded: refused under this module's name
            finally:
                _resolving.discard(key)
    return RefusedValue(f"{ds_module}.{name}", ds_module)


def _importing_from():
    """Whether the caller of a module's __getattr__ (two frames up) is a `from ... import` statement."""
    try:
        frame = sys._getframe(2)
        return frame.f_code.co_code[frame.f_lasti] == _IMPORT_FROM
    except (ValueError, IndexError, AttributeError):
        return False


def module_getattr(module_name, own=None):
    """The __getattr__ of uckpt's module `module_name`: DeepSpeed 0.14.5's names that the module lacks."""
    ds_module = deepspeed_name(module_name)

    def __getattr__(name):
        if own is not None:
            try:
                return own(name)
            except AttributeError:
                pass
        module = sys.modules.get(module_name)
        table = names(ds_module) or {}
        if not name.startswith("__") and name in table:
            value = value_of(ds_module, name, table[name], module_name)
            if module is not None:
                setattr(module, name, value)  # once: the same object on every read
            return value
        if f"{ds_module}.{name}" in _tree.MODULES:
            return importlib.import_module(f"{module_name}.{name}")
        version = later_name(ds_module, name) or later_module(f"{ds_module}.{name}")
        if version is not None:
            message = later_message(f"{ds_module}.{name}", version)
            if _importing_from():
                raise DeepSpeedVersionImportError(message, name=module_name)
            raise DeepSpeedVersionAttributeError(message)
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__


def module_dir(module_name):
    ds_module = deepspeed_name(module_name)

    def __dir__():
        module = sys.modules.get(module_name)
        own = set(vars(module)) if module is not None else set()
        children = {m.rsplit(".", 1)[1] for m in _tree.MODULES if m.rsplit(".", 1)[0] == ds_module}
        return sorted(own | set(names(ds_module) or ()) | children)

    return __dir__


# ---------------------------------------------------------------------------------------------------------------
# The finder: uckpt's own modules get DeepSpeed's missing names; DeepSpeed's other modules are made from the tree


class _WithDeepSpeedNames(importlib.abc.Loader):
    """uckpt's own module for a DeepSpeed module: loaded by its own loader, then given __getattr__ and __dir__ for
    DeepSpeed's names it lacks (after its own __getattr__, if it has one)."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        own = module.__dict__.get("__getattr__")
        module.__getattr__ = module_getattr(module.__name__, own)
        if "__dir__" not in module.__dict__:
            module.__dir__ = module_dir(module.__name__)

    def __getattr__(self, name):  # get_source, get_code, is_package, ... as the file's own loader
        return getattr(self._loader, name)


class _FromTree(importlib.abc.Loader):
    """A DeepSpeed module uckpt has no file for: its names come from the tree."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        ds_module = deepspeed_name(module.__name__)
        module.__doc__ = (f"DeepSpeed {VERSION}'s {ds_module}, as uckpt has it: its names import; those uckpt does "
                          f"not implement ({feature(ds_module)}) are refused when used.")
        module.__getattr__ = module_getattr(module.__name__)
        module.__dir__ = module_dir(module.__name__)


class _Finder(importlib.abc.MetaPathFinder):

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("uckpt."):
            return None
        ds_module = deepspeed_name(fullname)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None:
            if ds_module in _tree.MODULES and spec.loader is not None:
                spec.loader = _WithDeepSpeedNames(spec.loader)
            return spec
        if ds_module in _tree.MODULES:
            return importlib.util.spec_from_loader(fullname, _FromTree(), origin="uckpt._deepspeed_tree",
                                                   is_package=ds_module in _tree.PACKAGES)
        version = later_module(ds_module)
        if version is not None:
            raise DeepSpeedVersionModuleNotFoundError(
                later_message(f"the module {ds_module} ({fullname})", version), name=fullname)
        return None


_finder = _Finder()


def install(package):
    """Called by uckpt/__init__.py first: the finder, and the package's own __getattr__/__dir__."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    return module_getattr(package), module_dir(package)
