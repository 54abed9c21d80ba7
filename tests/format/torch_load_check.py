#!/usr/bin/python3
"""Checks uckpt's torch files against real PyTorch, both ways.

1. Runs write_samples, which writes files with our writer plus a JSON
   description of each (the fixture manifest schema), and every fixture read
   and written again. Every file must parse with Python's zipfile (CRCs too)
   in torch's record layout; every file must load with
   torch.load(weights_only=True) and match its description: values, dtypes,
   shapes, strides, offsets, and storage sharing (data_ptr).
   Torch 1.13's restricted unpickler refuses some things our writer emits for
   ordinary values (BINFLOAT for Python floats, torch.device, bytes, ...). A
   refusal is accepted only when its message names such a construct and that
   construct is in the file's pickle; the file is then loaded with
   weights_only=False (safe: we wrote it) and compared the same way.
   Files that need _rebuild_tensor_v3 (uint16/32/64, float8) are checked by a
   torch-free reader here when this torch lacks those types (1.13), and said so.
2. Saves objects with torch.save and checks `uckpt inspect --json` against
   what torch says they are (with --uckpt).

Exit status 0 only if every check passed.
"""

import argparse
import collections
import hashlib
import io
import json
import math
import os
import pickle
import pickletools
import re
import shutil
import struct
import subprocess
import sys
import zipfile

import numpy as np
import torch

HAS_V3 = hasattr(torch._utils, "_rebuild_tensor_v3") and hasattr(torch, "uint16")

# Fields of a tensor node that describe the file (what our writer chose), not
# the value torch loads; torch cannot tell us these.
FILE_FIELDS = {"storage_class", "storage_numel", "storage_location", "rebuild"}

# What torch's weights_only unpickler refuses although our writer emits it for
# ordinary data: opcodes (name -> the number its message gives) and globals.
# torch 1.13 refuses all of these; torch 2.x only LONG4, bytes() and sets.
REFUSED_OPCODES = {"BINFLOAT": 71, "LONG4": 139}
REFUSED_GLOBALS = {
    "torch.device", "_codecs.encode", "__builtin__.bytes", "__builtin__.bytearray", "__builtin__.set",
    "__builtin__.frozenset", "__builtin__.complex", "torch.bfloat16", "torch.bool", "torch.uint8",
    "torch._tensor._rebuild_from_type_v2",
}

failures = []


def torch_keeps_tensor_attrs():
    """torch 1.13's _rebuild_from_type_v2 drops the attribute dict when the
    type is torch.Tensor; later versions set the attributes."""
    t = torch._tensor._rebuild_from_type_v2(lambda: torch.zeros(1), torch.Tensor, (), {"probe": 1})
    return getattr(t, "probe", None) == 1


KEEPS_ATTRS = torch_keeps_tensor_attrs()


def without_attrs(node):
    """`node` with the tensor attribute dicts removed."""
    if isinstance(node, dict):
        return {k: without_attrs(v) for k, v in node.items() if not (k == "attrs" and node.get("type") == "tensor")}
    if isinstance(node, list):
        return [without_attrs(v) for v in node]
    return node


def fail(msg):
    failures.append(msg)
    print("FAIL: " + msg)


# ---- Describing torch objects in the manifest schema ------------------------

def float_node(x):
    return {"type": "float", "value": repr(x), "bits": struct.pack(">d", x).hex()}


def num(x):
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def storage_of(t):
    s = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    return s.data_ptr(), s.nbytes()


def le_bytes(t):
    t = t.detach().contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy().tobytes()


UNSIGNED = {"uint16": "<u2", "uint32": "<u4", "uint64": "<u8"}


def tensor_values(t, name):
    flat = t.detach().reshape(-1)
    if name == "bool":
        return [bool(x) for x in flat.tolist()]
    if name in UNSIGNED:
        return [int(x) for x in np.frombuffer(le_bytes(t), dtype=UNSIGNED[name])]
    if t.is_complex():
        return [[num(z.real), num(z.imag)] for z in flat.tolist()]
    if t.is_floating_point():
        return [num(x) for x in flat.double().tolist()]
    return [int(x) for x in flat.tolist()]


def tensor_node(t, requires_grad=None):
    name = str(t.dtype).replace("torch.", "")
    ptr, nbytes = storage_of(t)
    raw = le_bytes(t)
    node = {
        "type": "tensor", "dtype": name, "shape": list(t.shape), "stride": list(t.stride()),
        "storage_offset": t.storage_offset(),
        "requires_grad": t.requires_grad if requires_grad is None else requires_grad,
        "numel": t.numel(), "storage_nbytes": nbytes,
        "sha256_of_contiguous_le_bytes": hashlib.sha256(raw).hexdigest(),
        "storage_key": ("ptr", ptr, nbytes),
    }
    if t.numel() <= 64:
        node["values"] = tensor_values(t, name)
    attrs = {k: v for k, v in vars(t).items()} if hasattr(t, "__dict__") else {}
    if attrs:
        node["attrs"] = {"type": "dict", "items": [[describe(k), describe(v)] for k, v in attrs.items()]}
    return node


