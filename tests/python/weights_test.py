#!/usr/bin/env python3
"""Weights alone through the Python engine, 2 CPU ranks, stages 2 and 3 (bf16), seconds.

usage: weights_test.py CASE PYTHONPATH_OF_UCKPT [SHARED_DIR (the deepspeed case)]

CASE:
  load  engine.load_weights of a safetensors file written here by a plain Python writer that
        follows the format's spec (or by the `safetensors` package when it is installed): the
        weights equal the file's values in bf16, missing/unexpected names come back as torch's
        _IncompatibleKeys, strict=True raises naming them, name_map= (a function) and
        strip_prefix= map the names.
  deepspeed  real DeepSpeed 0.14.5 (UCKPT_DEEPSPEED_SRC; else exit 77, skipped) and uckpt each
        save_16bit_model the same freshly initialised model at stages 2 and 3: the two
        pytorch_model.bin files hold the same type, keys in the same order, _metadata, dtypes
        and values.
  save  save_16bit_model to pytorch_model.bin (read by torch.load) and to model.safetensors
        (read by a plain reader, or the `safetensors` package): equal to the gathered weights;
        _zero3_consolidated_16bit_state_dict on rank 0 (None on rank 1) at stage 3, ValueError at
        stage 2; without stage3_gather_16bit_weights_on_model_save stage 3 saves nothing (False).
"""
import json
import os
import struct
import sys
import tempfile

import testkit
from testkit import fail

DTYPES = {"F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2)}


def launch(case, pypath, world, workdir):
    testkit.launch(__file__, case, pypath, world, [workdir], env={"PYTHONHASHSEED": "0"})


# ---- safetensors by its spec: u64 little-endian header size, JSON header, raw row-major data.

def write_safetensors(torch, path, tensors):
    try:
        import safetensors.torch
        safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, path)
        return
    except ImportError:
        pass
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(torch, path):
    """(tensors, metadata) by the spec, checking the tensors tile the data."""
    try:
        import safetensors
        with safetensors.safe_open(path, "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except ImportError:
        pass
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8:8 + n])
    data = b[8 + n:]
    meta = header.pop("__metadata__", {})
    out, end = {}, 0
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        s, t = e["data_offsets"]
        if s != end:
            fail(f"{path}: tensor {name} does not follow the one before it")
        end = t
        dtype = getattr(torch, DTYPES[e["dtype"]][0])
        out[name] = torch.frombuffer(bytearray(data[s:t]), dtype=torch.uint8).view(dtype).reshape(e["shape"])
    if end != len(data):
        fail(f"{path}: {len(data) - end} bytes after the last tensor")
    return out, meta


# ---------------------------------------------------------------- workers

def net(torch, seed):
    torch.manual_seed(seed)

    class Block(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 7)

        def forward(self, x):
            return torch.tanh(self.fc(x))

    class Net(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(4, 8)
            self.block = Block()
            self.out = torch.nn.Linear(7, 1)
            self.register_buffer("shift", torch.randn(4))

        def forward(self, x):
            x = (x + self.shift).to(self.inp.weight.dtype)
            return self.out(self.block(self.inp(x))).float().pow(2).mean()

    return Net()


def config(stage, gather=True):
    z = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if stage == 3:
        z["stage3_gather_16bit_weights_on_model_save"] = gather
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "torch_adam": True}}, "zero_optimization": z}


def whole_state(deepspeed, model):
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def file_values(torch):
    """The values of another seed's model, in several dtypes, under the state_dict names."""
    sd = net(torch, 7).state_dict()
    out = {k: v.clone() for k, v in sd.items()}
    out["inp.bias"] = out["inp.bias"].to(torch.bfloat16)
    out["out.weight"] = out["out.weight"].to(torch.float16)
    return out


