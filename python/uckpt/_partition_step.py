"""A client's element-wise torch optimizer stepping the engine's fp32 partitions.

DeepSpeed's ZeRO optimizers step their basic (torch) optimizer over the flat
fp32 partitions a rank owns: each param group's params replaced by its
partitions, each partition's .grad its reduced gradient, then step(). The
engine calls PartitionStepper.step at every applied step; the optimizer's state
lives in the engine between steps (saved and loaded under its own keys), and
is handed to the optimizer for the step.
"""
import collections

import torch

# Optimizers whose state is not one value per element of the parameter:
# refused at initialize, naming why.
_NOT_ELEMENTWISE = {
    "LBFGS": "its state is a history of whole-model vectors and its step() needs a closure",
    "SparseAdam": "it steps sparse gradients only",
}


def refusal(optimizer):
    """Why `optimizer` cannot step partitions, or None."""
    for cls in type(optimizer).__mro__:
        why = _NOT_ELEMENTWISE.get(cls.__name__)
        if why and cls.__module__.startswith("torch.optim"):
            return (f"uckpt.initialize: optimizer {type(optimizer).__name__} is not supported: {why}; uckpt's ZeRO "
                    "partitions need an element-wise optimizer (state tensors of the parameter's shape and scalars)")
    return None


def _number_or_tensor(v):
    """A state as the optimizer keeps it: 0-d int64 and float64 tensors are its Python numbers."""
    if v is None:
        return None
    if v.dim() == 0 and v.dtype == torch.int64:
        return int(v)
    if v.dim() == 0 and v.dtype == torch.float64:
        return float(v)
    return v


def _describe(v):
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    return f"a {type(v).__name__}"


class PartitionStepper:
    """Steps `optimizer` over partitions: (master, grad, group, lr, state) tuples."""

    def __init__(self, optimizer, engine_group_of):
        self.optimizer = optimizer
        self.name = type(optimizer).__name__
        # Each param-group dict (by identity: the engine may drop empty ones) -> its engine group.
        self.group_of = {id(d): g for d, g in zip(optimizer.param_groups, engine_group_of)}

    def step(self, parts):
        opt = self.optimizer
        groups = opt.param_groups
        saved = [g["params"] for g in groups]
        by_group = {}
        for i, part in enumerate(parts):
            by_group.setdefault(part[2], []).append(i)
        masters = [p[0] for p in parts]
        try:
            for d in groups:
                idx = by_group.get(self.group_of.get(id(d), -1), [])
                d["params"] = [parts[i][0] for i in idx]
                if idx and float(d["lr"]) != parts[idx[0]][3]:
                    d["lr"] = parts[idx[0]][3]
            for master, grad, group, lr, state in parts:
                master.grad = grad
                if state:
                    opt.state[master] = {k: _number_or_tensor(v) for k, v in state.items()}
                elif isinstance(opt, torch.optim.Adagrad):
                    # Adagrad makes its state at construction, not at its first step.
                    d = next(d for d in groups if any(p is master for p in d["params"]))
                    opt.state[master] = {"step": torch.tensor(0.0),
                                         "sum": torch.full_like(master, d.get("initial_accumulator_value", 0.0))}
            opt.step()
            return [self._checked(opt.state.get(master, {}), master, state) for master, _, _, _, state in parts]
        finally:
            for d, params in zip(groups, saved):
                d["params"] = params
            for master in masters:
                master.grad = None
                opt.state.pop(master, None)

    def _checked(self, state, master, before):
        out = []
        for key, v in state.items():
            if v is None:  # torch's "no state" (SGD's momentum_buffer without momentum)
                out.append((key, None))
                continue
            if isinstance(v, int) and not isinstance(v, bool):  # a number (RMSprop's step): kept as a 0-d int64 (float64) tensor
                v = torch.tensor(v, dtype=torch.int64)
            elif isinstance(v, float):
                v = torch.tensor(v, dtype=torch.float64)
            if not isinstance(v, torch.Tensor) or (v.dim() != 0 and v.shape != master.shape):
                raise ValueError(f"uckpt: {self.name}'s state '{key}' is {_describe(v)}, not a tensor of the "
                                 f"parameter's shape ({master.numel()} elements of this partition) or a 0-d tensor: "
                                 f"{self.name} is not an element-wise optimizer, which uckpt's ZeRO partitions need")
            out.append((key, v))
        if before and set(before) != {k for k, _ in out}:
            raise ValueError(f"uckpt: the loaded optimizer state has keys {sorted(before)} but {self.name} keeps "
                             f"{sorted(k for k, _ in out)}: the checkpoint was saved with another optimizer")
        return out


def stage0_state_dict(optimizer, param_states):
    """The client `optimizer`'s own state_dict() with the engine's state: DeepSpeed's
    optimizer.state_dict() at ZeRO stage 0 in fp32, where it steps the client's
    optimizer on the parameters themselves. `param_states`: (parameter, {key: value})
    pairs, values as views of the engine's state."""
    own = optimizer.state
    state = collections.defaultdict(dict)
    for p, st in param_states:
        if st:
            state[p] = {k: _number_or_tensor(v) for k, v in st.items()}
    optimizer.state = state
    try:
        return optimizer.state_dict()
    finally:
        optimizer.state = own


def stage0_load_state_dict(optimizer, state_dict):
    """torch's load_state_dict on the client `optimizer`, keeping its param-group
    dicts (the engine and a scheduler hold them): their entries become the saved
    ones. Returns the loaded state as (parameter, {key: tensor}) pairs (numbers
    as 0-d int64/float64 tensors), leaving the optimizer's own state as it was."""
    groups = optimizer.param_groups
    dicts = list(groups)
    own = optimizer.state
    try:
        optimizer.load_state_dict(state_dict)
        loaded = optimizer.state
        for old, new in zip(dicts, optimizer.param_groups):
            params = old["params"]
            old.clear()
            old.update(new)
            old["params"] = params
    finally:
        optimizer.param_groups = groups
        optimizer.state = own
    return _param_states(dicts, loaded)


def take_state(optimizer):
    """The state a client `optimizer` holds already (a script's load_state_dict before
    initialize), as (parameter, {key: tensor}) pairs; its own state is left empty, the
    engine keeps it from now on (DeepSpeed's stage 0 steps the optimizer with it)."""
    taken = _param_states(optimizer.param_groups, optimizer.state)
    optimizer.state.clear()
    return [(p, st) for p, st in taken if st]


def _param_states(dicts, state):
    out = []
    for d in dicts:
        for p in d["params"]:
            st = {}
            for k, v in state.get(p, {}).items():
                if v is None:  # torch's None state, kept
                    st[k] = None
                    continue
                if isinstance(v, bool) or not isinstance(v, (int, float, torch.Tensor)):
                    raise ValueError(f"optimizer.load_state_dict: state '{k}' is {_describe(v)}, not a tensor or a "
                                     "number (uckpt keeps an element-wise optimizer's state)")
                if isinstance(v, int):
                    v = torch.tensor(v, dtype=torch.int64)
                elif isinstance(v, float):
                    v = torch.tensor(v, dtype=torch.float64)
                st[k] = v
            out.append((p, st))
    return out