def describe(x):
    if x is None:
        return {"type": "none"}
    if isinstance(x, bool):
        return {"type": "bool", "value": x}
    if isinstance(x, int):
        return {"type": "int", "value": str(x)}
    if isinstance(x, float):
        return float_node(x)
    if isinstance(x, complex):
        return {"type": "complex", "real": float_node(x.real), "imag": float_node(x.imag)}
    if isinstance(x, str):
        node = {"type": "str", "value": x}
        if not x.isascii():
            node["utf8_hex"] = x.encode("utf-8", "surrogatepass").hex()
        return node
    if isinstance(x, bytearray):
        return {"type": "bytearray", "hex": bytes(x).hex()}
    if isinstance(x, bytes):
        return {"type": "bytes", "hex": x.hex()}
    if isinstance(x, torch.Size):
        return {"type": "torch.Size", "value": list(x)}
    if isinstance(x, torch.device):
        return {"type": "torch.device", "value": str(x)}
    if isinstance(x, torch.dtype):
        return {"type": "torch.dtype", "value": str(x).replace("torch.", "")}
    if isinstance(x, torch.nn.Parameter):
        node = {"type": "parameter", "requires_grad": x.requires_grad, "tensor": tensor_node(x.data, False)}
        return node
    if isinstance(x, torch.Tensor):
        return tensor_node(x)
    if isinstance(x, (list, tuple, set, frozenset)):
        kind = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}[type(x)]
        return {"type": kind, "items": [describe(i) for i in x]}
    if isinstance(x, dict):
        ordered = type(x) is collections.OrderedDict
        node = {"type": "ordered_dict" if ordered else "dict",
                "items": [[describe(k), describe(v)] for k, v in x.items()]}
        state = vars(x) if ordered and hasattr(x, "__dict__") else {}
        if state:
            node["state"] = {"type": "dict", "items": [[describe(k), describe(v)] for k, v in state.items()]}
        return node
    raise TypeError(f"cannot describe {type(x)}")


# ---- Comparing a description (ours) with what torch says ---------------------

class Comparer:
    """Compares our JSON (`ours`) with a torch description (`theirs`). Storage
    keys must map one-to-one onto storage data pointers (sharing)."""

    def __init__(self):
        self.diffs = []
        self.key_to_ptr = {}
        self.ptr_to_key = {}

    def same_number(self, a, b):
        if isinstance(a, bool) or isinstance(b, bool):
            return type(a) is type(b) and a == b
        if isinstance(a, float) or isinstance(b, float):
            return isinstance(a, float) and isinstance(b, float) and repr(a) == repr(b)
        return a == b

    def compare(self, ours, theirs, path="$"):
        if len(self.diffs) > 20:
            return
        if isinstance(theirs, tuple) and theirs and theirs[0] == "ptr":
            _, ptr, nbytes = theirs
            if nbytes == 0:
                return  # empty storages have no address to share
            k = self.key_to_ptr.setdefault(ours, ptr)
            p = self.ptr_to_key.setdefault(ptr, ours)
            if k != ptr:
                self.diffs.append(f"{path}: storage '{ours}' is not shared in torch")
            if p != ours:
                self.diffs.append(f"{path}: storages '{p}' and '{ours}' share memory in torch")
            return
        if isinstance(ours, dict) and isinstance(theirs, dict):
            keys_ours = set(ours) - FILE_FIELDS
            keys_theirs = set(theirs) - FILE_FIELDS
            if keys_ours != keys_theirs:
                self.diffs.append(f"{path}: keys differ: ours only {sorted(keys_ours - keys_theirs)}, "
                                  f"torch only {sorted(keys_theirs - keys_ours)}")
            is_set = ours.get("type") in ("set", "frozenset")
            for k in sorted(keys_ours & keys_theirs):
                if is_set and k == "items":
                    self.compare_set(ours[k], theirs[k], f"{path}.items")
                else:
                    self.compare(ours[k], theirs[k], f"{path}.{k}")
            return
        if isinstance(ours, list) and isinstance(theirs, list):
            if len(ours) != len(theirs):
                self.diffs.append(f"{path}: {len(ours)} items in ours, {len(theirs)} in torch")
                return
            for i, (a, b) in enumerate(zip(ours, theirs)):
                self.compare(a, b, f"{path}[{i}]")
            return
        if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)):
            if not self.same_number(ours, theirs):
                self.diffs.append(f"{path}: ours {ours!r}, torch {theirs!r}")
            return
        if ours != theirs or type(ours) is not type(theirs):
            self.diffs.append(f"{path}: ours {str(ours)[:100]!r}, torch {str(theirs)[:100]!r}")

    def compare_set(self, ours, theirs, path):
        if len(ours) != len(theirs):
            self.diffs.append(f"{path}: set sizes differ")
            return
        left = list(theirs)
        for item in ours:
            for j, cand in enumerate(left):
                c = Comparer()
                c.compare(item, cand)
                if not c.diffs:
                    del left[j]
                    break
            else:
                self.diffs.append(f"{path}: {json.dumps(item)[:100]} not in torch's set")


