#!/usr/bin/env python3
"""zero.Init's memory on the CPU (#25): a GPT-2-shaped model built at WORLD ranks, whole and under
deepspeed.zero.Init, each in fresh processes.

Per rank it measures the peak RSS (VmHWM, /proc/self/status) from the start of the process to the end of the
model's construction, and the RSS before construction (torch, uckpt and the process group imported). Then both
builds train 3 steps at ZeRO stage 3 (the losses must be equal, bit for bit), and the zero.Init build loads
weights from a safetensors file with engine.load_weights (each gathered parameter must equal the file's).

    /usr/bin/python3 bench/zero_init_cpu.py PYTHONPATH [--layers 32] [--hidden 768] [--vocab 8192] [--world 4]
                                            [--check peak|growth|none]

--check peak (the default): peak RSS per rank under zero.Init <= 0.5 x the whole build's, and the model's whole
fp32 size >= 4 x one rank's partition; --check growth compares only what construction added to the RSS (for
small models, where torch's own import dominates the peak). The exit status is 0 when every check passes.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- The model (GPT-2's shape: token and position embeddings, pre-LN blocks, tied head). ----

def build_model(torch, layers, hidden, vocab, seq):
    nn = torch.nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(hidden, 3 * hidden)
            self.c_proj = nn.Linear(hidden, hidden)
            self.heads = max(1, hidden // 64)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.c_attn(x).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
            mask = torch.ones(t, t, dtype=torch.bool).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            return self.c_proj((att @ v).transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(hidden)
            self.attn = Attention()
            self.ln_2 = nn.LayerNorm(hidden)
            self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, hidden)
            self.wpe = nn.Embedding(seq, hidden)
            self.h = nn.ModuleList([Block() for _ in range(layers)])
            self.ln_f = nn.LayerNorm(hidden)
            self.apply(self._init_weights)  # GPT-2's initialisation, over modules already built

        @staticmethod
        def _init_weights(m):
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

        def forward(self, tokens):
            x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
            for block in self.h:
                x = block(x)
            logits = torch.nn.functional.linear(self.ln_f(x), self.wte.weight)  # the tied head
            return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    torch.manual_seed(0)
    return GPT()


def config():
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            # Buckets of 10M elements: DeepSpeed's default 500M would be a 2 GiB buffer on each of the ranks.
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 10000000, "stage3_prefetch_bucket_size": 10000000}}


# ---- safetensors, enough of it to write the file and read it back. ----

def write_safetensors(path, tensors):
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * 4
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors.values():
            f.write(t.contiguous().numpy().tobytes())


def read_safetensors(torch, path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        a, b = h["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[a:b]), dtype=torch.float32).view(h["shape"])
    return out


# ---- One rank. ----

def status_kb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def worker(build, layers, hidden, vocab, seq, weights):
    import torch
    import uckpt as deepspeed
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    # The process group's connections and buffers exist before the measurement, in both builds (its first
    # collectives set them up; initialize runs them anyway).
    torch.distributed.broadcast(torch.zeros(1 << 16), 0)
    torch.distributed.all_gather([torch.zeros(1 << 14) for _ in range(torch.distributed.get_world_size())],
                                 torch.zeros(1 << 14))
    before_kb = status_kb("VmRSS")
    if build == "zero_init":
        with deepspeed.zero.Init(config_dict_or_path=config()):
            model = build_model(torch, layers, hidden, vocab, seq)
    else:
        model = build_model(torch, layers, hidden, vocab, seq)
    peak_kb = status_kb("VmHWM")
    whole_numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    partition_numel = sum(p.ds_tensor.numel() for p in model.parameters()) if build == "zero_init" else whole_numel
    # After the measurement, glibc hands freed memory back at each step, so that the ranks' training fits
    # next to each other on one host (not needed for the result: RSS here is not measured).
    import ctypes
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    engine, *_ = deepspeed.initialize(model=model, config=config())
    trim(0)
    g = torch.Generator().manual_seed(100 + rank)
    losses, rss_mb = [], [status_kb("VmRSS") // 1024]
    for _ in range(3):
        loss = engine(torch.randint(0, vocab, (1, seq), generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        trim(0)
        rss_mb.append(status_kb("VmRSS") // 1024)
    if os.environ.get("ZERO_INIT_BENCH_VERBOSE"):
        print(f"rank {rank} {build}: RSS after initialize and each step (MiB) {rss_mb}", flush=True)
    weights_equal = None
    if build == "zero_init":
        engine.load_weights(weights)
        want = read_safetensors(torch, weights)
        weights_equal = True
        for name, p in model.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                weights_equal &= bool(torch.equal(p.detach(), want[name]))
    print("RESULT " + json.dumps({"rank": rank, "build": build, "before_kb": before_kb, "peak_kb": peak_kb,
                                  "whole_numel": whole_numel, "partition_numel": partition_numel,
                                  "losses": losses, "weights_equal": weights_equal}), flush=True)
    torch.distributed.barrier()


# ---- The driver. ----

def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_build(args, build, weights):
    port = str(free_port())
    procs = []
    for r in range(args.world):
        env = dict(os.environ, PYTHONPATH=args.pythonpath, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DS_ACCELERATOR="cpu")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", build, str(args.layers), str(args.hidden),
               str(args.vocab), str(args.seq), weights]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = {}
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=1800)
        for line in out.splitlines():
            if line.startswith("rank "):
                print(line)
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT "):])
                results[res["rank"]] = res
        if p.returncode != 0:
            sys.stdout.write(out)
            sys.exit(f"FAIL: the {build} build's rank {r} failed (output above)")
    return [results[r] for r in range(args.world)]


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        build, layers, hidden, vocab, seq, weights = sys.argv[2:8]
        return worker(build, int(layers), int(hidden), int(vocab), int(seq), weights)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pythonpath", help="where the uckpt package is (BUILD/python)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--check", choices=["peak", "growth", "none"], default="peak")
    args = ap.parse_args()

    import torch
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "model.safetensors")
        names = [(n, tuple(p.shape)) for n, p in build_model(torch, args.layers, args.hidden, args.vocab,
                                                            args.seq).named_parameters()]
        g = torch.Generator().manual_seed(7)
        write_safetensors(weights, {n: torch.randn(shape, generator=g) * 0.02 for n, shape in names})
        whole = run_build(args, "whole", weights)
        init = run_build(args, "zero_init", weights)

    mb = lambda kb: kb / 1024  # noqa: E731
    whole_mb = whole[0]["whole_numel"] * 4 / 2**20
    part_mb = max(r["partition_numel"] for r in init) * 4 / 2**20
    print(f"model: {args.layers} blocks of hidden {args.hidden}, vocab {args.vocab}: {whole[0]['whole_numel']} "
          f"parameters, {whole_mb:.0f} MiB whole in fp32; one rank's partition {part_mb:.0f} MiB "
          f"({whole_mb / part_mb:.2f}x) at {args.world} ranks")
    print("rank  RSS before (MiB)  whole peak  zero.Init peak  peak ratio  growth whole  growth zero.Init  "
          "growth ratio")
    peak_ratios, growth_ratios = [], []
    for w, z in zip(whole, init):
        gw, gz = w["peak_kb"] - w["before_kb"], z["peak_kb"] - z["before_kb"]
        peak_ratios.append(z["peak_kb"] / w["peak_kb"])
        growth_ratios.append(gz / gw)
        print(f"{w['rank']:4d}  {mb(z['before_kb']):16.0f}  {mb(w['peak_kb']):10.0f}  {mb(z['peak_kb']):14.0f}  "
              f"{peak_ratios[-1]:10.3f}  {mb(gw):12.0f}  {mb(gz):16.0f}  {growth_ratios[-1]:12.3f}")
    losses_equal = all(w["losses"] == z["losses"] for w, z in zip(whole, init))
    weights_equal = all(z["weights_equal"] for z in init)
    print(f"first 3 losses (rank 0): whole {whole[0]['losses']}, zero.Init {init[0]['losses']}: "
          f"{'equal bit for bit on every rank' if losses_equal else 'DIFFERENT'}")
    print(f"weights after engine.load_weights: {'equal to the file' if weights_equal else 'DIFFERENT from the file'}")

    failed = []
    if not losses_equal:
        failed.append("the first 3 losses differ")
    if not weights_equal:
        failed.append("loaded weights differ from the file")
    if args.check == "peak":
        if whole_mb < 4 * part_mb:
            failed.append(f"the model is {whole_mb / part_mb:.2f}x a partition, not >= 4x")
        if max(peak_ratios) > 0.5:
            failed.append(f"peak RSS ratio {max(peak_ratios):.3f} > 0.5")
    elif args.check == "growth" and max(growth_ratios) > 0.5:
        failed.append(f"construction's RSS growth ratio {max(growth_ratios):.3f} > 0.5")
    print("FAIL: " + "; ".join(failed) if failed else f"PASS (check: {args.check})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
