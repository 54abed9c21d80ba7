#!/usr/bin/env python3
"""Scripts written here in the style of three DeepSpeedExamples scripts (#26), through `import uckpt as
deepspeed` on the CPU, 2 ranks, seconds each (bench/ds-examples-gpu.sh runs the real scripts on a GPU).

usage: examples_style_test.py CASE PYTHONPATH_OF_UCKPT WORK_DIR

CASE:
  cifar     training/cifar/cifar10_deepspeed.py's way: add_config_arguments, init_distributed, get_accelerator's
            set_device / device_name, its config (Adam type, WarmupLR, clipping, the legacy cpu_offload, overlap_comm
            ...), param groups from moe.utils.split_params_into_different_moe_groups_for_optimizer, the loader of
            initialize(training_data=), epochs over it, eval() under no_grad: the counts DeepSpeed's loader gives
            and a falling loss, at ZeRO 0 and 2; --moe (deepspeed.moe.layer.MoE in the model) refused by name.
  imagenet  training/imagenet/main.py's way: --deepspeed_config with its keys (cuda_visible_devices,
            zero_allow_untested_optimizer, gradient_clipping 0), a client SGD (momentum, weight decay) at ZeRO 0
            with a torch StepLR on it that initialize is not given (lr_scheduler=None), the script's own
            DistributedSampler with set_epoch, and state_dict() of the engine and optimizer.state_dict() saved
            with the epoch: losses equal a plain PyTorch loop's (1e-5 relative), the lr following the StepLR, the
            saved weights named module.<name>, the saved optimizer state the plain loop's SGD state_dict().
  imagenet_fp16  the same with main.py's ds_fp16_config.json (fp16 at ZeRO 0, auto_cast) and
            ds_fp16_z1_config.json (ZeRO 1): 3 epochs train, and the epoch's saved optimizer.state_dict() has
            DeepSpeed's keys (FP16_UnfusedOptimizer's, DeepSpeedZeroOptimizer's) and reads back with torch.load's
            weights_only default (DeepSpeed's state classes allowed).
  chat      DeepSpeed-Chat step 1's way: its ds config (hybrid_engine and tensorboard sections switched off, the
            stage-3 knobs as floats, offload devices "none"), its optimizer groups (the empty one dropped),
            FusedAdam with a cosine LambdaLR as lr_scheduler=, model(**batch, use_cache=False).loss, evaluation
            with all_reduce, engine.model, tput_timer.update_epoch_count(), the whole weights saved by rank 0 and
            at stage 3 through GatheredParameters: stages 2 and 3 give the same losses and weights (1e-6).
"""
import json
import math
import os
import sys

import testkit
from testkit import fail


# ---------------------------------------------------------------- cifar