def compare(ours, theirs):
    c = Comparer()
    c.compare(ours, theirs)
    return c.diffs


# ---- Files: zip layout and pickle contents --------------------------------------

def check_layout(path, archive):
    """Parses `path` with zipfile (CRCs included) and checks torch's record
    layout. Returns the data.pkl bytes."""
    with zipfile.ZipFile(path) as zf:
        bad = zf.testzip()
        if bad is not None:
            fail(f"{path}: zipfile reports a bad CRC in {bad}")
        names = [i.filename for i in zf.infolist()]
        storages = sorted((n for n in names if n.startswith(archive + "/data/")), key=lambda n: int(n.rsplit("/", 1)[1]))
        want = [f"{archive}/{n}" for n in ("data.pkl", ".format_version", ".storage_alignment", "byteorder")]
        want += [f"{archive}/data/{k}" for k in range(len(storages))]
        want += [f"{archive}/version", f"{archive}/.data/serialization_id"]
        if names != want:
            fail(f"{path}: records {names}, expected {want}")
        with open(path, "rb") as f:
            raw = f.read()
        for info in zf.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                fail(f"{path}: {info.filename} is compressed")
            h = info.header_offset
            name_len, extra_len = struct.unpack("<HH", raw[h + 26:h + 30])
            start = h + 30 + name_len + extra_len
            if start % 64:
                fail(f"{path}: {info.filename} data starts at {start}, not a multiple of 64")
        return zf.read(f"{archive}/data.pkl")


def pickle_contents(data):
    """Opcode names and GLOBAL names (module.name) in a pickle."""
    ops, globals_ = set(), set()
    strings = []
    for op, arg, _ in pickletools.genops(data):
        ops.add(op.name)
        if op.name == "GLOBAL":
            globals_.add(arg.replace(" ", "."))
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE"):
            strings.append(arg)
        if op.name == "STACK_GLOBAL" and len(strings) >= 2:
            globals_.add(f"{strings[-2]}.{strings[-1]}")
    return ops, globals_


def refusal_reason(message):
    """What a weights_only refusal names: ("operand", 71) or ("global",
    "__builtin__.bytes"), or None. torch 1.13 says "Unsupported class
    __builtin__.bytes"; torch 2.x "Unsupported global: GLOBAL bytes was not an
    allowed global" (with Python 3 builtins names)."""
    m = re.search(r"Unsupported operand (\d+)", message)
    if m:
        return ("operand", int(m.group(1)))
    m = re.search(r"Unsupported class (\S+)", message) or re.search(r"Unsupported global: GLOBAL (\S+)", message)
    if m:
        name = m.group(1)
        if "." not in name:
            name = "__builtin__." + name
        elif name.startswith("builtins."):
            name = "__builtin__." + name[len("builtins."):]
        return ("global", name)
    return None


def refusal_is_documented(reason, ops, globals_):
    """True if a weights_only refusal names a construct in REFUSED_* that the
    pickle really contains."""
    if reason is None:
        return False
    kind, what = reason
    if kind == "operand":
        return any(what == REFUSED_OPCODES[o] for o in ops if o in REFUSED_OPCODES)
    return what in REFUSED_GLOBALS and what in globals_


