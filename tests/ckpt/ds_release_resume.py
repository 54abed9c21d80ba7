#!/usr/bin/env python3
"""uckpt's engine resumes a newer DeepSpeed release's ZeRO checkpoint at another world size, unconverted.

usage: ds_release_resume.py PYTHONPATH_OF_UCKPT CASE_DIR WORLD

CASE_DIR is a fixture of tests/fixtures/deepspeed-releases (ds<release>/z<stage>_<dtype>, saved
by that release at 2 ranks). WORLD ranks (`import uckpt as deepspeed`, Gloo on the CPU) build the
fixture's model from another seed, load CASE_DIR/ckpt (its `latest`) with the same config, and:
  - every trainable parameter equals DeepSpeed's own fp32 master in the release's universal
    folder (ckpt/global_step3_universal/zero/<name>/fp32.pt), rounded to bf16 for bf16 runs;
  - the frozen parameter equals the checkpoint's module (stage 1/2, whose model states hold it);
  - the engine's global step is the saved one (3) (its load also checks the state it holds
    against the files: the state fingerprint, docs/manifest-format.md);
  - one more training step runs and gives a finite loss.
A Muon checkpoint (loaded with the parameter groups DeepSpeed made for it) is refused by name:
uckpt's engine has no Muon.
"""
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def worker(case_dir):
    import argparse
    import torch
    sys.path.insert(0, os.path.join(case_dir, "..", ".."))  # the fixtures' train.py
    import train
    import uckpt as deepspeed

    name = os.path.basename(os.path.normpath(case_dir))
    parts = name.split("_")
    args = argparse.Namespace(stage=int(parts[0][1:]), dtype=parts[1], optimizer="Muon" if "muon" in parts else "AdamW")
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = train.config(args, world)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "betas": [0.9, 0.95], "eps": 1e-8}}
    torch.manual_seed(1234)  # other initial weights: everything must come from the checkpoint
    model = train.Net()
    groups = train.param_groups(model, "AdamW")
    if args.optimizer == "Muon":  # the groups DeepSpeed made: Muon's matrices, then the rest for Adam
        muon = [p for n, p in model.named_parameters()
                if p.requires_grad and p.dim() >= 2 and "embed" not in n and "lm_head" not in n]
        groups = [{"params": muon}, {"params": [p for p in model.parameters()
                                               if p.requires_grad and all(p is not q for q in muon)]}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    ckpt = os.path.join(case_dir, "ckpt")
    if args.optimizer == "Muon":
        try:
            engine.load_checkpoint(ckpt)
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            msg = str(e)
            if "momentum_buffer" not in msg and "Muon" not in msg:
                fail(f"a Muon checkpoint was refused without naming why: {msg}")
            print(f"OK: refused by name: {msg}")
            return
        fail("uckpt's engine loaded a Muon checkpoint into AdamW")
    path, client = engine.load_checkpoint(ckpt)
    if path is None:
        fail(f"load_checkpoint({ckpt}) loaded nothing")
    if engine.global_steps != 3:
        fail(f"global_steps {engine.global_steps} after the load, saved 3")
    universal = os.path.join(ckpt, "global_step3_universal", "zero")
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, p in params.items():
        if n == "frozen.weight":
            continue
        ref = torch.load(os.path.join(universal, n, "fp32.pt"), weights_only=True)
        ref = ref["param"] if isinstance(ref, dict) else ref
        want = ref.reshape(p.shape).to(p.dtype)
        if not torch.equal(p, want):
            fail(f"{n} after the load differs from DeepSpeed's fp32 master (max |diff| "
                 f"{(p.float() - want.float()).abs().max().item()})")
    if args.stage < 3:
        module = torch.load(os.path.join(ckpt, "global_step3", "mp_rank_00_model_states.pt"), weights_only=False,
                            map_location="cpu")["module"]
        if not torch.equal(params["frozen.weight"], module["frozen.weight"]):
            fail("the frozen parameter differs from the checkpoint's module")
    tokens, target = train.batch(4, rank, 2)
    loss = engine(tokens, target)
    engine.backward(loss)
    engine.step()
    if not torch.isfinite(loss).item():
        fail(f"loss {loss.item()} after the resume")
    if rank == 0:
        print(f"OK: {name} resumed at {world} ranks (saved at 2), parameters equal DeepSpeed's, "
              f"one more step, loss {loss.item():.4f}")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2])
    pypath, case_dir, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for r in range(world):
        env = dict(os.environ, PYTHONPATH=pypath, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", case_dir], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    failed = False
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=240)
        sys.stdout.write("".join(f"[{r}/{world}] {line}\n" for line in out.splitlines()))
        failed |= p.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
