#!/usr/bin/env python3
"""Checkpoint save and resume: host memory and time on the CPU (#25), through DeepSpeed's Python API.

For each ZeRO stage asked for (3: parameters and optimizer offloaded; 2: optimizer offloaded), WORLD ranks build
a GPT-2-shaped model, train one step (so that Adam's moments exist), then per rank:
  save     engine.save_checkpoint (synchronous): seconds, RSS before, peak RSS during (VmHWM, reset just before
           the save through /proc/self/clear_refs), and last_save's snapshot bytes where the engine says them;
           then (rank 0) `cp -r` of the saved tag folder + `sync`: its seconds and the save's ratio to it;
  torch    torch.save of tensors of the same sizes as the rank's optimizer state (fp32 master, exp_avg,
           exp_avg_sq of its partition), fsynced as the checkpoint's files are, then torch.load of that file.
Then one process (a world of 1) builds the same model and resumes the checkpoint without converting it:
  resume   engine.load_checkpoint: seconds, RSS before, peak RSS during.
"partition" is what a rank's own state takes: 16-bit weights plus fp32 master, exp_avg and exp_avg_sq of its
partition (stage 3: of its parameters' partitions; the resume's rank holds them all).

    /usr/bin/python3 bench/ckpt_memory.py BUILD/python [--stages 3,2] [--layers 16] [--hidden 1024]
                                          [--vocab 8192] [--world 2] [--dtype bf16|fp32] [--dir DIR]

Prints one line per rank and phase and a JSON summary at the end ("RESULT {...}").
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def build_model(torch, layers, hidden, vocab):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(hidden)
            self.up = nn.Linear(hidden, 4 * hidden)
            self.down = nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, hidden)
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, ids):
            x = self.wte(ids)
            for b in self.blocks:
                x = b(x)
            logits = self.head(x).float()
            return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))

    return Model()


def config(stage, dtype):
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 10000000}
    if stage == 3:
        zero.update({"offload_param": {"device": "cpu"}, "stage3_prefetch_bucket_size": 10000000})
    c = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero}
    if dtype == "bf16":
        c["bf16"] = {"enabled": True}
    return c


def status_kb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def reset_peak():
    """VmHWM back to the current RSS (Linux >= 4.0), after handing freed heap memory back."""
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def gib(kb):
    return round(kb / (1 << 20), 3)


def timed_peak(fn):
    reset_peak()
    before = status_kb("VmRSS")
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t, before, status_kb("VmHWM")


def snapshot_bytes(engine):
    stats = getattr(engine, "last_save", None)
    stats = stats() if callable(stats) else stats
    return getattr(stats, "snapshot_bytes", None)


def worker(phase, stage, dtype, layers, hidden, vocab, ckpt):
    import torch
    import uckpt as deepspeed
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(1)
    model = build_model(torch, layers, hidden, vocab)
    numel = sum(p.numel() for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage, dtype))
    del model
    part = (numel + world - 1) // world  # elements of this rank's partition (within padding)
    half = 2 if dtype == "bf16" else 4
    out = {"rank": rank, "world": world, "stage": stage, "phase": phase, "params": numel,
           "partition_gib": round(part * (half + 12) / (1 << 30), 3)}
    if phase == "save":
        g = torch.Generator().manual_seed(rank)
        loss = engine(torch.randint(0, vocab, (1, 64), generator=g))
        engine.backward(loss)
        engine.step()
        torch.distributed.barrier()
        s, before, peak = timed_peak(lambda: engine.save_checkpoint(ckpt, tag="step1"))
        out.update(save_s=round(s, 3), save_rss_before_gib=gib(before), save_peak_gib=gib(peak),
                   save_extra_gib=gib(peak - before), snapshot_bytes=snapshot_bytes(engine),
                   threads=torch.get_num_threads())
        torch.distributed.barrier()
        if rank == 0:  # the disk's own speed for the same folder, in the same run
            copy = os.path.join(os.path.dirname(ckpt), "cp-copy")
            t = time.perf_counter()
            subprocess.run(["cp", "-r", os.path.join(ckpt, "step1"), copy], check=True)
            subprocess.run(["sync"], check=True)
            cp_s = time.perf_counter() - t
            folder_bytes = sum(os.path.getsize(os.path.join(copy, f)) for f in os.listdir(copy))
            subprocess.run(["rm", "-rf", copy], check=True)
            out.update(folder_gib=round(folder_bytes / (1 << 30), 3), cp_sync_s=round(cp_s, 3),
                       save_over_cp=round(out["save_s"] / cp_s, 2))
        torch.distributed.barrier()
        # torch.save / torch.load of tensors the size of this rank's optimizer state, fsynced.
        state = {k: torch.randn(part) for k in ("fp32", "exp_avg", "exp_avg_sq")}
        path = os.path.join(ckpt, f"torch_rank{rank}.pt")

        def save():
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        s, _, _ = timed_peak(save)
        del state
        out["torch_save_s"] = round(s, 3)
        s, before, peak = timed_peak(lambda: torch.load(path))
        out.update(torch_load_s=round(s, 3), torch_load_extra_gib=gib(peak - before))
        os.remove(path)
    else:
        s, before, peak = timed_peak(lambda: engine.load_checkpoint(ckpt, tag="step1"))
        out.update(resume_s=round(s, 3), resume_rss_before_gib=gib(before), resume_peak_gib=gib(peak),
                   resume_extra_gib=gib(peak - before))
    print("RESULT " + json.dumps(out), flush=True)
    torch.distributed.barrier()


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, phase, stage, world, ckpt):
    port = str(free_port())
    procs = []
    for r in range(world):
        env = dict(os.environ, PYTHONPATH=args.pythonpath, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DS_ACCELERATOR="cpu")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", phase, str(stage), args.dtype,
               str(args.layers), str(args.hidden), str(args.vocab), ckpt]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=3600)
        if p.returncode != 0:
            sys.stdout.write(out)
            sys.exit(f"FAIL: stage {stage} {phase}, rank {r} (output above)")
        results += [json.loads(l[len("RESULT "):]) for l in out.splitlines() if l.startswith("RESULT ")]
    for res in results:
        print(f"stage {stage} {phase} rank {res['rank']}/{res['world']}: " +
              ", ".join(f"{k} {v}" for k, v in res.items() if k not in ("rank", "world", "stage", "phase")),
              flush=True)
    return results


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        phase, stage, dtype, layers, hidden, vocab, ckpt = sys.argv[2:9]
        return worker(phase, int(stage), dtype, int(layers), int(hidden), int(vocab), ckpt)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pythonpath", help="where the uckpt package is (BUILD/python)")
    ap.add_argument("--stages", default="3,2")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    args = ap.parse_args()
    summary = {}
    for stage in [int(s) for s in args.stages.split(",")]:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            ckpt = os.path.join(tmp, "ckpt")
            os.makedirs(ckpt)
            saved = launch(args, "save", stage, args.world, ckpt)
            resumed = launch(args, "resume", stage, 1, ckpt)
            summary[f"stage{stage}"] = {"save": saved, "resume": resumed}
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
