from uckpt.ops import adam, sparse_attention  # noqa: F401
