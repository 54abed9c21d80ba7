"""DeepSpeed 0.14.5's API on uckpt (#40): every module and name, the comm calls, the config keys, client_state with
any object, a script's own optimizer.step() at stage 0, fp16 at stage 0 without an optimizer.

  deepspeed_api_test.py CASE PYPATH WORK
    tree           python/uckpt/_deepspeed_tree.py against the installed DeepSpeed 0.14.5's source
                   (scripts/deepspeed_api.py --check; UCKPT_DEEPSPEED_SRC, else skipped, exit 77)
    names          every module and name of that tree imports from uckpt; the issue's examples implemented or
                   refused by name; names after 0.14.5 say which release has them; DeepSpeedConfig (against real
                   DeepSpeed's when UCKPT_DEEPSPEED_SRC is set); the accelerator's memory calls
    comm           deepspeed.comm's point-to-point calls, all_to_all_single, reduce_scatter_tensor, ... (2 ranks)
    config         prescale_gradients / gradient_predivide_factor at stage 0 with DeepSpeed's arithmetic (bit for
                   bit at 2 ranks), fp16.auto_cast, offload_param below stage 3, quantize_training
    client_state   numpy values and any object in client_state: saved pickled, read back safely or refused
                   naming UCKPT_TRUST_PICKLED_CLIENT_STATE (2 ranks)
    optimizer_step loss.backward(); optimizer.step(); optimizer.zero_grad() at stage 0 (BingBertGlue), against
                   torch's own optimizer on each rank's data (2 ranks)
    fp16_stage0    an engine without optimizer at stage 0 in fp16 only casts its module
    empty_groups   a client optimizer's empty param groups dropped as DeepSpeed does, its scheduler following
                   (2 and 4 ranks)
"""
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import testkit  # noqa: E402
from testkit import fail  # noqa: E402

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def expect_error(kind, needles, fn, what):
    try:
        fn()
    except kind as e:
        for needle in ([needles] if isinstance(needles, str) else needles):
            if needle not in str(e):
                fail(f"{what}: the error does not name '{needle}': {type(e).__name__}: {e}")
        return e
    except Exception as e:  # noqa: BLE001
        fail(f"{what}: {type(e).__name__} instead of {kind.__name__}: {e}")
    fail(f"{what}: accepted")


def deepspeed_src():
    src = os.environ.get("UCKPT_DEEPSPEED_SRC", "")
    return src if src and os.path.isfile(os.path.join(src, "deepspeed", "__init__.py")) else None


def toy_cfg(stage=0, **extra):
    c = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
         "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
         "zero_optimization": {"stage": stage}}
    c.update(extra)
    return c


# ---------------------------------------------------------------- tree

def case_tree():
    src = deepspeed_src()
    if src is None:
        print("SKIPPED: UCKPT_DEEPSPEED_SRC does not name DeepSpeed 0.14.5's source; nothing was compared.")
        sys.exit(SKIP)
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "deepspeed_api.py"), src, "--check",
                        os.path.join(REPO, "python", "uckpt", "_deepspeed_tree.py")], capture_output=True, text=True)
    print(r.stdout + r.stderr)
    if r.returncode != 0:
        fail("python/uckpt/_deepspeed_tree.py differs from the installed DeepSpeed 0.14.5 (output above)")
    print("ok   the tree of modules, names and class members is DeepSpeed 0.14.5's")


# ---------------------------------------------------------------- names (one process)

