"""uckpt.data.ResumableSampler: a run saved at 4 ranks and resumed at 2
(gradient accumulation 1 -> 2) sees exactly the samples the uninterrupted
4-rank run saw after the save, and its losses and weights continue that run
(fp32: losses within 1e-6 relative, weights within 1e-6 of their scale); its first iterator after the load starts at
the saved data position, not at the epoch's start (what a default sampler
would give, the failure this checks for).

usage: data_resume_test.py BUILD_PYTHON_DIR WORK_DIR
"""
import json
import os
import sys

import testkit
from testkit import fail

STEPS, SAVE_AT = 6, 3


def worker(mode, work):
    import torch
    import uckpt as deepspeed
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(40, 4))  # 5 global batches of 8: epoch 2 starts at step 6
    model = testkit.toy_net(torch)
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, "zero_optimization": {"stage": 2}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    first, last = 1, STEPS
    if mode == "first":
        last = SAVE_AT
    if mode == "second":
        engine.load_checkpoint(os.path.join(work, "ckpt"))
        first = SAVE_AT + 1
    sampler = deepspeed.data.ResumableSampler(data, engine, seed=7)
    loader = iter(torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler))
    records = []
    step = first
    while step <= last:
        for _ in range(engine.gradient_accumulation_steps()):
            try:
                (x,) = next(loader)
            except StopIteration:  # the epoch ended: the next iterator continues from the engine's position
                loader = iter(torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler))
                (x,) = next(loader)
            loss = engine(x)
            records.append({"step": step, "first_sample": x[0].tolist(), "loss": loss.item()})
            engine.backward(loss)
            engine.step()
        step += 1
    if mode == "first":
        engine.save_checkpoint(os.path.join(work, "ckpt"))
    out = {"records": records, "samples": engine.global_samples}
    if engine.global_rank == 0:
        out["weights"] = [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]
    with open(os.path.join(work, f"{mode}-{engine.global_rank}.json"), "w") as f:
        json.dump(out, f)


def load(work, mode, world):
    runs = [json.load(open(os.path.join(work, f"{mode}-{r}.json"))) for r in range(world)]
    by_sample = {}
    for run in runs:
        for rec in run["records"]:
            by_sample[(rec["step"], tuple(rec["first_sample"]))] = rec["loss"]
    return by_sample, runs[0]


def close(a, b):
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b), 1e-12)


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return
    pypath, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    testkit.launch(__file__, "full", pypath, 4, [work])
    testkit.launch(__file__, "first", pypath, 4, [work])
    testkit.launch(__file__, "second", pypath, 2, [work])
    full, full0 = load(work, "full", 4)
    second, second0 = load(work, "second", 2)
    after = {k: v for k, v in full.items() if k[0] > SAVE_AT}
    if set(second) != set(after):
        fail(f"the resumed run at 2 ranks saw other samples than the uninterrupted run after step {SAVE_AT}: "
             f"{len(set(second) - set(after))} micro-batches it should not have, {len(set(after) - set(second))} missing")
    for k, v in after.items():
        if not close(second[k], v):
            fail(f"step {k[0]}: loss {second[k]!r} after the resume, {v!r} uninterrupted")
    if second0["samples"] != full0["samples"]:
        fail(f"data position {second0['samples']} after the resume, {full0['samples']} uninterrupted")
    # Relative to the weights' scale: the two runs sum the same gradients in another order (fp32 rounding).
    scale = max(abs(b) for b in full0["weights"])
    bad = [i for i, (a, b) in enumerate(zip(second0["weights"], full0["weights"])) if abs(a - b) > 1e-6 * scale]
    if bad:
        fail(f"{len(bad)} weights differ from the uninterrupted run's (first: element {bad[0]})")
    print(f"ok: {len(after)} micro-batches after the save at step {SAVE_AT} (4 -> 2 ranks) are the uninterrupted run's, "
          f"losses and weights within 1e-6")


if __name__ == "__main__":
    main()
