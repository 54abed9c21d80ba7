#!/usr/bin/env python3
"""uckpt's engine resumes a newer DeepSpeed release's ZeRO checkpoint at another world size, unconverted.

usage: ds_release_resume.py PYTHONPATH_OF_UCKPT CASE_DIR WORLD [UCKPT]

With UCKPT (the CLI), the case is first converted with `uckpt convert` and the engine loads that
universal folder (`"checkpoint": {"load_universal": true}`) instead: the same checks hold.

CASE_DIR is a fixture of tests/fixtures/deepspeed-releases (ds<release>/z<stage>_<dtype>[_<optimizer>],
saved by that release at 2 ranks). WORLD ranks (`import uckpt as deepspeed`, Gloo on the CPU) build the
fixture's model from another seed, load CASE_DIR/ckpt (its `latest`) with the same config, and:
  - every trainable parameter equals DeepSpeed's own fp32 master in the release's universal
    folder (ckpt/global_step3_universal/zero/<name>/fp32.pt), rounded to bf16/fp16 for such runs;
    where DeepSpeed's converter made none (Adagrad), the master read here from the rank files
    with torch; at stage 0 (no universal folder) the checkpoint's module, as saved;
  - the frozen parameter equals the checkpoint's module (stage 1/2, whose model states hold it);
  - the engine's global step is the saved one (3) (its load also checks the state it holds
    against the files: the state fingerprint, docs/manifest-format.md);
  - one more training step runs and gives a finite loss.
A Muon checkpoint (loaded with the parameter groups DeepSpeed made for it) is refused by name:
uckpt's engine has no Muon; so is a Lion one (DeepSpeedCPULion's state has Adam's key names, its
param groups no `eps`), loaded into AdamW. Adagrad is resumed into torch's Adagrad, the client
optimizer uckpt's engine steps as DeepSpeed does. `_hf` cases (the Hugging Face Trainer's
checkpoint-3, hf_trainer.py) build the model from the folder's config.json and the engine from the
saved ds_config, as the Trainer does.
"""
import os
import shutil
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def torch_load(path):
    import torch
    return torch.load(path, weights_only=False, map_location="cpu")


def masters_from_rank_files(tag):
    """name -> fp32 master, read from a ZeRO 1-3 folder's rank files with torch (no uckpt)."""
    import torch
    optim = [torch_load(os.path.join(tag, f))["optimizer_state_dict"]
             for f in sorted(os.listdir(tag)) if f.endswith("optim_states.pt")]
    model_file = sorted(f for f in os.listdir(tag) if f.endswith("model_states.pt"))[0]
    shapes = torch_load(os.path.join(tag, model_file))["param_shapes"]
    out = {}
    for g, group in enumerate(shapes):
        names = list(group)
        if "fp32_flat_groups" in optim[0]:  # stage 3: each parameter ceil(numel/dp) per rank, in order
            at = 0
            for n in names:
                numel = group[n].numel()
                ps = -(-numel // len(optim))
                out[n] = torch.cat([o["fp32_flat_groups"][g][at:at + ps] for o in optim])[:numel]
                at += ps
            continue
        maps = [o["param_slice_mappings"][g] for o in optim]
        for n in names:
            out[n] = torch.cat([o["single_partition_of_fp32_groups"][g][m[n].start:m[n].start + m[n].numel]
                                for o, m in zip(optim, maps) if n in m])
    return out


def build(case_dir, name, world):
    """(model, engine kwargs, train args, the optimizer the checkpoint was saved with)."""
    import argparse
    import torch
    sys.path.insert(0, os.path.join(case_dir, "..", ".."))  # the fixtures' train.py
    import train
    parts = name.split("_")
    opt = {"muon": "Muon", "adagrad": "Adagrad", "lion": "Lion", "hf": "hf"}.get(parts[-1], "AdamW")
    args = argparse.Namespace(stage=int(parts[0][1:]), dtype=parts[1], optimizer=opt)
    torch.manual_seed(1234)  # other initial weights: everything must come from the checkpoint
    if opt == "hf":  # the Trainer's: the model from the folder's config.json, the engine from the saved config
        from transformers import AutoConfig, AutoModelForCausalLM
        ckpt = os.path.join(case_dir, "ckpt")
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt))
        cfg = torch_load(os.path.join(ckpt, "global_step3", "mp_rank_00_model_states.pt"))["ds_config"]
        cfg = dict(cfg, train_batch_size=cfg["train_micro_batch_size_per_gpu"] * world)
        return model, dict(model_parameters=[p for p in model.parameters() if p.requires_grad], config=cfg), args
    cfg = train.config(args, world)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "betas": [0.9, 0.95],
                                                    "eps": 1e-8}}
    model = train.Net()
    groups = train.param_groups(model, "Adagrad" if opt == "Adagrad" else "AdamW")
    kwargs = dict(model_parameters=groups, config=cfg)
    if opt == "Muon":  # the groups DeepSpeed made: Muon's matrices, then the rest for Adam
        muon = [p for n, p in model.named_parameters()
                if p.requires_grad and p.dim() >= 2 and "embed" not in n and "lm_head" not in n]
        kwargs["model_parameters"] = [{"params": muon}, {"params": [p for p in model.parameters()
                                                                   if p.requires_grad and all(p is not q for q in muon)]}]
    if opt == "Adagrad":  # torch's, which DeepSpeed's "type": "Adagrad" is; uckpt's engine steps it as a client's
        del cfg["optimizer"]
        kwargs["optimizer"] = torch.optim.Adagrad(groups, lr=0.02, weight_decay=0.01, eps=1e-8)
    return model, kwargs, args


