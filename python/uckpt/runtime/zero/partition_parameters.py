"""deepspeed.runtime.zero.partition_parameters: stage 3's parameter status, construction and gathering contexts."""
import collections.abc
import contextlib
import functools
import itertools
import os
from enum import Enum

import torch

from uckpt import _uckpt


class ZeroParamStatus(Enum):
    AVAILABLE = 1  # whole on this rank
    NOT_AVAILABLE = 2  # only this rank's partition is held
    INFLIGHT = 3  # being gathered (uckpt's gathers complete before a call returns: never seen)


# Tensor calls that read no element of a parameter: allowed on a partitioned one.
_METADATA_CALLS = frozenset([
    "size", "dim", "ndimension", "numel", "nelement", "shape", "ndim", "dtype", "device", "layout", "is_cuda",
    "is_sparse", "is_quantized", "is_meta", "is_mkldnn", "is_floating_point", "is_complex", "is_leaf", "element_size",
    "requires_grad", "requires_grad_", "grad", "_grad", "grad_fn", "_grad_fn", "register_hook", "retain_grad",
    "retains_grad", "output_nr", "_version", "_base", "_cdata", "names", "stride", "is_contiguous", "storage_offset",
    "storage", "untyped_storage", "_typed_storage", "_storage", "data_ptr", "get_device", "__hash__", "name",
    "is_shared", "is_pinned", "_is_view", "__len__", "_backward_hooks", "_post_accumulate_grad_hooks",
    # new tensors of the parameter's shape and dtype
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "new_zeros",
    "new_ones", "new_empty", "new_full", "new_tensor",
])


def _whole_here(p):
    """Whether parameter p holds its whole value on this rank (ds_numel elements with bytes behind them)."""
    with torch._C.DisableTorchFunction():
        if p.ds_numel == 0:
            return True
        if p.numel() != p.ds_numel:
            return False  # zero.Init's placeholder (0 elements)
        storage = p.untyped_storage() if hasattr(p, "untyped_storage") else p.storage()
        return storage.size() > 0


def _call_name(func):
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):  # a property's getter or setter: its name is the property's
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", name)
    return name


def _partitioned_among(values):
    for v in values:
        if isinstance(v, _Stage3Parameter) and not _whole_here(v):
            return v
        if isinstance(v, (list, tuple)):
            found = _partitioned_among(v)
            if found is not None:
                return found
    return None


def _in_place_on_placeholder(name, args, kwargs):
    """A call writing in place (name_: a tensor method, or torch.nn.init's, which passes `tensor=`) into a
    partitioned parameter whose data is a 0-element placeholder (zero.Init's), its first argument."""
    if not name.endswith("_") or name.endswith("__"):
        return False
    target = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
    if not isinstance(target, _Stage3Parameter):
        return False
    with torch._C.DisableTorchFunction():
        return target.numel() == 0 and target.ds_numel > 0


def _refuse_read(func, p_id, p_shape, what=""):
    raise RuntimeError(
        f"uckpt ZeRO stage 3: {_call_name(func) or func} reads parameter ds_id={p_id}{what} (shape {tuple(p_shape)}) "
        f"while it is partitioned (ds_status NOT_AVAILABLE): this rank holds only its partition (ds_tensor). Read or "
        f"write it inside its gather unit's forward or inside deepspeed.zero.GatheredParameters([param], "
        f"modifier_rank=...)")


