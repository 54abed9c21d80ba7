#!/usr/bin/env python3
"""Where a traced step's device time goes: reads a Chrome trace of torch's profiler
(`UCKPT_TRACE=PREFIX uckpt train ...` writes PREFIX.rank<r>.json; .json.gz is read too)
and prints, per step (the kernel time divided by --steps), each CUDA stream's busy time
and the kernels that took the most of it, with the host op that launched them.

usage: bench/trace_summary.py TRACE [--steps 3] [--top 25]
"""
import argparse
import collections
import gzip
import json


def load(path):
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d


def launching_ops(events):
    """correlation id -> the outermost host op around the kernel's launch."""
    ops = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[e["tid"]].append(e)
    out = {}
    for e in events:
        if e.get("cat") != "cuda_runtime" or "correlation" not in e.get("args", {}):
            continue
        around = [o for o in ops.get(e["tid"], []) if o["ts"] <= e["ts"] <= o["ts"] + o["dur"]]
        if around:
            out[e["args"]["correlation"]] = min(around, key=lambda o: o["ts"])["name"]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    events = load(a.trace)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        raise SystemExit(f"{a.trace}: no kernels in the trace")
    ops = launching_ops(events)
    per = 1000.0 * a.steps  # microseconds in the trace -> ms per step
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / per
    print(f"{a.trace}: {len(kernels)} kernels, {span:.2f} ms of trace per step ({a.steps} steps)")
    streams = collections.defaultdict(list)
    for e in kernels:
        streams[e["tid"]].append(e)
    for s, ks in sorted(streams.items(), key=lambda kv: -len(kv[1])):
        busy = sum(e["dur"] for e in ks) / per
        print(f"\nstream {s}: {busy:.2f} ms busy per step, {len(ks) / a.steps:.0f} kernels per step")
        by = collections.defaultdict(lambda: [0.0, 0])
        for e in ks:
            key = (e["name"][:90], ops.get(e.get("args", {}).get("correlation"), "?")[:60])
            by[key][0] += e["dur"]
            by[key][1] += 1
        for (name, op), (t, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[: a.top]:
            print(f"  {t / per:7.2f} ms {n / a.steps:6.0f}x  {name}  <- {op}")


if __name__ == "__main__":
    main()
