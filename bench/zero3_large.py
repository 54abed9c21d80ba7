"""A model larger than one rank at ZeRO stage 3, through DeepSpeed's API: `import deepspeed` or
`import uckpt as deepspeed` (--impl). One process per rank under a torchrun-style launcher.

The model is Llama-shaped (RMSNorm, rotary attention, SwiGLU MLP, untied head; written here in
plain torch so it needs no transformers). Phases, each timed on every rank (barrier before and
after), with the peak host RSS (VmHWM) and the peak GPU memory after each:
  construct  the model built under zero.Init (each parameter partitioned as its module is built)
  init       deepspeed.initialize (stage 3, parameters and optimizer offloaded to CPU)
  load       the weights from safetensors shards with Hugging Face's index (--shards):
             uckpt: engine.load_weights after initialize (each rank reads its partitions' bytes);
             DeepSpeed: Hugging Face's pattern before initialize (its fp32 master weights do not
             see GatheredParameters writes made after it): GatheredParameters(modifier_rank=0)
             module by module, rank 0 copying each tensor from the memory-mapped shard
  train      --steps steps on random tokens (the losses are printed)
  save       engine.save_checkpoint(--ckpt)
  save16     engine.save_16bit_model(--ckpt16, "pytorch_model.bin")
  resume     (--resume) instead of load/train/save: load_checkpoint(--ckpt) and one step
Prints one JSON line per rank at the end ("phases": seconds, host and GPU peaks per phase).
--write-shards PATH writes random bf16 weights of the model into safetensors shards and an
index (rank 0 of a single process, one tensor at a time) and exits.
"""
import argparse
import importlib
import json
import os
import struct
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["uckpt", "deepspeed"], default="uckpt")
    p.add_argument("--hidden", type=int, default=3200)
    p.add_argument("--intermediate", type=int, default=8640)
    p.add_argument("--layers", type=int, default=26)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--offload", type=int, default=1)
    p.add_argument("--shards", default="")
    p.add_argument("--ckpt", default="")
    p.add_argument("--ckpt16", default="")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--write-shards", default="")
    p.add_argument("--shard-bytes", type=int, default=2 << 30)
    p.add_argument("--local_rank", type=int, default=0)  # what DeepSpeed-style launchers pass
    return p.parse_args()


class RMSNorm(nn.Module):
    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


