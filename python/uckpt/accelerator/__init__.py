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


_accelerator = None


def get_accelerator():
    global _accelerator
    if _accelerator is None:
        cpu = os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()
        _accelerator = _Accelerator("cpu" if cpu else "cuda")
    return _accelerator
