#!/usr/bin/env python3
"""Plain-PyTorch reference for uckpt's BERT masked-LM (src/models/bert.h).

The same model written with torch.nn (same parameter names, same operations in
the same order), the same masking rule (bit-identical masks: the SplitMix64
hash is written out below) and a training loop: AdamW in fp32 with optional
gradient clipping, initial weights from a torch.save state dict, token data
from a file of bytes cut into rows of --seq-len. Prints one line per optimizer
step: "step <k> loss <loss %.9g>".

Data rule: step s (0-based) trains on global samples s*B .. s*B+B-1; sample n
is row n mod N of the file (N = file size // seq_len) and is masked with
mask_batch(..., first_global_sample_index=s*B, seed=--mask-seed).

Runs on Debian's python3-torch 1.13 (and PyTorch 2.x); needs numpy only to
read the data file.
"""

import argparse
import math
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

NUM_BYTE_TOKENS = 256
MASK_TOKEN = 256
NUM_SPECIAL_TOKENS = 1
IGNORE_LABEL = -100

_U64 = (1 << 64) - 1


def splitmix64(x):
    z = (x + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _unit(x):
    # The top 53 bits as a double in [0, 1): exact, as in C++.
    return (x >> 11) * (2.0 ** -53)


def mask_batch(ids, first_global_sample_index, seed, select_prob=0.15, mask_prob=0.8, random_prob=0.1,
               mask_token=MASK_TOKEN, num_random_tokens=NUM_BYTE_TOKENS):
    """BERT masking of int64 [B, T] ids; returns (masked input, labels).

    Row b is global sample n = first_global_sample_index + b; its draws depend
    on (seed, n) only:
      key = splitmix64(splitmix64(seed) + n); r(k) = splitmix64(key + k)
      position t is selected iff u(r(3t)) < select_prob; if none is, position
      r(3T) mod T is; a selected position becomes mask_token if
      u(r(3t+1)) < mask_prob, else r(3t+2) mod num_random_tokens if
      u(r(3t+1)) < mask_prob + random_prob, else stays; its label is the id.
    """
    src = ids.tolist()
    B = len(src)
    T = len(src[0]) if B else 0
    inp = [row[:] for row in src]
    lab = [[IGNORE_LABEL] * T for _ in range(B)]
    seed_key = splitmix64(seed & _U64)
    for b in range(B):
        key = splitmix64((seed_key + first_global_sample_index + b) & _U64)

        def r(k, key=key):
            return splitmix64((key + k) & _U64)

        def apply(t, b=b, r=r):
            lab[b][t] = src[b][t]
            u = _unit(r(3 * t + 1))
            if u < mask_prob:
                inp[b][t] = mask_token
            elif u < mask_prob + random_prob:
                inp[b][t] = r(3 * t + 2) % num_random_tokens

        chosen = False
        for t in range(T):
            if _unit(r(3 * t)) < select_prob:
                apply(t)
                chosen = True
        if not chosen:
            apply(r(3 * T) % T)
    return torch.tensor(inp, dtype=torch.long), torch.tensor(lab, dtype=torch.long)


class Config:
    def __init__(self, n_layer, n_head, n_embd, vocab_size, n_positions, layer_norm_eps=1e-12,
                 initializer_range=0.02, dropout=0.0):
        if vocab_size < NUM_BYTE_TOKENS + NUM_SPECIAL_TOKENS:
            raise ValueError("vocab_size %d is too small: bytes and specials need %d" %
                             (vocab_size, NUM_BYTE_TOKENS + NUM_SPECIAL_TOKENS))
        if n_embd % n_head:
            raise ValueError("n_embd must be a multiple of n_head")
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.vocab_size, self.n_positions = vocab_size, n_positions
        self.layer_norm_eps, self.initializer_range, self.dropout = layer_norm_eps, initializer_range, dropout


class Embeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.n_embd)
        self.position_embeddings = nn.Embedding(c.n_positions, c.n_embd)
        self.LayerNorm = nn.LayerNorm(c.n_embd, eps=c.layer_norm_eps)
        self.register_buffer("position_ids", torch.arange(c.n_positions, dtype=torch.long).unsqueeze(0))


class SelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.query = nn.Linear(c.n_embd, c.n_embd)
        self.key = nn.Linear(c.n_embd, c.n_embd)
        self.value = nn.Linear(c.n_embd, c.n_embd)


class DenseNorm(nn.Module):
    def __init__(self, c, n_in):
        super().__init__()
        self.dense = nn.Linear(n_in, c.n_embd)
        self.LayerNorm = nn.LayerNorm(c.n_embd, eps=c.layer_norm_eps)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self = SelfAttention(c)
        self.output = DenseNorm(c, c.n_embd)


class Intermediate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c.n_embd, 4 * c.n_embd)


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention = Attention(c)
        self.intermediate = Intermediate(c)
        self.output = DenseNorm(c, 4 * c.n_embd)


class Encoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layer = nn.ModuleList([Layer(c) for _ in range(c.n_layer)])


class Bert(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embeddings = Embeddings(c)
        self.encoder = Encoder(c)


class Decoder(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight  # the embedding's Parameter itself (tied)


class Predictions(nn.Module):
    def __init__(self, c, word_embeddings_weight):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(c.vocab_size))
        self.transform = DenseNorm(c, c.n_embd)
        self.decoder = Decoder(word_embeddings_weight)


class Cls(nn.Module):
    def __init__(self, c, word_embeddings_weight):
        super().__init__()
        self.predictions = Predictions(c, word_embeddings_weight)


class BertMlm(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.bert = Bert(c)
        self.cls = Cls(c, self.bert.embeddings.word_embeddings.weight)

    def _dropout(self, x):
        return F.dropout(x, self.c.dropout, True) if self.c.dropout > 0 and self.training else x

    def encode(self, input_ids):
        c = self.c
        B, T = input_ids.shape
        H, D = c.n_head, c.n_embd // c.n_head
        scale = math.sqrt(D)
        e = self.bert.embeddings
        x = e.word_embeddings(input_ids) + e.position_embeddings(e.position_ids.narrow(1, 0, T))
        x = self._dropout(e.LayerNorm(x))
        for layer in self.bert.encoder.layer:
            att = layer.attention

            def heads(t):
                return t.view(B, T, H, D).transpose(1, 2)

            q, k, v = heads(att.self.query(x)), heads(att.self.key(x)), heads(att.self.value(x))
            probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / scale, -1)
            ctx = torch.matmul(self._dropout(probs), v).transpose(1, 2).reshape(B, T, c.n_embd)
            a = att.output.LayerNorm(self._dropout(att.output.dense(ctx)) + x)
            f = layer.output.dense(F.gelu(layer.intermediate.dense(a)))
            x = layer.output.LayerNorm(self._dropout(f) + a)
        return x

    def head(self, hidden):
        p = self.cls.predictions
        h = p.transform.LayerNorm(F.gelu(p.transform.dense(hidden)))
        return F.linear(h, p.decoder.weight, p.bias)

    def forward(self, input_ids):
        return self.head(self.encode(input_ids))

    def loss(self, input_ids, labels):
        hidden = self.encode(input_ids)
        flat = labels.reshape(-1)
        idx = torch.nonzero(flat.ne(IGNORE_LABEL)).squeeze(1)
        logits = self.head(hidden.reshape(-1, self.c.n_embd).index_select(0, idx))
        return F.cross_entropy(logits.float(), flat.index_select(0, idx))


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", required=True, help="torch.save state dict of the initial weights")
    ap.add_argument("--data", required=True, help="file of bytes (token ids 0-255)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--vocab-size", type=int, default=260)
    ap.add_argument("--n-positions", type=int, default=64)
    ap.add_argument("--layer-norm-eps", type=float, default=1e-12)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=0.0, help="max gradient norm; 0: no clipping")
    ap.add_argument("--mask-seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--masks-out", help="write each step's masked ids then labels here (int64 little-endian)")
    ap.add_argument("--print-params", action="store_true",
                    help='first print "param <name> <shape>" for each of named_parameters() (tied once), in order')
    a = ap.parse_args(argv)

    torch.set_num_threads(a.threads)
    cfg = Config(a.n_layer, a.n_head, a.n_embd, a.vocab_size, a.n_positions, a.layer_norm_eps, dropout=a.dropout)
    model = BertMlm(cfg)
    state = torch.load(a.init, map_location="cpu")
    model.load_state_dict(state, strict=True)
    emb = model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.weight is emb, "the decoder weight must stay tied"
    model.train()
    if a.print_params:
        for name, p in model.named_parameters():
            print("param %s %s" % (name, "x".join(str(d) for d in p.shape)))

    data = np.fromfile(a.data, dtype=np.uint8)
    n_rows = data.size // a.seq_len
    if n_rows == 0:
        sys.exit("%s: fewer than %d bytes" % (a.data, a.seq_len))
    rows = torch.from_numpy(data[: n_rows * a.seq_len].astype(np.int64)).view(n_rows, a.seq_len)

    params = list(model.parameters())  # each tensor once (the tied weight too)
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, weight_decay=a.weight_decay)
    masks_out = open(a.masks_out, "wb") if a.masks_out else None
    for s in range(a.steps):
        first = s * a.batch
        idx = torch.tensor([(first + b) % n_rows for b in range(a.batch)], dtype=torch.long)
        inp, lab = mask_batch(rows.index_select(0, idx), first, a.mask_seed)
        if masks_out:
            masks_out.write(inp.numpy().astype("<i8").tobytes())
            masks_out.write(lab.numpy().astype("<i8").tobytes())
        opt.zero_grad()
        loss = model.loss(inp, lab)
        loss.backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, a.clip)
        opt.step()
        print("step %d loss %.9g" % (s + 1, loss.item()), flush=True)
    if masks_out:
        masks_out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
