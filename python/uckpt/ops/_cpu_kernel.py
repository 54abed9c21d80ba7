"""The loop DeepSpeed's CPU optimizers (DeepSpeedCPUAdagrad, DeepSpeedCPULion) share: each parameter asserted
on the CPU as DeepSpeed's kernels assert it, its state made with DeepSpeed's keys and an integer `step`, then
the subclass's element-wise update."""
import torch


class CpuKernelOptimizer(torch.optim.Optimizer):
    kernel_name = None  # as DeepSpeed's assertion names it: "CPUAdagrad", "CPULion"
    state_keys = ()     # the moment tensors DeepSpeed's class keeps, zeros at the first step

    def __init__(self, model_params, defaults, fp32_optimizer_states):
        super().__init__(model_params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)

    def _check(self, p):
        """Refuses what the kernel cannot step, before any state is made (a subclass adds its own)."""
        assert p.device == torch.device("cpu"), (
            f"{self.kernel_name} param is on {p.device} and must be 'cpu', make sure you enabled "
            "'offload_optimizer': 'cpu' in your ZeRO config.")

    def _update(self, p, state, group):
        raise NotImplementedError

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
                self._check(p)
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    dtype = torch.float if self.fp32_optimizer_states else p.dtype
                    for key in self.state_keys:
                        state[key] = torch.zeros_like(p, dtype=dtype, device="cpu")
                state["step"] += 1
                self._update(p, state, group)
        return loss
