"""deepspeed.ops.adagrad: DeepSpeedCPUAdagrad, in PyTorch.

DeepSpeed 0.14.5's class steps each parameter on the CPU through its C++ kernel; this one runs the same
arithmetic per element in torch's fp32 ops, in the kernel's order (the weight decay enters the sum of squares
only; the update divides the raw gradient):

    g = grad + weight_decay * p      (when weight_decay > 0)
    exp_avg_sq += g * g
    p += -lr * (grad / (sqrt(exp_avg_sq) + eps))

with DeepSpeed's state keys (`step`, a Python int, and `exp_avg_sq`), so its files carry the same entries.
uckpt's engine steps it on the fp32 partitions like any element-wise client optimizer. As DeepSpeed's, it
asserts that its parameters are on the CPU (ZeRO's `offload_optimizer` on a GPU machine). DeepSpeed's C++
kernel may fuse a multiply and an add (AVX); results agree to the last bit or two, not always exactly.
"""
from uckpt.ops._cpu_kernel import CpuKernelOptimizer


class DeepSpeedCPUAdagrad(CpuKernelOptimizer):
    kernel_name = "CPUAdagrad"
    state_keys = ("exp_avg_sq",)

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True):
        super().__init__(model_params, dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad),
                         fp32_optimizer_states)

    def _check(self, p):
        super()._check(p)
        if p.grad.is_sparse:
            raise NotImplementedError("DeepSpeedCPUAdagrad: sparse gradients are not supported by uckpt")

    def _update(self, p, state, group):
        _adagrad_update(p, p.grad, state["exp_avg_sq"], group["lr"], group["eps"], group["weight_decay"])


def _adagrad_update(p, grad, exp_avg_sq, lr, eps, weight_decay):
    param = p.float()
    g32 = grad.float()
    g = param * weight_decay + g32 if weight_decay > 0 else g32
    variance = exp_avg_sq.float() + g * g  # two roundings, as the kernel's scalar loop (addcmul may fuse them)
    # Correctly rounded, as the kernel's sqrt: PyTorch's float sqrt goes through MKL's vector math, which is
    # 1 ulp off on some CPUs (AMD's); the double's sqrt rounded to float is the float's exact one.
    update = g32 / (variance.double().sqrt().float() + eps)
    param = update * (-lr) + param
    p.copy_(param)
    exp_avg_sq.copy_(variance)
