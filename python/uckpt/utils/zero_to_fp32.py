#!/usr/bin/env python
"""deepspeed.utils.zero_to_fp32: the whole fp32 weights of a ZeRO checkpoint as a state_dict.

The weights come from the same code as `uckpt export` (through the extension), read back from its
safetensors output; what DeepSpeed's functions add on top (buffers as fp32, frozen parameters in their saved
dtype, tied names sharing one tensor, exclude_frozen_parameters) is applied here from the model-states file.

As DeepSpeed's, every save_checkpoint at ZeRO stages 1-3 copies this file into its save_dir, beside the tag
folder, where it runs with DeepSpeed 0.14.5's command line (it needs uckpt importable):

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_FILE [-t TAG] [--exclude_frozen_parameters] [-d]

CHECKPOINT_DIR is the folder holding `latest` and the tag folders (e.g. checkpoint-12); OUTPUT_FILE receives
the fp32 state_dict (torch.save)."""
import argparse
import glob
import json
import os
import re
import tempfile
from collections import OrderedDict

import torch

from uckpt import _uckpt
from uckpt.utils.logging import logger

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _natural_key(path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def _read_safetensors(path):
    """name -> tensor of a safetensors file (aliases in __metadata__ share their owner's tensor)."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    out = OrderedDict()
    for name, h in header.items():
        begin, end = h["data_offsets"]
        dtype = _SAFETENSORS_DTYPES[h["dtype"]]
        raw = bytearray(data[base + begin:base + end])
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(h["shape"]).clone()
    for alias, owner in meta.items():
        if alias != "format" and owner in out:
            out[alias] = out[owner]
    return out


def _tag_folder(checkpoint_dir, tag):
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise ValueError(f"Unable to find 'latest' file at {latest}")
        with open(latest) as f:
            tag = f.read().strip()
    folder = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"Directory '{folder}' doesn't exist")
    return folder


def _model_states(folder):
    files = sorted(glob.glob(os.path.join(folder, "*model_states.pt")), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"can't find *model_states.pt files in directory '{folder}'")
    return [torch.load(f, map_location="cpu", weights_only=False) for f in files]


def _deepspeed_dtypes(state_dict, folder, exclude_frozen_parameters):
    """DeepSpeed's zero_to_fp32 gives what the model-states file names: buffers (as fp32, integer ones too),
    frozen parameters where it lists them (stages 2-3; in the dtype they were saved in) unless
    exclude_frozen_parameters, the trainable parameters and the tied names."""
    states = _model_states(folder)
    first = states[0]
    named = set(first.get("buffer_names", [])) | set(first.get("frozen_param_shapes") or {})
    named |= {name for group in first.get("param_shapes", []) for name in group}
    named |= set(first.get("shared_params") or {})
    for name in [n for n in state_dict if n not in named]:
        del state_dict[name]
    for name in first.get("buffer_names", []):
        if name in state_dict:
            state_dict[name] = state_dict[name].float()
    frozen = first.get("frozen_param_shapes") or {}
    fragments = first.get("frozen_param_fragments") or {}
    for name in frozen:
        if name not in state_dict:
            continue
        if exclude_frozen_parameters:
            del state_dict[name]
        elif name in fragments:
            state_dict[name] = state_dict[name].to(fragments[name].dtype)
    for alias, owner in (first.get("shared_params") or {}).items():
        if owner in state_dict:
            state_dict[alias] = state_dict[owner]
    return state_dict


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False):
    """The model's weights from the ZeRO checkpoint `checkpoint_dir`/`tag` (tag None: the one `latest`
    names), trainable parameters from the fp32 master weights, on the CPU, as DeepSpeed's. As DeepSpeed's, it
    needs ZeRO's optimizer files (stages 1-3; `uckpt export` also reads stage-0 and universal folders)."""
    folder = _tag_folder(checkpoint_dir, tag)
    if not glob.glob(os.path.join(folder, "*_optim_states.pt")):
        raise FileNotFoundError(f"can't find *_optim_states.pt files in directory '{folder}'")
    with tempfile.TemporaryDirectory(prefix="uckpt-zero-to-fp32-") as tmp:
        out = os.path.join(tmp, "model.safetensors")
        _uckpt.export_fp32(folder, out)
        state_dict = _read_safetensors(out)
    return _deepspeed_dtypes(state_dict, folder, exclude_frozen_parameters)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag=None,
                                               exclude_frozen_parameters=False):
    """get_fp32_state_dict_from_zero_checkpoint's state_dict, written with torch.save to `output_file`."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    torch.save(state_dict, output_file)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Moves `model` to the CPU and loads the checkpoint's fp32 weights into it (strict=False); returns it."""
    logger.info("Extracting fp32 weights")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    logger.info("Overwriting model with fp32 weights")
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


if __name__ == "__main__":
    # DeepSpeed 0.14.5's command line for this script: the same arguments and flags.
    parser = argparse.ArgumentParser(description="The fp32 weights of the ZeRO checkpoint in CHECKPOINT_DIR, "
                                                 "written with torch.save to OUTPUT_FILE (uckpt's zero_to_fp32)")
    parser.add_argument("checkpoint_dir", type=str,
                        help="the folder holding `latest` and the tag folders (e.g. out/checkpoint-12)")
    parser.add_argument("output_file", type=str, help="where the state_dict goes (e.g. pytorch_model.bin)")
    parser.add_argument("-t", "--tag", type=str, default=None,
                        help="the tag folder to read (e.g. global_step12); default: the one `latest` names")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out the parameters that were frozen (requires_grad False)")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted; uckpt prints nothing more")
    args = parser.parse_args()
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_file, tag=args.tag,
                                               exclude_frozen_parameters=args.exclude_frozen_parameters)
