"""deepspeed.accelerator.get_accelerator(): CUDA when torch sees a GPU (and
DS_ACCELERATOR is not "cpu"), else the CPU."""
import os

import torch


class _Accelerator:

    def __init__(self, name):
        self._name = name
        self._cuda = name == "cuda"

    def device_name(self, device_index=None):
        return self._name if device_index is None or not self._cuda else f"cuda:{device_index}"

    def device(self, device_index=None):
        return torch.device(self.device_name(device_index))

    def current_device(self):
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self):
        return self.device_name(self.current_device()) if self._cuda else "cpu"

    def set_device(self, device_index):
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self):
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self):  # as DeepSpeed's: the CPU always, CUDA as torch sees it
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index=None):
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def empty_cache(self):
        if self._cuda:
            torch.cuda.empty_cache()

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def is_bf16_supported(self):  # DeepSpeed's CPU accelerator: True; CUDA: torch's answer
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self):  # DeepSpeed's: compute capability 7 or more (6 with DS_ALLOW_DEPRECATED_FP16=1)
        if not self._cuda:
            return False
        major, _ = torch.cuda.get_device_capability()
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")

    def communication_backend_name(self):
        return "nccl" if self._cuda else "gloo"

    def pin_memory(self, tensor, align_bytes=1):
        return tensor.pin_memory() if self._cuda else tensor

    def on_accelerator(self, tensor):
        return tensor.device.type == self._name

    # ---- DeepSpeed's accelerator calls that are torch's (CUDA) or the process's memory (CPU), as its
    # CUDA_Accelerator and CPU_Accelerator answer them. Its op builders are refused by name (__getattr__).

    def name(self):
        return self._name

    def is_synchronized_device(self):
        return not self._cuda

    use_host_timers = resolves_data_dependency = handles_memory_backpressure = is_synchronized_device

    def random(self):
        return torch.random

    def get_rng_state(self, device_index=None):
        if not self._cuda:
            return torch.get_rng_state()
        return torch.cuda.get_rng_state() if device_index is None else torch.cuda.get_rng_state(device_index)

    def set_rng_state(self, new_state, device_index=None):
        if not self._cuda:
            return torch.set_rng_state(new_state) if device_index is None else torch.set_rng_state(new_state,
                                                                                                   device_index)
        if device_index is None:
            return torch.cuda.set_rng_state(new_state)
        return torch.cuda.set_rng_state(new_state, device_index)

    def initial_seed(self):
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def default_generator(self, device_index):
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    @property
    def Stream(self):
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self):
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream):
        import contextlib
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index) if self._cuda else None

    # Memory: torch.cuda's counters; on the CPU the process's resident memory and its peak (DeepSpeed's).
    _max_rss = 0

    def _rss(self, reset=False):
        import psutil
        mem = psutil.Process().memory_info().rss
        if reset or mem > self._max_rss:
            self._max_rss = mem
        return mem

    def memory_allocated(self, device_index=None):
        return torch.cuda.memory_allocated(device_index) if self._cuda else self._rss()

    def max_memory_allocated(self, device_index=None):
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self._rss()
        return self._max_rss

    def reset_max_memory_allocated(self, device_index=None):
        if self._cuda:
            return torch.cuda.reset_peak_memory_stats(device_index)
        self._rss(reset=True)

    def memory_cached(self, device_index=None):
        return torch.cuda.memory_reserved(device_index) if self._cuda else self._rss()

    def max_memory_reserved(self, device_index=None):
        if self._cuda:
            return torch.cuda.max_memory_reserved(device_index)
        self._rss()
        return self._max_rss

    def max_memory_cached(self, device_index=None):
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index=None):
        return self.reset_max_memory_allocated(device_index)

    def memory_reserved(self, device_index=None):
        return torch.cuda.memory_reserved(device_index) if self._cuda else self._rss()

    def memory_stats(self, device_index=None):
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        mem = self._rss()
        return {"allocated_bytes.all.current": mem, "allocated_bytes.all.peak": self._max_rss}

    def reset_peak_memory_stats(self, device_index=None):
        return self.reset_max_memory_allocated(device_index)

    def total_memory(self, device_index=None):
        if self._cuda:
            return torch.cuda.get_device_properties(device_index).total_memory
        import psutil
        return psutil.virtual_memory().total

    def available_memory(self, device_index=None):
        if self._cuda:
            free, _ = torch.cuda.mem_get_info(device_index)
            return free
        import psutil
        return psutil.virtual_memory().available

    def supported_dtypes(self):
        if not self._cuda:
            return [torch.float, torch.bfloat16]
        return [torch.float] + [torch.half] * self.is_fp16_supported() + [torch.bfloat16] * self.is_bf16_supported()

    def amp(self):
        return torch.cuda.amp if self._cuda else torch.cpu.amp

    def range_push(self, msg):
        if self._cuda:
            return torch.cuda.nvtx.range_push(msg)

    def range_pop(self):
        if self._cuda:
            return torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        return torch.cuda._lazy_call(callback) if self._cuda else callback()

    def is_triton_supported(self):
        return self._cuda and torch.cuda.get_device_capability()[0] >= 8

    def create_graph(self):
        return torch.cuda.CUDAGraph() if self._cuda else None

    def capture_to_graph(self, graph, pool=None, stream=None):
        import contextlib
        return torch.cuda.graph(graph, pool, stream) if self._cuda else contextlib.nullcontext()

    def replay_graph(self, graph):
        if self._cuda:
            graph.replay()

    def _tensor_type(self, dtype, cpu_type):
        if not self._cuda:
            return cpu_type
        import functools
        return functools.partial(torch.tensor, dtype=dtype, device="cuda")

    BFloat16Tensor = property(lambda self: self._tensor_type(torch.bfloat16, torch.BFloat16Tensor))
    ByteTensor = property(lambda self: self._tensor_type(torch.uint8, torch.ByteTensor))
    DoubleTensor = property(lambda self: self._tensor_type(torch.double, torch.DoubleTensor))
    FloatTensor = property(lambda self: self._tensor_type(torch.float, torch.FloatTensor))
    HalfTensor = property(lambda self: self._tensor_type(torch.half, torch.HalfTensor))
    IntTensor = property(lambda self: self._tensor_type(torch.int, torch.IntTensor))
    LongTensor = property(lambda self: self._tensor_type(torch.long, torch.LongTensor))

    def is_pinned(self, tensor):
        return tensor.is_pinned()

    def visible_devices_envs(self):
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env, local_accelerator_ids):
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self):
        return ["NCCL"] if self._cuda else []

    _compile_backend = "inductor"

    def get_compile_backend(self):
        return self._compile_backend

    def set_compile_backend(self, backend):
        self._compile_backend = backend

    def __getattr__(self, name):
        """DeepSpeed's accelerator names uckpt does not have (its op builders) are refused by name."""
        from uckpt.runtime import _deepspeed_names
        if not name.startswith("_") and name in _deepspeed_names.ACCELERATOR:
            raise NotImplementedError(f"get_accelerator().{name}: DeepSpeed 0.14.5's accelerator has '{name}' "
                                      "(its op builders: DeepSpeed's compiled kernels); uckpt does not support it")
        version = _deepspeed_names.later("ACCELERATOR", name) if not name.startswith("_") else None
        if version is not None:
            from uckpt._deepspeed_api import DeepSpeedVersionAttributeError, later_message
            raise DeepSpeedVersionAttributeError(later_message(f"get_accelerator().{name}", version))
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


_accelerator = None


def get_accelerator():
    global _accelerator
    if _accelerator is None:
        cpu = os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()
        _accelerator = _Accelerator("cpu" if cpu else "cuda")
    return _accelerator
