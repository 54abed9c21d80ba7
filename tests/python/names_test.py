#!/usr/bin/env python3
"""The names scripts import and the engine's smaller calls (#26), and the config keys of #22, on CPU (seconds).

usage: names_test.py CASE PYTHONPATH_OF_UCKPT FIXTURE_DIR WORK_DIR

CASE:
  script      names_script.py under uckpt: every import resolves, and what it records follows DeepSpeed 0.14.5's
              rules (was_step_applied() true exactly at the updates, set_gradient_accumulation_boundary moving
              the update, set_train_batch_size changing the accumulation, optimizer_name() lower-casing the config
              type, no engine.no_sync, optimizer.overflow only where DeepSpeed's optimizer has one, zero_to_fp32
              giving the trained weights with the buffer as fp32 and the frozen parameter, checkpointing).
  deepspeed   names_script.py under real DeepSpeed and under uckpt: the records agree (losses within 1e-6
              relative; VALID_LR_SCHEDULES: uckpt's a subset of DeepSpeed's). Needs UCKPT_DEEPSPEED_SRC (else 77).
  surface     in-process checks: checkpointing.configure's settings honoured or refused by name, checkpoint()'s
              gradients equal to the plain forward's, log_dist's rank rule, the refusals (init_inference,
              optimizer.backward/state_dict, DeepSpeed's engine, optimizer and scheduler names uckpt lacks),
              optimizer.cur_scale and loss_scale where DeepSpeed's optimizer has them,
              lr_scheduler.last_batch_iteration, stage 3's ZeroParamStatus and a DeepSpeed-Chat style save of
              whole weights (2 ranks), zero_to_fp32 on a bf16 run (frozen parameter kept bf16).
  config      the config keys: activation_checkpointing and aio accepted without a warning,
              dataloader_drop_last given to the dataloader, zero_allow_untested_optimizer and
              zero_force_ds_cpu_optimizer as DeepSpeed checks them, timers.throughput warned about,
              checkpoint.tag_validation (Fail stops every rank when the tags differ; bad values refused).
"""
import json
import os
import shutil
import subprocess
import sys

import testkit
from testkit import fail, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP = 77


def run_script(impl, pypath, fixture, work, ds_src=None):
    out = os.path.join(work, impl + ".json")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONHASHSEED="0")
    env["PYTHONPATH"] = pypath if impl == "uckpt" else ds_src
    cmd = [sys.executable, os.path.join(fixture, "scripts", "launch.py"), "1", str(free_port()),
           os.path.join(HERE, "names_script.py"), "--impl", impl, "--fixture", fixture,
           "--work", os.path.join(work, impl), "--out", out]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        fail(f"names_script.py under {impl} exited {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-2000:]}")
    return json.load(open(out))


# ---------------------------------------------------------------- script

