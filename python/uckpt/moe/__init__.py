from uckpt.moe import layer, utils  # noqa: F401
