#!/usr/bin/env python3
"""DeepSpeed 0.14.5's semantics of smaller surfaces, on CPU with a toy model (seconds).

usage: semantics_test.py CASE PYTHONPATH_OF_UCKPT

CASE:
  grads      setting .grad to None after initialize (module.zero_grad(set_to_none=True),
             p.grad = None, the optimizer's zero_grad(set_to_none=True)) or to another tensor
             trains as a loop that leaves .grad alone: equal losses at stages 0-3, 1 and 2 ranks.
  gathered   stage 3, 2 ranks: zero.GatheredParameters gathers only the given parameters; with
             modifier_rank=0 rank 0's writes become every rank's (the partitions and the next
             forward; the fp32 masters are not written, as DeepSpeed's: the next step starts from
             them); with modifier_rank=None writes are discarded (also for the always-whole root
             unit's parameters and a frozen one); a parameter of no engine is a no-op.
  writes     a write to a parameter (p.data) at stages 0-2: DeepSpeed's next step starts from it at
             stage 0 in fp32 (its optimizer steps the module's parameters) and from the fp32
             masters otherwise (bf16, ZeRO 1-2): the same here.
  buffers    non-persistent buffers are cast (bf16) with the module as DeepSpeed's module.bfloat16();
             at fp32 nothing is cast (a float64 buffer stays float64).
  surface    engine.device is a torch.device; get_accelerator() answers is_available() and
             is_bf16_supported() as DeepSpeed's (the CPU: True; CUDA: as torch); a user's class named MoE/Experts/TopKGate trains;
             uckpt's own MoE is refused; a trainable parameter left out of model_parameters gets
             no update at stages 0-2 (as DeepSpeed) and is refused at stage 3.
"""

import testkit
from testkit import fail


# ---------------------------------------------------------------- workers

def net(torch):
    return testkit.toy_net(torch)


def config(stage, **extra):
    c = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
         "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
         "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    c.update(extra)
    return c


def batch(torch, step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(2, 4, generator=g)


def train(deepspeed, torch, stage, clear, steps=3):
    """Losses of `steps` optimizer steps (GA 2), calling clear(model, optimizer, micro) after each micro-step."""
    model = net(torch)
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    out = []
    for step in range(steps):
        for micro in range(2):
            loss = engine(batch(torch, step, micro, engine.global_rank))
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            clear(model, opt, boundary, engine)
            out.append(float(loss))
    return out


def worker_grads(deepspeed, torch):
    def keep(model, opt, boundary, engine):
        pass

    def module_zero_grad(model, opt, boundary, engine):
        if boundary:
            model.zero_grad(set_to_none=True)

    def grad_none(model, opt, boundary, engine):
        if boundary:
            for p in model.parameters():
                p.grad = None

    def grad_zeros(model, opt, boundary, engine):  # another tensor, of zeros: the same as no gradient
        if boundary:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)

    def opt_zero_grad(model, opt, boundary, engine):
        if boundary:
            opt.zero_grad(set_to_none=True)

    def every_micro(model, opt, boundary, engine):
        model.zero_grad(set_to_none=True)

    def engine_every_micro(model, opt, boundary, engine):
        engine.zero_grad()

    def opt_every_micro(model, opt, boundary, engine):
        opt.zero_grad()

    def opt_zero_every_micro(model, opt, boundary, engine):
        opt.zero_grad(set_to_none=False)

    for stage in (0, 1, 2, 3):
        want = train(deepspeed, torch, stage, keep)
        for clear in (module_zero_grad, grad_none, grad_zeros, opt_zero_grad):
            got = train(deepspeed, torch, stage, clear)
            if got != want:
                fail(f"stage {stage}, {clear.__name__} between steps: losses {got} differ from {want}")
            print(f"ok   stage {stage}: {clear.__name__} trains as a loop that keeps .grad")
        # Between micro-steps: DeepSpeed's stages 2-3 keep the reduced gradients out of .grad
        # (nothing lost); at stages 0-1 the gradient accumulated so far is dropped with .grad.
        got = train(deepspeed, torch, stage, every_micro)
        if (got == want) != (stage >= 2):
            fail(f"stage {stage}, zero_grad between micro-steps: losses {got} vs {want}")
        print(f"ok   stage {stage}: zero_grad between micro-steps "
              f"{'keeps' if stage >= 2 else 'drops'} the accumulated gradient, as DeepSpeed")
        # engine.zero_grad() and optimizer.zero_grad() are DeepSpeed's .grad = None (or zero_()):
        # between micro-steps they do what the module's zero_grad does.
        for other in (engine_every_micro, opt_every_micro, opt_zero_every_micro):
            if train(deepspeed, torch, stage, other) != got:
                fail(f"stage {stage}, {other.__name__}: losses differ from module.zero_grad between micro-steps")
            print(f"ok   stage {stage}: {other.__name__} as module.zero_grad between micro-steps")