def cifar_worker(work, stage, moe):
    import argparse
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import uckpt as deepspeed
    from uckpt.accelerator import get_accelerator
    from uckpt.moe.utils import split_params_into_different_moe_groups_for_optimizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    args = deepspeed.add_config_arguments(parser).parse_args([])
    deepspeed.init_distributed()
    local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(local_rank)
    g = torch.Generator().manual_seed(5)
    images = torch.randn(64, 3, 16, 16, generator=g)
    labels = torch.arange(64) % 4
    images += labels.view(-1, 1, 1, 1).float()  # learnable: the class shifts the image
    trainset = torch.utils.data.TensorDataset(images, labels)

    class Net(nn.Module):

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.pool = nn.MaxPool2d(2, 2)
            self.fc1 = nn.Linear(4 * 7 * 7, 16)
            if moe:
                self.moe_layer_list = nn.ModuleList([deepspeed.moe.layer.MoE(hidden_size=16, expert=nn.Linear(16, 16),
                                                                             num_experts=2, ep_size=1, k=1)])
            self.fc2 = nn.Linear(16, 4)

        def forward(self, x):
            x = self.pool(F.relu(self.conv(x))).flatten(1)
            return self.fc2(F.relu(self.fc1(x)))

    torch.manual_seed(0)
    net = Net()
    parameters = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in net.parameters() if p.requires_grad], "name": "parameters"})
    ds_config = {
        "train_batch_size": 16, "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 4}},
        "gradient_clipping": 1.0, "prescale_gradients": False, "bf16": {"enabled": False},
        "fp16": {"enabled": False, "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }
    try:
        engine, _, trainloader, _ = deepspeed.initialize(args=args, model=net, model_parameters=parameters,
                                                         training_data=trainset, config=ds_config)
    except ValueError as e:
        if moe and "mixture of experts (MoE) is not supported" in str(e):
            print(f"ok   --moe refused: {e}")
            return
        raise
    if moe:
        fail("a model holding deepspeed.moe.layer.MoE was accepted")
    device = get_accelerator().device_name(engine.local_rank)
    target_dtype = torch.bfloat16 if engine.bfloat16_enabled() else (torch.half if engine.fp16_enabled() else None)
    criterion = nn.CrossEntropyLoss()
    epoch_loss = []
    for epoch in range(4):
        total, n = 0.0, 0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(device), data[1].to(device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            loss = criterion(engine(inputs), labels)
            engine.backward(loss)
            engine.step()
            total, n = total + loss.item(), n + 1
        epoch_loss.append(total / n)
    engine.eval()
    correct = 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(trainset, batch_size=4, shuffle=False):
            correct += (engine(x.to(device)).argmax(1) == y).sum().item()
    out = {"batches_per_epoch": n, "len": len(trainloader), "global_steps": engine.global_steps,
           "global_samples": engine.global_samples, "epoch_loss": epoch_loss, "correct": correct}
    with open(os.path.join(work, f"cifar-{stage}-{engine.global_rank}.json"), "w") as f:
        json.dump(out, f)


def case_cifar(pypath, work):
    for stage in (0, 2):
        testkit.launch(__file__, "cifar", pypath, 2, [work, str(stage), "0"])
        r = json.load(open(os.path.join(work, f"cifar-{stage}-0.json")))
        # DeepSpeed's loader: DistributedSampler over 2 ranks, micro 8 (16 / 2 ranks): 32 samples, 4 batches a rank.
        want = {"batches_per_epoch": 4, "len": 4, "global_steps": 16, "global_samples": 256}
        got = {k: r[k] for k in want}
        if got != want:
            fail(f"stage {stage}: {got}, want {want}")
        if not all(math.isfinite(x) for x in r["epoch_loss"]) or not r["epoch_loss"][-1] < r["epoch_loss"][0]:
            fail(f"stage {stage}: the loss did not fall over the epochs: {r['epoch_loss']}")
        print(f"ok   cifar style, ZeRO {stage}: initialize's loader (4 batches a rank an epoch), 16 updates, loss "
              f"{r['epoch_loss'][0]:.3f} -> {r['epoch_loss'][-1]:.3f}, eval {r['correct']}/64")
    testkit.launch(__file__, "cifar", pypath, 2, [work, "0", "1"])


# ---------------------------------------------------------------- imagenet

IMAGENET_CONFIG = {"train_batch_size": 8, "gradient_accumulation_steps": 1, "steps_per_print": 50,
                   "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                            "weight_decay": 3e-7}},
                   "zero_optimization": {"stage": 0}, "zero_allow_untested_optimizer": True,
                   "fp16": {"enabled": False}, "gradient_clipping": 0, "prescale_gradients": False,
                   "cuda_visible_devices": 0, "wall_clock_breakdown": False}


def imagenet_model(torch):
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 5))


def imagenet_data(torch):
    g = torch.Generator().manual_seed(9)
    return torch.utils.data.TensorDataset(torch.randn(32, 3, 8, 8, generator=g), torch.arange(32) % 5)


def imagenet_worker(work, config_file="ds_config.json"):
    import argparse
    import torch
    import uckpt as deepspeed
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", os.path.join(work, config_file)])
    model = imagenet_model(torch)
    optimizer = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9, weight_decay=1e-4)  # as main.py's
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # not given to initialize
    model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, args=args, lr_scheduler=None,
                                                  dist_init_required=True)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    dataset = imagenet_data(torch)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8 // world, shuffle=False, sampler=sampler)
    criterion = torch.nn.CrossEntropyLoss()
    losses, lrs = [], []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        model.train()
        for images, target in loader:
            loss = criterion(model(images), target)
            model.backward(loss)
            model.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world)
        lrs.append(model.get_lr())
        scheduler.step()
        state = {"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict()}
        if rank == 0:
            torch.save(state, os.path.join(work, config_file + ".pth.tar" if config_file != "ds_config.json"
                                           else "checkpoint.pth.tar"))
    if config_file != "ds_config.json":
        if rank == 0:
            with open(os.path.join(work, config_file + ".losses"), "w") as f:
                json.dump(losses, f)
        return
    if rank == 0:  # the client optimizer's step count: DeepSpeed steps it at each update (torch schedulers read it)
        with open(os.path.join(work, "imagenet.json"), "w") as f:
            # PyTorch < 2.7 counts the steps on the optimizer; later ones mark the optimizer the scheduler
            # wrapped as stepped.
            opt = scheduler.optimizer
            json.dump({"losses": losses, "lrs": lrs, "world": world, "updates": model.global_steps,
                       "step_count": getattr(opt, "_step_count", model.global_steps if getattr(opt, "_opt_called", False) else 0)}, f)


def imagenet_reference(torch, work, world):
    """The same training as a plain PyTorch loop over each step's global batch."""
    model = imagenet_model(torch)
    optimizer = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    dataset = imagenet_data(torch)
    criterion = torch.nn.CrossEntropyLoss()
    losses = []
    micro = 8 // world
    for epoch in range(3):
        parts = []
        for r in range(world):
            s = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=world, rank=r)
            s.set_epoch(epoch)
            parts.append(list(s))
        model.train()
        for step in range(len(parts[0]) // micro):
            optimizer.zero_grad()
            total = 0.0
            for r in range(world):  # DeepSpeed averages the ranks' gradients
                x, y = dataset[parts[r][step * micro:(step + 1) * micro]]
                loss = criterion(model(x), y)
                (loss / world).backward()
                total += loss.item()
            optimizer.step()
            losses.append(total / world)
        scheduler.step()
    return losses, model.state_dict(), optimizer.state_dict()


# main.py's ds_fp16_config.json (fp16 at ZeRO 0: FP16_UnfusedOptimizer around the SGD) and ds_fp16_z1_config.json
# (ZeRO 1): optimizer.state_dict() in the epoch's torch.save is DeepSpeed's optimizer's, with its keys.
IMAGENET_FP16 = {
    "ds_fp16_config.json": (0, ["dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor",
                                "scale_window", "optimizer_state_dict", "fp32_groups"]),
    "ds_fp16_z1_config.json": (1, ["loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad",
                                   "base_optimizer_state", "single_partition_of_fp32_groups", "zero_stage",
                                   "group_paddings", "partition_count", "ds_version", "param_slice_mappings"]),
}


def case_imagenet_fp16(pypath, work):
    import torch
    sys.path.insert(0, pypath)
    from uckpt.runtime.fp16.loss_scaler import DynamicLossScaler
    from uckpt.runtime.zero.config import ZeroStageEnum
    from uckpt.utils.tensor_fragment import fragment_address
    for name, (stage, keys) in IMAGENET_FP16.items():
        config = dict(IMAGENET_CONFIG, zero_optimization={"stage": stage}, fp16={"enabled": True, "auto_cast": True})
        with open(os.path.join(work, name), "w") as f:
            json.dump(config, f)
        testkit.launch(__file__, "imagenet", pypath, 2, [work, name])
        losses = json.load(open(os.path.join(work, name + ".losses")))
        if len(losses) != 12 or not all(math.isfinite(x) for x in losses):
            fail(f"{name}: losses {losses}")
        with torch.serialization.safe_globals([DynamicLossScaler, ZeroStageEnum, fragment_address]):
            saved = torch.load(os.path.join(work, name + ".pth.tar"), weights_only=True)
        opt = saved["optimizer"]
        if list(opt) != keys:
            fail(f"{name}: the saved optimizer.state_dict() has keys {list(opt)}, DeepSpeed's {keys}")
        inner = opt["optimizer_state_dict"] if stage == 0 else opt["base_optimizer_state"]
        # ZeRO's DynamicLossScaler starts at 2^32 without fp16 scale keys (DeepSpeed's default), so all 12 steps
        # overflow: halved 12 times, no SGD step yet. FP16_UnfusedOptimizer's starts at 2^16 and steps.
        stepped = opt["cur_scale"] < 2.0 ** 16 if stage == 0 else opt["loss_scaler"].cur_scale == 2.0 ** 20
        if inner["param_groups"][0]["momentum"] != 0.9 or bool(inner["state"]) != (stage == 0) or not stepped:
            fail(f"{name}: the wrapped SGD's state_dict {inner}, the scale {opt.get('cur_scale', opt.get('loss_scaler'))}")
        print(f"ok   imagenet style, {name}: {len(losses)} fp16 steps, optimizer.state_dict() saved with DeepSpeed's "
              f"keys and read back with weights_only=True")


def case_imagenet(pypath, work):
    import torch
    with open(os.path.join(work, "ds_config.json"), "w") as f:
        json.dump(IMAGENET_CONFIG, f)
    testkit.launch(__file__, "imagenet", pypath, 2, [work])
    r = json.load(open(os.path.join(work, "imagenet.json")))
    want_losses, want_state, want_optimizer = imagenet_reference(torch, work, r["world"])
    if len(r["losses"]) != len(want_losses):
        fail(f"{len(r['losses'])} steps, the plain loop {len(want_losses)}")
    for i, (a, b) in enumerate(zip(r["losses"], want_losses)):
        if abs(a - b) > 1e-5 * abs(b):
            fail(f"step {i + 1}: loss {a!r}, the plain PyTorch loop {b!r}")
    if r["lrs"] != [[0.01], [0.005], [0.0025]]:
        fail(f"the lr over the epochs {r['lrs']}: the StepLR on the client optimizer gives 0.01, 0.005, 0.0025")
    if r["step_count"] != r["updates"]:
        fail(f"the client optimizer's _step_count is {r['step_count']} after {r['updates']} updates (DeepSpeed steps it "
             f"at each; torch's StepLR then warns of a scheduler step before the optimizer's)")
    checkpoint = torch.load(os.path.join(work, "checkpoint.pth.tar"))
    # optimizer.state_dict() at ZeRO 0: the client SGD's own, as DeepSpeed returns it.
    got = checkpoint["optimizer"]
    if got["param_groups"] != want_optimizer["param_groups"] or sorted(got["state"]) != sorted(want_optimizer["state"]):
        fail(f"optimizer.state_dict(): groups {got['param_groups']} / ids {sorted(got['state'])}, the plain loop's "
             f"{want_optimizer['param_groups']} / {sorted(want_optimizer['state'])}")
    for i, st in want_optimizer["state"].items():
        buf = got["state"][i]["momentum_buffer"]
        if buf.shape != st["momentum_buffer"].shape or (buf - st["momentum_buffer"]).abs().max().item() > 1e-5:
            fail(f"optimizer.state_dict()['state'][{i}]['momentum_buffer'] differs from the plain loop's")
    saved = checkpoint["state_dict"]
    if sorted(saved) != sorted("module." + k for k in want_state):
        fail(f"engine.state_dict() keys {sorted(saved)}: DeepSpeed's engine names them module.<name>")
    # The parameters (each rank's BatchNorm keeps its own running statistics, as under DeepSpeed and DDP).
    params = [k for k in want_state if "running_" not in k and "num_batches" not in k]
    worst = max((saved["module." + k].double() - want_state[k].double()).abs().max().item() for k in params)
    if worst > 1e-5:
        fail(f"the saved weights differ from the plain loop's by {worst}")
    print(f"ok   imagenet style: {len(want_losses)} losses equal the plain PyTorch loop's (1e-5), the lr follows the "
          f"client optimizer's StepLR, engine.state_dict() saved as module.<name> (weights within {worst:.2g}), "
          f"optimizer.state_dict() the plain loop's SGD state")


# ---------------------------------------------------------------- DeepSpeed-Chat

def chat_model(torch):
    import types
    nn = torch.nn

    class Layer(nn.Module):  # a decoder layer answering a tuple, as Hugging Face's do

        def __init__(self, d):
            super().__init__()
            self.self_attn_layer_norm = nn.LayerNorm(d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, hidden_states, attention_mask=None):
            h = self.fc2(torch.relu(self.fc1(self.self_attn_layer_norm(hidden_states))))
            return (hidden_states + h,)

    class Decoder(nn.Module):

        def __init__(self, vocab, d):
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList([Layer(d), Layer(d)])
            self.final_layer_norm = nn.LayerNorm(d)

    class Inner(nn.Module):

        def __init__(self, vocab, d):
            super().__init__()
            self.decoder = Decoder(vocab, d)

    class CausalLM(nn.Module):

        def __init__(self, vocab=32, d=16):
            super().__init__()
            self.config = types.SimpleNamespace(vocab_size=vocab, hidden_size=d, num_hidden_layers=2)
            self.model = Inner(vocab, d)
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

        def forward(self, input_ids, attention_mask=None, labels=None, use_cache=None):
            dec = self.model.decoder
            h = dec.embed_tokens(input_ids)
            for layer in dec.layers:
                h = layer(h, attention_mask=attention_mask)[0]
            logits = self.lm_head(dec.final_layer_norm(h))
            loss = None
            if labels is not None:
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                         labels[:, 1:].reshape(-1))
            return types.SimpleNamespace(loss=loss, logits=logits)

    torch.manual_seed(11)
    return CausalLM()


