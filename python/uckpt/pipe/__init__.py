import torch


class PipelineModule(torch.nn.Module):
    """Pipeline parallelism is not supported by uckpt: initialize() refuses this module."""

    def __init__(self, layers=None, *args, **kwargs):
        super().__init__()
        self.layers = torch.nn.ModuleList([m for m in (layers or []) if isinstance(m, torch.nn.Module)])


class LayerSpec:

    def __init__(self, typename, *args, **kwargs):
        self.typename, self.args, self.kwargs = typename, args, kwargs