def check_every_name(uckpt):
    import importlib
    from uckpt import _deepspeed_api as api, _deepspeed_tree as tree
    count, bad = 0, []
    for m in sorted(tree.MODULES):
        um = api.uckpt_name(m)
        try:
            mod = importlib.import_module(um)
        except BaseException as e:  # noqa: BLE001
            bad.append(f"import {um}: {type(e).__name__}: {e}")
            continue
        for name in sorted(api.names(m)):
            count += 1
            try:
                getattr(mod, name)
            except BaseException as e:  # noqa: BLE001
                bad.append(f"{um}.{name}: {type(e).__name__}: {e}")
    if bad:
        fail(f"{len(bad)} of DeepSpeed 0.14.5's names do not import from uckpt:\n  " + "\n  ".join(bad[:30]))
    if count < 5000:
        fail(f"only {count} names in the tree")
    print(f"ok   all {count} names of DeepSpeed 0.14.5's {len(tree.MODULES)} modules import from uckpt")
    # Every later module and name: an error naming its release, never Python's bare one.
    for m, version in sorted(tree.LATER_MODULES.items()):
        e = expect_error(ModuleNotFoundError, ["first appears in", m], lambda: importlib.import_module(api.uckpt_name(m)),
                         f"import {m}")
        if version != "HEAD" and version not in str(e):
            fail(f"import {m}: the error does not name DeepSpeed {version}: {e}")
    later = 0
    for m, by_version in sorted(tree.LATER_NAMES.items()):
        mod = importlib.import_module(api.uckpt_name(m))
        for version, listed in by_version.items():
            for name in listed.split():
                later += 1
                if hasattr(mod, name) and name not in vars(mod):
                    fail(f"hasattr({m}, {name!r}) is True; DeepSpeed 0.14.5 has no such name")
                if name in vars(mod):
                    continue  # uckpt's own module defines it (a name of its own)
                ns = {}
                expect_error(ImportError, ["first appears in", f"{m}.{name}"],
                             lambda: exec(f"from {api.uckpt_name(m)} import {name}", ns), f"from {m} import {name}")
    print(f"ok   {len(tree.LATER_MODULES)} modules and {later} names of later DeepSpeed releases: errors naming "
          "the release (ImportError / ModuleNotFoundError; hasattr() False)")


def case_names(pypath, work):
    testkit.launch(__file__, "names", pypath, 1, (work,))


