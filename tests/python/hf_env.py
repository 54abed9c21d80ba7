"""Throwaway virtual environments for the `deepspeed` alias and the Hugging Face tests.

The tests' Python has real DeepSpeed 0.14.5 installed next to transformers, Accelerate, PEFT and TRL, and no
test may install into it. make_venv() makes a venv (without pip of its own) whose site-packages sees the tests'
Python's packages through a .pth file: all of them (`with_deepspeed=True`, a Python where DeepSpeed is
installed), or all but DeepSpeed (a folder of links to every entry except deepspeed/ and its dist-info), so
that the alias can be installed into the venv's own site-packages and `import deepspeed` is then uckpt.
"""
import os
import shutil
import subprocess
import sys
import sysconfig


def _site_packages():
    return sysconfig.get_paths()["purelib"]


def make_venv(path, with_deepspeed=False):
    """A fresh venv at `path` over this Python's packages; returns its python."""
    if os.path.exists(path):
        shutil.rmtree(path)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    python = os.path.join(path, "bin", "python")
    venv_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    base = _site_packages()
    if not with_deepspeed:
        farm = os.path.join(path, "base-without-deepspeed")
        os.makedirs(farm)
        for entry in os.listdir(base):
            low = entry.lower()
            if low == "deepspeed" or (low.startswith("deepspeed-") and low.endswith((".dist-info", ".egg-info"))):
                continue
            os.symlink(os.path.join(base, entry), os.path.join(farm, entry))
        base = farm
    # site.addsitedir also runs the base's own .pth files (setuptools' distutils shim).
    with open(os.path.join(venv_site, "zz-uckpt-test-base.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({base!r})\n")
    return python


def run(python, args, pypath, env=None, check=False, **kw):
    """`python *args` with PYTHONPATH=pypath; returns the CompletedProcess (stdout and stderr as text)."""
    full_env = dict(os.environ, PYTHONPATH=pypath, **(env or {}))
    full_env.pop("PYTHONHOME", None)
    done = subprocess.run([python, *args], env=full_env, capture_output=True, text=True, **kw)
    if check and done.returncode != 0:
        sys.stdout.write(done.stdout + done.stderr)
        raise SystemExit(f"FAIL: {python} {' '.join(args)} exited {done.returncode} (output above)")
    return done


def cpu_data_parallel():
    """TrainingArguments' keywords for a data-parallel run on a machine without GPUs. There Accelerate's state finds
    no backend and counts 1 process while DeepSpeed's group has them all, so its loaders are not sharded and its
    gathers fail; a PartialState made first with Gloo, which the Trainer then uses (`use_configured_state`),
    counts the ranks. Nothing on a GPU machine."""
    import torch
    if torch.cuda.is_available():
        return {}
    from accelerate import PartialState
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    return {"accelerator_config": {"use_configured_state": True}}
