#!/usr/bin/env python3
"""What Hugging Face's libraries hand DeepSpeed 0.14.5, and what they catch from it (issue 39,
docs/hf-calls.md's failures 1, 3-9), on the CPU at one rank (seconds).

usage: hf_calls_test.py CASE PYTHONPATH_OF_UCKPT

CASE:
  config     Accelerate's steps_per_print = float("inf") (and NaN, -inf) is taken as DeepSpeed takes it (never
             prints; engine.steps_per_print() returns it); a NaN or inf where no number like it makes sense is
             refused naming the key; "auto" values left in zero_optimization and its offload sections take
             DeepSpeed's defaults (its pydantic sections drop them), as in TRL's reference-model config copy.
  optimizer  hasattr(optimizer, "optimizer") answers (False) instead of raising, as Accelerate's
             AcceleratedOptimizer.train() probes it at every Trainer step; reading it still refuses by name;
             inspect.signature(engine.save_checkpoint) has exclude_frozen_parameters (the Trainer's test).
  asserts    the exception types the libraries catch: lr_scheduler.get_last_lr() before the first step raises
             AssertionError (as DeepSpeed's), and the batch-size check raises an AssertionError that is also a
             RuntimeError.
  frozen     PEFT's calls through the Trainer, at ZeRO 1-3: save_checkpoint(exclude_frozen_parameters=True)
             leaves the frozen parameters out of the model-states file's module and sets frozen_param_shapes
             and frozen_param_fragments to None, as DeepSpeed 0.14.5; load_checkpoint of it refuses with
             load_module_strict=True naming the key, and with load_module_strict=False keeps the model's
             frozen values and restores the rest; each save writes zero_to_fp32.py beside the tag folder.
  zero_init  zero.Init given the Trainer's config before initialize, "auto" still in scheduler.params (the
             Trainer fills warmup_num_steps at initialize; DeepSpeed's config keeps those sections as they
             are), as a dict and as a path: accepted.
"""
import glob
import inspect
import json
import math
import os
import shutil
import tempfile

import testkit
from testkit import fail


def config(**extra):
    c = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
         "zero_optimization": {"stage": 1}}
    c.update(extra)
    return c


def train_step(engine, torch):
    loss = engine(torch.randn(2, 4))
    engine.backward(loss)
    engine.step()


def refusal(call, types=(ValueError, TypeError, RuntimeError)):
    try:
        call()
    except types as e:
        return str(e)
    fail("accepted")


def worker_config(deepspeed, torch):
    for value in (float("inf"), float("-inf"), float("nan")):
        model = testkit.toy_net(torch)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config(steps_per_print=value))
        got = engine.steps_per_print()
        if not (got == value or (math.isnan(value) and isinstance(got, float) and math.isnan(got))):
            fail(f"steps_per_print {value}: engine.steps_per_print() is {got!r}")
        train_step(engine, torch)
        print(f"ok   steps_per_print = {value}: taken, engine.steps_per_print() = {got}, a step trains")
    for key, value in (("gradient_clipping", float("nan")), ("train_micro_batch_size_per_gpu", float("inf"))):
        c = config()
        c[key] = value
        got = refusal(lambda: deepspeed.initialize(model=testkit.toy_net(torch), config=c))
        if f"'{key}'" not in got or ("NaN" not in got and "Infinity" not in got):
            fail(f"{key} = {value}: the refusal does not name the key and the value: {got}")
        print(f"ok   {key} = {value}: refused: {got}")
    check_auto(deepspeed, torch)


def check_auto(deepspeed, torch):
    # TRL's prepare_deepspeed copy: the hidden-size "auto"s unresolved, the dotted keys beside them.
    zero = {"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "overlap_comm": "auto",
            "offload_optimizer": {"device": "none", "pin_memory": "auto"}}
    c = config(zero_optimization=zero, steps_per_print=float("inf"))
    c["zero_optimization.reduce_bucket_size"] = 4096
    model = testkit.toy_net(torch)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=c)
    if engine.zero_optimization_stage() != 2:
        fail(f"stage {engine.zero_optimization_stage()}, want 2")
    train_step(engine, torch)
    print("ok   \"auto\" in zero_optimization (bucket sizes, overlap_comm, offload_optimizer.pin_memory) takes "
          "DeepSpeed's defaults; a step trains")
    # DeepSpeed drops a "stage": "auto" too: its default, 0.
    model = testkit.toy_net(torch)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config(zero_optimization={"stage": "auto"}))
    if engine.zero_optimization_stage() != 0:
        fail(f"\"stage\": \"auto\" gave stage {engine.zero_optimization_stage()}, DeepSpeed's default is 0")
    print("ok   zero_optimization.stage \"auto\" is stage 0, DeepSpeed's default")
    # Outside DeepSpeed's pydantic sections "auto" is still refused by name.
    got = refusal(lambda: deepspeed.initialize(model=testkit.toy_net(torch),
                                               config=config(gradient_clipping="auto")))
    if "'gradient_clipping'" not in got:
        fail(f"gradient_clipping \"auto\": the refusal does not name it: {got}")
    print(f"ok   gradient_clipping \"auto\" (not a pydantic section in DeepSpeed) refused: {got}")


