from uckpt.ops import adagrad, adam, lion, sparse_attention  # noqa: F401
