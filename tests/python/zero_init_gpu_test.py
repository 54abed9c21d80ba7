"""zero.Init on a GPU with offload_param: whole values gathered by GatheredParameters live on the GPU, as DeepSpeed's.

    zero_init_gpu_test.py PYPATH

Hugging Face's from_config / from_pretrained under ZeRO-3 initialise each weight inside
GatheredParameters(modifier_rank=0). DeepSpeed gathers into this rank's GPU even when the partitions are offloaded
to the CPU, so the initialisation draws from the GPU's generator and an offload run starts from the weights of a
run without offload. Checked on one rank: inside the block the parameter is on the GPU, and the weights a module
gets from an initialisation inside the block are the same with and without offload_param. Exit 77 without a GPU.
"""
import os
import socket
import sys


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def built_weights(deepspeed, torch, offload):
    zero = {"stage": 3}
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {"train_batch_size": 1, "bf16": {"enabled": True}, "zero_optimization": zero}
    with deepspeed.zero.Init(config_dict_or_path=config):
        layer = torch.nn.Linear(64, 32)
    devices = set()
    torch.manual_seed(0)
    torch.cuda.manual_seed(0)
    for p in layer.parameters():
        with deepspeed.zero.GatheredParameters(p, modifier_rank=0):
            devices.add(p.device.type)
            p.data.normal_(mean=0.0, std=0.02)  # transformers' _init_weights
    with deepspeed.zero.GatheredParameters(list(layer.parameters())):
        values = [p.detach().float().cpu().clone() for p in layer.parameters()]
    return devices, values


def main():
    sys.path.insert(0, sys.argv[1])
    import torch
    if not torch.cuda.is_available():
        print("SKIPPED: no GPU")
        sys.exit(77)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    import uckpt as deepspeed
    deepspeed.init_distributed()
    plain_devices, plain = built_weights(deepspeed, torch, offload=False)
    off_devices, off = built_weights(deepspeed, torch, offload=True)
    for what, devices in (("without offload", plain_devices), ("with offload_param", off_devices)):
        if devices != {"cuda"}:
            sys.exit(f"FAIL: {what}: GatheredParameters gave whole values on {sorted(devices)}, DeepSpeed's on cuda")
    for a, b in zip(plain, off):
        if not torch.equal(a, b):
            sys.exit(f"FAIL: the weights initialised inside GatheredParameters differ with offload_param "
                     f"(max {float((a - b).abs().max()):.3e})")
    print("ok   GatheredParameters gathers onto the GPU with offload_param; the same initialised weights")
    print("PASS")


if __name__ == "__main__":
    main()