def held(t):
    """Elements of storage a tensor holds (0 for a stage-3 parameter outside its gather)."""
    return t.untyped_storage().nbytes() // t.element_size() if hasattr(t, "untyped_storage") else t.storage().size()


def worker_gathered(deepspeed, torch):
    rank = torch.distributed.get_rank()
    model = net(torch)
    model.inp.bias.requires_grad_(False)  # frozen: uckpt keeps it whole, DeepSpeed partitions it
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(3))
    w, other = model.blocks[0].fc.weight, model.blocks[1].fc.weight
    Z = deepspeed.zero.GatheredParameters
    for micro in range(2):  # one step, so that the masters differ from the initial weights
        engine.backward(engine(batch(torch, 0, micro, rank)))
        engine.step()
    if held(w) != 0 or held(other) != 0:
        fail(f"stage 3: block weights hold storage outside forward ({held(w)}, {held(other)})")
    with Z(w):
        if held(w) != 64 or held(other) != 0:
            fail(f"GatheredParameters(w) gathered {held(w)} elements of w and {held(other)} of another block")
        before = w.detach().clone()
    if held(w) != 0:
        fail("GatheredParameters(w): w still holds storage after the block")
    print("ok   GatheredParameters(params) gathers those parameters only, and frees them after")

    with Z([w], modifier_rank=None):
        w.data.fill_(7.0)
    with Z(w):
        if not torch.equal(w, before):
            fail("modifier_rank=None: a write inside the block was kept")
    print("ok   modifier_rank=None: writes are discarded")

    with Z(w, modifier_rank=0):
        if rank == 0:
            w.data.fill_(0.25)
    with Z(w):
        if not torch.all(w == 0.25):
            fail(f"modifier_rank=0: rank {rank} sees {w.flatten()[:4].tolist()}, not rank 0's 0.25")
    # The next forward sees the new values: a hook on the block reads them.
    seen = []
    h = model.blocks[0].fc.register_forward_pre_hook(lambda m, i: seen.append(m.weight.detach().clone()))
    loss = engine(batch(torch, 1, 0, rank))
    h.remove()
    if not torch.all(seen[0] == 0.25):
        fail(f"modifier_rank=0: the next forward on rank {rank} used {seen[0].flatten()[:4].tolist()}")
    engine.backward(loss)
    engine.step()
    engine.backward(engine(batch(torch, 1, 1, rank)))
    engine.step()
    with Z(w):
        # DeepSpeed's stage 3 steps its fp32 masters, which the write did not reach: the
        # step's result starts from `before`, not from 0.25 (an AdamW step of lr 0.05 moves
        # each weight by at most about 0.05).
        if (w - before).abs().max() > 0.1 or torch.all(w == 0.25):
            fail(f"after a step the weights {w.flatten()[:4].tolist()} do not come from the masters "
                 f"{before.flatten()[:4].tolist()}")
    print("ok   modifier_rank=0: rank 0's writes reach every rank's partition and the next forward; "
          "the step starts from the fp32 masters (as DeepSpeed)")

    # The root unit's parameters (always whole here) and a frozen one behave the same.
    for p in (model.out.weight, model.inp.bias):
        saved = p.detach().clone()
        with Z(p):
            p.data.fill_(float(rank + 3))
        if not torch.equal(p, saved):
            fail(f"modifier_rank=None: a write to an always-whole parameter {tuple(p.shape)} was kept")
        with Z(p, modifier_rank=1):
            p.data.fill_(float(rank + 3))
        if not torch.all(p == 4.0):
            fail(f"modifier_rank=1: rank {rank} has {p.flatten()[:3].tolist()}, not rank 1's 4.0")
    print("ok   the same for the root unit's parameters and a frozen one")

    # What is not a tensor is skipped, as DeepSpeed skips it: Hugging Face's resize_token_embeddings
    # gathers [lm_head.weight, lm_head.bias] with the bias None.
    with Z([w, None], modifier_rank=0):
        if held(w) != 64:
            fail(f"GatheredParameters([w, None]) gathered {held(w)} elements of w")
    with Z(None):
        pass
    print("ok   entries that are not tensors (None) are skipped, as DeepSpeed skips them")

    plain = torch.nn.Parameter(torch.ones(3))
    with Z(plain, modifier_rank=0):
        plain.data.fill_(float(rank + 2))
    if not torch.all(plain == rank + 2):
        fail("a parameter of no engine: GatheredParameters changed it")
    with Z(model.parameters(), enabled=False):
        if held(w) != 0:
            fail("enabled=False gathered")
    try:
        with Z(w, modifier_rank=2):
            fail("modifier_rank 2 of a world of 2 was accepted")
    except ValueError as err:
        if "modifier_rank 2" not in str(err):
            fail(f"the refusal of modifier_rank 2 does not name it: {err}")
    print("ok   a parameter of no engine and enabled=False are no-ops; a modifier_rank that is no rank is refused")


