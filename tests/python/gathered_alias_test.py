"""ZeRO-3 GatheredParameters' exit leaves a tensor that shares the gathered bytes its bytes, as DeepSpeed 0.14.5
(which re-partitions with `param.data = torch.empty(0)`): DeepSpeed-Chat's save_zero_three_model keeps
`v.data.cpu()` from inside the block, which on the CPU is the parameter's own storage. The parameter is
partitioned again after the block and trains on. Usage: gathered_alias_test.py PYTHONPATH (1 rank, seconds)."""
import os
import sys

from testkit import free_port


def main():
    sys.path.insert(0, sys.argv[1])
    port = free_port()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import uckpt as deepspeed
    from uckpt.runtime.zero.partition_parameters import ZeroParamStatus

    class Block(torch.nn.Module):  # a gather unit of its own (as a transformer layer)

        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    class Net(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])
            self.head = torch.nn.Linear(16, 1)

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return self.head(x).pow(2).mean()

    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}})
    xs = [torch.randn(2, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def step(x):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        return loss.item()

    step(xs[0])
    p = engine.module.layers[0].fc1.weight
    if p.ds_status != ZeroParamStatus.NOT_AVAILABLE:
        sys.exit(f"FAIL: setup: fc1.weight is {p.ds_status} after a step, not partitioned (the case tests nothing)")
    with deepspeed.zero.GatheredParameters([p]):
        kept = p.data.cpu()  # on the CPU: p's own storage, as in DeepSpeed-Chat's save_zero_three_model
        whole = p.data.clone()
    errors = []
    kept_has_bytes = kept.untyped_storage().nbytes() == whole.numel() * whole.element_size()
    if not kept_has_bytes:  # (reading it then would dereference no memory)
        errors.append(f"the tensor kept from the block has {kept.untyped_storage().nbytes()} bytes, not "
                      f"{whole.numel() * whole.element_size()}")
    elif not torch.equal(kept, whole):
        errors.append("the tensor kept from the block changed at its exit")
    if p.ds_status != ZeroParamStatus.NOT_AVAILABLE or p.untyped_storage().nbytes() != 0:
        errors.append(f"fc1.weight is not partitioned again after the block ({p.ds_status}, "
                      f"{p.untyped_storage().nbytes()} bytes)")
    losses = [step(x) for x in xs[1:]]
    with deepspeed.zero.GatheredParameters([p]):
        after = p.data.clone()
    if torch.equal(after, whole):
        errors.append("fc1.weight did not change in the steps after the block")
    if kept_has_bytes and not torch.equal(kept, whole):
        errors.append("the kept tensor changed when fc1.weight was gathered and updated again")
    if not all(l == l for l in losses):
        errors.append(f"losses after the block: {losses}")
    if errors:
        sys.exit("FAIL: " + "; ".join(errors))
    print(f"ok: the tensor kept from GatheredParameters keeps its bytes; training goes on (losses {losses})")


if __name__ == "__main__":
    main()