def worker_names(deepspeed, torch, work):
    check_every_name(deepspeed)
    # The examples.
    from uckpt import DeepSpeedConfig, DeepSpeedTransformerConfig, DeepSpeedTransformerLayer  # noqa: F401
    expect_error(NotImplementedError, ["DeepSpeedTransformerConfig", "fused transformer kernels"],
                 lambda: DeepSpeedTransformerConfig(batch_size=1, hidden_size=8), "DeepSpeedTransformerConfig()")
    expect_error(NotImplementedError, "fused transformer kernels", lambda: DeepSpeedTransformerLayer(None),
                 "DeepSpeedTransformerLayer()")
    c = deepspeed.runtime.config
    if (c.LAMB_OPTIMIZER, c.ONEBIT_LAMB_OPTIMIZER, c.TRAIN_BATCH_SIZE) != ("lamb", "onebitlamb", "train_batch_size"):
        fail("deepspeed.runtime.config's constants are not DeepSpeed's values")
    # Assigned twice in a row (the last counts) and from another constant (bing_bert reads both).
    from uckpt.runtime.constants import SPARSE_MODE_DEFAULT, TRAIN_MICRO_BATCH_SIZE_PER_GPU
    if (TRAIN_MICRO_BATCH_SIZE_PER_GPU, SPARSE_MODE_DEFAULT) != ("train_micro_batch_size_per_gpu", "fixed"):
        fail("deepspeed.runtime.constants' reassigned and aliased constants are not DeepSpeed's values")
    # Values DeepSpeed's code changes after their first assignment (EXPORT_ENVS grows by +=) or that depend on what
    # is installed (the transformers module, else None) are refused, not answered with one literal.
    from uckpt.launcher.runner import EXPORT_ENVS
    from uckpt.linear.context_manager import transformers as linear_transformers
    expect_error(NotImplementedError, "EXPORT_ENVS", lambda: list(EXPORT_ENVS), "launcher.runner.EXPORT_ENVS")
    expect_error(NotImplementedError, "context_manager.transformers", lambda: bool(linear_transformers),
                 "linear.context_manager.transformers")
    import uckpt.module_inject
    expect_error(NotImplementedError, ["replace_transformer_layer", "kernel injection"],
                 lambda: uckpt.module_inject.replace_transformer_layer(None, None), "module_inject")
    from uckpt.compression.compress import init_compression, redundancy_clean
    expect_error(NotImplementedError, "compression", lambda: init_compression(None, None), "init_compression")
    expect_error(NotImplementedError, "compression", lambda: redundancy_clean(None, None), "redundancy_clean")
    from uckpt.runtime.zero.offload_config import OffloadDeviceEnum
    if OffloadDeviceEnum("cpu") is not OffloadDeviceEnum.cpu or OffloadDeviceEnum.cpu != "cpu":
        fail("OffloadDeviceEnum is not DeepSpeed's str enum")
    expect_error(ImportError, ["OffloadStateTypeEnum", "DeepSpeed 0.15.2"],
                 lambda: exec("from uckpt.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum"),
                 "OffloadStateTypeEnum")
    if hasattr(deepspeed.runtime.zero.offload_config, "OffloadStateTypeEnum"):
        fail("hasattr(offload_config, 'OffloadStateTypeEnum') is True")
    expect_error(ModuleNotFoundError, ["deepspeed.runtime.domino", "DeepSpeed 0.16.0"],
                 lambda: exec("from uckpt.runtime.domino.transformer import DominoTransformer"), "runtime.domino")
    print("ok   the issue's names: DeepSpeedTransformerLayer/Config refused naming fused transformer kernels, "
          "runtime.config's constants, module_inject, compression.compress; OffloadStateTypeEnum and runtime.domino "
          "name their release")
    # The accelerator's memory calls (DeepSpeed's CPU accelerator: the process's memory).
    acc = deepspeed.get_accelerator()
    for call in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                 "total_memory", "available_memory", "memory_cached", "max_memory_cached"):
        v = getattr(acc, call)()
        if not isinstance(v, int) or v <= 0:
            fail(f"get_accelerator().{call}() = {v!r}")
    acc.reset_peak_memory_stats()
    acc.reset_max_memory_allocated()
    if not isinstance(acc.memory_stats(), dict) or acc.get_rng_state() is None or acc.random() is not torch.random:
        fail("get_accelerator()'s memory_stats/get_rng_state/random")
    expect_error(NotImplementedError, ["create_op_builder", "op builders"], lambda: acc.create_op_builder("x"),
                 "create_op_builder")
    print("ok   get_accelerator(): memory_allocated, total_memory, ... answered; op builders refused by name")
    # A later release's engine name: AttributeError naming it (hasattr False, as DeepSpeed 0.14.5's engine).
    model = testkit.toy_net(torch)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=toy_cfg(1))
    if hasattr(engine, "offload_states"):
        fail("hasattr(engine, 'offload_states') is True (DeepSpeed 0.14.5's engine has no offload_states)")
    expect_error(AttributeError, ["offload_states", "first appears in"], lambda: engine.offload_states(),
                 "engine.offload_states()")
    expect_error(NotImplementedError, "compile", lambda: engine.compile(), "engine.compile()")
    if engine.fp16_auto_cast() is not None:
        fail("engine.fp16_auto_cast() is not None outside fp16")
    print("ok   engine.offload_states (DeepSpeed 0.15.2+) is an AttributeError naming the release")
    check_deepspeed_config(deepspeed, work)


CONFIGS = [
    {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 5, "gradient_clipping": 1.0,
     "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.01}},
     "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
     "fp16": {"enabled": True, "loss_scale_window": 500, "auto_cast": True}, "prescale_gradients": False,
     "zero_optimization": {"stage": 2}},
    {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
     "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "gradient_predivide_factor": 2.0,
     "dataloader_drop_last": True},
    {"train_batch_size": 16, "fp16": {"enabled": True}, "zero_optimization": {"stage": 1}},
    # sparse_attention: each mode's keys, defaults filled in (bing_bert reads them from DeepSpeedConfig)
    {"train_batch_size": 8, "sparse_attention": {"mode": "fixed", "block": 32, "num_local_blocks": 8}},
    {"train_batch_size": 8, "sparse_attention": {}},
    {"train_batch_size": 8, "sparse_attention": {"mode": "variable", "local_window_blocks": [2, 4],
                                                 "global_block_end_indices": [1], "num_local_blocks": 9}},
    {"train_batch_size": 8, "sparse_attention": {"mode": "bigbird", "num_random_blocks": 2}},
    {"train_batch_size": 8, "sparse_attention": {"mode": "bslongformer"}},
    {"train_batch_size": 8, "sparse_attention": {"mode": "dense", "block": 64}},
]
CONFIG_KEYS = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
               "gradient_clipping", "fp16_enabled", "bfloat16_enabled", "fp16_auto_cast", "loss_scale",
               "initial_dynamic_scale", "dynamic_loss_scale_args", "zero_enabled", "zero_optimization_stage",
               "optimizer_name", "optimizer_params", "scheduler_name", "scheduler_params", "prescale_gradients",
               "gradient_predivide_factor", "dataloader_drop_last", "wall_clock_breakdown",
               "load_universal_checkpoint", "global_rank", "world_size", "sparse_attention"]