def worker_writes(deepspeed, torch):
    for stage, bf16 in ((0, False), (1, False), (2, False), (0, True)):
        model = net(torch)
        extra = {"bf16": {"enabled": True}} if bf16 else {}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config(stage, **extra))
        w = model.blocks[0].fc.weight
        for step in range(2):
            if step == 1:
                before = w.detach().float().clone()
                with torch.no_grad():
                    w.fill_(0.5)
            for micro in range(2):
                engine.backward(engine(batch(torch, step, micro, engine.global_rank).to(w.dtype)))
                engine.step()
        # An AdamW step of lr 0.05 moves a weight by about 0.05 at most.
        from_write = bool(((w.float() - 0.5).abs() < 0.1).all())
        from_before = bool(((w.float() - before).abs() < 0.1).all())
        # DeepSpeed steps the module's parameters at stage 0 in fp32; elsewhere fp32 masters.
        kept = stage == 0 and not bf16
        if (from_write, from_before) != (kept, not kept):
            fail(f"stage {stage} bf16={bf16}: after a write of 0.5 and a step the weights are "
                 f"{w.flatten()[:3].tolist()} (before the write {before.flatten()[:3].tolist()}); DeepSpeed "
                 f"{'steps from the write' if kept else 'steps from its fp32 masters'}")
        print(f"ok   stage {stage} bf16={bf16}: a write to a parameter is "
              f"{'where the step starts' if kept else 'overwritten by the step from the fp32 masters'}, as DeepSpeed")