def load_and_compare(path, archive, ours, label, report):
    """torch.load(weights_only=True), or weights_only=False after a documented
    refusal; compare with `ours`."""
    data = check_layout(path, archive)
    ops, globals_ = pickle_contents(data)
    if "torch._utils._rebuild_tensor_v3" in globals_ and not HAS_V3:
        report["skipped_v3"].append(label)
        check_v3_without_torch(path, archive, ours, label)
        return
    how = "weights_only=True"
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - the message is what we check
        reason = refusal_reason(str(e))
        if not refusal_is_documented(reason, ops, globals_):
            fail(f"{label}: weights_only=True refused it for an undocumented reason: {str(e) or repr(e)}")
            return
        report["weights_only_false"].append((label, f"{reason[0]} {reason[1]}"))
        how = "weights_only=False"
        obj = torch.load(path, map_location="cpu", weights_only=False)
    if not KEEPS_ATTRS and "torch._tensor._rebuild_from_type_v2" in globals_:
        report["attrs_dropped"].append(label)
        ours = without_attrs(ours)
    diffs = compare(ours, describe(obj))
    if diffs:
        fail(f"{label} ({how}) differs from its description:\n  " + "\n  ".join(diffs[:15]))
    else:
        report["ok"].append((label, how))


# ---- v3 dtypes without torch support --------------------------------------------

F8 = {"float8_e4m3fn": (4, 3, 7), "float8_e5m2": (5, 2, 15)}
V3_NUMPY = {"uint16": "<u2", "uint32": "<u4", "uint64": "<u8", "float8_e4m3fn": "u1", "float8_e5m2": "u1"}


def float8(b, name):
    e_bits, m_bits, bias = F8[name]
    sign = -1.0 if b & 0x80 else 1.0
    e = (b >> m_bits) & ((1 << e_bits) - 1)
    m = b & ((1 << m_bits) - 1)
    if name == "float8_e4m3fn" and e == 15 and m == 7:
        return math.nan
    if name == "float8_e5m2" and e == 31:
        return math.nan if m else sign * math.inf
    if e == 0:
        return sign * math.ldexp(m, 1 - bias - m_bits)
    return sign * math.ldexp(m + (1 << m_bits), e - bias - m_bits)


class _V3Tensor:
    def __init__(self, raw, dtype, offset, size, stride):
        self.raw, self.dtype, self.offset, self.size, self.stride = raw, dtype, offset, size, stride


