from uckpt.ops import adam  # noqa: F401
