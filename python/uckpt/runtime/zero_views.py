"""The optimizer and the config's lr scheduler initialize() returns: views of the C++ engine core.

The optimizer's param groups are the same dicts every time (writes take effect at the next engine.step(), where the
update runs). Each view refuses, by name, the attributes DeepSpeed's class for the same run has and it lacks
(runtime/_deepspeed_names.py); any other missing name is an AttributeError, as it is for DeepSpeed's."""
import torch

from uckpt._deepspeed_api import DeepSpeedVersionAttributeError, later_message
from uckpt.runtime import _deepspeed_names

# DeepSpeed's optimizer at stage 0 outside bf16: the torch optimizer itself.
_TORCH_OPTIMIZER = frozenset(n for n in dir(torch.optim.Optimizer) if not n.startswith("_")) | {"defaults", "state"}


class UnsupportedAttributeError(AttributeError, NotImplementedError):
    """A DeepSpeed attribute uckpt refuses where libraries probe it with hasattr (which swallows only
    AttributeError): the probe answers False, a read still raises naming it."""


# Probed with hasattr by Accelerate's AcceleratedOptimizer.train()/eval() at every Trainer step: DeepSpeed's
# answer is the wrapped torch optimizer, which has no train() for the optimizers uckpt runs, so that call is
# skipped under DeepSpeed too.
_PROBED = frozenset(("optimizer",))


class EngineOptimizer:
    """What DeepSpeed's initialize returns as the optimizer (its ZeRO optimizer, BF16_Optimizer, or at stage 0 the
    torch optimizer)."""

    def __init__(self, core):
        self._core = core

    @property
    def param_groups(self):
        return self._core.param_groups()

    def zero_grad(self, set_to_none=True):
        """DeepSpeed's ZeRO optimizers': each trainable parameter's .grad set to None, or zeroed in place (the
        engine's gradient views stay attached)."""
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def step(self, closure=None):
        """At ZeRO stage 0 in fp32 DeepSpeed's optimizer is the torch optimizer itself, which a script may step
        (after its own loss.backward()): one update of every parameter from its own .grad, not averaged over the
        ranks nor clipped, the lr schedule and step counters untouched, as there. Elsewhere refused."""
        if closure is not None:
            raise ValueError("engine.optimizer.step(closure): a closure is not supported by uckpt")
        if self._deepspeed_class == "torch" and not self._core.parsed_config().fp16_enabled:
            self._core.optimizer_step()
            return None
        raise RuntimeError("engine.optimizer.step() is not supported by uckpt: the update runs in engine.step() (with "
                           "the gradient-accumulation boundary, the lr schedule and the step counters); call "
                           "engine.step(). (A script's own optimizer.step() works at ZeRO stage 0 in fp32, where "
                           "DeepSpeed's optimizer is the torch optimizer itself.)")

    def backward(self, *args, **kwargs):
        raise RuntimeError("engine.optimizer.backward() is not supported by uckpt: call engine.backward(loss) (which "
                           "also reduces the gradients across ranks, as DeepSpeed's engine.backward does)")

    def state_dict(self):
        """DeepSpeed's optimizer's: at ZeRO stage 0 in fp32 with a client torch optimizer that optimizer's own, at
        stage 0 in fp16 the FP16 wrapper's, at stages 1-2 the ZeRO optimizer's (this rank's); elsewhere refused by
        name."""
        return self._core.optimizer_state_dict()

    def load_state_dict(self, state_dict):
        self._core.load_optimizer_state_dict(state_dict)

    @property
    def overflow(self):
        """Whether the last update was skipped for an fp16 overflow."""
        return self._core.optimizer_overflow()

    # Read as DeepSpeed's ZeRO optimizers'; DeepSpeed's can also be set, uckpt's cannot.
    @property
    def loss_scale(self):
        return self._core.optimizer_loss_scale("loss_scale")

    @loss_scale.setter
    def loss_scale(self, value):
        raise RuntimeError("setting engine.optimizer.loss_scale is not supported by uckpt")

    @property
    def cur_scale(self):
        return self._core.optimizer_loss_scale("cur_scale")

    @cur_scale.setter
    def cur_scale(self, value):
        raise RuntimeError("setting engine.optimizer.cur_scale is not supported by uckpt")

    @property
    def _deepspeed_class(self):
        return self._core.optimizer_class()

    def __repr__(self):
        return "<uckpt ZeRO optimizer>"

    def __getattr__(self, name):
        attribute = type(self).__dict__.get(name)
        if attribute is not None:  # a property that raised AttributeError: its own message
            return attribute.__get__(self, type(self))
        if name.startswith("__") or name == "_core":
            raise AttributeError(name)
        cls = self._deepspeed_class
        if name in _deepspeed_names.OPTIMIZER.get(cls, _TORCH_OPTIMIZER):
            error = UnsupportedAttributeError if name in _PROBED else NotImplementedError
            raise error(f"optimizer.{name}: DeepSpeed 0.14.5's optimizer here ({cls}) has '{name}'; uckpt's "
                        "optimizer does not support it")
        version = _deepspeed_names.later(cls, name)
        if version is not None:
            raise DeepSpeedVersionAttributeError(later_message(f"optimizer.{name} ({cls}.{name})", version))
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


class EngineScheduler:
    """The config's lr schedule; the engine steps it at each boundary (as DeepSpeed's engine steps its scheduler),
    and step() steps it once more."""

    def __init__(self, core):
        self._core = core

    def get_lr(self):
        return self._core.scheduler_get_lr()

    def get_last_lr(self):
        return self._core.scheduler_get_last_lr()

    def state_dict(self):
        return self._core.scheduler_state_dict()

    def step(self, *args, **kwargs):
        """step(n) or step(<its keyword>=n): last_batch_iteration (Warmup*) or batch_iteration (OneCycle,
        LRRangeTest)."""
        self._core.scheduler_step(*args, **kwargs)

    @property
    def last_batch_iteration(self):
        """DeepSpeed's count of updates, -1 before the first."""
        return self._core.scheduler_last_batch_iteration()

    @property
    def _deepspeed_class(self):
        """The config's scheduler type: the deepspeed.runtime.lr_schedules class DeepSpeed builds."""
        return self._core.scheduler_type()

    def __getattr__(self, name):
        if name.startswith("__") or name == "_core":
            raise AttributeError(name)
        cls = self._deepspeed_class
        if name in _deepspeed_names.SCHEDULER.get(cls, ()):
            raise NotImplementedError(f"lr_scheduler.{name}: DeepSpeed 0.14.5's {cls} has '{name}'; uckpt's "
                                      "scheduler does not support it")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
