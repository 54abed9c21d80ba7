"""GPT-2 in plain PyTorch with uckpt's math and Hugging Face's parameter names.

Used by bench/gpt2_reference_loop.py (the fp32 loss cross-check) and
bench/torch_dp_bench.py (DDP + ZeroRedundancyOptimizer and FSDP2 throughput).

`fused=False` is the exact math of src/models/gpt2.cc (HF's eager attention,
gelu_new written out term by term), which is also what uckpt trains by
default. `fused=True` is uckpt's `--fused_kernels`: scaled_dot_product_attention
(flash / memory-efficient kernels) and the one-kernel tanh GELU; the same
function with different rounding.

Also: the synthetic data rule of shared/fixtures/refrun-gpt2 (splitmix64) and a
minimal safetensors reader (no dependency beyond numpy), so the reference can
start from a file written by `uckpt export`.
"""
import json
import math
import struct

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Conv1D(nn.Module):
    """y = x @ W + b with W stored [in, out] (HF's Conv1D layout)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        shape = x.shape[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(shape)


def gelu_written_out(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Attention(nn.Module):
    def __init__(self, n_embd, n_head, fused):
        super().__init__()
        self.c_attn = Conv1D(n_embd, 3 * n_embd)
        self.c_proj = Conv1D(n_embd, n_embd)
        self.n_head, self.fused = n_head, fused

    def forward(self, x):
        B, T, C = x.shape
        H = self.n_head
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        if self.fused:
            if hasattr(F, "scaled_dot_product_attention"):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # torch 1.13
                y = F._scaled_dot_product_attention(q, k, v, None, 0.0, False, True)[0]
        else:
            att = torch.matmul(q, k.transpose(-1, -2))
            att = att / torch.full([], (C // H) ** 0.5, dtype=att.dtype, device=att.device)
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = torch.where(causal, att, torch.full([], torch.finfo(att.dtype).min, dtype=att.dtype, device=x.device))
            y = torch.matmul(torch.softmax(att, dim=-1), v)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd, fused):
        super().__init__()
        self.c_fc = Conv1D(n_embd, 4 * n_embd)
        self.c_proj = Conv1D(4 * n_embd, n_embd)
        self.fused = fused

    def forward(self, x):
        h = self.c_fc(x)
        h = F.gelu(h, approximate="tanh") if self.fused else gelu_written_out(h)
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self, n_embd, n_head, fused):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = Attention(n_embd, n_head, fused)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.mlp = MLP(n_embd, fused)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, vocab_size, n_positions, fused):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(n_positions, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, fused) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)


class GPT2(nn.Module):
    """named_parameters() are HF's names in HF's (and DeepSpeed's flat) order."""

    def __init__(self, n_layer, n_head, n_embd, vocab_size, n_positions, fused=False):
        super().__init__()
        self.transformer = Transformer(n_layer, n_head, n_embd, vocab_size, n_positions, fused)

    def forward(self, ids):
        t = self.transformer
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        x = t.wte(ids) + t.wpe(pos)
        for blk in t.h:
            x = blk(x)
        return F.linear(t.ln_f(x), t.wte.weight)  # tied LM head

    def loss(self, ids):
        """HF's causal-LM loss with labels = ids, in fp32."""
        logits = self(ids)
        V = logits.shape[-1]
        return F.cross_entropy(logits[:, :-1, :].float().reshape(-1, V), ids[:, 1:].reshape(-1))


def gpt2_init_(model, n_layer, seed=1234, std=0.02):
    """GPT-2's init as uckpt's Gpt2Init: one CPU generator, parameters in order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                p.fill_(1.0 if name.endswith(".weight") else 0.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                s = std / math.sqrt(2.0 * n_layer) if name.endswith("c_proj.weight") else std
                p.copy_(torch.empty(p.shape).normal_(0.0, s, generator=g))


_MASK64 = (1 << 64) - 1


def splitmix64(x):
    """numpy uint64 array in, uint64 array out (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def synthetic_batch(seed, step, rows, seq_len, vocab, first_row=0):
    """token(s, i, t) = splitmix64(seed + s*1000003 + i*1009 + t) mod vocab, rows [first_row, +rows)."""
    i = np.arange(first_row, first_row + rows, dtype=np.uint64)[:, None]
    t = np.arange(seq_len, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        x = np.uint64(seed) + np.uint64(step) * np.uint64(1000003) + i * np.uint64(1009) + t
    return torch.from_numpy((splitmix64(x) % np.uint64(vocab)).astype(np.int64))


_ST_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64, "I32": np.int32}


def read_safetensors(path):
    """name -> torch tensor (F32/F64/F16/I64/I32; BF16 widened to fp32)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[base + a:base + b]
        if info["dtype"] == "BF16":
            arr = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=_ST_DTYPES[info["dtype"]])
        out[name] = torch.from_numpy(arr.copy()).reshape(info["shape"])
    return out


def load_weights_(model, tensors, path):
    """Copies every named parameter from `tensors`; errors name the file and the tensor."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in tensors:
                raise SystemExit(f"{path}: no tensor {name}")
            if tuple(tensors[name].shape) != tuple(p.shape):
                raise SystemExit(f"{path}: {name} has shape {tuple(tensors[name].shape)}, the model needs {tuple(p.shape)}")
            p.copy_(tensors[name])