class _PartitionedData(torch.Tensor):
    """`.data` of a partitioned parameter: as DeepSpeed's there, a 0-element tensor, so that an in-place write to it
    (`module.weight.data.normal_()`, as 7 of transformers 5.17's _init_weights write it) runs on 0 elements and
    changes nothing. Reading its elements raises naming the parameter (DeepSpeed's would read 0 elements)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _call_name(func)
        target = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
        writes_in_place = name.endswith("_") and not name.endswith("__") and isinstance(target, _PartitionedData)
        if not writes_in_place and name not in _METADATA_CALLS:
            of = next((v for v in list(args) + list(kwargs.values()) if isinstance(v, _PartitionedData)), None)
            if of is not None:
                _refuse_read(func, of._uckpt_ds_id, of._uckpt_ds_shape, "'s .data")
        with torch._C.DisableTorchFunction():
            return func(*args, **kwargs)


def _partitioned_data(p):
    with torch._C.DisableTorchFunction():
        data = torch.empty(0, dtype=p.dtype, device=p.device).as_subclass(_PartitionedData)
    data._uckpt_ds_id, data._uckpt_ds_shape = p.ds_id, p.ds_shape
    return data


class _Stage3Parameter(torch.nn.Parameter):
    """A partitioned parameter (zero.Init's, or a stage-3 engine's: initialize switches its class to this one).
    ds_status says, as DeepSpeed's does, whether it is whole on this rank now; any tensor call that reads its
    elements while it is not raises a RuntimeError that says so (instead of reading freed storage)."""

    @property
    def ds_status(self):
        return ZeroParamStatus.AVAILABLE if _whole_here(self) else ZeroParamStatus.NOT_AVAILABLE

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.detach and len(args) == 1 and isinstance(args[0], _Stage3Parameter) \
                and not _whole_here(args[0]):
            # What a partitioned parameter's detach() gives under DeepSpeed (its data is a 0-element tensor):
            # Module.state_dict() calls it, and Hugging Face's from_pretrained reads its keys under ZeRO-3.
            with torch._C.DisableTorchFunction():
                return torch.empty(0, dtype=args[0].dtype, device=args[0].device)
        name = _call_name(func)
        if name == "data" and getattr(func, "__name__", "") == "__get__" and len(args) == 1 \
                and isinstance(args[0], _Stage3Parameter) and not _whole_here(args[0]):
            return _partitioned_data(args[0])
        if _in_place_on_placeholder(name, args, kwargs):
            # DeepSpeed's partitioned parameter is a 0-element tensor: an in-place call on it (init.normal_,
            # zero_, fill_, ... as transformers' initialize_weights_zero3 makes on every rank for a child's
            # parameter outside its gather) runs on those 0 elements and changes nothing. zero.Init's
            # placeholder here is the same 0-element tensor: the call runs on it, as there.
            with torch._C.DisableTorchFunction():
                return func(*args, **kwargs)
        if name not in _METADATA_CALLS:
            p = _partitioned_among(args)
            if p is None:
                p = _partitioned_among(kwargs.values())
            if p is not None:
                _refuse_read(func, p.ds_id, p.ds_shape)
        with torch._C.DisableTorchFunction():
            return func(*args, **kwargs)


def mark_stage3_parameters(module, engine=None):
    """Gives a stage-3 engine's parameters DeepSpeed's ds_id, ds_shape, ds_numel, ds_status and ds_tensor (the
    engine's partition of this rank), which scripts read to find what to gather
    (`p.ds_status == ZeroParamStatus.NOT_AVAILABLE`). Parameters of other subclasses of torch.nn.Parameter are
    left as they are."""
    partitions = {}
    if engine is not None:
        partitions = {id(p): part for p, part in engine._parameter_partitions()}
    for p in module.parameters():
        if type(p) is torch.nn.Parameter:
            p.__class__ = _Stage3Parameter
            p.ds_id = next(_Partitioner._ids)
            with torch._C.DisableTorchFunction():
                p.ds_shape = p.shape
                p.ds_numel = p.numel()
        elif type(p) is not _Stage3Parameter:
            continue
        p._uckpt_unowned = False  # the engine's now
        if id(p) in partitions:
            p.ds_tensor = partitions[id(p)]


# ---- zero.Init's partitions before initialize: made, gathered and re-made in Python. ----


def _dist():
    import torch.distributed as dist
    return dist


def _rank_world():
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _comm_device():
    """Where collectives of whole values run: torch.distributed's backend's device."""
    dist = _dist()
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _compute_device():
    """Where whole values live while gathered, as DeepSpeed's: this rank's GPU when CUDA is used, even when the
    partitions are offloaded to the CPU (so initialisation inside GatheredParameters draws from the GPU's
    generator, as in a build without offload)."""
    if os.environ.get("DS_ACCELERATOR") != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _is_unowned_partition(p):
    """A parameter partitioned by zero.Init that no engine holds yet."""
    return isinstance(p, _Stage3Parameter) and getattr(p, "_uckpt_unowned", False)


def _slice_of_rank(whole, partition):
    """Copies this rank's slice of `whole` (flattened) into `partition` (zeros past the end)."""
    rank, world = _rank_world()
    flat = whole.reshape(-1)
    ps = partition.numel()
    start = rank * ps
    n = max(0, min(ps, flat.numel() - start))
    if n > 0:
        # Converted where the value is: torch converts a blocking copy between devices on the host, through a
        # temporary of the source dtype (a 3B model's construction took 8 s in those copies instead of 2).
        partition[:n].copy_(flat[start:start + n].to(partition.dtype))
    if n < ps:
        partition[n:].zero_()


def _movable(t):
    """t as a dtype every backend moves (torch 1.13's gloo has no bfloat16): its bits, reinterpreted."""
    return t.view(torch.float16) if t.dtype == torch.bfloat16 else t


def _broadcast_from(whole, rank):
    """`rank`'s values of `whole` on every rank (a new tensor on the comm device unless already there)."""
    if _rank_world()[1] == 1:
        return whole
    t = whole.detach().to(_comm_device()).contiguous()
    _dist().broadcast(_movable(t), rank)
    return t


def _gather_whole(p):
    """Every rank's partition of p, concatenated, as p's data (its whole value)."""
    with torch._C.DisableTorchFunction():
        part = p.ds_tensor
        _, world = _rank_world()
        if world == 1:
            flat = part
        else:
            mine = part.to(_comm_device()).contiguous()
            pieces = [torch.empty_like(mine) for _ in range(world)]
            _dist().all_gather([_movable(t) for t in pieces], _movable(mine))
            flat = torch.cat(pieces)
            del pieces
        whole = flat[:p.ds_numel].view(p.ds_shape)
        device = _compute_device()
        p.data = whole.to(device) if whole.device != device else whole.clone() if world == 1 else whole


class _FreedMemory:
    """Hands freed whole values back to the system as construction goes (glibc keeps freed heap memory
    otherwise, and a model of many mid-size parameters would grow to its whole size in free lists): malloc_trim
    once every _EVERY bytes freed. Does nothing where there is no glibc."""

    _EVERY = 4 << 20
    _freed = 0
    _trim = None

    @classmethod
    def note(cls, nbytes):
        cls._freed += nbytes
        if cls._freed < cls._EVERY:
            return
        cls._freed = 0
        if cls._trim is None:
            try:
                import ctypes
                cls._trim = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):
                cls._trim = False
        if cls._trim:
            cls._trim(0)


