#!/usr/bin/env python3
"""Real DeepSpeed's own tools on uckpt's training checkpoints.

Needs a DeepSpeed source tree (e.g. `git archive v0.14.5 deepspeed` of its
repository) named by UCKPT_DEEPSPEED_SRC; nothing of it is installed or copied
here. Without it the check exits 77 (ctest: skipped, never passed).

DeepSpeed's package __init__ pulls in its whole runtime (pydantic, accelerators,
...), which Debian's torch 1.13 machine does not have; its checkpoint tools do
not use any of that. So `deepspeed` is stood in by an empty package whose path
is the real source folder (deepspeed.checkpoint and zero_to_fp32 run
unchanged), plus stubs, under DeepSpeed's module paths, for the four classes
its pickles name (ZeroStageEnum, LossScaler, DynamicLossScaler,
fragment_address), a logger and tqdm. Step 0 checks that this harness is
faithful: DeepSpeed's converter on the fixture's DeepSpeed checkpoint must
reproduce the fixture's universal folder byte for byte.

Then, for ZeRO stage 1 and 2 (fp32, and bf16) at world size 2, `uckpt launch`
trains the fixture's GPT-2 for 6 steps and saves; on that checkpoint:
  1. DeepSpeed's ds_to_universal.py and `uckpt convert` write byte-identical
     folders;
  2. zero_to_fp32's get_fp32_state_dict_from_zero_checkpoint gives the
     model's weights (fp32: equal to the saved module; bf16: the fp32 masters
     round to the saved bf16 module);
  3. deepspeed.checkpoint.DeepSpeedCheckpoint reads it (iteration, world
     sizes, each rank's zero state = our file).

usage: deepspeed_tools_check.py UCKPT_BINARY SHARED_DIR WORK_DIR
"""
import enum
import filecmp
import json
import logging
import os
import runpy
import shutil
import subprocess
import sys
import types

SKIP = 77


def install_deepspeed_stand_ins(src):
    def module(name):
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sub = ".".join(parts[:i])
            if sub not in sys.modules:
                sys.modules[sub] = types.ModuleType(sub)
        return sys.modules[name]

    module("deepspeed").__path__ = [os.path.join(src, "deepspeed")]
    utils = module("deepspeed.utils")
    utils.__path__ = []
    utils.logger = logging.getLogger("deepspeed")

    class ZeroStageEnum(int, enum.Enum):
        disabled = 0
        optimizer_states = 1
        gradients = 2
        weights = 3

    class LossScaler:
        pass

    class DynamicLossScaler:
        pass

    class fragment_address:
        pass

    for cls, where in [(ZeroStageEnum, "deepspeed.runtime.zero.config"),
                       (LossScaler, "deepspeed.runtime.fp16.loss_scaler"),
                       (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler"),
                       (fragment_address, "deepspeed.utils.tensor_fragment")]:
        cls.__module__, cls.__qualname__ = where, cls.__name__  # pickled by module path and name
        setattr(module(where), cls.__name__, cls)
    module("tqdm").tqdm = lambda iterable=None, *a, **k: iterable


def ds_src():
    src = os.environ.get("UCKPT_DEEPSPEED_SRC", "")
    if not src or not os.path.isfile(os.path.join(src, "deepspeed/checkpoint/ds_to_universal.py")):
        return None
    return src


def run_ds_converter(src, folder, out):
    """DeepSpeed's ds_to_universal.py, as its own main, in a child process."""
    script = os.path.join(src, "deepspeed/checkpoint/ds_to_universal.py")
    cmd = [sys.executable, os.path.abspath(__file__), "--as-deepspeed", script, "--input_folder", folder,
           "--output_folder", out, "--num_extract_workers", "2", "--num_merge_workers", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"ds_to_universal.py failed on {folder}:\n{r.stdout}\n{r.stderr}")


def same_value(x, y):
    import torch
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                and x.shape == y.shape and x.stride() == y.stride() and torch.equal(x, y))
    if isinstance(x, dict) or isinstance(y, dict):
        return type(x) is type(y) and list(x) == list(y) and all(same_value(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same_value(u, v) for u, v in zip(x, y))
    if hasattr(x, "__dict__") and not isinstance(x, type):
        return type(x).__name__ == type(y).__name__ and same_value(vars(x), vars(y))
    return x == y


def compare_trees(a, b, exact_bytes=True):
    """Relative paths that differ (missing on a side, or other bytes); uckpt's
    manifest (docs/manifest-format.md), which DeepSpeed does not write, aside.
    Without exact_bytes, files whose bytes differ are compared by what torch.load
    reads from them: uckpt writes PyTorch 1.13's record layout, PyTorch 2.x's
    torch.save another (its records and alignment), so DeepSpeed's converter on
    PyTorch 2.x writes the same values in other bytes."""
    import torch

    def files(root):
        return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                if f != "uckpt-manifest.json"}
    fa, fb = files(a), files(b)
    bad = sorted((fa ^ fb))
    for p in sorted(fa & fb):
        pa, pb = os.path.join(a, p), os.path.join(b, p)
        if filecmp.cmp(pa, pb, shallow=False):
            continue
        if exact_bytes or not p.endswith(".pt") or not same_value(
                torch.load(pa, map_location="cpu", weights_only=False),
                torch.load(pb, map_location="cpu", weights_only=False)):
            bad.append(p)
    return bad, len(fa)


def refrun(shared):
    """The reference runs made on this PyTorch (ctest's UCKPT_REFRUN), else the shared ones."""
    return os.environ.get("UCKPT_REFRUN") or os.path.join(shared, "fixtures/refrun-gpt2")


