#!/usr/bin/env bash
# The Python package installed as a user installs it: `pip install --no-build-isolation SOURCE`
# into a fresh virtual environment whose only other packages are PyTorch's (the build's own
# Python's, seen through a .pth file), then, from another folder and with no PYTHONPATH: every
# module of the installed package imports, and 2 ranks train, save and resume through
# `import uckpt as deepspeed`.
# usage: pip_install_test.sh PYTHON SOURCE_DIR BUILD_DIR WORK_DIR
set -euo pipefail
py=$1 src=$(realpath "$2") build=$(realpath "$3") work=$4
rm -rf "$work"; mkdir -p "$work"; work=$(realpath "$work")
fail() { echo "FAIL: $*" >&2; exit 1; }

"$py" -m venv "$work/venv" || fail "python -m venv"
vpy=$work/venv/bin/python
site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
torch_site=$("$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
echo "$torch_site" > "$site/torch-site.pth"
"$vpy" -c 'import uckpt' 2> /dev/null && fail "uckpt importable before it was installed"
# The build folder already built is reused (setup.py: UCKPT_BUILD_DIR), so this costs a link at most.
UCKPT_BUILD_DIR=$build "$vpy" -m pip install --disable-pip-version-check --no-build-isolation "$src" \
  > "$work/pip.log" 2>&1 || { tail -30 "$work/pip.log"; fail "pip install"; }
cd "$work"
env -u PYTHONPATH "$vpy" - "$site" <<'PY' || fail "the installed package"
import importlib, os, pkgutil, sys
import uckpt
where = os.path.dirname(uckpt.__file__)
if not where.startswith(sys.argv[1]):
    sys.exit(f"uckpt imported from {where}, not the virtual environment's {sys.argv[1]}")
names = [m.name for m in pkgutil.walk_packages(uckpt.__path__, "uckpt.")]
src_dirs = {d for d, _, files in os.walk(where) if "__init__.py" in files}
for name in names:
    importlib.import_module(name)
pkgs = {os.path.dirname(importlib.import_module(n).__file__) for n in names if n.count(".")}
missing = sorted(d for d in src_dirs if d != where and d not in pkgs)
if missing:
    sys.exit(f"sub-packages not importable: {missing}")
print(f"ok   {len(names)} modules of the installed package import")
PY
cat > train.py <<'PY'
import os, sys
import torch
import uckpt as deepspeed
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
       "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
if sys.argv[1] == "resume":
    engine.load_checkpoint("ckpt")
g = torch.Generator().manual_seed(engine.global_steps * 10 + engine.global_rank)
for _ in range(3):
    x = torch.randn(4, 8, generator=g)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
engine.save_checkpoint("ckpt")
print(f"rank {engine.global_rank} step {engine.global_steps} loss {loss.item():.6f}")
PY
for what in train resume; do
  port=$("$vpy" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  env -u PYTHONPATH OMP_NUM_THREADS=1 timeout 300 "$vpy" -m torch.distributed.run --nproc_per_node 2 \
    --master_addr 127.0.0.1 --master_port "$port" --log_dir "$work/torchelastic" train.py $what > "$what.log" 2>&1 ||
    { cat "$what.log"; fail "2 ranks ($what) with the installed package"; }
done
grep -q "rank 0 step 6 " resume.log || { cat resume.log; fail "the resumed run did not reach step 6"; }
echo "ok   2 ranks trained, saved and resumed with the installed package"