def _free_whole(p, modifier_rank):
    """Back to p's partition: modifier_rank's whole values re-partitioned first (None: changes dropped)."""
    with torch._C.DisableTorchFunction():
        if modifier_rank is not None:
            whole = _broadcast_from(p.data, modifier_rank)
            _slice_of_rank(whole.to(p.ds_tensor.device), p.ds_tensor)
            del whole
        nbytes = p.numel() * p.element_size()
        p.data = torch.empty(0, dtype=p.ds_tensor.dtype, device=p.data.device)
    _FreedMemory.note(nbytes)


class _Partitioner:
    """What zero.Init does to a parameter: rank 0's value (broadcast, as DeepSpeed's), this rank's slice of it
    kept as ds_tensor, and the parameter left a 0-element placeholder carrying DeepSpeed's ds_* attributes."""

    _ids = itertools.count()  # DeepSpeed numbers zero.Init's parameters in creation order

    def __init__(self, dtype, device, pin_memory):
        self.dtype = dtype
        self.device = device
        self.pin_memory = pin_memory

    def partition(self, p):
        if isinstance(p, _Stage3Parameter) or getattr(p, "ds_id", None) is not None:
            return  # partitioned already (a parameter shared between modules)
        _, world = _rank_world()
        with torch.no_grad():
            whole = _broadcast_from(p.data, 0)
            dtype = self.dtype if (self.dtype is not None and whole.is_floating_point()) else whole.dtype
            numel = whole.numel()
            # Pageable even with pin_memory: initialize copies the partitions into its own pinned buffers, and
            # pinned blocks freed then would stay in torch's pinned-memory cache, counted in the rank's memory.
            part = torch.empty(-(-numel // world), dtype=dtype, device=self.device)
            _slice_of_rank(whole, part)
            p.ds_shape = whole.shape
            p.ds_numel = numel
            p._uckpt_built_dtype = whole.dtype  # Module.apply's fn sees it in this dtype, as in a whole build
            p.ds_id = next(self._ids)
            p.ds_tensor = part
            p.data = torch.empty(0, dtype=dtype, device=p.data.device)
            del whole
        p.__class__ = _Stage3Parameter
        p._uckpt_unowned = True
        _FreedMemory.note(numel * p.element_size())


def zero_init_partitions(model):
    """(param, ds_shape, ds_tensor) of each of model's parameters that zero.Init partitioned and no engine holds."""
    return [(p, list(p.ds_shape), p.ds_tensor) for p in model.parameters() if _is_unowned_partition(p)]


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):
    """As DeepSpeed's: the stage-3 parameters among `params` (a tensor or an
    iterable of them) are whole inside the block (collective: all ranks enter
    it with the same parameters). On exit, with modifier_rank set, that rank's
    values become every rank's (partitions and the next forward; the fp32
    master weights are not written, as DeepSpeed's); with modifier_rank None,
    writes made inside the block are discarded. Parameters of an engine at
    stages 0-2, or of no engine, are left alone (DeepSpeed's context does
    nothing for them); zero.Init's partitions not yet given to initialize are
    gathered and re-partitioned the same way."""
    if not enabled:
        yield
        return
    if isinstance(params, torch.Tensor) or not isinstance(params, collections.abc.Iterable):
        params = [params]
    # What is not a tensor is skipped, as DeepSpeed skips it (a Linear's bias=None).
    params = [p for p in params if torch.is_tensor(p)]
    rank = -1 if modifier_rank is None else int(modifier_rank)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if modifier_rank is not None and not 0 <= rank < world:
        raise ValueError(f"uckpt.zero.GatheredParameters: modifier_rank {modifier_rank} is not a rank "
                         f"(world size {world})")
    unowned = sorted((p for p in params if _is_unowned_partition(p) and not _whole_here(p)), key=lambda p: p.ds_id)
    partitioned = _uckpt.gather_parameters(params, True) + len(unowned)
    if fwd_module is not None and partitioned:
        _uckpt.gather_parameters(params, False)
        raise ValueError("uckpt.zero.GatheredParameters: fwd_module= (registering external parameters) is not "
                         "supported by uckpt at ZeRO stage 3")
    for p in unowned:
        _gather_whole(p)
    try:
        yield
    finally:
        for p in unowned:
            _free_whole(p, modifier_rank)
        _uckpt.gather_parameters(params, False, rank)


# ---- zero.Init: each module's own parameters partitioned when its __init__ returns. ----

_active = []  # the entered Init contexts, outermost first
_patched = {}  # class -> its own __init__, while patched
_building = set()  # ids of modules whose outermost __init__ is running


def _all_module_classes():
    seen, todo = [], [torch.nn.Module]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return [torch.nn.Module] + seen


def _wrap_init(cls):
    if "__init__" not in cls.__dict__ or cls in _patched:
        return
    own = cls.__dict__["__init__"]

    @functools.wraps(own)
    def init(module, *args, **kwargs):
        outermost = id(module) not in _building
        if not outermost:
            return own(module, *args, **kwargs)
        _building.add(id(module))
        try:
            own(module, *args, **kwargs)
        finally:
            _building.discard(id(module))
        if _active:
            _active[0]._partition_module(module)

    _patched[cls] = own
    cls.__init__ = init


def _init_subclass(cls, **kwargs):
    super(torch.nn.Module, cls).__init_subclass__(**kwargs)
    _wrap_init(cls)


_patched_init_subclass = None
_orig_apply = None


def _apply_gathering(module, fn):
    """Module.apply under zero.Init (DeepSpeed's override_module_apply): each module's own partitioned
    parameters whole while fn runs on it, in the dtype they were built in (so that an initialisation over
    built children gives a whole build's values), then rank 0's values partitioned again."""
    if getattr(fn, "_uckpt_gathers", False):
        return _orig_apply(module, fn)

    def gathered(m):
        params = sorted((p for p in m.parameters(recurse=False) if _is_unowned_partition(p) and not _whole_here(p)),
                        key=lambda p: p.ds_id)
        for p in params:
            _gather_whole(p)
            with torch._C.DisableTorchFunction():  # the dtype it was built in (fp32 under a bf16 or fp16 config)
                p.data = p.data.to(p._uckpt_built_dtype)
        fn(m)
        for p in params:
            _free_whole(p, 0)

    gathered._uckpt_gathers = True
    return _orig_apply(module, gathered)


def _patch(override_apply):
    global _patched_init_subclass, _orig_apply
    for cls in _all_module_classes():
        _wrap_init(cls)
    _patched_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
    torch.nn.Module.__init_subclass__ = classmethod(_init_subclass)
    _orig_apply = torch.nn.Module.apply
    if override_apply:
        torch.nn.Module.apply = _apply_gathering


def _unpatch():
    global _orig_apply
    for cls, own in _patched.items():
        cls.__init__ = own
    _patched.clear()
    if _patched_init_subclass is None:
        del torch.nn.Module.__init_subclass__
    else:
        torch.nn.Module.__init_subclass__ = _patched_init_subclass
    torch.nn.Module.apply = _orig_apply
    _orig_apply = None


def _parse_config(config):
    """The config parsed as initialize parses it (uckpt._uckpt.Config), or None without one."""
    if config is None:
        return None
    if hasattr(config, "_param_dict"):  # a DeepSpeedConfig
        config = config._param_dict
    if isinstance(config, (str, os.PathLike)):
        import json
        with open(config) as f:
            config = json.load(f)
    # DeepSpeed's config class keeps the optimizer's and scheduler's sections as they are until initialize builds
    # them: the Hugging Face Trainer's config still has "auto" in scheduler.params when it builds a model under
    # zero.Init (it fills warmup_num_steps and total_num_steps at initialize). zero.Init reads neither.
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if k not in ("optimizer", "scheduler")}
    return _uckpt.parse_config(config)


