"""DeepSpeed's Adam classes, as initialize() takes them: their param_groups and
mode become the engine's Adam(W) configuration; the engine runs the update."""
import torch


class DeepSpeedCPUAdam(torch.optim.AdamW):

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        if not bias_correction:
            raise ValueError("DeepSpeedCPUAdam: bias_correction=False is not supported by uckpt")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        self.adamw_mode = adamw_mode


class FusedAdam(torch.optim.AdamW):

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0., amsgrad=False, set_grad_none=True):
        if not bias_correction:
            raise ValueError("FusedAdam: bias_correction=False is not supported by uckpt")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        self.adam_w_mode = adam_w_mode
