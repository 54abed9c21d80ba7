import torch


class MoE(torch.nn.Module):
    """Mixture of experts is not supported by uckpt: initialize() refuses a model holding one."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, *args, **kwargs):
        raise NotImplementedError("uckpt: mixture of experts (MoE) is not supported")