def config_record(cls):
    out = []
    for cfg in CONFIGS:
        c = cls(cfg)
        out.append({k: getattr(c, k) for k in CONFIG_KEYS})
    return out


def check_deepspeed_config(deepspeed, work):
    import json
    ours = config_record(deepspeed.DeepSpeedConfig)
    if ours[0]["train_micro_batch_size_per_gpu"] != 2 or ours[0]["gradient_accumulation_steps"] != 4:
        fail(f"DeepSpeedConfig's batch sizes: {ours[0]}")
    expect_error(NotImplementedError, "zero_config", lambda: deepspeed.DeepSpeedConfig(CONFIGS[0]).zero_config,
                 "DeepSpeedConfig.zero_config")
    src = deepspeed_src()
    if src is None:
        print("ok   DeepSpeedConfig answers (real DeepSpeed not given: not compared)")
        return
    script = (f"import json, sys; sys.path.insert(0, {HERE!r}); import deepspeed_api_test as t; "
              "from deepspeed.runtime.config import DeepSpeedConfig; "
              "print('RECORD ' + json.dumps(t.config_record(DeepSpeedConfig), default=str))")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env.update(PYTHONPATH=src, DS_ACCELERATOR="cpu")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RECORD ")]
    if r.returncode != 0 or not lines:
        fail(f"real DeepSpeed's DeepSpeedConfig failed:\n{r.stdout}\n{r.stderr[-3000:]}")
    theirs = json.loads(lines[-1][len("RECORD "):])
    ours = json.loads(json.dumps(ours, default=str))
    for i, (a, b) in enumerate(zip(ours, theirs)):
        for k in CONFIG_KEYS:
            if a[k] != b[k]:
                fail(f"config {i}: DeepSpeedConfig.{k}: uckpt {a[k]!r}, DeepSpeed {b[k]!r}")
    print(f"ok   DeepSpeedConfig: {len(CONFIG_KEYS)} answers equal real DeepSpeed 0.14.5's on {len(CONFIGS)} configs")


# ---------------------------------------------------------------- comm (2 ranks)

def worker_comm(deepspeed, torch, work):
    dist = deepspeed.comm
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = 1 - rank
    t = torch.full((3,), float(rank))
    if rank == 0:
        dist.send(t + 10, dst=peer, prof=True, log_name="send")
        got = torch.zeros(3)
        if dist.irecv(got, src=peer) is not None:
            fail("irecv returned a handle (DeepSpeed 0.14.5's blocks and returns None)")
    else:
        got = torch.zeros(3)
        dist.recv(got, src=peer)
        if dist.isend(t + 20, dst=peer) is not None:
            fail("isend returned a handle")
    expected = 20 + peer if rank == 0 else 10 + peer
    if not torch.equal(got, torch.full((3,), float(expected))):
        fail(f"point-to-point: got {got.tolist()}")
    inp = torch.arange(4, dtype=torch.float32) + 4 * rank
    out = torch.empty(4)
    dist.all_to_all_single(out, inp)
    exp = torch.tensor([2 * rank, 2 * rank + 1, 4 + 2 * rank, 5 + 2 * rank], dtype=torch.float32)
    if not torch.equal(out, exp):
        fail(f"all_to_all_single: {out.tolist()} != {exp.tolist()}")
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.ones(4) * (rank + 1))
    if not torch.equal(rs, torch.full((2,), 3.0)):
        fail(f"reduce_scatter_tensor: {rs.tolist()}")
    ag = torch.empty(2 * world)
    dist.all_gather_into_tensor(ag, torch.full((2,), float(rank)))
    dist.allgather_fn(ag, torch.full((2,), float(rank)))
    if not torch.equal(ag, torch.tensor([0.0, 0.0, 1.0, 1.0])):
        fail(f"all_gather_into_tensor: {ag.tolist()}")
    m = torch.tensor([float(rank)])
    dist.all_reduce(m, op=deepspeed.comm.reduce_op.ReduceOp.MAX, prof=False, log_name="x")
    s = torch.tensor([1.0])
    dist.all_reduce(s, op=dist.ReduceOp.SUM)
    if m.item() != 1.0 or s.item() != 2.0:
        fail("all_reduce with DeepSpeed's and torch's ReduceOp")
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=1, log_name="bcast")
    dist.barrier(prof=True)
    world_group = dist.get_world_group()
    if b.item() != 1.0 or dist.get_global_rank(world_group, 1) != 1 or \
            dist.get_all_ranks_from_group(world_group) != [0, 1]:
        fail("broadcast / get_global_rank / get_all_ranks_from_group")
    print("ok   deepspeed.comm: send/recv, isend/irecv, all_to_all_single, reduce_scatter_tensor, "
          "all_gather_into_tensor, all_reduce (DeepSpeed's ReduceOp), broadcast, barrier, ranks")