def _config_dtype(cfg):
    return torch.bfloat16 if cfg.bfloat16_enabled else torch.half if cfg.fp16_enabled else torch.float


class Init:
    """deepspeed.zero.Init: inside the block, each module's own parameters are partitioned across the ranks as
    soon as its __init__ returns (rank 0's values; this rank keeps ds_tensor, elements [r*P, (r+1)*P) of the
    flattened parameter, P = ceil(numel / world size)), so a rank never holds more than its partitions and the
    module being built. initialize takes such a model at ZeRO stage 3 only. See docs/python.md."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None, param_swapper=None):
        self.enabled = enabled
        if not enabled:
            return
        refused = {"mpu": mpu, "zero_param_parallel_group": zero_param_parallel_group,
                   "sequence_data_parallel_group": sequence_data_parallel_group, "param_swapper": param_swapper}
        for name, value in refused.items():
            if value is not None:
                raise ValueError(f"uckpt.zero.Init: {name}= is not supported by uckpt (data parallel ZeRO over "
                                 f"all ranks only)")
        for name, value in (("zero_quantized_weights", zero_quantized_weights),
                            ("zero_quantized_nontrainable_weights", zero_quantized_nontrainable_weights)):
            if value:
                raise ValueError(f"uckpt.zero.Init: {name}=True is not supported by uckpt")
        # The config's rules (its zero_quantized_* and zero_hpz_partition_size among them) are the parser's.
        cfg = _parse_config(config if config is not None else config_dict_or_path)
        if cfg is not None and cfg.offload_param:
            remote_device = "cpu"
            pin_memory = cfg.offload_param_pin_memory
        if remote_device == "nvme":
            raise ValueError("uckpt.zero.Init: remote_device 'nvme' (offload_param to NVMe) is not supported by uckpt")
        if remote_device not in (None, "none", "cpu"):
            raise ValueError(f"uckpt.zero.Init: remote_device {remote_device!r} is not one of None, 'none', 'cpu'")
        if dtype is None and cfg is not None:
            dtype = _config_dtype(cfg)
        if dtype is not None and dtype not in (torch.half, torch.bfloat16, torch.float):
            raise ValueError(f"uckpt.zero.Init: dtype {dtype} is not one of torch.half, torch.bfloat16, torch.float")
        self.override_apply = cfg.override_module_apply if cfg is not None else True
        dist = _dist()
        if not dist.is_initialized():
            import uckpt
            uckpt.init_distributed()
        if os.environ.get("DS_ACCELERATOR") != "cpu" and torch.cuda.is_available():
            # Each rank's own GPU for the broadcasts of whole values (NCCL), as DeepSpeed's Init sets it.
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if data_parallel_group is not None and (dist.get_world_size(data_parallel_group) != dist.get_world_size()
                                                or dist.get_rank(data_parallel_group) != dist.get_rank()):
            raise ValueError("uckpt.zero.Init: data_parallel_group= must be all ranks (uckpt partitions over the "
                             "whole world)")
        self.partitioner = _Partitioner(dtype, self._partition_device(remote_device), pin_memory)
        if module is not None:
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"uckpt.zero.Init: module must be a torch.nn.Module, got {type(module).__name__}")
            self._partition_tree(module)

    @staticmethod
    def _partition_device(remote_device):
        return torch.device("cpu") if remote_device == "cpu" else _compute_device()

    def _partition_module(self, module):
        for p in module._parameters.values():
            if p is not None:
                self.partitioner.partition(p)

    def _partition_tree(self, module):
        for m in module.modules():
            self._partition_module(m)

    def __enter__(self):
        if not self.enabled:
            return self
        if not _active:
            _patch(self.override_apply)
            self._built_on = _BuildDevice.enter()
        _active.append(self)
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        _active.pop()
        if not _active:
            _unpatch()
            _BuildDevice.exit(self._built_on)
        return False


class _BuildDevice:
    """Where modules built inside zero.Init create their tensors: as DeepSpeed's Init, torch.tensor, empty, zeros,
    ones, full, arange, eye and randn called without a device make them on this rank's GPU (LOCAL_RANK) when CUDA is
    there, so initialisation runs there and rank 0's values are broadcast without a copy; other factories (rand,
    randint, ...) stay where torch puts them, as under DeepSpeed. Patched while the outermost block is open."""

    _NAMES = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")

    @classmethod
    def enter(cls):
        if os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available():
            return None
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        originals = {name: getattr(torch, name) for name in cls._NAMES}
        for name, fn in originals.items():
            setattr(torch, name, cls._on(fn, device))
        return originals

    @staticmethod
    def _on(fn, device):
        @functools.wraps(fn)
        def made_on_device(*args, **kwargs):
            if kwargs.get("device") is None:
                kwargs["device"] = device
            return fn(*args, **kwargs)
        return made_on_device

    @staticmethod
    def exit(originals):
        for name, fn in (originals or {}).items():
            setattr(torch, name, fn)
