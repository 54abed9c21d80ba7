"""deepspeed.compression.helper: the module-path helpers DeepSpeed-Chat's LoRA imports."""


def recursive_getattr(model, module_name):
    """The attribute at a dotted path ("decoder.layers.0.fc") of `model`."""
    obj = model
    for part in module_name.split("."):
        obj = getattr(obj, part)
    return obj


def recursive_setattr(model, module_name, module):
    """Sets the attribute at a dotted path of `model` (e.g. replaces a submodule)."""
    *parents, last = module_name.split(".")
    setattr(recursive_getattr(model, ".".join(parents)) if parents else model, last, module)