def worker_optimizer(deepspeed, torch):
    model = testkit.toy_net(torch)
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config())
    if hasattr(opt, "optimizer"):  # raised NotImplementedError before: hasattr lets all but AttributeError out
        fail("hasattr(optimizer, 'optimizer') is True, but uckpt's optimizer has no torch optimizer to give")
    try:
        opt.optimizer
        fail("optimizer.optimizer was answered")
    except NotImplementedError as e:
        if "optimizer.optimizer" not in str(e):
            fail(f"optimizer.optimizer: the refusal does not name it: {e}")
    print("ok   hasattr(optimizer, 'optimizer') is False; optimizer.optimizer refused by name (NotImplementedError)")
    if "exclude_frozen_parameters" not in inspect.signature(engine.save_checkpoint).parameters:
        fail("inspect.signature(engine.save_checkpoint) lacks exclude_frozen_parameters")
    print("ok   inspect.signature(engine.save_checkpoint).parameters has exclude_frozen_parameters")
    train_step(engine, torch)


def worker_asserts(deepspeed, torch):
    c = config(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2}})
    model = testkit.toy_net(torch)
    engine, _, _, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=c)
    got = refusal(sched.get_last_lr, AssertionError)
    print(f"ok   get_last_lr() before the first step: AssertionError: {got}")
    train_step(engine, torch)
    if len(sched.get_last_lr()) != 1:
        fail(f"get_last_lr() after a step: {sched.get_last_lr()}")
    bad = config(train_batch_size=3, gradient_accumulation_steps=1)
    got = refusal(lambda: deepspeed.initialize(model=testkit.toy_net(torch), config=bad), AssertionError)
    try:
        deepspeed.initialize(model=testkit.toy_net(torch), config=bad)
    except RuntimeError:
        pass
    if "train_batch_size 3" not in got:
        fail(f"the batch-size error does not give the numbers: {got}")
    print(f"ok   the batch-size check raises an AssertionError (and RuntimeError): {got}")


def frozen_net(torch):
    """The toy net with its input layer frozen (a LoRA-like split: frozen base, trainable rest)."""
    net = testkit.toy_net(torch)
    for p in net.inp.parameters():
        p.requires_grad_(False)
    return net


def worker_frozen(deepspeed, torch):
    for stage in (1, 2, 3):
        work = tempfile.mkdtemp(prefix=f"hf-calls-frozen-{stage}-")
        net = frozen_net(torch)
        engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters()
                                                                            if p.requires_grad],
                                               config=config(zero_optimization={"stage": stage}))
        train_step(engine, torch)
        engine.save_checkpoint(work, exclude_frozen_parameters=True)
        if not os.access(os.path.join(work, "zero_to_fp32.py"), os.X_OK):
            fail(f"stage {stage}: no executable zero_to_fp32.py beside the tag folder")
        files = glob.glob(os.path.join(work, "global_step1", "*model_states.pt"))
        for f in files:
            sd = torch.load(f, weights_only=False)
            left = [k for k in sd["module"] if k.startswith("inp.")]
            if left or sd["frozen_param_shapes"] is not None or sd["frozen_param_fragments"] is not None:
                fail(f"stage {stage}: {os.path.basename(f)} keeps frozen parameters: module {left}, "
                     f"frozen_param_shapes {sd['frozen_param_shapes']}, fragments {sd['frozen_param_fragments']}")
        print(f"ok   stage {stage}: save_checkpoint(exclude_frozen_parameters=True) leaves inp.* out of "
              f"{len(files)} model-states file(s), frozen_param_* None; zero_to_fp32.py written")
        want = {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad and stage < 3}
        net2 = frozen_net(torch)
        with torch.no_grad():
            net2.inp.weight.fill_(0.25)  # the model's own frozen values: kept by a non-strict load
        engine2, _, _, _ = deepspeed.initialize(model=net2, model_parameters=[p for p in net2.parameters()
                                                                              if p.requires_grad],
                                                config=config(zero_optimization={"stage": stage}))
        got = refusal(lambda: engine2.load_checkpoint(work))
        if "inp." not in got or "load_module_strict" not in got:
            fail(f"stage {stage}: a strict load of it: {got!r} does not name the key and load_module_strict")
        path, _ = engine2.load_checkpoint(work, load_module_strict=False)
        if path is None or engine2.global_steps != 1:
            fail(f"stage {stage}: load_module_strict=False: {path}, global_steps {engine2.global_steps}")
        if stage < 3:
            if not torch.all(net2.inp.weight == 0.25):
                fail(f"stage {stage}: the frozen weight was not kept")
            for n, p in net2.named_parameters():
                if n in want and not torch.equal(p.detach(), want[n]):
                    fail(f"stage {stage}: {n} not restored")
        train_step(engine2, torch)
        print(f"ok   stage {stage}: load_checkpoint refuses it with load_module_strict=True ({got.splitlines()[0]}); "
              f"with False the model's frozen values stay, the trainable ones and counters are restored")
        shutil.rmtree(work, ignore_errors=True)


def worker_zero_init(deepspeed, torch):
    c = config(zero_optimization={"stage": 3}, scheduler={"type": "WarmupLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": "auto", "total_num_steps": "auto"}})
    c["optimizer"]["params"]["lr"] = "auto"
    with deepspeed.zero.Init(config_dict_or_path=c):
        net = testkit.toy_net(torch)
    path = os.path.join(tempfile.mkdtemp(prefix="hf-calls-zero-init-"), "ds_config.json")
    with open(path, "w") as f:
        json.dump(c, f)
    with deepspeed.zero.Init(config_dict_or_path=path):
        testkit.toy_net(torch)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    if net.inp.weight.ds_status.name != "NOT_AVAILABLE":
        fail("zero.Init did not partition")
    print("ok   zero.Init takes the Trainer's config with \"auto\" in scheduler.params and optimizer.params "
          "(a dict and a path)")


if __name__ == "__main__":
    testkit.case_main(globals())
