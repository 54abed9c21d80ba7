#!/usr/bin/env python3
"""engine.optimizer.state_dict() at ZeRO stages 1 and 2 (#40: DeepSpeedExamples' imagenet main.py torch.saves it
every epoch) against real DeepSpeed 0.14.5's DeepSpeedZeroOptimizer.state_dict() of the same run (CPU, 2 ranks, Gloo,
seconds; without DeepSpeed 0.14.5 installed: skipped, exit 77).

usage: zero_optimizer_state_dict_test.py CASE PYPATH WORK

CASE: stage1, stage2   fp32, a client torch.optim.SGD with momentum (imagenet's), 3 steps. On each rank the dict's
        keys in DeepSpeed's order, every value's Python type, the loss scaler's class and fields, ZeroStageEnum,
        the base optimizer's state_dict (state tensors bit for bit, param groups), the fp32 partitions (shapes, bit
        for bit), group_paddings, partition_count, ds_version and param_slice_mappings equal DeepSpeed's; uckpt's
        dict survives torch.save + torch.load(weights_only=True) with DeepSpeed's three state classes allowed (as
        DeepSpeed's needs them allowed); load_state_dict() is refused naming DeepSpeed's call.
  stage1_fp16  uckpt alone at 4 ranks (DeepSpeed's engine refuses fp16 on the CPU), imagenet's ds_fp16_z1_config.json case:
        the dict torch.saves as main.py saves it, holds DeepSpeed's DynamicLossScaler at the engine's scale, the
        fp32 masters and SGD's state, and reads back with weights_only=True; its last step overflows, so
        'overflow' is True (DeepSpeed's optimizer saves its own `overflow`), and a fresh engine that
        load_checkpoint()s it has optimizer.overflow True again (DeepSpeed's takes it back with the loss scaler).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import testkit  # noqa: E402
from testkit import fail, have_deepspeed  # noqa: E402

SKIP = 77
STEPS = 3


def config(stage, fp16=False):
    return {**({"fp16": {"enabled": True, "initial_scale_power": 8}} if fp16 else {}),"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "gradient_clipping": 1.0}


def net(torch):
    torch.manual_seed(0)
    # 3 + 8*4+8 + 3*8 = 67 elements: the partitions need padding at 2 ranks.
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def neutral(torch, v):
    """`v` with DeepSpeed's objects as (class name, fields): comparable across the two processes' classes.
    (param_slice_mappings' OrderedDicts come back as dicts from uckpt: both count as "dict".)"""
    if type(v).__name__ == "ZeroStageEnum":
        return "ZeroStageEnum", int(v)
    if isinstance(v, torch.dtype):
        return "dtype", str(v)
    if isinstance(v, dict):
        return "dict", [(k, neutral(torch, x)) for k, x in v.items()]
    if isinstance(v, (list, tuple)):
        return type(v).__name__, [neutral(torch, x) for x in v]
    if torch.is_tensor(v):
        return "tensor", str(v.dtype), tuple(v.shape), v.requires_grad, v.detach().reshape(-1).tolist()
    if isinstance(v, (bool, int, float, str)) or v is None:
        return type(v).__name__, v
    return type(v).__name__, sorted((k, neutral(torch, x)) for k, x in vars(v).items())


def check_fp16(engine, sd):
    """fp16 ZeRO-1 (imagenet's ds_fp16_z1_config.json; DeepSpeed's engine refuses fp16 on the CPU, so uckpt alone):
    DeepSpeed's DynamicLossScaler with the engine's scale, and every key as in fp32."""
    import torch
    ls = sd["loss_scaler"]
    if type(ls).__name__ != "DynamicLossScaler" or ls.cur_scale != engine.optimizer.cur_scale or not ls.dynamic \
            or sd["dynamic_loss_scale"] is not True or ls.scale_window != 1000 or ls.dtype != torch.float16:
        fail(f"fp16: loss_scaler {type(ls).__name__} {vars(ls)}, the engine's scale {engine.optimizer.cur_scale}")
    parts = sd["single_partition_of_fp32_groups"]
    if any(t.dtype != torch.float32 or not t.requires_grad for t in parts):
        fail(f"fp16: single_partition_of_fp32_groups are not fp32 masters: {parts}")
    if sd["overflow"] is not True or engine.optimizer.overflow is not True:
        fail(f"fp16: the last step overflowed, but state_dict()['overflow'] is {sd['overflow']!r} "
             f"and optimizer.overflow {engine.optimizer.overflow!r}")
    if "momentum_buffer" not in sd["base_optimizer_state"]["state"][0]:
        fail(f"fp16: base_optimizer_state has no SGD state: {sd['base_optimizer_state']}")


def check_overflow_restored(deepspeed, torch, engine, stage, work):
    """DeepSpeed's ZeRO optimizers take their `overflow` back from the checkpoint with the loss scaler."""
    folder = os.path.join(work, f"overflow_s{stage}")
    engine.save_checkpoint(folder)
    model = net(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    fresh, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config(stage, True))
    if fresh.optimizer.overflow is not False:
        fail(f"fp16: a fresh engine's optimizer.overflow is {fresh.optimizer.overflow!r}")
    fresh.load_checkpoint(folder)
    if fresh.optimizer.overflow is not True or fresh.optimizer.state_dict()["overflow"] is not True:
        fail(f"fp16: loaded a checkpoint saved after an overflow, but optimizer.overflow is "
             f"{fresh.optimizer.overflow!r} and state_dict()['overflow'] {fresh.optimizer.state_dict()['overflow']!r}")


def worker(impl, stage, work, fp16=False):
    import torch
    import torch.distributed as dist
    if impl == "uckpt":
        import uckpt as deepspeed
        deepspeed.init_distributed()
    else:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model = net(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config(stage, fp16))
    for step in range(STEPS):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = engine(x.half() if fp16 else x).float().pow(2).mean()
        if fp16 and step == STEPS - 1:
            loss = loss * float("inf")  # an overflow: the step is skipped
        engine.backward(loss)
        engine.step()
    sd = optimizer.state_dict()
    if fp16:
        check_fp16(engine, sd)
        check_overflow_restored(deepspeed, torch, engine, stage, work)
    path = os.path.join(work, f"{impl}_s{stage}_r{rank}.pt")
    torch.save({"optimizer": sd}, path)  # as imagenet's main.py saves it
    if impl == "uckpt":
        from uckpt.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from uckpt.runtime.zero.config import ZeroStageEnum
        from uckpt.utils.tensor_fragment import fragment_address
        try:
            torch.load(path, weights_only=True)
            fail("torch.load(weights_only=True) took the loss scaler without it being allowed (DeepSpeed's refuses)")
        except Exception as e:  # noqa: BLE001
            if "weights_only" not in str(e).lower() and "WeightsUnpickler" not in str(e):
                raise
        with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
            back = torch.load(path, weights_only=True)["optimizer"]
        if neutral(torch, back) != neutral(torch, sd):
            fail("state_dict() changed through torch.save / torch.load(weights_only=True)")
        try:  # the loss scaler holds DeepSpeed's fields; its methods are refused by name
            sd["loss_scaler"].update_scale(False)
            fail("the loss scaler's update_scale() was accepted")
        except NotImplementedError as e:
            if "update_scale" not in str(e):
                fail(f"the loss scaler's update_scale(): the refusal names nothing: {e}")
        try:
            optimizer.load_state_dict([sd] * dist.get_world_size())
            fail("optimizer.load_state_dict() was accepted")
        except RuntimeError as e:
            if "load_state_dict" not in str(e) or "load_checkpoint" not in str(e):
                fail(f"optimizer.load_state_dict(): the refusal names nothing: {e}")
    torch.save(neutral(torch, sd), path + ".neutral")


def launch(pypath, impl, stage, work, fp16=False, ranks=2):
    """This file's worker at `ranks` ranks on `impl`: uckpt from PYTHONPATH, or the real DeepSpeed this Python has."""
    testkit.launch(__file__, impl, pypath if impl == "uckpt" else "", ranks, extra=[str(stage), work, str(int(fp16))])


def first_difference(a, b, where="state_dict()"):
    if type(a) is not type(b):
        return f"{where}: {a!r:.200} vs {b!r:.200}"
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} entries vs {len(b)}: {a!r:.300} vs {b!r:.300}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{where}: {a!r:.200} vs {b!r:.200}"


def main():
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1")
        return
    case, pypath, work = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(work, exist_ok=True)
    if case == "stage1_fp16":
        launch(pypath, "uckpt", 1, work, fp16=True, ranks=4)
        print(f"PASS {case}")
        return
    stage = {"stage1": 1, "stage2": 2}[case]
    if not have_deepspeed():
        print("SKIP: DeepSpeed 0.14.5 is not installed beside torch")
        sys.exit(SKIP)
    import torch
    os.makedirs(work, exist_ok=True)
    launch(pypath, "deepspeed", stage, work)
    launch(pypath, "uckpt", stage, work)
    for r in range(2):
        ours = torch.load(os.path.join(work, f"uckpt_s{stage}_r{r}.pt.neutral"), weights_only=True)
        theirs = torch.load(os.path.join(work, f"deepspeed_s{stage}_r{r}.pt.neutral"), weights_only=True)
        d = first_difference(ours, theirs)
        if d:
            fail(f"stage {stage} rank {r}: uckpt's state_dict() differs from DeepSpeed's: {d}")
        keys = [k for k, _ in ours[1]]
        print(f"ok   stage {stage} rank {r}: state_dict() equals DeepSpeed's: {keys}")
    print(f"PASS {case}")


if __name__ == "__main__":
    main()