def chat_worker(work, stage):
    import argparse
    import torch
    import uckpt as deepspeed
    from uckpt.ops.adam import FusedAdam
    from uckpt import get_accelerator
    from uckpt.runtime.zero.partition_parameters import ZeroParamStatus

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    args = deepspeed.add_config_arguments(parser).parse_args([])
    get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    ds_config = {
        "train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10,
        "zero_optimization": {"stage": stage, "overlap_comm": True, "offload_param": {"device": "none"},
                              "offload_optimizer": {"device": "none"}, "stage3_param_persistence_threshold": 1e4,
                              "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                              "memory_efficient_linear": False},
        "bfloat16": {"enabled": False}, "gradient_clipping": 1.0, "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
        "tensorboard": {"enabled": False, "output_path": "step1_tensorboard/ds_tensorboard_logs/",
                        "job_name": "step1_model_tensorboard"},
    }
    model = chat_model(torch)
    no_decay = ["bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight"]
    groups = [{"params": [p for n, p in model.named_parameters()
                          if not any(nd in n.lower() for nd in no_decay) and "lora" not in n], "weight_decay": 0.1},
              {"params": [p for n, p in model.named_parameters() if "lora" in n], "weight_decay": 0.1, "lr": 5e-4},
              {"params": [p for n, p in model.named_parameters() if any(nd in n.lower() for nd in no_decay)],
               "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    optimizer = FusedAdam(groups, lr=1e-2, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 32, (24, 12), generator=g)
    train = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids[:16]]
    evals = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids[16:]]
    train_loader = torch.utils.data.DataLoader(train, sampler=torch.utils.data.distributed.DistributedSampler(train),
                                               batch_size=2)
    eval_loader = torch.utils.data.DataLoader(evals, sampler=torch.utils.data.distributed.DistributedSampler(evals),
                                              batch_size=2)
    total_steps = 2 * len(train_loader)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(  # Hugging Face's cosine schedule without warmup
        optimizer, lambda s: max(0.0, 0.5 * (1.0 + math.cos(math.pi * s / total_steps))))
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)

    def evaluation():
        model.eval()
        losses = 0
        for step, batch in enumerate(eval_loader):
            with torch.no_grad():
                losses += model(**batch).loss.float()
        losses = losses / (step + 1)
        torch.distributed.all_reduce(losses)
        return (losses / world).item()

    rec = {"ppl_before": math.exp(evaluation()), "losses": [], "lrs": []}
    for epoch in range(2):
        model.train()
        for batch in train_loader:
            loss = model(**batch, use_cache=False).loss
            model.backward(loss)
            model.step()
            rec["losses"].append(loss.item())
            rec["lrs"].append(model.get_lr()[0])
        rec["params"] = sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in model.model.parameters())
        model.tput_timer.update_epoch_count()
    rec["ppl_after"] = math.exp(evaluation())
    rec["epoch_count"] = model.tput_timer.epoch_count
    # save_hf_format and save_zero_three_model's ways.
    whole = {}
    for k, v in model.module.named_parameters():
        fetch = [v] if hasattr(v, "ds_id") and v.ds_status == ZeroParamStatus.NOT_AVAILABLE else []
        with deepspeed.zero.GatheredParameters(fetch, enabled=stage == 3):
            whole[k] = v.data.cpu().clone()
    if rank == 0:
        torch.save(whole, os.path.join(work, f"chat-z{stage}.bin"))
    with open(os.path.join(work, f"chat-z{stage}-{rank}.json"), "w") as f:
        json.dump(rec, f)