# ---------------------------------------------------------------- config (1-3 ranks)

def stderr_of(fn):
    """fn()'s result and what it wrote to file descriptor 2 (the C++ engine's warnings too)."""
    import tempfile
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as f:
        os.dup2(f.fileno(), 2)
        try:
            result = fn()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        return result, f.read().decode(errors="replace")


def local_grads(torch, model, x):
    model.zero_grad()
    model(x).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def worker_config(deepspeed, torch, work):
    import copy
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # Stage 0's averaging, DeepSpeed's arithmetic (engine.allreduce_bucket), bit for bit at 2 ranks (a sum of two is
    # the same in any order): postscale (the default) with predivide f: (g0/f + g1/f) * (f/W); prescale: g/W summed.
    for label, extra in (("default", {}), ("gradient_predivide_factor 3", {"gradient_predivide_factor": 3.0}),
                         ("prescale_gradients", {"prescale_gradients": True})):
        model = testkit.toy_net(torch)
        ref = copy.deepcopy(model)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=toy_cfg(0, **extra))
        opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0, foreach=False)
        f = extra.get("gradient_predivide_factor", 1.0)
        for step in range(3):
            xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(world)]
            engine.backward(engine(xs[rank]))
            engine.step()
            grads = [local_grads(torch, ref, x) for x in xs]
            for i, p in enumerate(ref.parameters()):
                if extra.get("prescale_gradients"):
                    g = sum(gr[i] * (1.0 / world) for gr in grads)
                else:
                    g = sum(gr[i] * (1.0 / f) if f != 1.0 else gr[i] for gr in grads)
                    if f != world:
                        g = g * (f / world)
                p.grad = g
            opt.step()
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            if world <= 2 and not torch.equal(a.detach(), b.detach()):
                fail(f"{label}: {n} differs from DeepSpeed's arithmetic by {(a - b).abs().max().item()}")
            if world > 2 and not torch.allclose(a.detach(), b.detach(), rtol=1e-6, atol=1e-7):
                fail(f"{label}: {n} differs from DeepSpeed's arithmetic by {(a - b).abs().max().item()}")
    print(f"ok   stage 0 at {world} rank(s): default, gradient_predivide_factor 3 and prescale_gradients average as "
          "DeepSpeed's allreduce_bucket does")
    # Stages 1-2: DeepSpeed's reduce_scatter averaging ignores them (a warning); stage 3 refuses them, as DeepSpeed.
    model = testkit.toy_net(torch)
    _, err = stderr_of(lambda: deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=toy_cfg(2, prescale_gradients=True)))
    if rank == 0 and "changes nothing" not in err:
        fail(f"prescale_gradients at stage 2: no warning: {err}")
    model = testkit.toy_net(torch)
    expect_error(Exception, ["prescale_gradients", "stage 3"],
                 lambda: deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=toy_cfg(3, prescale_gradients=True)), "prescale at stage 3")
    # offload_param below stage 3: ignored, as DeepSpeed (DeepSpeed-Chat's --offload sets it at every stage).
    for stage, device in ((0, "cpu"), (1, "nvme"), (2, "cpu")):
        model = testkit.toy_net(torch)
        zero = {"stage": stage, "offload_param": {"device": device, "pin_memory": True}}
        (engine, _, _, _), err = stderr_of(lambda: deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=toy_cfg(stage, zero_optimization=zero)))
        engine.backward(engine(torch.randn(2, 4)))
        engine.step()
        if rank == 0 and "offload_param applies to stage 3 only" not in err:
            fail(f"offload_param at stage {stage}: no warning: {err}")
    print("ok   offload_param below stage 3 ignored with a warning (cpu and nvme), as DeepSpeed ignores it")
    model = testkit.toy_net(torch)
    expect_error(Exception, "quantize_training",
                 lambda: deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=toy_cfg(0, quantize_training={"enabled": True})),
                 "quantize_training")
    _, err = stderr_of(lambda: deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=toy_cfg(0, quantize_training={"enabled": False})))
    if "quantize_training" in err:
        fail(f"quantize_training disabled: warned: {err}")
    print("ok   quantize_training enabled refused by name; disabled accepted")
    # fp16.auto_cast: every tensor among the positional inputs made half (integers too), keyword inputs not.
    seen = {}

    class Probe(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, x, ids, pair, extra=None):
            seen.update(x=x.dtype, ids=ids.dtype, pair=[t.dtype for t in pair], extra=extra.dtype)
            return self.fc(x).float().pow(2).mean()

    fp16 = {"enabled": True, "auto_cast": True}
    probe = Probe()
    engine, _, _, _ = deepspeed.initialize(model=probe, model_parameters=probe.parameters(),
                                           config=toy_cfg(1, fp16=fp16))
    engine(torch.randn(2, 4), torch.tensor([1, 2]), (torch.randn(2), torch.tensor([3])), extra=torch.randn(2))
    if seen != {"x": torch.half, "ids": torch.half, "pair": [torch.half, torch.half], "extra": torch.float32}:
        fail(f"fp16.auto_cast: the module saw {seen}")
    if engine.fp16_auto_cast() is not True:
        fail("engine.fp16_auto_cast() is not True")
    print("ok   fp16.auto_cast: positional tensors cast to half as DeepSpeed's _cast_inputs_half, keywords not")


