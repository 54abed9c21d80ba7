"""deepspeed.runtime.dataloader: RepeatingLoader."""


class RepeatingLoader:
    """Iterates `loader` forever: when it is exhausted, a new iterator over it starts (as DeepSpeed's)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
