"""deepspeed.ops.sparse_attention: importable (scripts import it at the top), refused where it is used:
uckpt has no sparse attention kernels."""


def _refuse(what):
    raise NotImplementedError(f"uckpt: {what}: DeepSpeed's sparse attention is not supported by uckpt")


class _Refused:
    def __init__(self, *args, **kwargs):
        _refuse(type(self).__name__)


class SparsityConfig(_Refused):
    pass


class DenseSparsityConfig(SparsityConfig):
    pass


class FixedSparsityConfig(SparsityConfig):
    pass


class VariableSparsityConfig(SparsityConfig):
    pass


class BigBirdSparsityConfig(SparsityConfig):
    pass


class BSLongformerSparsityConfig(SparsityConfig):
    pass


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    pass


class SparseSelfAttention(_Refused):
    pass


class BertSparseSelfAttention(_Refused):
    pass


class _RefusedStatics(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        _refuse(f"SparseAttentionUtils.{name}")


class SparseAttentionUtils(_Refused, metaclass=_RefusedStatics):
    pass