def expected_params(case_dir, args):
    """name -> what each trainable parameter must hold after the load, in fp32 (before the dtype cast)."""
    import torch
    ckpt = os.path.join(case_dir, "ckpt")
    universal = os.path.join(ckpt, "global_step3_universal", "zero")
    if args.stage == 0:  # no universal folder (DeepSpeed has none at stage 0): the module as saved
        return {n: t for n, t in torch_load(os.path.join(ckpt, "global_step3", "mp_rank_00_model_states.pt"))
                ["module"].items()}
    if os.path.isdir(universal):
        out = {}
        for n in os.listdir(universal):
            if os.path.exists(os.path.join(universal, n, "fp32.pt")):
                ref = torch_load(os.path.join(universal, n, "fp32.pt"))
                out[n] = ref["param"] if isinstance(ref, dict) else ref
        return out
    return masters_from_rank_files(os.path.join(ckpt, "global_step3"))


def worker(case_dir):
    import torch
    import uckpt as deepspeed

    name = os.path.basename(os.path.normpath(case_dir))
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, kwargs, args = build(case_dir, name, world)
    ckpt = os.path.join(case_dir, "ckpt")
    if os.environ.get("RESUME_UNIVERSAL"):  # uckpt's conversion of the case (main)
        ckpt = os.environ["RESUME_UNIVERSAL"]
        kwargs["config"] = dict(kwargs["config"], checkpoint={"load_universal": True})
    engine, _, _, _ = deepspeed.initialize(model=model, **kwargs)
    if args.optimizer in ("Muon", "Lion"):  # uckpt's engine has neither: AdamW given their state
        try:
            engine.load_checkpoint(ckpt)
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            msg = str(e)
            named = ("momentum_buffer", "Muon") if args.optimizer == "Muon" else ("eps", "Lion")
            if not any(w in msg for w in named):
                fail(f"a {args.optimizer} checkpoint was refused without naming why: {msg}")
            print(f"OK: refused by name: {msg}")
            return
        fail(f"uckpt's engine loaded a {args.optimizer} checkpoint into AdamW")
    path, client = engine.load_checkpoint(ckpt)
    if path is None:
        fail(f"load_checkpoint({ckpt}) loaded nothing")
    if engine.global_steps != 3:
        fail(f"global_steps {engine.global_steps} after the load, saved 3")
    want_all = expected_params(case_dir, args)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, p in params.items():
        if n == "frozen.weight":
            continue
        if n not in want_all:
            fail(f"{n}: no reference value in the fixture")
        want = want_all[n].reshape(p.shape).to(p.dtype)
        if not torch.equal(p, want):
            fail(f"{n} after the load differs from DeepSpeed's fp32 master (max |diff| "
                 f"{(p.float() - want.float()).abs().max().item()})")
    if args.stage < 3 and "frozen.weight" in params:
        module = torch_load(os.path.join(case_dir, "ckpt", "global_step3", "mp_rank_00_model_states.pt"))["module"]
        if not torch.equal(params["frozen.weight"], module["frozen.weight"]):
            fail("the frozen parameter differs from the checkpoint's module")
    if args.optimizer == "hf":
        tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
        loss = engine(input_ids=tokens, labels=tokens).loss
    else:
        import train
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
    extra = {}
    if len(sys.argv) > 4:  # load uckpt's universal conversion of the case
        import tempfile
        folder = tempfile.mkdtemp(prefix="ds_release_resume_")
        subprocess.run([sys.argv[4], "convert", os.path.join(case_dir, "ckpt", "global_step3"),
                        os.path.join(folder, "global_step3_universal"), "-q"], check=True)
        extra["RESUME_UNIVERSAL"] = folder
    # The store's port stays held by this process while the ranks run (they bind it: both set
    # SO_REUSEADDR), so a concurrent test cannot take it first.
    reserved = socket.socket()
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reserved.bind(("127.0.0.1", 0))
    port = str(reserved.getsockname()[1])
    procs = []
    for r in range(world):
        env = dict(os.environ, **extra, PYTHONPATH=pypath, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", case_dir], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    failed = False
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=240)
        sys.stdout.write("".join(f"[{r}/{world}] {line}\n" for line in out.splitlines()))
        failed |= p.returncode != 0
    reserved.close()
    if "RESUME_UNIVERSAL" in extra:
        shutil.rmtree(extra["RESUME_UNIVERSAL"], ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
