"""Throwaway virtual environments for the `deepspeed` alias and the Hugging Face tests.

The tests' Python has real DeepSpeed 0.14.5 installed next to transformers, Accelerate, PEFT and TRL, and no
test may install into it. make_venv() makes a venv (without pip of its own) whose site-packages sees the tests'
Python's packages through a .pth file: all of them (`with_deepspeed=True`, a Python where DeepSpeed is
installed), or all but DeepSpeed (a folder of links to every entry except deepspeed/ and its dist-info), so
that the alias can be installed into the venv's own site-packages and `import deepspeed` is then uckpt.

GPU mode (the harnesses hf_trainer_test, hf_accelerate_test, hf_trl_test; bench/hf-stack-gpu.sh): set
UCKPT_TEST_GPU=1. Their ranks then run on `cuda:LOCAL_RANK` with NCCL (DeepSpeed's and uckpt's accelerator
found as on any GPU machine: no DS_ACCELERATOR=cpu, no Gloo state of our own), NVLink multicast off in every
launched process (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1). Without it they
run on CPU ranks with Gloo, as in CI. Two more variables, for a machine where packages cannot be installed:
  UCKPT_TEST_DEEPSPEED=DIR  real DeepSpeed 0.14.5 from its source folder DIR (holding deepspeed/), a dist-info
                            made beside it in the venv, instead of the one installed in the tests' Python;
  UCKPT_TEST_SITE=DIR[:DIR] folders of carried pure-Python packages (TRL, datasets, ...) that every venv sees
                            after the tests' Python's own.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile


def _site_packages():
    return sysconfig.get_paths()["purelib"]


GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def gpu_mode():
    """True when UCKPT_TEST_GPU=1: the harnesses' ranks on GPUs (NCCL); unset or 0: CPU ranks (Gloo)."""
    value = os.environ.get("UCKPT_TEST_GPU", "0")
    if value not in ("0", "1", ""):
        raise SystemExit(f"UCKPT_TEST_GPU={value!r}: set it to 1 (ranks on GPUs) or 0 / unset (CPU ranks)")
    return value == "1"


def _env_dirs(name, must_hold=None):
    """The folders listed (":"-separated) in environment variable `name`, each checked to exist (and to hold
    `must_hold`)."""
    dirs = [os.path.abspath(d) for d in os.environ.get(name, "").split(":") if d]
    for d in dirs:
        if not os.path.isdir(os.path.join(d, must_hold or "")):
            raise SystemExit(f"{name}: {d} is not a folder{' holding ' + must_hold if must_hold else ''}")
    return dirs


def _deepspeed_source_dirs(venv):
    """[source, metadata folder] when UCKPT_TEST_DEEPSPEED names DeepSpeed's source (transformers and Accelerate
    check the package metadata too, so a dist-info with the source's version.txt is made in the venv), else []."""
    found = _env_dirs("UCKPT_TEST_DEEPSPEED", must_hold="deepspeed")
    if not found:
        return []
    source = found[0]
    version_file = os.path.join(source, "version.txt")
    version = open(version_file).read().strip() if os.path.exists(version_file) else "0.14.5"
    meta = os.path.join(venv, "deepspeed-metadata")
    os.makedirs(os.path.join(meta, f"deepspeed-{version}.dist-info"))
    with open(os.path.join(meta, f"deepspeed-{version}.dist-info", "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")
    return [source, meta]


def make_venv(path, with_deepspeed=False):
    """A fresh venv at `path` over this Python's packages; returns its python. With `with_deepspeed` and
    UCKPT_TEST_DEEPSPEED set, DeepSpeed's source goes first; UCKPT_TEST_SITE's folders go last."""
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
    dirs = (_deepspeed_source_dirs(path) if with_deepspeed else []) + [base] + _env_dirs("UCKPT_TEST_SITE")
    # site.addsitedir also runs the base's own .pth files (setuptools' distutils shim).
    with open(os.path.join(venv_site, "zz-uckpt-test-base.pth"), "w") as f:
        f.writelines(f"import site; site.addsitedir({d!r})\n" for d in dirs)
    return python


def run(python, args, pypath, env=None, check=False, **kw):
    """`python *args` with PYTHONPATH=pypath; returns the CompletedProcess (stdout and stderr as text)."""
    full_env = dict(os.environ, PYTHONPATH=pypath)
    full_env.update({**(GPU_ENV if gpu_mode() else {}), **(env or {})})
    full_env.pop("PYTHONHOME", None)
    done = subprocess.run([python, *args], env=full_env, capture_output=True, text=True, **kw)
    if check and done.returncode != 0:
        sys.stdout.write(done.stdout + done.stderr)
        raise SystemExit(f"FAIL: {python} {' '.join(args)} exited {done.returncode} (output above)")
    return done


def cpu_data_parallel(half=False):
    """TrainingArguments' keywords for a data-parallel run on a machine without GPUs. There Accelerate's state finds
    no backend and counts 1 process while DeepSpeed's group has them all, so its loaders are not sharded and its
    gathers fail; a PartialState made first with Gloo, which the Trainer then uses (`use_configured_state`),
    counts the ranks. `half` (bf16=True or fp16=True): use_cpu=True too, without which TrainingArguments refuses
    bf16 where no GPU has it. Nothing on a GPU machine."""
    import torch
    if gpu_mode() and not torch.cuda.is_available():
        raise SystemExit("UCKPT_TEST_GPU=1 but torch sees no GPU (torch.cuda.is_available() is False)")
    if torch.cuda.is_available():
        return {}
    from accelerate import PartialState
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    return {"accelerator_config": {"use_configured_state": True}, **({"use_cpu": True} if half else {})}


# ---- What the harnesses (hf_trainer_test, hf_accelerate_test, hf_trl_test, hf_zero3_test) share: the Trainer's
# config, their arguments, venvs, torchrun, errors.

# The config a Hugging Face Trainer run passes as `deepspeed=`, with the "auto" values the Trainer fills in.
TRAINER_DS_CONFIG = {
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "allgather_bucket_size": 2e8},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def trainer_ds_config(stage, offload=False):
    """TRAINER_DS_CONFIG at ZeRO `stage` (a fresh copy); `offload`: offload_optimizer to the CPU (DeepSpeed's
    optimizer is then its DeepSpeedCPUAdam, not FusedAdam)."""
    cfg = json.loads(json.dumps(TRAINER_DS_CONFIG))
    cfg["zero_optimization"]["stage"] = stage
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if stage == 3:  # the keys Hugging Face's ZeRO-3 examples set, "auto" where the Trainer fills them
        cfg["zero_optimization"].update({"stage3_prefetch_bucket_size": "auto",
                                         "stage3_param_persistence_threshold": "auto",
                                         "stage3_gather_16bit_weights_on_model_save": True})
    return cfg


def tiny_gpt2_config(**overrides):
    """The tests' tiny GPT-2 (2 layers of 32, no dropout), built from a config: nothing downloaded."""
    from transformers import GPT2Config
    kw = dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0)
    kw.update(overrides)
    return GPT2Config(**kw)