def worker_load(deepspeed, torch, work):
    rank = torch.distributed.get_rank()
    values = file_values(torch)
    plain, prefixed, extra = (os.path.join(work, n) for n in ("plain.safetensors", "prefixed.safetensors",
                                                              "extra.safetensors"))
    if rank == 0:
        write_safetensors(torch, plain, values)
        write_safetensors(torch, prefixed, {"model." + k: v for k, v in values.items()})
        write_safetensors(torch, extra, dict({k: v for k, v in values.items() if k != "inp.bias"},
                                             **{"lm.extra": torch.ones(3)}))
    torch.distributed.barrier()
    for stage in (2, 3):
        model = net(torch, 0)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))

        def check(what):
            got = whole_state(deepspeed, model)
            for k, v in values.items():
                if not torch.equal(got[k], v.to(got[k].dtype)):
                    fail(f"stage {stage} {what}: {k} differs from the file's value")

        keys = engine.load_weights(plain)
        if list(keys.missing_keys) or list(keys.unexpected_keys):
            fail(f"stage {stage}: load_weights returned {keys}")
        check("plain file")
        print(f"ok   stage {stage}: load_weights gives the file's values (F32, BF16, F16 -> bf16)")

        model2 = net(torch, 0)
        engine2, _, _, _ = deepspeed.initialize(model=model2, model_parameters=model2.parameters(), config=config(stage))
        keys = engine2.load_weights(prefixed, name_map=lambda n: n[len("model."):] if n != "model.shift" else None,
                                    strict=False)
        if list(keys.missing_keys) != ["shift"] or list(keys.unexpected_keys):
            fail(f"stage {stage}: name_map skipping shift: {keys}")
        engine2.load_weights(prefixed, strip_prefix="model.")
        model, engine = model2, engine2
        check("name_map / strip_prefix")
        print(f"ok   stage {stage}: name_map (a function, None skips) and strip_prefix map the names")

        try:
            engine.load_weights(extra)
            fail(f"stage {stage}: strict load_weights accepted a file with a missing and an unexpected name")
        except RuntimeError as e:
            if 'Missing key(s) in state_dict: "inp.bias"' not in str(e) or '"lm.extra"' not in str(e):
                fail(f"stage {stage}: strict error does not name the names: {e}")
        keys = engine.load_weights(extra, strict=False)
        if list(keys.missing_keys) != ["inp.bias"] or list(keys.unexpected_keys) != ["lm.extra"]:
            fail(f"stage {stage}: strict=False returned {keys}")
        print(f"ok   stage {stage}: strict errors name the names; strict=False returns them")


def worker_save(deepspeed, torch, work):
    rank = torch.distributed.get_rank()
    for stage in (2, 3):
        model = net(torch, 0)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
        engine.backward(engine(torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))))
        engine.step()
        want = whole_state(deepspeed, model)
        d = os.path.join(work, f"stage{stage}")
        if engine.save_16bit_model(d) is not True or engine.save_16bit_model(d, "model.safetensors") is not True:
            fail(f"stage {stage}: save_16bit_model did not return True")
        torch.distributed.barrier()
        if rank == 0:
            got = torch.load(os.path.join(d, "pytorch_model.bin"))
            if list(got.keys()) != list(want.keys()):
                fail(f"stage {stage}: pytorch_model.bin keys {list(got.keys())}, the state_dict's {list(want.keys())}")
            for k, v in want.items():
                if got[k].dtype != v.dtype or not torch.equal(got[k], v):
                    fail(f"stage {stage}: pytorch_model.bin's {k} differs from the weights")
            tensors, _ = read_safetensors(torch, os.path.join(d, "model.safetensors"))
            if sorted(tensors) != sorted(want):
                fail(f"stage {stage}: model.safetensors holds {sorted(tensors)}")
            for k, v in want.items():
                if not torch.equal(tensors[k], v):
                    fail(f"stage {stage}: model.safetensors' {k} differs from the weights")
        print(f"ok   stage {stage}: save_16bit_model's .bin (torch.load) and .safetensors equal the weights")
        if stage == 3:
            if not engine.zero_gather_16bit_weights_on_model_save():
                fail("zero_gather_16bit_weights_on_model_save() is False with the config key set")
            sd = engine._zero3_consolidated_16bit_state_dict()
            if rank != 0 and sd is not None:
                fail("_zero3_consolidated_16bit_state_dict returned a dict on rank 1")
            if rank == 0 and (list(sd) != list(want) or any(not torch.equal(sd[k], v) for k, v in want.items())):
                fail("_zero3_consolidated_16bit_state_dict differs from the weights")
            model3 = net(torch, 0)
            engine3, _, _, _ = deepspeed.initialize(model=model3, model_parameters=model3.parameters(),
                                                    config=config(3, gather=False))
            if engine3.save_16bit_model(os.path.join(work, "nogather")) is not False:
                fail("stage 3 without stage3_gather_16bit_weights_on_model_save: save_16bit_model did not return False")
            if os.path.exists(os.path.join(work, "nogather", "pytorch_model.bin")):
                fail("stage 3 without the gather key wrote a file")
            print("ok   stage 3: consolidated state dict on rank 0; nothing saved without the gather key")
        else:
            try:
                engine._zero3_consolidated_16bit_state_dict()
                fail("stage 2: _zero3_consolidated_16bit_state_dict did not raise")
            except ValueError as e:
                if "requires ZeRO-3" not in str(e):
                    fail(f"stage 2: {e}")


