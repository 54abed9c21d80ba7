#!/usr/bin/env python3
"""Independent check of uckpt's training checkpoints with real torch (Debian's
torch 1.13): `uckpt launch` trains a tiny GPT-2, then torch.load reads every
file (DeepSpeed's classes are stood in by stubs with the same module paths,
as DeepSpeed itself is not installed) and the ZeRO partitions are merged the
way DeepSpeed's zero_to_fp32.py merges them.

usage: check_torch_load.py UCKPT_BINARY WORK_DIR
"""
import enum
import os
import shutil
import subprocess
import sys
import types

import torch


def install_deepspeed_stubs():
    def module(name):
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sub = ".".join(parts[:i])
            if sub not in sys.modules:
                sys.modules[sub] = types.ModuleType(sub)
        return sys.modules[name]

    class LossScaler:
        pass

    class DynamicLossScaler:
        pass

    class ZeroStageEnum(enum.IntEnum):
        disabled = 0
        optimizer_states = 1
        gradients = 2
        weights = 3

    class fragment_address:
        pass

    module("deepspeed.runtime.fp16.loss_scaler").LossScaler = LossScaler
    module("deepspeed.runtime.fp16.loss_scaler").DynamicLossScaler = DynamicLossScaler
    module("deepspeed.runtime.zero.config").ZeroStageEnum = ZeroStageEnum
    module("deepspeed.utils.tensor_fragment").fragment_address = fragment_address
    return ZeroStageEnum


MODEL_KEYS = ["module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
              "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
              "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
              "ds_version", "universal_checkpoint_info", "iteration"]
OPTIM_KEYS = ["loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "base_optimizer_state",
              "single_partition_of_fp32_groups", "zero_stage", "group_paddings", "partition_count", "ds_version",
              "param_slice_mappings"]


def check(folder, world, stage, bf16, enum_cls):
    sd = torch.load(os.path.join(folder, "mp_rank_00_model_states.pt"), map_location="cpu")
    assert list(sd.keys())[:len(MODEL_KEYS)] == MODEL_KEYS, list(sd.keys())
    module = sd["module"]
    wte = module["transformer.wte.weight"]
    assert module["lm_head.weight"].data_ptr() == wte.data_ptr(), "lm_head must share wte's storage"
    ptrs = {t.storage().data_ptr() for t in module.values()}
    assert len(ptrs) == 1, "every parameter is a view into one flat buffer"
    assert wte.dtype == (torch.bfloat16 if bf16 else torch.float32)
    shapes = sd["param_shapes"][0]
    assert list(shapes.keys()) == [k for k in module.keys() if k != "lm_head.weight"]
    assert all(isinstance(s, torch.Size) for s in shapes.values())
    assert sd["shared_params"] == {"lm_head.weight": "transformer.wte.weight"}
    assert isinstance(sd["sparse_tensor_module_names"], set)
    assert sd["dp_world_size"] == world and sd["global_steps"] == 3 and sd["iteration"] == 3
    assert (sd["frozen_param_shapes"] is None) == (stage == 1)
    assert sd["lr_scheduler"] == {"last_batch_iteration": 2}, sd["lr_scheduler"]
    assert module._metadata[""] == {"version": 1}

    numel = sum(s.numel() for s in shapes.values())
    align = 2 * world
    padded = (numel + align - 1) // align * align
    part = padded // world
    flat = []
    for r in range(world):
        name = ("bf16_" if bf16 else "") + f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        f = torch.load(os.path.join(folder, name), map_location="cpu")
        assert list(f.keys()) == ["optimizer_state_dict", "ds_config", "ds_version"]
        osd = f["optimizer_state_dict"]
        assert list(osd.keys()) == OPTIM_KEYS, list(osd.keys())
        assert osd["zero_stage"] is (enum_cls.optimizer_states if stage == 1 else enum_cls.gradients)
        assert osd["partition_count"] == [world]
        assert osd["loss_scaler"].cur_scale == 1.0 and osd["loss_scaler"].dynamic is False
        st = osd["base_optimizer_state"]["state"][0]
        assert st["step"].dim() == 0 and st["step"].dtype == torch.float32 and float(st["step"]) == 3.0
        assert st["exp_avg"].shape == (part,) and st["exp_avg_sq"].shape == (part,)
        assert osd["base_optimizer_state"]["param_groups"][0]["params"] == [0]
        fp32 = osd["single_partition_of_fp32_groups"][0]
        pad = max(0, min(part, (r + 1) * part - numel))
        assert osd["group_paddings"] == [pad], (osd["group_paddings"], pad)
        assert fp32.dtype == torch.float32 and fp32.numel() == part - pad and fp32.requires_grad
        offset = 0
        for pname, addr in osd["param_slice_mappings"][0].items():
            assert addr.start == offset, (pname, addr.start, offset)
            offset += addr.numel
        assert offset == part - pad, (offset, part, pad)
        flat.append(fp32.detach())
    # zero_to_fp32's merge: concatenate the partitions in rank order, walk param_shapes.
    merged = torch.cat(flat)
    off = 0
    for pname, shape in shapes.items():
        n = shape.numel()
        w = merged[off:off + n].view(shape)
        want = module[pname].float() if bf16 else module[pname]
        got = w.to(torch.bfloat16).float() if bf16 else w
        assert torch.equal(got, want), pname
        off += n
    assert off == numel


def main():
    binary, work = sys.argv[1], sys.argv[2]
    enum_cls = install_deepspeed_stubs()
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    for world, stage, bf16 in [(2, 2, False), (3, 1, True), (4, 2, False)]:
        ckpt = os.path.join(work, f"ckpt_{world}_{stage}_{int(bf16)}")
        cmd = [binary, "launch", "-n", str(world), "--master_port", "0", "--", binary, "train",
               "--train_batch_size", "12", "--zero_stage", str(stage), "--steps", "3", "--n_layer", "1",
               "--n_head", "2", "--n_embd", "6", "--vocab_size", "37", "--n_positions", "9", "--seq_len", "9",
               "--checkpoint_dir", ckpt, "--log_dir", os.path.join(work, "logs"), "--run_name", "py",
               "--config", os.path.join(work, "ds.json")]
        with open(os.path.join(work, "ds.json"), "w") as f:
            f.write('{"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}, '
                    '"bf16": {"enabled": %s}}' % ("true" if bf16 else "false"))
        subprocess.run(cmd, check=True, timeout=300)
        check(os.path.join(ckpt, "global_step3"), world, stage, bf16, enum_cls)
        print(f"ok: world {world}, stage {stage}, {'bf16' if bf16 else 'fp32'}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
