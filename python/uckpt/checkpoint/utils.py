"""deepspeed.checkpoint.utils: clone_tensors_for_torch_save."""
import torch


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """A copy of `item` whose tensors (alone, or in nested lists, tuples and dicts) are detached clones on
    `device`, so that torch.save writes only their elements, not the storage they are views of."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
