#!/usr/bin/env python3
"""The Python engine as a Python class, and the config parsed once (issue 42, parts 3 and 4), on CPU (seconds).

usage: engine_class_test.py CASE PYTHONPATH_OF_UCKPT UCKPT_BINARY

CASE:
  engine  DeepSpeedEngine is a torch.nn.Module defined in Python: attributes can be set on it (Accelerate's
          _is_accelerate_prepared), its methods have DeepSpeed's signatures (inspect.signature), isinstance holds,
          its child `module` is the model, DeepSpeed's names torch.nn.Module also has (compile) are refused by name;
          nothing is patched onto the extension's classes; engine._config is the parsed, typed config.
  config  one rule, one message: a bad zero_optimization.stage is refused with the same words by initialize,
          zero.Init and `uckpt train`; fp16 and bf16 together likewise by initialize and zero.Init.
"""
import inspect
import subprocess

import testkit
from testkit import fail

STAGE_MESSAGE = "zero_optimization.stage 5 is not supported (0, 1, 2 or 3)"
DTYPE_MESSAGE = "fp16 and bf16 cannot both be enabled"


def config(stage=1, **extra):
    c = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
         "zero_optimization": {"stage": stage}}
    c.update(extra)
    return c


def check_attributes(engine, model):
    engine.foo = 1
    engine._is_accelerate_prepared = True  # what Accelerate's prepare() sets
    if engine.foo != 1 or engine._is_accelerate_prepared is not True:
        fail("attributes set on the engine do not read back")
    if hasattr(model, "foo"):
        fail("an attribute set on the engine landed on the model")
    print("ok   engine.foo = 1 and engine._is_accelerate_prepared = True are kept on the engine")


def check_signatures(engine):
    want = {"save_checkpoint": ["save_dir", "tag", "client_state", "save_latest", "exclude_frozen_parameters"],
            "load_checkpoint": ["load_dir", "tag", "load_module_strict", "load_optimizer_states",
                                "load_lr_scheduler_states", "load_module_only", "custom_load_fn"],
            "backward": ["loss", "allreduce_gradients", "release_loss", "retain_graph", "scale_wrt_gas"],
            "step": ["lr_kwargs"]}
    for name, params in want.items():
        got = list(inspect.signature(getattr(engine, name)).parameters)
        if got != params:
            fail(f"inspect.signature(engine.{name}): {got}, want DeepSpeed 0.14.5's {params}")
    print("ok   inspect.signature gives DeepSpeed's parameters for save_checkpoint, load_checkpoint, backward, step")


def check_class(deepspeed, torch, engine, model):
    if not (isinstance(engine, torch.nn.Module) and isinstance(engine, deepspeed.DeepSpeedEngine)
            and isinstance(engine, deepspeed.runtime.engine.DeepSpeedEngine)):
        fail(f"isinstance: {type(engine)} is not a torch.nn.Module and DeepSpeedEngine")
    if type(engine).__module__ != "uckpt.runtime.engine" or engine.module is not model:
        fail(f"the engine's class is {type(engine).__module__}.{type(engine).__name__}; module {engine.module!r}")
    if [n for n, _ in engine.named_children()] != ["module"]:
        fail(f"the engine's children: {[n for n, _ in engine.named_children()]}, want ['module']")
    for name in ("compile", "monitor"):  # compile is torch.nn.Module's too: refused all the same
        try:
            getattr(engine, name)
            fail(f"engine.{name} was answered")
        except NotImplementedError as e:
            if f"engine.{name}" not in str(e):
                fail(f"engine.{name}: the refusal does not name it: {e}")
    from uckpt import _uckpt
    for cls in (_uckpt.EngineCore, _uckpt.Config):
        if "__getattr__" in cls.__dict__:
            fail(f"_uckpt.{cls.__name__} has a __getattr__ patched onto it")
    print("ok   the engine is a torch.nn.Module of uckpt.runtime.engine with the child 'module'; engine.compile is "
          "refused by name; no __getattr__ on the extension's classes")


def check_parsed_config(engine, opt):
    c = engine._config
    got = (c.zero_optimization_stage, c.fp16_enabled, c.bfloat16_enabled, c.optimizer_name, c.steps_per_print)
    if got != (1, False, False, "adamw", 10):
        fail(f"engine._config: {got}")
    if engine.config.get("zero_optimization") != {"stage": 1}:
        fail(f"engine.config is not the dict given: {engine.config}")
    if type(opt).__module__ != "uckpt.runtime.zero_views":
        fail(f"the optimizer's class is {type(opt).__module__}.{type(opt).__name__}")
    print("ok   engine._config is the parsed config (DeepSpeedConfig's names); engine.config the dict given")


def worker_engine(deepspeed, torch):
    model = testkit.toy_net(torch)
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config())
    check_attributes(engine, model)
    check_signatures(engine)
    check_class(deepspeed, torch, engine, model)
    check_parsed_config(engine, opt)
    loss = engine(torch.randn(2, 4))
    engine.backward(loss)
    engine.step()
    if engine.global_steps != 1:
        fail(f"global_steps {engine.global_steps} after one step")
    print("ok   the engine trains a step through its Python class")


def refusal(call):
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as e:
        return str(e)
    fail("accepted")


def worker_config(deepspeed, torch):
    both = {"fp16": {"enabled": True}, "bf16": {"enabled": True}}
    messages = {
        "initialize, stage 5": (refusal(lambda: deepspeed.initialize(model=testkit.toy_net(torch), config=config(5))),
                                STAGE_MESSAGE),
        "zero.Init, stage 5": (refusal(lambda: deepspeed.zero.Init(config_dict_or_path=config(5))), STAGE_MESSAGE),
        "initialize, fp16+bf16": (refusal(lambda: deepspeed.initialize(model=testkit.toy_net(torch),
                                                                       config=config(1, **both))), DTYPE_MESSAGE),
        "zero.Init, fp16+bf16": (refusal(lambda: deepspeed.zero.Init(config_dict_or_path=config(3, **both))),
                                 DTYPE_MESSAGE),
    }
    for name, (got, want) in messages.items():
        if want not in got:
            fail(f"{name}: {got!r} does not say {want!r}")
        print(f"ok   {name}: {got}")


def check_cli(uckpt):
    out = subprocess.run([uckpt, "train", "--zero_stage", "5", "--steps", "1"], capture_output=True, text=True)
    text = out.stdout + out.stderr
    if out.returncode == 0 or STAGE_MESSAGE not in text:
        fail(f"uckpt train --zero_stage 5: exit {out.returncode}, does not say {STAGE_MESSAGE!r}:\n{text}")
    print(f"ok   uckpt train --zero_stage 5: {text.strip().splitlines()[-1]}")


def after(case, argv):
    if case == "config":
        check_cli(argv[3])


if __name__ == "__main__":
    testkit.case_main(globals(), after=after)