def case_chat(pypath, work):
    import torch
    for stage in (2, 3):
        testkit.launch(__file__, "chat", pypath, 2, [work, str(stage)])
    z2, z3 = (json.load(open(os.path.join(work, f"chat-z{s}-0.json"))) for s in (2, 3))
    for k in ("losses", "lrs"):
        if len(z2[k]) != len(z3[k]) or any(abs(a - b) > 1e-6 * max(abs(b), 1e-12) for a, b in zip(z3[k], z2[k])):
            fail(f"stage 3's {k} {z3[k]} differ from stage 2's {z2[k]}")
    want_lrs = [1e-2 * 0.5 * (1 + math.cos(math.pi * s / 8)) for s in range(1, 9)]
    if any(abs(a - b) > 1e-12 for a, b in zip(z2["lrs"], want_lrs)):
        fail(f"the lr after each step {z2['lrs']}: the cosine LambdaLR given as lr_scheduler gives {want_lrs}")
    for r in (z2, z3):
        if not r["ppl_after"] < r["ppl_before"] or r["epoch_count"] != 2:
            fail(f"perplexity {r['ppl_before']} -> {r['ppl_after']}, tput_timer epochs {r['epoch_count']}")
    w2, w3 = (torch.load(os.path.join(work, f"chat-z{s}.bin")) for s in (2, 3))
    if sorted(w2) != sorted(w3) or any(w3[k].shape != w2[k].shape for k in w2):
        fail("stage 3's gathered weights have other names or shapes than stage 2's")
    worst = max((w3[k] - w2[k]).abs().max().item() for k in w2)
    if worst > 1e-6:
        fail(f"stage 3's gathered weights differ from stage 2's by {worst}")
    print(f"ok   DeepSpeed-Chat style: stages 2 and 3 train alike ({len(z2['losses'])} losses, weights within "
          f"{worst:.2g}), the cosine lr_scheduler stepped, perplexity {z2['ppl_before']:.1f} -> {z2['ppl_after']:.1f}")


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        case, rest = sys.argv[2], sys.argv[3:]
        if case == "cifar":
            cifar_worker(rest[0], int(rest[1]), rest[2] == "1")
        elif case == "imagenet":
            imagenet_worker(*rest)
        else:
            chat_worker(rest[0], int(rest[1]))
        return
    case, pypath, work = sys.argv[1:4]
    os.makedirs(work, exist_ok=True)
    {"cifar": case_cifar, "imagenet": case_imagenet, "imagenet_fp16": case_imagenet_fp16,
     "chat": case_chat}[case](pypath, work)


if __name__ == "__main__":
    main()