def worker_buffers(deepspeed, torch):
    for bf16 in (True, False):
        model = net(torch)
        model.register_buffer("mask", torch.ones(3), persistent=False)
        model.register_buffer("wide", torch.ones(3, dtype=torch.float64), persistent=False)
        model.register_buffer("ids", torch.arange(3), persistent=False)
        extra = {"bf16": {"enabled": True}} if bf16 else {}
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(1, **extra))
        want = (torch.bfloat16, torch.bfloat16) if bf16 else (torch.float32, torch.float64)
        got = (model.mask.dtype, model.wide.dtype)
        if got != want or model.ids.dtype != torch.int64:
            fail(f"bf16={bf16}: non-persistent buffers are {got} and {model.ids.dtype}, DeepSpeed's are {want}, int64")
    print("ok   non-persistent buffers are cast with the module (bf16), and left alone at fp32")


def worker_surface(deepspeed, torch):
    model = net(torch)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(1))
    if not isinstance(engine.device, torch.device) or engine.device.type != "cpu":
        fail(f"engine.device is {engine.device!r}, not torch.device('cpu')")
    acc = deepspeed.accelerator.get_accelerator()
    # DeepSpeed's CPU accelerator: always available; bf16 as torch's CPU kernels allow (True).
    if acc.is_available() is not True or acc.is_bf16_supported() is not True:
        fail(f"CPU accelerator: is_available {acc.is_available()}, is_bf16_supported {acc.is_bf16_supported()}")
    # The CUDA accelerator answers as torch does (here a torch that sees no bf16-capable GPU).
    saved = torch.cuda.is_available, torch.cuda.is_bf16_supported
    torch.cuda.is_available, torch.cuda.is_bf16_supported = (lambda: False), (lambda: False)
    try:
        cuda = type(acc)("cuda")
        if cuda.is_available() is not False or cuda.is_bf16_supported() is not False:
            fail(f"CUDA accelerator without a GPU: is_available {cuda.is_available()}, "
                 f"is_bf16_supported {cuda.is_bf16_supported()}")
    finally:
        torch.cuda.is_available, torch.cuda.is_bf16_supported = saved
    print("ok   engine.device is a torch.device; the accelerators' answers")

    class MoE(torch.nn.Module):  # the user's own class, not DeepSpeed's

        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.fc(x).pow(2).mean()

    mine = MoE()
    e, _, _, _ = deepspeed.initialize(model=mine, model_parameters=mine.parameters(), config=config(1))
    e.backward(e(batch(torch, 0, 0, 0)))
    try:
        theirs = torch.nn.Sequential(deepspeed.moe.layer.MoE(8, torch.nn.Linear(8, 8)), torch.nn.Linear(8, 1))
        deepspeed.initialize(model=theirs, model_parameters=theirs.parameters(), config=config(1))
        fail("uckpt's own MoE layer was accepted")
    except ValueError as err:
        if "MoE" not in str(err):
            fail(f"the refusal of an MoE layer does not name it: {err}")
    print("ok   a user's class named MoE trains; deepspeed.moe.layer.MoE is refused")

    for stage in (0, 1, 2, 3):
        model = net(torch)
        left_out = model.out.weight
        given = [p for p in model.parameters() if p is not left_out]
        try:
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=given, config=config(stage))
        except ValueError as err:
            if stage == 3 and "out.weight" in str(err):
                print(f"ok   stage 3 refuses a trainable parameter left out of model_parameters: {err}")
                continue
            fail(f"stage {stage}: {err}")
        if stage == 3:
            fail("stage 3 accepted a trainable parameter left out of model_parameters")
        before, other = left_out.detach().clone(), model.inp.weight.detach().clone()
        for micro in range(2):
            engine.backward(engine(batch(torch, 0, micro, engine.global_rank)))
            engine.step()
        if not torch.equal(before, left_out) or torch.equal(other, model.inp.weight):
            fail(f"stage {stage}: the left-out parameter changed, or the others did not")
        if left_out.grad is None:
            fail(f"stage {stage}: the left-out parameter has no .grad (DeepSpeed's has its local gradient)")
        print(f"ok   stage {stage}: a trainable parameter left out of model_parameters is not updated")


if __name__ == "__main__":
    testkit.case_main(globals(), worlds={"grads": (1, 2), "gathered": (2,)})