# ---------------------------------------------------------------- client_state (2 ranks)

class Thing:
    """An object of the script's own (DeepSpeed pickles it into the model-states file)."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Thing) and other.value == self.value


def worker_client_state(deepspeed, torch, work):
    import numpy as np
    rank = torch.distributed.get_rank()
    model = testkit.toy_net(torch)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=toy_cfg(1))
    engine.backward(engine(torch.randn(2, 4)))
    engine.step()
    np.random.seed(7)
    rng = np.random.get_state()
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    state = {"np_rng": rng, "arr": arr, "scalar": np.float64(2.5), "bytes": b"\x00\x01", "set": {1, 2},
             "nested": {"list": [arr, (np.int64(3), "x")]}, "torch_rng": torch.get_rng_state()}
    engine.save_checkpoint(work, tag="numpy", client_state=state)
    # As DeepSpeed saves it: the model-states file's own pickle, which torch.load (weights_only=False) reads.
    saved = torch.load(os.path.join(work, "numpy", "mp_rank_00_model_states.pt"), weights_only=False)
    if not (saved["np_rng"][0] == "MT19937" and np.array_equal(saved["np_rng"][1], rng[1])
            and np.array_equal(saved["arr"], arr) and saved["arr"].dtype == np.float32):
        fail("the saved file's np_rng / arr are not numpy's values")
    _, cs = engine.load_checkpoint(work, tag="numpy")
    if not (isinstance(cs["arr"], np.ndarray) and np.array_equal(cs["arr"], arr) and cs["arr"].dtype == np.float32):
        fail(f"arr came back as {cs['arr']!r}")
    np.random.set_state(cs["np_rng"])
    if np.random.rand() != (np.random.seed(7), np.random.rand())[1]:
        fail("np.random.set_state(loaded state) does not continue numpy's generator")
    if cs["scalar"] != 2.5 or cs["bytes"] != b"\x00\x01" or cs["set"] != {1, 2}:
        fail(f"scalar/bytes/set came back as {cs['scalar']!r}, {cs['bytes']!r}, {cs['set']!r}")
    if not np.array_equal(cs["nested"]["list"][0], arr) or cs["nested"]["list"][1][0] != 3:
        fail(f"nested came back as {cs['nested']!r}")
    if not torch.equal(cs["torch_rng"], state["torch_rng"]):
        fail("torch_rng came back different")
    print("ok   numpy arrays, np.random.get_state(), bytes and sets in client_state: saved pickled (torch.load "
          "reads them), loaded back by the safe reader")
    # Any other object: saved as DeepSpeed does; loaded only when trusted, else refused naming the opt-in.
    engine.save_checkpoint(work, tag="object", client_state={"thing": Thing(3)})
    saved = torch.load(os.path.join(work, "object", "mp_rank_00_model_states.pt"), weights_only=False)
    if saved["thing"] != Thing(3):
        fail("the saved file's object is not the script's")
    expect_error(Exception, ["UCKPT_TRUST_PICKLED_CLIENT_STATE", "Thing"],
                 lambda: engine.load_checkpoint(work, tag="object"), "an object without the opt-in")
    os.environ["UCKPT_TRUST_PICKLED_CLIENT_STATE"] = "1"
    try:
        _, cs = engine.load_checkpoint(work, tag="object")
    finally:
        del os.environ["UCKPT_TRUST_PICKLED_CLIENT_STATE"]
    if cs["thing"] != Thing(3):
        fail(f"trusted load gave {cs['thing']!r}")
    expect_error(TypeError, "tensor", lambda: engine.save_checkpoint(work, tag="bad",
                                                                     client_state={"t": Thing(torch.ones(1))}),
                 "a tensor inside an object")
    print("ok   an object of the script's: saved pickled; loading refused naming UCKPT_TRUST_PICKLED_CLIENT_STATE, "
          "loaded with it")


# ---------------------------------------------------------------- optimizer_step (2 ranks)

def worker_optimizer_step(deepspeed, torch, work):
    import copy
    rank = torch.distributed.get_rank()
    for label, make in (("config AdamW", None),
                        ("client SGD", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))):
        model = testkit.toy_net(torch)
        ref = copy.deepcopy(model)
        cfg = toy_cfg(0)
        if make is not None:
            del cfg["optimizer"]
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                                       optimizer=make(model.parameters()) if make else None)
        ref_opt = make(ref.parameters()) if make else torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0,
                                                                                 foreach=False)
        for step in range(4):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = engine(x)
            loss.backward()  # the script's own backward: no reduction over the ranks, as under DeepSpeed
            if step == 2:
                for g in optimizer.param_groups:
                    g["lr"] = g["lr"] * 0.5
                for g in ref_opt.param_groups:
                    g["lr"] = g["lr"] * 0.5
            optimizer.step()
            optimizer.zero_grad()
            ref_loss = ref(x)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            if loss.item() != ref_loss.item():
                fail(f"{label}: step {step}: loss {loss.item()} != torch's {ref_loss.item()}")
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            if not torch.equal(a.detach(), b.detach()):
                fail(f"{label}: {n} differs from torch's optimizer on this rank's data")
        if engine.global_steps != 0:
            fail(f"{label}: global_steps moved ({engine.global_steps})")
    model = testkit.toy_net(torch)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=toy_cfg(1))
    engine(torch.randn(2, 4)).backward()
    expect_error(RuntimeError, "engine.step()", lambda: optimizer.step(), "optimizer.step() at stage 1")
    print("ok   stage 0: the script's loss.backward(), optimizer.step(), optimizer.zero_grad() equal torch's optimizer "
          "on each rank's own data (config AdamW, client SGD, lr set by hand); stage 1 refuses it naming engine.step()")


# ---------------------------------------------------------------- empty param groups and a client scheduler

def worker_empty_groups(deepspeed, torch, work):
    """VisualChat's pattern: four param groups, two empty, and a LambdaLR made on them before initialize. DeepSpeed
    drops the empty groups in place and its first step then stops in torch's LambdaLR (one lambda per original group);
    uckpt drops them too and gives the scheduler the kept groups' lambdas and base lrs."""
    lambdas = (lambda s: 1.0 / (s + 1), lambda s: 7.0, lambda s: 0.5 ** s, lambda s: 9.0)
    if deepspeed.dist is not None:  # DeepSpeed's module global, bound by initialize()
        fail(f"deepspeed.dist before initialize: {deepspeed.dist!r}, DeepSpeed's is None")
    for stage, make in ((0, lambda gs: torch.optim.SGD(gs, lr=0.1)), (2, lambda gs: torch.optim.AdamW(gs, lr=0.1))):
        model = testkit.toy_net(torch)
        params = list(model.parameters())
        opt = make([{"params": params[:2], "lr": 0.1}, {"params": [], "lr": 0.2},
                    {"params": params[2:], "lr": 0.01}, {"params": [], "lr": 0.3}])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, list(lambdas))
        if stage == 0:  # the schedulers inside a SequentialLR follow too
            constant = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0] * 4)
            sched = torch.optim.lr_scheduler.SequentialLR(opt, [sched, constant], milestones=[10])
        cfg = toy_cfg(stage)
        del cfg["optimizer"]
        engine, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                                                  config=cfg)
        if deepspeed.dist is not deepspeed.comm:
            fail(f"deepspeed.dist after initialize: {deepspeed.dist!r}, DeepSpeed's is deepspeed.comm")
        if len(optimizer.param_groups) != 2:
            fail(f"stage {stage}: {len(optimizer.param_groups)} param groups after initialize (DeepSpeed keeps 2)")
        for step in range(3):
            engine.backward(engine(torch.randn(2, 4)))
            engine.step()
            want = (0.1 * lambdas[0](step + 1), 0.01 * lambdas[2](step + 1))
            got = tuple(g["lr"] for g in optimizer.param_groups)
            if any(abs(a - b) > 1e-12 for a, b in zip(got, want)) or lr_scheduler.get_last_lr() != list(got):
                fail(f"stage {stage}, step {step}: lrs {got}, scheduler {lr_scheduler.get_last_lr()}; want {want}")
    print("ok   empty param groups dropped as DeepSpeed drops them (stages 0 and 2); the client LambdaLR made before "
          "initialize keeps each kept group's lambda and base lr (DeepSpeed 0.14.5 stops at its first step)")