def check_v3_without_torch(path, archive, ours, label):
    """Reads a v3 file with a restricted unpickler (nothing imported or called
    but the rebuild stubs here) and compares elements gathered by numpy."""
    zf = zipfile.ZipFile(path)

    class Stub(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
                return lambda storage, offset, size, stride, grad, hooks, dtype, *m: _V3Tensor(
                    storage, dtype, offset, size, stride)
            if (module, name) == ("collections", "OrderedDict"):
                return collections.OrderedDict
            if module == "torch" and name in V3_NUMPY:
                return name
            if (module, name) == ("torch.storage", "UntypedStorage"):
                return "UntypedStorage"
            raise pickle.UnpicklingError(f"unexpected global {module}.{name}")

        def persistent_load(self, pid):
            return zf.read(f"{archive}/data/{pid[2]}")

    root = Stub(io.BytesIO(zf.read(f"{archive}/data.pkl"))).load()
    if ours["type"] == "tensor":
        pairs = [("root", ours, root)]
    else:
        pairs = [(k["value"], v, root[k["value"]]) for k, v in ours["items"]]
    for where, value_node, t in pairs:
        elems = np.frombuffer(t.raw, dtype=V3_NUMPY[t.dtype])
        item = elems.itemsize
        view = np.lib.stride_tricks.as_strided(elems[t.offset:], shape=t.size,
                                               strides=[s * item for s in t.stride])
        flat = np.ascontiguousarray(view).reshape(-1)
        got = {"dtype": t.dtype, "shape": list(t.size), "stride": list(t.stride), "storage_offset": t.offset,
               "sha256_of_contiguous_le_bytes": hashlib.sha256(flat.tobytes()).hexdigest(),
               "values": [num(float8(int(b), t.dtype)) if t.dtype in F8 else int(b) for b in flat]}
        for k, v in got.items():
            c = Comparer()
            c.compare(value_node[k], v)
            if c.diffs:
                fail(f"{label}: {where}.{k}: {c.diffs}")


# ---- torch.save -> uckpt inspect ------------------------------------------------

def torch_saved_objects():
    torch.manual_seed(0)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return {
        "tensors": {
            "f32": base, "t": base.t(), "block": base[1:, 1:3], "zero_dim": torch.tensor(2.5),
            "empty": torch.zeros(2, 0, 3, dtype=torch.int64), "bf16": (base / 3).to(torch.bfloat16),
            "f16": (base * 100).half(), "f64": base.double() / 7, "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
            "bool": torch.tensor([True, False]), "c64": torch.complex(base[0], base[1]),
            "grad": torch.ones(3, requires_grad=True), "big": torch.arange(5000, dtype=torch.float32).reshape(50, 100).t(),
        },
        "state_dict": model.state_dict(),
        "parameter": torch.nn.Parameter(base.clone()),
        "optimizer": opt.state_dict(),
        "containers": {
            "ints": [0, -1, 2**31, 2**63, -(2**63) - 1, 2**64, 2**300], "floats": [0.1, -0.0, float("inf"), 5e-324],
            "str": ["", "héllo", "日本", "a\0b"], "bytes": [b"", b"\x00\xff"], "set": {1, 2}, "fs": frozenset(["x"]),
            "size": torch.Size([2, 3]), "device": torch.device("cuda", 1), "dtype": torch.bfloat16,
            "nested": {(1, 2): [None, True, (3,)], 5: collections.OrderedDict(a=1)},
        },
    }


def check_inspect(uckpt, work, report):
    objs = torch_saved_objects()
    for name, obj in objs.items():
        for proto in (2, 4):
            path = os.path.join(work, f"torch_saved_{name}_p{proto}.pt")
            torch.save(obj, path, pickle_protocol=proto)
            r = subprocess.run([uckpt, "inspect", "--json", path], capture_output=True, text=True)
            label = f"torch.save({name}, protocol {proto})"
            if r.returncode != 0:
                fail(f"{label}: uckpt inspect failed: {r.stderr.strip()}")
                continue
            diffs = compare(json.loads(r.stdout), describe(obj))
            if diffs:
                fail(f"{label}: uckpt inspect --json differs from torch:\n  " + "\n  ".join(diffs[:15]))
            else:
                report["inspect_ok"].append(label)


# ---- Main -----------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write-samples",
                    help="the write_samples binary; without it, check the files already in --work")
    ap.add_argument("--fixtures", nargs="*", default=[], help="fixture folders to round-trip")
    ap.add_argument("--work", required=True, help="scratch folder (emptied first if --write-samples is given)")
    ap.add_argument("--uckpt", help="the uckpt binary, for the torch.save -> inspect checks")
    args = ap.parse_args()

    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, _rebuild_tensor_v3: {HAS_V3}")
    if args.write_samples:
        shutil.rmtree(args.work, ignore_errors=True)
        os.makedirs(args.work)
        subprocess.run([args.write_samples, args.work] + args.fixtures, check=True)
    report = {"ok": [], "weights_only_false": [], "skipped_v3": [], "inspect_ok": [], "attrs_dropped": []}

    # 1a. Our samples.
    with open(os.path.join(args.work, "samples.json")) as f:
        samples = json.load(f)
    for s in samples:
        path = os.path.join(args.work, s["file"])
        load_and_compare(path, s["name"], s["expected"], "sample " + s["name"], report)

    # 1b. Fixtures read and written again, against their manifests. Malicious
    # files and files needing custom classes are only parsed as zips.
    with open(os.path.join(args.work, "roundtrip.json")) as f:
        roundtrip = json.load(f)
    for r in roundtrip:
        path = os.path.join(args.work, r["file"])
        label = f"round trip {r['version']}/{r['name']}"
        if not r["unpickle"]:
            check_layout(path, r["name"])
            report["ok"].append((label, "zip layout only (malicious or custom classes: not unpickled)"))
            continue
        load_and_compare(path, r["name"], r["expected"], label, report)

    # 2. torch.save -> uckpt inspect.
    if args.uckpt:
        check_inspect(args.uckpt, args.work, report)
    else:
        print("NOTE: no --uckpt binary in this build: torch.save -> uckpt inspect not checked here")

    print(f"\n{len(report['ok'])} files loaded by torch and matched:")
    for label, how in report["ok"]:
        print(f"  {label}: {how}")
    print(f"\n{len(report['weights_only_false'])} needed weights_only=False after a documented refusal:")
    for label, reason in report["weights_only_false"]:
        print(f"  {label}: weights_only=True refused it: unsupported {reason}")
    if report["skipped_v3"]:
        print(f"\n{len(report['skipped_v3'])} not loaded by torch {torch.__version__} (no _rebuild_tensor_v3 / "
              "uint16-64 / float8); checked with a torch-free reader instead:")
        for label in report["skipped_v3"]:
            print(f"  {label}")
    if report["attrs_dropped"]:
        print(f"\n{len(report['attrs_dropped'])} had tensor attributes, which torch {torch.__version__}'s "
              "_rebuild_from_type_v2 drops on load; compared without them:")
        for label in report["attrs_dropped"]:
            print(f"  {label}")
    if args.uckpt:
        print(f"\n{len(report['inspect_ok'])} torch.save files read by uckpt inspect and matched")
    if failures:
        print(f"\n{len(failures)} FAILURES")
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