def check_stage(stage, r):
    where = f"stage {stage}"
    ga_updates = [False, True] * 3  # GA 2: the second micro-step of each step updates
    forced = [True, False, False, True]  # set_gradient_accumulation_boundary(True), then False, False, True
    # set_train_batch_size(6): GA 3 from micro-step 10 on (6 + 4 micro-steps before), DeepSpeed's rule
    ga3 = [(10 + k + 1) % 3 == 0 for k in range(3)]
    if r["applied"] != ga_updates + forced + ga3:
        fail(f"{where}: was_step_applied() after each step {r['applied']}, want {ga_updates + forced + ga3}")
    if r["boundary"][:6] != ga_updates or r["boundary"][6:10] != forced or r["boundary"][10:] != ga3:
        fail(f"{where}: is_gradient_accumulation_boundary() {r['boundary']}")
    if r["global_steps"] != 3 + 2 + sum(ga3):
        fail(f"{where}: {r['global_steps']} updates, want {3 + 2 + sum(ga3)}")
    if r["after_set_train_batch_size"] != [6, 3] or r["set_train_batch_size_5"] != "ValueError":
        fail(f"{where}: set_train_batch_size: {r['after_set_train_batch_size']}, 5 -> {r['set_train_batch_size_5']}")
    want = {"isinstance": True, "optimizer_name": "adamw", "steps_per_print": 3, "wall_clock_breakdown": False,
            "has_no_sync": False, "has_overflow": stage > 0}
    got = {k: r[k] for k in want}
    if got != want:
        fail(f"{where}: {got}, want {want}")
    if stage > 0 and r["overflow"] is not False:
        fail(f"{where}: optimizer.overflow is {r['overflow']} in an fp32 run")
    # DeepSpeed's engine keeps initialize()'s arguments; fp32 without gradient_clipping: 0.0, loss_scale 0
    # (dynamic); its ZeRO optimizers' scale is 1.0 outside fp16, the torch optimizer (stage 0) has none.
    want = {"initialize_arguments": [True] * 6, "scale_getters": [0.0, 0, True],
            "optimizer_scale": [1.0, 1.0] if stage > 0 else "absent"}
    got = {k: r[k] for k in want}
    if got != want:
        fail(f"{where}: {got}, want {want}")
    names = ["inp.weight", "inp.bias", "blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.1.fc.weight",
             "blocks.1.fc.bias", "out.weight", "out.bias"]
    module_view = {"state_dict_keys": sorted("module." + n for n in names + ["seen"]),
                   "named_parameters": ["module." + n for n in names], "named_buffers": ["top.module.seen"],
                   "own_parameters": [], "load_state_dict": [[], []], "load_unprefixed": "RuntimeError",
                   "training_dataloader": True, "epoch_count": 1}
    got = {k: r[k] for k in module_view}
    if got != module_view:
        fail(f"{where}: the engine as DeepSpeed's Module (its model the child 'module'): {got}, want {module_view}")
    sd = r["fp32_state_dict"]
    if stage == 0:
        if sd != "FileNotFoundError":
            fail(f"{where}: zero_to_fp32 of a stage-0 checkpoint gave {sd} (DeepSpeed's: FileNotFoundError)")
        print("ok   stage 0: the engine's answers; zero_to_fp32 needs ZeRO files, as DeepSpeed's")
        return
    # DeepSpeed's model-states file lists frozen parameters from stage 2 on; its zero_to_fp32 gives what it lists.
    frozen = sd.get("inp.bias", [None])[0]
    if sd.get("seen", [None])[0] != "torch.float32" or frozen != ("torch.float32" if stage >= 2 else None):
        fail(f"{where}: zero_to_fp32: buffer 'seen' {sd.get('seen')} (DeepSpeed: fp32), frozen inp.bias {frozen}")
    if not r["fp32_matches_module"]:
        fail(f"{where}: zero_to_fp32's weights are not the trained module's")
    print(f"ok   stage {stage}: was_step_applied, the boundary by hand, set_train_batch_size, the engine's "
          "answers and zero_to_fp32")


def case_script(pypath, fixture, work):
    rec = run_script("uckpt", pypath, fixture, work)
    import_check = {"ZeroParamStatus": {"AVAILABLE": 1, "NOT_AVAILABLE": 2, "INFLIGHT": 3},
                    "accelerator": "cpu", "repeating": [1, 2, 3, 1, 2],
                    "checkpointing_configured": [False, True]}
    for k, want in import_check.items():
        if rec[k] != want:
            fail(f"{k}: {rec[k]}, want {want}")
    if rec["moe_split"] != [1, 2, "parameters", "ValueError"]:
        fail(f"moe.utils.split_params_into_different_moe_groups_for_optimizer: {rec['moe_split']}")
    if rec["compression_helper"] != ["Linear", 3, "Identity"]:
        fail(f"compression.helper recursive_getattr / recursive_setattr: {rec['compression_helper']}")
    if rec["clone"] != [[2.0, 3.0], 2, 3, "text"]:
        fail(f"clone_tensors_for_torch_save: {rec['clone']} (values, storage size, other items)")
    if not {"WarmupLR", "WarmupDecayLR"} <= set(rec["VALID_LR_SCHEDULES"]):
        fail(f"VALID_LR_SCHEDULES {rec['VALID_LR_SCHEDULES']} lacks the schedulers uckpt runs")
    print("ok   the imports; ZeroParamStatus, RepeatingLoader, clone_tensors_for_torch_save, checkpointing state")
    for stage, r in sorted(rec["stages"].items()):
        check_stage(int(stage), r)


# ---------------------------------------------------------------- deepspeed