def harness_parser(against=("uckpt", "deepspeed"), **against_kw):
    """A harness's argument parser: PYPATH, WORK_DIR and --against (who runs it: uckpt through the alias, or
    real DeepSpeed 0.14.5); the harness adds its own options."""
    p = argparse.ArgumentParser()
    p.add_argument("pypath")
    p.add_argument("work")
    p.add_argument("--against", choices=list(against), default="uckpt", **against_kw)
    return p


def fresh_work(work, name):
    """WORK/NAME, emptied: the folder of one harness run."""
    path = os.path.join(os.path.abspath(work), name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def worker_args(strings=(), ints=(), flags=(), worker=None, **defaults):
    """The options main() hands a torchrun worker, parsed: `--worker` (a flag, or one of `worker`'s choices),
    each of `strings` and `ints` a value, each of `flags` a switch; `defaults` by destination."""
    p = argparse.ArgumentParser()
    if worker:
        p.add_argument("--worker", choices=list(worker))
    else:
        p.add_argument("--worker", action="store_true")
    for k in strings:
        p.add_argument(k)
    for k in ints:
        p.add_argument(k, type=int)
    for k in flags:
        p.add_argument(k, action="store_true")
    p.set_defaults(**defaults)
    return p.parse_args()


def harness_venv(which, work, pypath):
    """(python, PYTHONPATH) of a fresh venv at WORK/venv-WHICH where `deepspeed` is uckpt through the alias
    (`which` "uckpt"; PYTHONPATH the build's) or real DeepSpeed 0.14.5 ("deepspeed"); exits 1 when the alias does
    not install."""
    if which == "uckpt":
        python = make_venv(os.path.join(work, "venv-uckpt"))
        done = run(python, ["-m", "uckpt.alias", "install"], pypath)
        if done.returncode != 0:
            print(done.stdout + done.stderr + "\nFAIL: the alias did not install", flush=True)
            sys.exit(1)
        return python, pypath
    return make_venv(os.path.join(work, "venv-deepspeed"), with_deepspeed=True), ""


def torchrun(python, pypath, nproc, script_args, log, timeout=900):
    """`python -m torch.distributed.run` of `script_args` at `nproc` CPU ranks (Gloo), or GPUs in GPU mode
    (NCCL, NVLink multicast off); a free port, nothing downloaded, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 for real
    DeepSpeed's own loads (which call torch.load without weights_only). The output is also written to `log`.
    Returns (exit code, output)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from testkit import free_port, sweep_deepspeed_shm
    env = dict(os.environ, PYTHONPATH=pypath, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if gpu_mode():
        import torch
        if torch.cuda.device_count() < nproc:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise SystemExit(f"UCKPT_TEST_GPU=1: {nproc} ranks need {nproc} GPUs, torch sees "
                             f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES={visible})")
        env.update(GPU_ENV)
        env.pop("DS_ACCELERATOR", None)
    else:
        env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   LOCAL_SIZE=str(nproc))  # DeepSpeed's CPU device count (else it asks numactl)
    env.pop("PYTHONHOME", None)
    port = free_port()
    # torchrun's own log folder (else a /tmp/torchelastic_* it never removes).
    with tempfile.TemporaryDirectory(prefix="torchelastic_") as logs:
        cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
               "--log-dir", logs, *script_args]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            rc, out = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            rc = 124
            out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
            out += f"\n(timed out after {timeout} s)"
    sweep_deepspeed_shm(port)
    with open(log, "w") as f:
        f.write(out)
    return rc, out


def first_error(out):
    """The first traceback's last lines (the exception), from rank output."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line:
            block = []
            for nxt in lines[i + 1:]:
                block.append(nxt)
                if re.match(r"^(\[rank\d+\]: )?[A-Za-z_.]+(Error|Exception|Interrupt)\b", nxt):
                    break
            return "\n".join(block[-8:])
    return "\n".join(lines[-15:])


def fail_run(what, rc, out, log):
    """Exits 1 naming the run, its exit code and its first error."""
    print(f"FAIL: {what}: exit {rc}; first error:\n{first_error(out)}\n(whole output: {log})", flush=True)
    sys.exit(1)