def rotary(x, pos):  # x: [b, h, s, d]
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos[:, None].float() * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def attention(q, k, v):
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = q.shape[-2]  # torch < 2 (the CPU check here)
    w = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    w = w.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return w.softmax(-1) @ v


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        h, i = a.hidden, a.intermediate
        self.heads = a.heads
        self.input_layernorm = RMSNorm(h)
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h)
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        y = self.input_layernorm(x)
        pos = torch.arange(s, device=x.device)
        q, k, v = (m(y).view(b, s, self.heads, -1).transpose(1, 2) for m in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rotary(q, pos), rotary(k, pos)
        att = attention(q, k, v).transpose(1, 2).reshape(b, s, h)
        x = x + self.o_proj(att)
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden)
        self.lm_head = nn.Linear(a.hidden, a.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed_tokens(tokens[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x)).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def shapes(a):
    """The model's parameter names and shapes, without building it."""
    h, i = a.hidden, a.intermediate
    out = [("embed_tokens.weight", (a.vocab, h))]
    for l in range(a.layers):
        pre = f"layers.{l}."
        out += [(pre + "input_layernorm.weight", (h,))]
        out += [(pre + n + ".weight", (h, h)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        out += [(pre + "post_attention_layernorm.weight", (h,)), (pre + "gate_proj.weight", (i, h)),
                (pre + "up_proj.weight", (i, h)), (pre + "down_proj.weight", (h, i))]
    return out + [("norm.weight", (h,)), ("lm_head.weight", (a.vocab, h))]


def write_shards(a):
    """Random bf16 weights as Hugging Face's sharded safetensors (written by hand: one tensor in memory)."""
    os.makedirs(a.write_shards, exist_ok=True)
    names = shapes(a)
    shards, cur, size = [], [], 0
    for name, shape in names:
        n = 2 * torch.Size(shape).numel()
        if cur and size + n > a.shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    shards.append(cur)
    weight_map, g = {}, torch.Generator().manual_seed(0)
    for k, items in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {}, 0
        for name, shape in items:
            n = 2 * torch.Size(shape).numel()
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        hb = json.dumps(header).encode()
        hb += b" " * (-len(hb) % 8)
        with open(os.path.join(a.write_shards, fname), "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb)
            for name, shape in items:
                std = 0.02 if len(shape) == 2 else 0.0
                t = (torch.randn(shape, generator=g) * std + (0.0 if len(shape) == 2 else 1.0)).to(torch.bfloat16)
                f.write(t.view(torch.int16).numpy().tobytes())
    total = sum(2 * torch.Size(s).numel() for _, s in names)
    with open(os.path.join(a.write_shards, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    print(f"wrote {len(shards)} shards, {total / 1e9:.2f} GB, {sum(torch.Size(s).numel() for _, s in names) / 1e9:.3f}B "
          f"parameters into {a.write_shards}")


class ShardReader:
    """Tensors of a sharded safetensors folder, memory-mapped (for DeepSpeed's side of the load)."""

    def __init__(self, index_dir):
        self.dir = index_dir
        self.map = json.load(open(os.path.join(index_dir, "model.safetensors.index.json")))["weight_map"]
        self.files = {}

    def get(self, name):
        fname = self.map[name]
        if fname not in self.files:
            path = os.path.join(self.dir, fname)
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(n))
            data = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
            self.files[fname] = (header, 8 + n, data)
        header, base, data = self.files[fname]
        e = header[name]
        b, c = e["data_offsets"]
        return data[base + b: base + c].view(torch.bfloat16).view(e["shape"])


def host_peak_gib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def host_now_gib():
    """The resident set now, by kind (anonymous, file pages, shared), and what torch's pinned allocator holds."""
    now = {}
    for line in open("/proc/self/status"):
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            now[key] = round(int(line.split()[1]) / 2**20, 3)
    try:
        now["torch_pinned"] = round(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) / 2**30, 3)
    except Exception:  # no CUDA, or a torch without host_memory_stats
        pass
    return now


def main():
    a = parse()
    if a.write_shards:
        write_shards(a)
        return
    ds = importlib.import_module("uckpt" if a.impl == "uckpt" else "deepspeed")
    if a.impl == "deepspeed" and os.environ.get("DS_CPU_COMPAT"):  # real DeepSpeed on a CPU (the fixtures' shims)
        sys.path.insert(0, os.environ["DS_CPU_COMPAT"])
        importlib.import_module("ds_cpu_compat").apply()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    ds.init_distributed()
    off = {"device": "cpu", "pin_memory": True}
    cfg = {"train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "steps_per_print": 1000000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    if os.environ.get("DS_CPU_COMPAT") and not a.offload:
        cfg["optimizer"]["params"]["torch_adam"] = True  # no JIT-built FusedAdam on a CPU
    if a.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if a.offload:
        cfg["zero_optimization"].update({"offload_param": off, "offload_optimizer": off})
    phases, peaks = {}, {}

    def barrier():
        if world > 1:
            torch.distributed.barrier()
        if cuda:
            torch.cuda.synchronize()

    class phase:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            barrier()
            self.t = time.perf_counter()

        def __exit__(self, *exc):
            if exc[0] is None:
                barrier()
                phases[self.name] = round(time.perf_counter() - self.t, 3)
                peaks[self.name] = {"host_gib": round(host_peak_gib(), 3), "host_now_gib": host_now_gib(),
                                    "gpu_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3) if cuda else 0}
                if rank == 0:
                    print(f"{a.impl} {world} rank(s): {self.name} {phases[self.name]:.2f} s, host peak "
                          f"{peaks[self.name]['host_gib']:.2f} GiB, GPU {peaks[self.name]['gpu_gib']:.2f} GiB, now "
                          f"{peaks[self.name]['host_now_gib']}", flush=True)

    with phase("construct"):
        prof = None
        if os.environ.get("PROFILE_CONSTRUCT") and rank == 0:  # where construction's time goes (rank 0)
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        with ds.zero.Init(config_dict_or_path=cfg):
            model = Llama(a)
        if prof:
            prof.disable()
            import pstats
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    nparams = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    if a.shards and not a.resume and a.impl == "deepspeed":
        # Hugging Face's from_pretrained order under ZeRO-3: the weights go into the partitioned model before
        # initialize, whose fp32 master weights are made from them (DeepSpeed's masters do not see writes made
        # through GatheredParameters after initialize).
        with phase("load"):
            reader = ShardReader(a.shards) if rank == 0 else None
            for name, module in model.named_modules():
                own = list(module.parameters(recurse=False))
                if not own:
                    continue
                with ds.zero.GatheredParameters(own, modifier_rank=0):
                    if rank == 0:
                        with torch.no_grad():
                            for pname, p in module.named_parameters(recurse=False):
                                p.copy_(reader.get((name + "." if name else "") + pname))
    with phase("init"):
        engine, _, _, _ = ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dev = engine.device if hasattr(engine, "device") else torch.device("cuda" if cuda else "cpu")
    g = torch.Generator().manual_seed(1234 + rank)
    batch = lambda: torch.randint(0, a.vocab, (a.micro, a.seq + 1), generator=g).to(dev)
    losses = []
    if a.resume:
        with phase("resume"):
            engine.load_checkpoint(a.ckpt)
        with phase("train"):
            loss = engine(batch())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    else:
        if a.shards and a.impl == "uckpt":
            with phase("load"):  # uckpt's direct path: into the running engine, masters included
                engine.load_weights(a.shards)
        with phase("train"):
            for _ in range(a.steps):
                loss = engine(batch())
                engine.backward(loss)
                engine.step()
                losses.append(round(loss.item(), 5))
        if a.ckpt:
            with phase("save"):
                engine.save_checkpoint(a.ckpt)
            # What is left to make the files durable: both saves return with their files in the page
            # cache (uckpt syncs them on a background thread): the same measure for both.
            with phase("save_sync"):
                os.sync()
        if a.ckpt16:
            with phase("save16"):
                engine.save_16bit_model(a.ckpt16, "pytorch_model.bin")
    unit = sum(torch.Size(sh).numel() for n, sh in shapes(a) if n.startswith("layers.0."))
    print(json.dumps({"impl": a.impl, "rank": rank, "world": world, "params": nparams, "unit_params": unit, "phases": phases,
                      "peaks": peaks, "losses": losses}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
