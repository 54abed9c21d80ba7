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

from uckpt.ops._cpu_kernel import CpuKernelOptimizer


def _f32(x):
    return torch.tensor(x, dtype=torch.float32)


class DeepSpeedCPULion(CpuKernelOptimizer):
    kernel_name = "CPULion"
    state_keys = ("exp_avg", "exp_avg_sq")  # DeepSpeed's makes exp_avg_sq and never uses it

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        super().__init__(model_params, dict(lr=lr, betas=betas, weight_decay=weight_decay), fp32_optimizer_states)

    def _update(self, p, state, group):
        beta1, beta2 = group["betas"]
        _lion_update(p, p.grad, state["exp_avg"], group["lr"], beta1, beta2, group["weight_decay"])


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
