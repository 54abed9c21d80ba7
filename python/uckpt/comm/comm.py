"""deepspeed.comm.comm: DeepSpeed 0.14.5's collectives and point-to-point calls, on torch.distributed's default group
(the engine's), as DeepSpeed's TorchBackend calls them: the same signatures, with the keywords DeepSpeed adds for its
comms logger (prof, log_name, debug) taken and ignored (uckpt logs no collectives). DeepSpeed 0.14.5's isend and
irecv block and return None (they call its backend's send and recv); uckpt's do the same.

Its other names (the comms logger, backends, MPI discovery helpers) are refused by name (uckpt/_deepspeed_api.py).
"""
import os

import torch.distributed as _dist


def _reduce_op(op):
    """torch's ReduceOp, from torch's or DeepSpeed's (deepspeed.comm.reduce_op.ReduceOp, an Enum)."""
    if isinstance(op, _dist.ReduceOp) or not hasattr(op, "name"):
        return op
    return getattr(_dist.ReduceOp, "PRODUCT" if op.name == "PRODUCT" else op.name)


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500, verbose=True,
                     timeout=None, init_method=None, dist_init_required=None, config=None, rank=-1, world_size=-1):
    import uckpt
    kwargs = {} if timeout is None else {"timeout": timeout}
    uckpt.init_distributed(dist_backend=dist_backend, auto_mpi_discovery=auto_mpi_discovery,
                           distributed_port=distributed_port, verbose=verbose, init_method=init_method,
                           dist_init_required=dist_init_required, config=config, rank=rank, world_size=world_size,
                           **kwargs)


def is_initialized():
    return _dist.is_available() and _dist.is_initialized()


def is_available():
    return True


def destroy_process_group(group=None):
    return _dist.destroy_process_group(group=group)


def new_group(ranks):
    return _dist.new_group(ranks)


def get_world_group():
    return _dist.group.WORLD


def get_world_size(group=None):
    return _dist.get_world_size(group=group)


def get_rank(group=None):
    return _dist.get_rank(group=group)


def get_local_rank():
    """As DeepSpeed's (its launcher's LOCAL_RANK; Open MPI's local rank), 0 when neither is set."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def get_global_rank(group=None, group_rank=0):
    return _dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group=None):
    """DeepSpeed's: the global ranks of `group`'s ranks, asked one by one until torch says there are no more
    (so for group=None, which torch's get_global_rank refuses, an empty list). DeepSpeed 0.14.5 asks without end
    where torch answers every rank (the world group, torch >= 2.x); uckpt stops at the group's size."""
    ranks = []
    try:
        for rank in range(_dist.get_world_size(group=group)):
            ranks.append(_dist.get_global_rank(group, rank))
    except (RuntimeError, ValueError):
        pass
    return ranks


def get_backend(group=None):
    return _dist.get_backend(group=group)


def broadcast(tensor, src, group=None, async_op=False, prof=False, log_name="broadcast", debug=None):
    return _dist.broadcast(tensor=tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False, prof=False, log_name="all_gather", debug=None):
    return _dist.all_gather(tensor_list=tensor_list, tensor=tensor, group=group, async_op=async_op)


def has_reduce_scatter_tensor():
    return True


def has_all_gather_into_tensor():
    return True


def has_all_reduce_coalesced():
    return hasattr(_dist, "all_reduce_coalesced")


def has_coalescing_manager():
    return hasattr(_dist.distributed_c10d, "_coalescing_manager")


def reduce_scatter_tensor(output_tensor, tensor, op=_dist.ReduceOp.SUM, group=None, async_op=False, prof=False,
                          log_name="reduce_scatter_tensor", debug=None):
    return _dist.reduce_scatter_tensor(output_tensor, tensor, op=_reduce_op(op), group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=_dist.ReduceOp.SUM, group=None, async_op=False, prof=False,
                      debug=None):
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, prof=False,
                           log_name="all_gather_into_tensor", debug=None):
    return _dist.all_gather_into_tensor(output_tensor=output_tensor, input_tensor=tensor, group=group,
                                        async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False,
                      prof=False, log_name="all_to_all_single", debug=None):
    return _dist.all_to_all_single(output=output, input=tensor, output_split_sizes=output_split_sizes,
                                   input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    return _dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def send(tensor, dst, group=None, tag=0, prof=False, log_name="send", debug=None):
    return _dist.send(tensor=tensor, dst=dst, group=group, tag=tag)


def recv(tensor, src=None, group=None, tag=0, prof=False, log_name="recv", debug=None):
    return _dist.recv(tensor=tensor, src=src, group=group, tag=tag)


def isend(tensor, dst, group=None, tag=0, prof=False, log_name="isend", debug=None):
    """As DeepSpeed 0.14.5's: a blocking send (its backend's send), returning None."""
    _dist.send(tensor=tensor, dst=dst, group=group, tag=tag)


def irecv(tensor, src=None, group=None, tag=0, prof=False, log_name="irecv", debug=None):
    """As DeepSpeed 0.14.5's: a blocking receive, returning None."""
    _dist.recv(tensor=tensor, src=src, group=group, tag=tag)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, prof=False, log_name="gather", debug=None):
    return _dist.gather(tensor=tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, prof=False, log_name="scatter",
            debug=None):
    return _dist.scatter(tensor=tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


def barrier(group=None, async_op=False, device_ids=None, prof=False, log_name="barrier", debug=None):
    return _dist.barrier(group=_dist.GroupMember.WORLD if group is None else group, async_op=async_op,
                         device_ids=device_ids)


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False, prof=False, log_name="monitored_barrier",
                      debug=None):
    return _dist.monitored_barrier(group=_dist.GroupMember.WORLD if group is None else group, timeout=timeout,
                                   wait_all_ranks=wait_all_ranks)


def reduce(tensor, dst, op=_dist.ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="reduce",
           debug=None):
    return _dist.reduce(tensor=tensor, dst=dst, op=_reduce_op(op), group=group, async_op=async_op)


def reduce_scatter(output, input_list, op=_dist.ReduceOp.SUM, group=None, async_op=False, prof=False,
                   log_name="reduce_scatter", debug=None):
    return _dist.reduce_scatter(output=output, input_list=input_list, op=_reduce_op(op), group=group,
                                async_op=async_op)


def all_reduce(tensor, op=_dist.ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="all_reduce",
               debug=None):
    return _dist.all_reduce(tensor, op=_reduce_op(op), group=group, async_op=async_op)


def inference_all_reduce(tensor, op=_dist.ReduceOp.SUM, group=None, async_op=False, prof=False,
                         log_name="all_reduce", debug=None):
    """DeepSpeed's without its inference kernel: torch.distributed.all_reduce."""
    return _dist.all_reduce(tensor, op=_reduce_op(op), group=group, async_op=False)


def all_reduce_coalesced(tensors, op=_dist.ReduceOp.SUM, group=None, async_op=False, prof=False,
                         log_name="all_reduce", debug=None):
    return _dist.all_reduce_coalesced(tensors, op=_reduce_op(op), group=group, async_op=async_op)


def all_gather_coalesced(output_tensors, input_tensors, group=None, async_op=False):
    """Each input all-gathered into its output, as DeepSpeed's (one all_gather_into_tensor each)."""
    assert len(output_tensors) == len(input_tensors), ""
    handles = [_dist.all_gather_into_tensor(o, i, group=group, async_op=async_op)
               for o, i in zip(output_tensors, input_tensors)]
    return handles[-1] if async_op and handles else None

