"""deepspeed.utils' ZeRO-3 leaf-module flags: set_z3_leaf_modules, unset_z3_leaf_modules, get_z3_leaf_modules,
z3_leaf_module, z3_leaf_parameter, as DeepSpeed 0.14.5 defines them.

A module whose class is listed gets `_z3_leaf` (True when set, False when unset); the functions return the
modules they flagged and raise ValueError when the model has none of those classes. DeepSpeed's ZeRO-3 then
fetches a leaf module's whole subtree when it enters the module, instead of hooking each child (for mixtures
of experts, whose experts run in a different order each step). uckpt's ZeRO-3 gathers each gather unit when it
is called, with no recorded order to prefetch by (docs/python.md, ZeRO stage 3), so the flag changes which
parameters are gathered together but not the values trained: see docs/hf-calls.md for its status.
"""
from typing import List, Type

import torch


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether `model` is flagged as a ZeRO-3 leaf module."""
    return hasattr(model, "_z3_leaf") and model._z3_leaf


def z3_leaf_parameter(model: torch.nn.Parameter) -> bool:
    """Whether a parameter belongs to a leaf module (DeepSpeed's ZeRO-3 marks it `ds_z3_leaf_module`)."""
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules of `model` flagged as leaf modules, in `model.modules()` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def _flag(model, leaf_module_classes, flag):
    if not all(isinstance(c, type) for c in leaf_module_classes):
        raise AssertionError(f"leaf_module_classes must be a list of types, got {leaf_module_classes}")
    flagged = []

    def visit(module):
        if module.__class__ in leaf_module_classes:  # the exact class, as DeepSpeed's (not subclasses)
            module._z3_leaf = flag
            flagged.append(module)

    model.apply(visit)
    if not flagged:
        raise ValueError(f"No modules of type {leaf_module_classes} found in model {model}")
    return flagged


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: List[Type]) -> List[torch.nn.Module]:
    """Flags every module of `model` whose class is in `leaf_module_classes` as a ZeRO-3 leaf; returns them."""
    return _flag(model, leaf_module_classes, True)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: List[Type]) -> List[torch.nn.Module]:
    """Clears the flag on every module of `model` whose class is in `leaf_module_classes`; returns them."""
    return _flag(model, leaf_module_classes, False)
