#!/usr/bin/env python3
"""Rebuilds the seed corpora in tests/fuzz/corpus/ from ../shared/fixtures/torch.

Whole small .pt files seed fuzz_zip and fuzz_torch_file; their data.pkl
streams seed fuzz_pickle. large_multi_tensor.pt is skipped (size). Inputs that
once crashed a fuzzer are kept under corpus/<target>/regress-* and left alone.
Usage: tests/fuzz/make_corpus.py [SHARED_DIR]
"""
import pathlib
import struct
import sys
import zipfile


def stored_record(data, info):
    """The bytes of a stored record, read directly (some fixtures carry CRC 0)."""
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    return data[start:start + info.file_size]

here = pathlib.Path(__file__).resolve().parent
shared = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else here.parents[2] / "shared"
fixtures = sorted((shared / "fixtures" / "torch").glob("*/*.pt"))
corpus = here / "corpus"

for target in ("fuzz_zip", "fuzz_torch_file", "fuzz_pickle"):
    d = corpus / target
    d.mkdir(parents=True, exist_ok=True)
    for old in d.iterdir():
        if not old.name.startswith("regress-"):
            old.unlink()

for pt in fixtures:
    if pt.name == "large_multi_tensor.pt":
        continue
    name = f"{pt.parent.name}-{pt.stem}"
    data = pt.read_bytes()
    for target in ("fuzz_zip", "fuzz_torch_file"):
        (corpus / target / f"{name}.pt").write_bytes(data)
    if zipfile.is_zipfile(pt):
        with zipfile.ZipFile(pt) as z:
            for info in z.infolist():
                if info.filename.endswith("/data.pkl"):
                    (corpus / "fuzz_pickle" / f"{name}.pkl").write_bytes(stored_record(data, info))

total = sum(f.stat().st_size for f in corpus.rglob("*") if f.is_file())
print(f"corpus: {total} bytes in {sum(1 for f in corpus.rglob('*') if f.is_file())} files")