def deepspeed_source(fixture):
    src = os.environ.get("UCKPT_DEEPSPEED_SRC", "")
    if not src or not os.path.isfile(os.path.join(src, "deepspeed", "__init__.py")):
        return None
    return src + os.pathsep + os.path.join(fixture, "scripts", "pyshim")


def close(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-6 * max(abs(a), abs(b), 1e-12)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    return a == b


def case_deepspeed(pypath, fixture, work):
    ds_src = deepspeed_source(fixture)
    if ds_src is None:
        print("SKIPPED: UCKPT_DEEPSPEED_SRC does not name DeepSpeed v0.14.5's source; nothing was compared.")
        sys.exit(SKIP)
    ours = run_script("uckpt", pypath, fixture, work)
    theirs = run_script("deepspeed", pypath, fixture, work, ds_src)
    if not set(ours.pop("VALID_LR_SCHEDULES")) <= set(theirs.pop("VALID_LR_SCHEDULES")):
        fail("VALID_LR_SCHEDULES names a scheduler DeepSpeed does not have")
    for k in sorted(set(ours) | set(theirs)):
        if k == "stages":
            continue
        if not close(ours.get(k), theirs.get(k)):
            fail(f"{k}: uckpt {ours.get(k)}, DeepSpeed {theirs.get(k)}")
    for stage in sorted(theirs["stages"]):
        a, b = ours["stages"][stage], theirs["stages"][stage]
        for k in sorted(set(a) | set(b)):
            if not close(a.get(k), b.get(k)):
                fail(f"stage {stage}: {k}: uckpt {a.get(k)}\n  DeepSpeed {b.get(k)}")
        print(f"ok   stage {stage}: uckpt's record equals DeepSpeed's ({len(a['losses'])} losses within 1e-6)")


# ---------------------------------------------------------------- surface / config (workers)

def launch(case, pypath, world, extra=()):
    testkit.launch(__file__, case, pypath, world, extra)


def toy(torch, frozen=False):
    net = testkit.toy_net(torch)
    if frozen:
        net.inp.bias.requires_grad_(False)
    return net


def cfg(stage=1, **extra):
    c = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
         "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, "zero_optimization": {"stage": stage}}
    c.update(extra)
    return c


def expect_error(kind, needle, fn, what):
    try:
        fn()
    except kind as e:
        if needle not in str(e):
            fail(f"{what}: the error does not name '{needle}': {e}")
        return str(e)
    fail(f"{what}: accepted")


def worker_surface(deepspeed, torch):
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    ck = deepspeed.checkpointing
    if world == 1:
        # checkpoint(): the gradients of the plain forward; DeepSpeed's result shapes.
        lin = torch.nn.Linear(3, 3)
        x = torch.randn(2, 3, requires_grad=True)
        lin(x).sum().backward()
        want = (lin.weight.grad.clone(), x.grad.clone())
        lin.weight.grad, x.grad = None, None
        out = ck.checkpoint(lambda t: (lin(t),), x)
        if not torch.is_tensor(out):
            fail(f"checkpoint() of a function returning a 1-tuple gave {type(out).__name__} (DeepSpeed: the tensor)")
        out.sum().backward()
        if not (torch.equal(lin.weight.grad, want[0]) and torch.equal(x.grad, want[1])):
            fail("checkpoint(): gradients differ from the plain forward's")
        both = ck.checkpoint(lambda t: [lin(t), t * 2], x)
        if not (isinstance(both, tuple) and len(both) == 2):
            fail(f"checkpoint() of a function returning a list of 2 gave {type(both).__name__}")
        print("ok   checkpointing.checkpoint: the plain forward's gradients, DeepSpeed's result shapes")
        expect_error(ValueError, "mpu_", lambda: ck.configure(object()), "configure(mpu)")
        expect_error(ValueError, "cpu_checkpointing", lambda: ck.configure(
            None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}}), "cpu_checkpointing")
        expect_error(ValueError, "checkpoint_in_cpu", lambda: ck.configure(None, checkpoint_in_cpu=True),
                     "checkpoint_in_cpu")
        expect_error(AssertionError, "partitioned activations",
                     lambda: ck.configure(None, contiguous_checkpointing=True), "contiguous without partition")
        expect_error(ValueError, "contiguous_checkpointing", lambda: ck.configure(
            None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2), "contiguous")
        ck.configure(None, deepspeed_config={"activation_checkpointing": {"partition_activations": True,
                                                                          "synchronize_checkpoint_boundary": True}})
        if not ck.is_configured():
            fail("is_configured() after configure()")
        print("ok   checkpointing.configure: honoured (partition_activations, synchronize) or refused by name")

        # log_dist: with torch.distributed up, ranks=None logs nothing; [0] and [-1] log on rank 0.
        import io
        import logging
        buf = io.StringIO()
        handler = logging.StreamHandler(buf)
        deepspeed.utils.logger.addHandler(handler)
        deepspeed.utils.log_dist("none", ranks=None)
        deepspeed.utils.log_dist("zero", ranks=[0])
        deepspeed.utils.log_dist("all", ranks=[-1])
        deepspeed.utils.log_dist("one", ranks=[1])
        deepspeed.runtime.utils.see_memory_usage("quiet")
        deepspeed.runtime.utils.see_memory_usage("forced", force=True)
        deepspeed.utils.logger.removeHandler(handler)
        lines = buf.getvalue().splitlines()
        got = [line.split("] ", 1)[1] for line in lines if line.startswith("[Rank")]
        if got != ["zero", "all"] or "quiet" in lines or "forced" not in lines:
            fail(f"log_dist logged {got} (DeepSpeed's rule gives ['zero', 'all']); see_memory_usage: {lines}")
        print("ok   log_dist: DeepSpeed's rank rule; see_memory_usage logs when forced")

        expect_error(NotImplementedError, "inference", lambda: deepspeed.init_inference(toy(torch)), "init_inference")
        # Imported at the top of scripts (BingBert's sparse attention, the random-LTD examples): refused when used.
        from uckpt.ops.sparse_attention import FixedSparsityConfig, SparseAttentionUtils
        from uckpt.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd
        expect_error(NotImplementedError, "sparse attention", lambda: FixedSparsityConfig(num_heads=4),
                     "FixedSparsityConfig")
        expect_error(NotImplementedError, "sparse attention", lambda: SparseAttentionUtils.pad_to_block_size,
                     "SparseAttentionUtils")
        expect_error(NotImplementedError, "random-LTD", lambda: convert_to_random_ltd(None, None), "random-LTD")
        model = toy(torch)
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg(1))
        loss = engine(torch.randn(2, 4))
        expect_error(RuntimeError, "engine.backward", lambda: opt.backward(loss), "optimizer.backward")
        expect_error(RuntimeError, "load_checkpoint", lambda: opt.load_state_dict([opt.state_dict()]),
                     "optimizer.load_state_dict")
        # bf16 at stage 1 is DeepSpeed 0.14.5's DeepSpeedZeroOptimizer (its BF16_Optimizer needs grad_accum_dtype
        # fp32 there), which has the loss scale (grad_accum_test.py compares with real DeepSpeed).
        for bf16_cfg, has in ((cfg(0), False), (cfg(0, bf16={"enabled": True}), False),
                              (cfg(1, bf16={"enabled": True}, gradient_clipping=0.5), True),
                              (cfg(2, bf16={"enabled": True}, gradient_clipping=0.5), True)):
            m = toy(torch)
            e, o, _, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=bf16_cfg)
            for name in ("overflow", "cur_scale", "loss_scale"):
                if hasattr(o, name) != has:
                    fail(f"optimizer.{name} present={not has} for {bf16_cfg} (DeepSpeed's optimizer: {has})")
            if has:
                got = [o.cur_scale, o.loss_scale, e.loss_scale(), e.dynamic_loss_scale(), e.gradient_clipping()]
                if got != [1.0, 1.0, 1.0, False, 0.5]:
                    fail(f"bf16 {bf16_cfg}: cur_scale, loss_scale, engine.loss_scale(), dynamic_loss_scale(), "
                         f"gradient_clipping(): {got}, DeepSpeed's [1.0, 1.0, 1.0, False, 0.5]")

                def set_scale():
                    o.cur_scale = 4.0
                expect_error(RuntimeError, "cur_scale", set_scale, "setting optimizer.cur_scale")
        print("ok   init_inference, sparse attention, random-LTD, optimizer.backward/state_dict refused by name; "
              "optimizer.overflow, cur_scale and loss_scale where DeepSpeed's optimizer has them")

        # DeepSpeed's engine answers its own names and never asks the model: those uckpt lacks are refused,
        # even where the model has them (torch's Module.compile, a model attribute), and hasattr() is no way out.
        m = toy(torch)
        m.monitor = "the model's"
        e, _, _, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg(1))
        expect_error(NotImplementedError, "engine.compile", lambda: e.compile(), "engine.compile()")
        expect_error(NotImplementedError, "'monitor'", lambda: e.monitor, "engine.monitor")
        expect_error(NotImplementedError, "'get_mom'", lambda: hasattr(e, "get_mom"), "hasattr(engine, 'get_mom')")
        if e.inp is not m.inp or hasattr(e, "no_such_name"):
            fail("the engine no longer passes other names on to the model")
        # The optimizer: the names of DeepSpeed's optimizer class for the run (stage 1: its ZeRO optimizer's
        # 'loss_scaler', 'optimizer'; stage 0: torch's 'add_param_group', 'state'), not those of another class.
        expect_error(NotImplementedError, "DeepSpeedZeroOptimizer", lambda: e.optimizer.loss_scaler,
                     "stage 1: optimizer.loss_scaler")
        # 'optimizer' is read as refused but probed as absent: Accelerate's AcceleratedOptimizer.train() asks
        # hasattr(optimizer, "optimizer") at every Trainer step (docs/hf-calls.md, failure 3).
        expect_error(NotImplementedError, "'optimizer'", lambda: e.optimizer.optimizer,
                     "stage 1: optimizer.optimizer")
        if hasattr(e.optimizer, "optimizer"):
            fail("stage 1: hasattr(optimizer, 'optimizer') is True")
        if hasattr(e.optimizer, "add_param_group") or hasattr(e.optimizer, "no_such_name"):
            fail("stage 1: the optimizer claims a name DeepSpeed's ZeRO optimizer does not have")
        m0 = toy(torch)
        _, o0, _, _ = deepspeed.initialize(model=m0, model_parameters=m0.parameters(), config=cfg(0))
        expect_error(NotImplementedError, "'add_param_group'", lambda: o0.add_param_group({"params": []}),
                     "stage 0: optimizer.add_param_group")
        if hasattr(o0, "loss_scaler"):
            fail("stage 0: the optimizer claims 'loss_scaler', which the torch optimizer DeepSpeed returns lacks")
        # The config's scheduler: DeepSpeed's WarmupLR counts updates in last_batch_iteration (-1 before the
        # first); its other names uckpt's lacks are refused.
        m1 = toy(torch)
        e1, _, _, sch = deepspeed.initialize(model=m1, model_parameters=m1.parameters(), config=cfg(
            1, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}}))
        counts = [sch.last_batch_iteration]
        e1.backward(e1(torch.randn(2, 4)))
        e1.step()
        counts.append(sch.last_batch_iteration)
        if counts != [-1, 0] or sch.state_dict()["last_batch_iteration"] != 0:
            fail(f"lr_scheduler.last_batch_iteration before and after one update: {counts}, DeepSpeed's [-1, 0]")
        expect_error(NotImplementedError, "WarmupLR has 'warmup_num_steps'", lambda: sch.warmup_num_steps,
                     "lr_scheduler.warmup_num_steps")
        expect_error(NotImplementedError, "'load_state_dict'", lambda: hasattr(sch, "load_state_dict"),
                     "hasattr(lr_scheduler, 'load_state_dict')")
        if hasattr(sch, "total_num_steps"):  # WarmupDecayLR's, not WarmupLR's
            fail("lr_scheduler claims 'total_num_steps', which DeepSpeed's WarmupLR does not have")
        print("ok   DeepSpeed's engine, optimizer and scheduler names uckpt lacks refused by name, not passed on "
              "to the model; lr_scheduler.last_batch_iteration")

        # zero_to_fp32 of a bf16 run: trainable parameters from the fp32 masters, the frozen one as saved (bf16).
        model = toy(torch, frozen=True)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=cfg(2, bf16={"enabled": True}))
        engine.backward(engine(torch.randn(2, 4).bfloat16()))
        engine.step()
        d = os.path.join(sys.argv[3], "bf16")
        engine.save_checkpoint(d)
        z = __import__("uckpt.utils.zero_to_fp32", fromlist=["x"])
        sd = z.get_fp32_state_dict_from_zero_checkpoint(d)
        if sd["inp.bias"].dtype != torch.bfloat16 or sd["out.weight"].dtype != torch.float32:
            fail(f"bf16 run: frozen inp.bias {sd['inp.bias'].dtype}, out.weight {sd['out.weight'].dtype}")
        if not torch.equal(sd["out.weight"].bfloat16(), model.out.weight.detach()):
            fail("bf16 run: the fp32 master of out.weight does not round to the module's bf16 weight")
        if "inp.bias" in z.get_fp32_state_dict_from_zero_checkpoint(d, exclude_frozen_parameters=True):
            fail("exclude_frozen_parameters=True kept the frozen parameter")
        out_file = os.path.join(d, "pytorch_model.bin")
        z.convert_zero_checkpoint_to_fp32_state_dict(d, out_file, tag="global_step1")
        fresh = z.load_state_dict_from_zero_checkpoint(toy(torch).float(), d)
        if not torch.equal(torch.load(out_file)["out.weight"], sd["out.weight"]) or \
                not torch.equal(fresh.out.weight, sd["out.weight"]):
            fail("convert_zero_checkpoint_to_fp32_state_dict / load_state_dict_from_zero_checkpoint differ")
        expect_error(ValueError, "latest", lambda: z.get_fp32_state_dict_from_zero_checkpoint(sys.argv[3]),
                     "no latest")
        print("ok   zero_to_fp32 (bf16): masters as fp32, the frozen parameter as saved, exclude_frozen, convert, load")
        return

    # 2 ranks, stage 3: ds_status and a DeepSpeed-Chat style save of whole weights.
    Status = deepspeed.runtime.zero.partition_parameters.ZeroParamStatus
    model = toy(torch)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=cfg(3, zero_optimization={"stage": 3,
                                                                            "stage3_param_persistence_threshold": 0}))
    engine.backward(engine(torch.randn(2, 4)))
    engine.step()
    w = model.blocks[0].fc.weight
    if not hasattr(w, "ds_id") or w.ds_status != Status.NOT_AVAILABLE:
        fail(f"stage 3: a block weight has ds_status {getattr(w, 'ds_status', None)}, want NOT_AVAILABLE")
    saved = {}
    for name, p in model.named_parameters():  # DeepSpeed-Chat's save_zero_three_model
        fetch = [q for q in [p] if hasattr(q, "ds_id") and q.ds_status == Status.NOT_AVAILABLE]
        with deepspeed.zero.GatheredParameters(fetch, enabled=True):
            if fetch and p.ds_status != Status.AVAILABLE:
                fail(f"stage 3: {name} inside GatheredParameters has ds_status {p.ds_status}")
            saved[name] = p.data.cpu().clone()
    if w.ds_status != Status.NOT_AVAILABLE:
        fail("stage 3: ds_status not NOT_AVAILABLE again after the block")
    d = os.path.join(sys.argv[3], "z3")
    engine.save_checkpoint(d)
    z = __import__("uckpt.utils.zero_to_fp32", fromlist=["x"])
    sd = z.get_fp32_state_dict_from_zero_checkpoint(d)
    for name, t in saved.items():
        if t.shape != sd[name].shape or not torch.equal(t, sd[name]):
            fail(f"stage 3: {name} saved through ds_status/GatheredParameters {tuple(t.shape)} differs from "
                 f"zero_to_fp32's {tuple(sd[name].shape)}")
    print(f"ok   stage 3 (rank {rank}): ds_status, a DeepSpeed-Chat style save gives the whole weights")