def worker_parity(deepspeed, torch, work):
    """save_16bit_model of a fresh model at stages 2 and 3, by whichever package is `deepspeed`."""
    for stage in (2, 3):
        model = net(torch, 0)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
        if engine.save_16bit_model(os.path.join(work, f"stage{stage}")) is not True:
            fail(f"stage {stage}: save_16bit_model did not return True")


def worker(case, work):
    import torch
    if case == "parity_deepspeed":
        import deepspeed
        import ds_cpu_compat
        ds_cpu_compat.apply()
        deepspeed.init_distributed(dist_backend="gloo")
        case = "parity"
    else:
        import uckpt as deepspeed
        deepspeed.init_distributed()
    globals()["worker_" + case](deepspeed, torch, work)


def compare_with_deepspeed(pypath, src, scripts, work):
    import torch
    ours, theirs = os.path.join(work, "uckpt"), os.path.join(work, "deepspeed")
    launch("parity", pypath, 2, ours)
    ds_path = os.pathsep.join([src, os.path.join(scripts, "pyshim"), scripts])
    launch("parity_deepspeed", ds_path, 2, theirs)
    for stage in (2, 3):
        a = torch.load(os.path.join(ours, f"stage{stage}", "pytorch_model.bin"))
        b = torch.load(os.path.join(theirs, f"stage{stage}", "pytorch_model.bin"))
        where = f"stage {stage}: uckpt's pytorch_model.bin vs DeepSpeed's"
        if type(a) is not type(b) or list(a) != list(b):
            fail(f"{where}: {type(a).__name__} {list(a)} vs {type(b).__name__} {list(b)}")
        if getattr(a, "_metadata", None) != getattr(b, "_metadata", None):
            fail(f"{where}: _metadata {getattr(a, '_metadata', None)} vs {getattr(b, '_metadata', None)}")
        for k in a:
            if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k]):
                fail(f"{where}: {k} differs ({a[k].dtype} {tuple(a[k].shape)} vs {b[k].dtype} {tuple(b[k].shape)})")
        print(f"ok   stage {stage}: the same keys, order, _metadata, dtypes and values as DeepSpeed's save_16bit_model")


def main():
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return
    case, pypath = sys.argv[1], sys.argv[2]
    if case == "deepspeed":
        src = os.environ.get("UCKPT_DEEPSPEED_SRC", "")
        if not src or not os.path.isdir(os.path.join(src, "deepspeed")) or len(sys.argv) < 4:
            print("SKIPPED: set UCKPT_DEEPSPEED_SRC to a DeepSpeed 0.14.5 source tree")
            sys.exit(77)
        scripts = os.path.join(sys.argv[3], "fixtures", "deepspeed", "scripts")
        with tempfile.TemporaryDirectory() as work:
            compare_with_deepspeed(pypath, src, scripts, work)
        print("PASS deepspeed")
        return
    with tempfile.TemporaryDirectory() as work:
        launch(case, pypath, 2, work)
    print(f"PASS {case}")


if __name__ == "__main__":
    main()
