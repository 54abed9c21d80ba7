"""deepspeed.ops.lion: DeepSpeedCPULion, in PyTorch (FusedLion, DeepSpeed's GPU-only class, is not provided).

DeepSpeed 0.14.5's class steps each parameter on the CPU through its C++ kernel; this one runs the same
arithmetic per element in torch's fp32 ops, in the kernel's order, with its constants in fp32:

    c = beta1 * exp_avg + (1 - beta1) * grad
    p = p * (1 - lr * weight_decay) - copysign(lr, c)      (a zero c moves p by -lr, as copysign does)
    exp_avg = beta2 * exp_avg + (1 - beta2) * grad

and DeepSpeed's state keys (`step`, `exp_avg`, and the `exp_avg_sq` it makes and never uses). uckpt's engine
steps it on the fp32 partitions like any element-wise client optimizer. As DeepSpeed's, it asserts that its
parameters are on the CPU. DeepSpeed's AVX kernel may fuse a multiply and an add: results agree to the last
bit or two, not always exactly.
"""
import torch


def _f32(x):
    return torch.tensor(x, dtype=torch.float32)


class DeepSpeedCPULion(torch.optim.Optimizer):

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        super().__init__(model_params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        self.fp32_optimizer_states = fp32_optimizer_states

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                assert p.device == torch.device("cpu"), (
                    f"CPULion param is on {p.device} and must be 'cpu', make sure you enabled "
                    "'offload_optimizer': 'cpu' in your ZeRO config.")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    dtype = torch.float if self.fp32_optimizer_states else p.dtype
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype, device="cpu")
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, device="cpu")
                state["step"] += 1
                beta1, beta2 = group["betas"]
                _lion_update(p, p.grad, state["exp_avg"], group["lr"], beta1, beta2, group["weight_decay"])
        return loss


def _lion_update(p, grad, exp_avg, lr, beta1, beta2, weight_decay):
    lr32, b1, b2, wd = _f32(lr), _f32(beta1), _f32(beta2), _f32(weight_decay)
    one = _f32(1.0)
    param = p.float()
    g = grad.float()
    momentum = exp_avg.float()
    c = g * (one - b1) + momentum * b1
    step = -torch.copysign(lr32.expand_as(c), c)
    param = param * (one - lr32 * wd) + step if weight_decay > 0 else param + step
    momentum = g * (one - b2) + momentum * b2
    p.copy_(param)
    exp_avg.copy_(momentum)