def train(uckpt, shared, work, stage, bf16):
    fixture = refrun(shared)
    cfg = json.load(open(os.path.join(fixture, "runs/z2_ws2_baseline/config.json")))["ds_config_as_passed"]
    cfg["zero_optimization"]["stage"] = stage
    cfg["bf16"] = {"enabled": bf16}
    name = f"stage{stage}_{'bf16' if bf16 else 'fp32'}"
    ckpt = os.path.join(work, name)
    with open(os.path.join(work, name + ".json"), "w") as f:
        json.dump(cfg, f)
    cmd = [uckpt, "launch", "-n", "2", "--master_port", "0", "--", uckpt, "train", "--config",
           os.path.join(work, name + ".json"), "--n_layer", "2", "--n_head", "2", "--n_embd", "16", "--vocab_size",
           "97", "--n_positions", "16", "--seq_len", "16", "--init", os.path.join(fixture, "init.pt"), "--steps", "6",
           "--checkpoint_dir", ckpt, "--log_dir", os.path.join(work, "logs"), "--run_name", name, "--threads", "1",
           "--no_progress"]
    subprocess.run(cmd, check=True, timeout=600, capture_output=True)
    return name, os.path.join(ckpt, "global_step6")


def check_readers(src, folder, bf16):
    import torch
    z2f = runpy.run_path(os.path.join(src, "deepspeed/utils/zero_to_fp32.py"))
    merged = z2f["get_fp32_state_dict_from_zero_checkpoint"](os.path.dirname(folder), tag=os.path.basename(folder))
    module = torch.load(os.path.join(folder, "mp_rank_00_model_states.pt"), map_location="cpu")["module"]
    assert list(merged.keys()) == list(module.keys()), (list(merged.keys()), list(module.keys()))
    for k, v in module.items():
        got = merged[k].to(v.dtype) if bf16 else merged[k]
        assert merged[k].dtype == torch.float32 and torch.equal(got, v), f"zero_to_fp32: {k} differs"

    from deepspeed.checkpoint import DeepSpeedCheckpoint
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, UNIVERSAL_CHECKPOINT_INFO
    ck = DeepSpeedCheckpoint(folder)
    assert (ck.tp_degree, ck.pp_degree, ck.dp_degree) == (1, 1, 2), (ck.tp_degree, ck.pp_degree, ck.dp_degree)
    assert ck.get_iteration() == 6, ck.get_iteration()
    assert ck.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO) == {"universal_checkpoint_version": 0.2}
    prefix = "bf16_" if bf16 else ""
    for r in range(2):
        sd = ck.get_zero_checkpoint_state(pp_index=0, tp_index=0, dp_index=r)
        ours = torch.load(os.path.join(folder, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        a = sd[OPTIMIZER_STATE_DICT]["single_partition_of_fp32_groups"][0]
        assert torch.equal(a, ours[OPTIMIZER_STATE_DICT]["single_partition_of_fp32_groups"][0]), f"rank {r}"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--as-deepspeed":
        install_deepspeed_stand_ins(ds_src())
        sys.argv = sys.argv[2:]
        runpy.run_path(sys.argv[0], run_name="__main__")
        return 0
    uckpt, shared, work = sys.argv[1:4]
    src = ds_src()
    if src is None:
        print("SKIPPED: set UCKPT_DEEPSPEED_SRC to a DeepSpeed source tree (with deepspeed/checkpoint/"
              "ds_to_universal.py) to run DeepSpeed's converter and readers on uckpt's checkpoints")
        return SKIP
    install_deepspeed_stand_ins(src)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    failures, checks = [], 1 + 4 * 2

    # 0. The harness is faithful: DeepSpeed's converter reproduces its own fixture output.
    fixture = os.path.join(refrun(shared), "ckpt")
    out = os.path.join(work, "fixture_by_deepspeed")
    run_ds_converter(src, os.path.join(fixture, "global_step6"), out)
    bad, n = compare_trees(out, os.path.join(fixture, "global_step6_universal"))
    print(f"{'ok' if not bad else 'FAIL'}: DeepSpeed's converter on the fixture's checkpoint vs the fixture's "
          f"universal folder: {n} files, {len(bad)} differ {bad[:5]}")
    if bad:
        failures.append("harness")

    for stage, bf16 in [(1, False), (2, False), (1, True), (2, True)]:
        name, folder = train(uckpt, shared, work, stage, bf16)
        ds_out, our_out = folder + "_by_deepspeed", folder + "_by_uckpt"
        run_ds_converter(src, folder, ds_out)
        subprocess.run([uckpt, "convert", "-q", folder, our_out], check=True, timeout=600)
        # Byte for byte where DeepSpeed runs on PyTorch 1.x, whose record layout uckpt writes.
        import torch
        bad, n = compare_trees(ds_out, our_out, exact_bytes=torch.__version__.startswith("1."))
        print(f"{'ok' if not bad else 'FAIL'}: {name}: ds_to_universal.py vs uckpt convert: {n} files, "
              f"{len(bad)} differ {bad[:5]}")
        if bad:
            failures.append(name + " convert")
        try:
            check_readers(src, folder, bf16)
            print(f"ok: {name}: zero_to_fp32 and DeepSpeedCheckpoint read it")
        except Exception as e:  # report every variant, then fail
            print(f"FAIL: {name}: DeepSpeed's readers: {type(e).__name__}: {e}")
            failures.append(name + " readers")
    shutil.rmtree(work, ignore_errors=True)
    print(f"{checks - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