# ---------------------------------------------------------------- fp16 at stage 0 without an optimizer

def worker_fp16_stage0(deepspeed, torch, work):
    model = testkit.toy_net(torch)
    cfg = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True}, "zero_optimization": {"stage": 0}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg)
    if optimizer is not None or any(p.dtype != torch.half for p in model.parameters()):
        fail("the engine without optimizer did not cast its module to fp16")
    with torch.no_grad():
        out = engine(torch.randn(2, 4).half())
    if out.dtype != torch.half:
        fail(f"forward gave {out.dtype}")
    expect_error(AssertionError, "must provide optimizer", lambda: engine.backward(out), "backward without optimizer")
    print("ok   an engine without optimizer at stage 0 in fp16 casts its module (DeepSpeed-Chat's reference models)")


# ---------------------------------------------------------------- main

def worker(case, work):
    import torch
    import uckpt as deepspeed
    deepspeed.init_distributed()
    os.makedirs(work, exist_ok=True)
    globals()["worker_" + case](deepspeed, torch, work)


WORLDS = {"comm": (2,), "config": (1, 2, 3), "client_state": (2,), "optimizer_step": (2,), "fp16_stage0": (1,),
          "empty_groups": (2, 4)}


def main():
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return
    case, pypath, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    if case == "tree":
        case_tree()
    elif case == "names":
        case_names(pypath, work)
    else:
        for world in WORLDS[case]:
            testkit.launch(__file__, case, pypath, world, (os.path.join(work, f"w{world}"),))
    print(f"PASS {case}")


if __name__ == "__main__":
    main()
