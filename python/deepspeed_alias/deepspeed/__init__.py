"""deepspeed, as uckpt: `import deepspeed` gives the module uckpt and `deepspeed.X` the module uckpt.X.

Installed by `python -m uckpt.alias install` (uckpt's docs/hf.md); removed by `python -m uckpt.alias remove`
(or `pip uninstall deepspeed`). This is not Microsoft's DeepSpeed.
"""
try:
    from uckpt.alias import activate as _activate
except ImportError as _e:
    raise ImportError(
        "deepspeed: this 'deepspeed' (%s) is uckpt's alias, installed by `python -m uckpt.alias install`, "
        "and `import uckpt` failed: %s. Make uckpt importable in this Python, or remove the alias with "
        "`python -m pip uninstall deepspeed`." % (__file__, _e), name="deepspeed") from _e
_activate()
