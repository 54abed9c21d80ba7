"""deepspeed.zero.Init (#25): each module's own parameters partitioned as its __init__ returns, the model given
to initialize at stage 3 without being gathered whole, DeepSpeed's ds_* attributes, the partitioned-parameter
guard. Usage: zero_init_test.py CASE PYTHONPATH (CASE: partition, train, guard, refuse, deepspeed)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from testkit import fail, launch, toy_net  # noqa: E402

WORLD = 2


def config(stage=3):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def batches(torch, n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 4, generator=g) for _ in range(n)]


def slice_of(torch, whole, rank, world):
    flat = whole.detach().reshape(-1)
    ps = -(-flat.numel() // world)
    out = torch.zeros(ps, dtype=whole.dtype)
    n = max(0, min(ps, flat.numel() - rank * ps))
    out[:n] = flat[rank * ps:rank * ps + n]
    return out


def step_losses(engine, xs):
    out = []
    for x in xs:
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def losses(deepspeed, torch, model, steps=3):
    engine, *_ = deepspeed.initialize(model=model, config=config(), model_parameters=[
        p for p in model.parameters() if p.requires_grad])
    out = []
    for x in batches(torch, steps):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return engine, out


def worker_partition(deepspeed, torch, rank):
    whole = dict(toy_net(torch).named_parameters())
    with deepspeed.zero.Init(config_dict_or_path=config()):
        net = toy_net(torch)
    Status = deepspeed.runtime.zero.partition_parameters.ZeroParamStatus
    for name, p in net.named_parameters():
        w = whole[name]
        if p.ds_numel != w.numel() or tuple(p.ds_shape) != tuple(w.shape) or p.ds_status != Status.NOT_AVAILABLE:
            fail(f"{name}: ds_numel {p.ds_numel}, ds_shape {tuple(p.ds_shape)}, ds_status {p.ds_status}")
        if p.numel() != 0:
            fail(f"{name}: the placeholder holds {p.numel()} elements, want 0")
        if not torch.equal(p.ds_tensor, slice_of(torch, w, rank, WORLD)):
            fail(f"{name}: ds_tensor is not rank {rank}'s slice of the whole build's value")
    # Module.apply (a parent's weight init over its children) sees whole parameters and keeps the result.
    with deepspeed.zero.Init():
        torch.manual_seed(0)
        net2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
        net2.apply(lambda m: torch.nn.init.constant_(m.weight, 0.5) if isinstance(m, torch.nn.Linear) else None)
    if not torch.equal(net2[1].weight.ds_tensor, slice_of(torch, torch.full((3, 8), 0.5), rank, WORLD)):
        fail("Module.apply under zero.Init: the partition does not hold what fn wrote")
    # GatheredParameters(modifier_rank=0) before initialize (Hugging Face's loading pattern).
    with deepspeed.zero.GatheredParameters(list(net2[0].parameters()), modifier_rank=0):
        if tuple(net2[0].weight.shape) != (8, 4):
            fail(f"GatheredParameters: whole shape {tuple(net2[0].weight.shape)}")
        if rank == 0:
            net2[0].weight.data.fill_(2.0)
    if not torch.equal(net2[0].weight.ds_tensor, slice_of(torch, torch.full((8, 4), 2.0), rank, WORLD)):
        fail("GatheredParameters(modifier_rank=0) before initialize: rank 0's write is not in the partitions")
    if net2[0].weight.numel() != 0:
        fail("GatheredParameters: the parameter is not a placeholder again after the block")
    # module=: an existing model's parameters partitioned at once.
    built = toy_net(torch)
    deepspeed.zero.Init(module=built)
    for name, p in built.named_parameters():
        if p.numel() != 0 or not torch.equal(p.ds_tensor, slice_of(torch, whole[name], rank, WORLD)):
            fail(f"Init(module=...): {name} is not partitioned as the whole build's slice")
    # Nothing is patched after the block.
    if torch.nn.Linear.__init__.__qualname__ != "Linear.__init__" or torch.nn.Module.apply.__name__ != "apply":
        fail("zero.Init left torch.nn patched after the block")
    print(f"ok   partition (rank {rank}): placeholders, ds_* attributes, ds_tensor = the whole build's slice; "
          f"Module.apply, GatheredParameters before initialize, Init(module=)")


def worker_train(deepspeed, torch, rank):
    import copy
    _, want = losses(deepspeed, torch, toy_net(torch))
    Status = deepspeed.runtime.zero.partition_parameters.ZeroParamStatus
    with deepspeed.zero.Init(config_dict_or_path=config()):
        net = toy_net(torch)
    engine, *_ = deepspeed.initialize(model=net, config=config())
    # Never gathered whole: the units start sharded (a whole build's start gathered until the first forward).
    if net.blocks[0].fc.weight.ds_status != Status.NOT_AVAILABLE:
        fail("initialize gathered a unit of a zero.Init model")
    del engine
    # Mixed: a module built whole, outside zero.Init, inside a zero.Init model.
    whole = toy_net(torch)
    with deepspeed.zero.Init(config_dict_or_path=config()):
        mixed = toy_net(torch)
    mixed.blocks[1] = copy.deepcopy(whole.blocks[1])
    for label, model in (("zero.Init", toy_net), ("mixed", None), ("whole", None)):
        if label == "zero.Init":
            with deepspeed.zero.Init(config_dict_or_path=config()):
                model = toy_net(torch)
        elif label == "mixed":
            model = mixed
        else:
            model = toy_net(torch)
        engine, got = losses(deepspeed, torch, model)
        if got != want:
            fail(f"{label}: first losses {got} != the whole build's {want}")
        for name, p in model.named_parameters():
            if p.ds_status != Status.NOT_AVAILABLE and "blocks" in name:
                fail(f"{label}: {name} is whole after the steps")
            with deepspeed.zero.GatheredParameters([p]):
                value = p.detach().clone()
            if not torch.equal(p.ds_tensor, slice_of(torch, value, rank, WORLD)):
                fail(f"{label}: {name}'s ds_tensor is not this rank's slice of its gathered value")
    # A frozen parameter (uckpt keeps frozen ones whole: gathered once by initialize).
    whole = toy_net(torch)
    whole.inp.weight.requires_grad_(False)
    _, want_frozen = losses(deepspeed, torch, whole)
    with deepspeed.zero.Init(config_dict_or_path=config()):
        net = toy_net(torch)
    net.inp.weight.requires_grad_(False)
    _, got_frozen = losses(deepspeed, torch, net)
    if got_frozen != want_frozen:
        fail(f"frozen parameter: first losses {got_frozen} != the whole build's {want_frozen}")
    # bf16: partitions in bf16; an initialisation over built children (Module.apply) that overwrites the values
    # gives the whole build's, so the losses are equal too.
    cfg16 = dict(config(), bf16={"enabled": True})

    def built_bf16():
        net = toy_net(torch)
        net.apply(lambda m: (torch.nn.init.normal_(m.weight, std=0.3), torch.nn.init.zeros_(m.bias))
                  if isinstance(m, torch.nn.Linear) else None)
        return net

    def run_bf16(model):
        engine, *_ = deepspeed.initialize(model=model, config=cfg16)
        return step_losses(engine, [x.bfloat16() for x in batches(torch, 3)])

    want16 = run_bf16(built_bf16())
    with deepspeed.zero.Init(config_dict_or_path=cfg16):
        net = built_bf16()
    if net.inp.weight.ds_tensor.dtype != torch.bfloat16:
        fail(f"bf16 config: ds_tensor is {net.inp.weight.ds_tensor.dtype}")
    if run_bf16(net) != want16:
        fail("bf16: the first losses under zero.Init differ from the whole build's")
    # A checkpoint of the whole build resumed by a zero.Init build: the same next losses.
    import tempfile
    ckpt = os.path.join(tempfile.gettempdir(), f"uckpt_zero_init_{os.environ['MASTER_PORT']}")
    engine, _ = losses(deepspeed, torch, toy_net(torch), steps=2)
    engine.save_checkpoint(ckpt, tag="t")
    next_whole = step_losses(engine, batches(torch, 4)[2:])
    with deepspeed.zero.Init(config_dict_or_path=config()):
        net = toy_net(torch)
    engine, *_ = deepspeed.initialize(model=net, config=config())
    engine.load_checkpoint(ckpt, tag="t")
    if step_losses(engine, batches(torch, 4)[2:]) != next_whole:
        fail("a zero.Init build resuming a whole build's checkpoint takes other steps")
    torch.distributed.barrier()
    if rank == 0:
        import shutil
        shutil.rmtree(ckpt, ignore_errors=True)
    print(f"ok   train (rank {rank}): zero.Init, mixed and whole builds: losses {got} equal bit for bit; units "
          f"start sharded; ds_tensor is the engine's partition; a frozen parameter; bf16; resuming a checkpoint")


def worker_guard(deepspeed, torch, rank):
    for built_under_init in (False, True):
        if built_under_init:
            with deepspeed.zero.Init(config_dict_or_path=config()):
                net = toy_net(torch)
            # In-place writes outside a gather (transformers' initialize_weights_zero3 on a child's parameter):
            # DeepSpeed's parameter is a 0-element tensor there and they change nothing; so here.
            w = net.blocks[0].fc.weight
            part = w.ds_tensor.clone()
            torch.nn.init.normal_(w, std=5.0)
            torch.nn.init.trunc_normal_(w)
            with torch.no_grad():
                w.zero_()
                w.fill_(3.0)
            if not torch.equal(w.ds_tensor, part) or w.ds_status.name != "NOT_AVAILABLE":
                fail("an in-place write to a zero.Init placeholder changed its partition or status")
        else:
            net = toy_net(torch)
        engine, _ = losses(deepspeed, torch, net, steps=1)
        w = net.blocks[0].fc.weight
        for what, call in (("sum", lambda: w.sum()), ("index", lambda: w[0]), ("matmul", lambda: w @ torch.ones(8)),
                           ("data", lambda: w.data.sum()), ("repr", lambda: repr(w))):
            try:
                call()
            except RuntimeError as e:
                if "partitioned" not in str(e) or "GatheredParameters" not in str(e):
                    fail(f"{what} on a partitioned parameter: unclear message: {e}")
            else:
                fail(f"{what} on a partitioned parameter (zero.Init {built_under_init}) did not raise")
        _ = (w.shape, w.dtype, w.requires_grad, w.grad, w.ds_status)  # metadata reads stay allowed
        # `.data` outside a gather is, as DeepSpeed's, a 0-element tensor: writes in place through it (an
        # _init_weights' `module.weight.data.normal_()`) change nothing.
        with deepspeed.zero.GatheredParameters([w]):
            before = w.detach().clone()
        w.data.normal_(mean=0.0, std=5.0)
        w.data.zero_()
        with deepspeed.zero.GatheredParameters([w]):
            if not torch.equal(w.detach(), before):
                fail(f"w.data.normal_() outside a gather changed the parameter (zero.Init {built_under_init})")
        if w.data.numel() != 0 or w.ds_status.name != "NOT_AVAILABLE":
            fail(f"w.data outside a gather: {w.data.numel()} elements, status {w.ds_status}")
        # state_dict() (Hugging Face's from_pretrained reads its keys): as DeepSpeed's, 0-element values.
        sd = net.state_dict()
        if list(sd) != [n for n, _ in net.named_parameters()] or sd["blocks.0.fc.weight"].numel() != 0:
            fail(f"state_dict of a partitioned model (zero.Init {built_under_init}): {[(k, v.shape) for k, v in sd.items()]}")
        # Calling a unit directly gathers it, and frees it again.
        x = torch.ones(2, 8)
        y = net.blocks[0](x)
        with deepspeed.zero.GatheredParameters(list(net.blocks[0].parameters())):
            want = torch.tanh(torch.nn.functional.linear(x, net.blocks[0].fc.weight, net.blocks[0].fc.bias))
        if not torch.equal(y, want):
            fail("a unit called directly does not compute with its gathered parameters")
        if w.ds_status.name != "NOT_AVAILABLE":
            fail("a unit called directly leaves its parameters gathered")
        # Its forward called directly (no module hooks) gathers it too.
        y = net.blocks[0].forward(x)
        if not torch.equal(y, want) or w.ds_status.name != "NOT_AVAILABLE":
            fail("a unit's forward called directly does not gather and free it")
    print(f"ok   guard (rank {rank}): reading a partitioned parameter raises a clear error; in-place writes to "
          f"zero.Init's placeholder and through an engine parameter's .data change nothing, as DeepSpeed's; a "
          f"unit called directly, or its forward, gathers itself")


def worker_refuse(deepspeed, torch, rank):
    def expect(what, fn, words):
        try:
            fn()
        except (ValueError, TypeError) as e:
            if not all(w in str(e) for w in words):
                fail(f"{what}: the message does not name {words}: {e}")
            return
        fail(f"{what}: accepted")
    for stage in (0, 1, 2):
        with deepspeed.zero.Init():
            net = toy_net(torch)
        expect(f"initialize at stage {stage} of a zero.Init model",
               lambda: deepspeed.initialize(model=net, config=config(stage)), ["zero.Init", "stage 3"])
    for stage in (2, 3):  # a model on the meta device has no values: refused by name, never read
        meta = toy_net(torch).to("meta")
        expect(f"initialize at stage {stage} of a meta-device model",
               lambda: deepspeed.initialize(model=meta, config=config(stage)), ["is on the meta device", "zero.Init"])
    expect("Init(mpu=...)", lambda: deepspeed.zero.Init(mpu=object()), ["mpu"])
    expect("Init(remote_device='nvme')", lambda: deepspeed.zero.Init(remote_device="nvme"), ["nvme"])
    expect("Init(dtype=torch.int8)", lambda: deepspeed.zero.Init(dtype=torch.int8), ["dtype"])
    with deepspeed.zero.Init(enabled=False):
        net = toy_net(torch)
    if type(net.inp.weight) is not torch.nn.Parameter or net.inp.weight.numel() != 32:
        fail("Init(enabled=False) partitioned the model")
    print(f"ok   refuse (rank {rank}): stages 0-2, meta-device models, mpu, nvme, dtype refused by name; enabled=False does nothing")


def worker_deepspeed(deepspeed, torch, rank):
    """Real DeepSpeed's zero.Init on the same toy model: its ds_tensor (the first ds_numel elements of the
    flattened layout) against uckpt's."""
    import deepspeed as ds  # real DeepSpeed, from UCKPT_DEEPSPEED_SRC
    import ds_cpu_compat  # its CPU patches for torch 1.13 + gloo (the fixtures' scripts)
    ds_cpu_compat.apply()
    ds.init_distributed()
    import uckpt
    cfg = dict(config(), fp16={"enabled": False})
    with ds.zero.Init(config_dict_or_path=cfg, mem_efficient_linear=False):
        theirs = toy_net(torch)
    with uckpt.zero.Init(config_dict_or_path=cfg):
        ours = toy_net(torch)
    for (name, a), b in zip(theirs.named_parameters(), ours.parameters()):
        ps = a.ds_tensor.numel()
        valid = max(0, min(ps, a.ds_numel - rank * ps))
        if ps != b.ds_tensor.numel() or not torch.equal(a.ds_tensor[:valid].float(), b.ds_tensor[:valid]):
            fail(f"{name}: uckpt's ds_tensor differs from DeepSpeed's on rank {rank}")
        if tuple(a.ds_shape) != tuple(b.ds_shape) or a.ds_numel != b.ds_numel:
            fail(f"{name}: ds_shape/ds_numel differ from DeepSpeed's")
    print(f"ok   deepspeed (rank {rank}): zero.Init's partitions equal DeepSpeed 0.14.5's")
    torch.distributed.barrier()  # the ranks leave together (gloo aborts a rank whose peer is gone)
    torch.distributed.destroy_process_group()


def worker(case):
    import torch
    import uckpt as deepspeed
    if case != "deepspeed":
        deepspeed.init_distributed()
    rank = int(os.environ["RANK"])
    {"partition": worker_partition, "train": worker_train, "guard": worker_guard, "refuse": worker_refuse,
     "deepspeed": worker_deepspeed}[case](deepspeed, torch, rank)


def main():
    if sys.argv[1] == "--worker":
        return worker(sys.argv[2])
    case, pypath = sys.argv[1], sys.argv[2]
    env = None
    if case == "deepspeed":
        src = os.environ.get("UCKPT_DEEPSPEED_SRC")
        if not src:
            print("SKIP: UCKPT_DEEPSPEED_SRC is not set (real DeepSpeed's source)")
            sys.exit(77)
        scripts = sys.argv[3]  # the DeepSpeed fixtures' scripts: pyshim/ and ds_cpu_compat.py
        pypath = os.pathsep.join([pypath, src, os.path.join(scripts, "pyshim"), scripts])
    launch(os.path.abspath(__file__), case, pypath, WORLD, env=env)
    print(f"PASS {case}")


if __name__ == "__main__":
    main()
