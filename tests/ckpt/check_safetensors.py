"""Independent check of `uckpt export`: reads the safetensors file with plain
numpy (header length, JSON header, raw little-endian data), and compares every
tensor with torch.load of DeepSpeed's universal fp32.pt files.
Usage: check_safetensors.py UCKPT_BINARY SHARED_DIR SCRATCH_DIR"""
import json, os, struct, subprocess, sys
import numpy as np
import torch

uckpt, shared, scratch = sys.argv[1:4]
DT = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8:8 + n])
    data = b[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        s, t = e["data_offsets"]
        out[name] = np.frombuffer(data[s:t], dtype=DT[e["dtype"]]).reshape(e["shape"])
    return header.get("__metadata__", {}), out


def universal_fp32(folder, name):
    v = torch.load(os.path.join(folder, "zero", name, "fp32.pt"))
    return (v["param"] if isinstance(v, dict) else v).detach()


checked = 0
cases = [(f"{shared}/fixtures/deepspeed/{fx}/ckpt", f"{shared}/fixtures/deepspeed/{fx}/ckpt/global_step5_universal")
         for fx in sorted(os.listdir(f"{shared}/fixtures/deepspeed")) if fx.startswith("z")]
cases.append((f"{shared}/fixtures/refrun-gpt2/ckpt", f"{shared}/fixtures/refrun-gpt2/ckpt/global_step6_universal"))
for ckpt, universal in cases:
    for dtype in ("fp32", "bf16", "fp16"):
        out = os.path.join(scratch, f"check_{dtype}.safetensors")
        subprocess.run([uckpt, "export", "-q", ckpt, out, "--dtype", dtype], check=True)
        meta, tensors = read(out)
        model = torch.load([os.path.join(universal, f) for f in sorted(os.listdir(universal)) if f.endswith(".pt")][0],
                           map_location="cpu")
        for name in [n for g in model["param_shapes"] for n in g]:
            ref = universal_fp32(universal, name).reshape(model["param_shapes"][0].get(name, tensors[name].shape)
                                                          if len(model["param_shapes"]) == 1 else tensors[name].shape)
            if dtype == "bf16":
                ref = ref.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            elif dtype == "fp16":
                ref = ref.to(torch.float16).numpy()
            else:
                ref = ref.numpy()
            got = tensors[name]
            assert got.shape == ref.shape, (ckpt, name, got.shape, ref.shape)
            assert got.tobytes() == ref.tobytes(), (ckpt, dtype, name)
            checked += 1
        for alias, owner in (model.get("shared_params") or {}).items():
            assert meta.get(alias) == owner, (alias, meta)
print(f"ok: {checked} tensors equal torch's values")