def worker_config(deepspeed, torch):
    import tempfile
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()

    def init(config, optimizer_cls=None, **kw):
        """initialize(...) and what it printed on stderr (the engine's warnings come from C++: file descriptor 2)."""
        model = toy(torch)
        opt = optimizer_cls(model.parameters(), lr=0.01) if optimizer_cls else None
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile(mode="w+") as err:
            os.dup2(err.fileno(), 2)
            try:
                r = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=opt,
                                         config=config, **kw)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            err.seek(0)
            return r, err.read()

    if world == 1:
        quiet = cfg(1, activation_checkpointing={"partition_activations": False, "number_checkpoints": 4},
                    aio={"block_size": 1048576})
        _, err = init(quiet)
        for key in ("activation_checkpointing", "aio"):
            if key in err:
                fail(f"'{key}' was warned about: {err}")
        _, err = init(cfg(1, timers={"throughput": {"enabled": True}}))
        if "timers.throughput" not in err:
            fail(f"timers.throughput enabled: no warning naming it: {err!r}")
        print("ok   activation_checkpointing and aio accepted as DeepSpeed's engine takes them; timers.throughput "
              "warned about")

        data = [torch.randn(4) for _ in range(5)]
        for drop, batches in ((False, 3), (True, 2)):
            (_, _, loader, _), _ = init(cfg(1, dataloader_drop_last=drop), training_data=data)
            if len(loader) != batches or len(list(loader)) != batches:
                fail(f"dataloader_drop_last={drop}: {len(loader)} batches of 2 from 5 samples, want {batches}")
        print("ok   dataloader_drop_last reaches the dataloader")

        class MyAdamW(torch.optim.AdamW):  # DeepSpeed tests the exact types only
            pass

        no_config_opt = cfg(1)
        del no_config_opt["optimizer"]
        expect_error(ValueError, "zero_allow_untested_optimizer", lambda: init(no_config_opt, MyAdamW),
                     "an untested optimizer at ZeRO 1")
        init(dict(no_config_opt, zero_allow_untested_optimizer=True), MyAdamW)
        init(dict(no_config_opt, zero_optimization={"stage": 0}), MyAdamW)
        init(no_config_opt, torch.optim.AdamW)
        offload = dict(no_config_opt, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
        expect_error(ValueError, "zero_force_ds_cpu_optimizer", lambda: init(offload, torch.optim.AdamW),
                     "ZeRO-Offload with torch.optim.AdamW")
        init(dict(offload, zero_force_ds_cpu_optimizer=False), torch.optim.AdamW)
        init(offload, deepspeed.ops.adam.DeepSpeedCPUAdam)
        print("ok   zero_allow_untested_optimizer and zero_force_ds_cpu_optimizer checked as DeepSpeed does")

        expect_error(RuntimeError, "tag_validation", lambda: init(cfg(1, checkpoint={"tag_validation": "bogus"})),
                     "tag_validation bogus")
        for mode in ("Warn", "ignore", "FAIL"):
            init(cfg(1, checkpoint={"tag_validation": mode}))
        print("ok   checkpoint.tag_validation: Warn/Ignore/Fail in any case accepted, others refused")
        return

    # 2 ranks: differing tags under "Fail" stop every rank; under the default, rank 0's tag is used.
    d = sys.argv[3]
    for mode in ("Warn", "Fail"):
        (engine, _, _, _), _ = init(cfg(1, checkpoint={"tag_validation": mode}))
        engine.backward(engine(torch.randn(2, 4)))
        engine.step()
        tag = f"{mode}_rank{rank}"
        if mode == "Warn":
            engine.save_checkpoint(d, tag=tag)
            torch.distributed.barrier()
            if not os.path.isdir(os.path.join(d, "Warn_rank0")) or os.path.isdir(os.path.join(d, "Warn_rank1")):
                fail("tag_validation Warn: rank 0's tag was not used")
        else:
            expect_error(ValueError, "tag_validation", lambda: engine.save_checkpoint(d, tag=tag),
                         "tag_validation Fail with differing tags")
    print(f"ok   rank {rank}: tag_validation Fail stops every rank on differing tags; Warn saves under rank 0's")


def worker(case, work):
    import torch
    import uckpt as deepspeed
    deepspeed.init_distributed()
    os.makedirs(work, exist_ok=True)
    globals()["worker_" + case](deepspeed, torch)


def main():
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return
    case, pypath, fixture, work = sys.argv[1:5]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    if case == "script":
        case_script(pypath, fixture, work)
    elif case == "deepspeed":
        case_deepspeed(pypath, fixture, work)
    else:
        for world in (1, 2):
            launch(case, pypath, world, (os.path.join(work, f"w{world}"),))
    print(f"PASS {case}")


if __name__ == "__main__":
    main()
