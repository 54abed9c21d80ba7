"""Data that resumes at any world size (uckpt's own; DeepSpeed's loader keeps no position).

`ResumableSampler` is opt-in: a script gives it to its own DataLoader,

    sampler = uckpt.data.ResumableSampler(dataset, engine, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(),
                                         sampler=sampler)

or opts in through the config, for the loader `initialize(training_data=...)`
returns (uckpt's own section, which DeepSpeed ignores; seed 0 and shuffle
true by default; any other key is refused):

    "uckpt": {"resumable_data": {"seed": 0, "shuffle": true}}

Either way the script must not skip batches itself after a load: the sampler starts where the
engine's data position says. That position is the samples consumed
(`engine.global_samples`), saved in every checkpoint and restored by
`load_checkpoint` at any world size and accumulation, so a resumed run sees
exactly the samples the uninterrupted run would have.

The order: each epoch a permutation of the dataset (seeded by `seed` and the
epoch, as torch's DistributedSampler), cut into global batches of
`train_batch_size` samples (a last incomplete one is dropped); rank r's micro
step m of a global batch takes samples [m * W * micro + r * micro, ... + micro)
of it (W ranks). An iterator runs to the end of the epoch the position is in;
the next one continues from the position again, so create the loader's
iterator after `load_checkpoint`.
"""
import torch


class ResumableSampler(torch.utils.data.Sampler):

    def __init__(self, dataset, engine, seed=0, shuffle=True):
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise ValueError(f"uckpt.data.ResumableSampler: {type(dataset).__name__} is an iterable dataset; resumable "
                             f"data needs a map-style one (len() and indexing)")
        self.n = len(dataset)
        self.engine = engine
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.batch = engine.train_batch_size()
        if self.n < self.batch:
            raise ValueError(f"uckpt.data.ResumableSampler: the dataset has {self.n} samples, fewer than one global "
                             f"batch ({self.batch})")

    def _order(self, epoch):
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def _per_epoch(self):
        return self.n // self.batch * self.batch  # samples of whole global batches

    def __len__(self):
        """This rank's samples left in the epoch the data position is in."""
        e = self.engine
        left = self._per_epoch() - e.global_samples % self._per_epoch()
        return left // e.world_size

    def __iter__(self):
        e = self.engine
        micro, world, rank = e.train_micro_batch_size_per_gpu(), e.world_size, e.global_rank
        position = e.global_samples
        if position % self.batch:
            raise ValueError(f"uckpt.data.ResumableSampler: the data position {position} is not a whole number of "
                             f"global batches of {self.batch}")
        per_epoch = self._per_epoch()
        epoch, at = divmod(position, per_epoch)
        order = self._order(epoch)
        for start in range(at, per_epoch, self.batch):
            for m in range(self.batch // (micro * world)):
                first = start + m * world * micro + rank * micro
                yield from order[first:first + micro]


def config_loader(dataset, engine, collate_fn=None):
    """The loader initialize(training_data=...) returns when the config's
    "uckpt" section has "resumable_data"; None without it (DeepSpeed's loader)."""
    section = engine._uckpt_config().get("resumable_data")
    if section is None:
        return None
    sampler = ResumableSampler(dataset, engine, seed=int(section.get("seed", 0)),
                               shuffle=bool(section.get("shuffle", True)))
    kwargs = {} if collate_fn is None else {"collate_fn": collate_fn}
    return torch.utils.data.DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler,
                                       **kwargs)


class GlobalResumableSampler(torch.utils.data.Sampler):
    """ResumableSampler's order for loaders that split it among the ranks themselves (Accelerate's, under the
    Hugging Face Trainer): every rank yields the same global order, from the engine's data position
    (`engine.global_samples`) to the end of the epoch that position is in; the loader gives rank r its micro
    batches r, r + W, ... of it. The order is the permutation of `seed + epoch` (torch.randperm, as the Trainer's
    default sampler, Accelerate's SeedableRandomSampler), cut to whole global batches of `train_batch_size`.

    `engine` is the engine or a callable that returns it when an iterator is made (the Trainer makes its sampler
    before its engine). len() is the dataset's, for the Trainer's step counts; iterators start at the position,
    so the loader's owner must not skip batches itself (the Trainer's ignore_data_skip=True)."""

    def __init__(self, dataset, engine, seed=0, shuffle=True):
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise ValueError(f"uckpt.data.GlobalResumableSampler: {type(dataset).__name__} is an iterable dataset; "
                             f"resumable data needs a map-style one (len() and indexing)")
        self.n = len(dataset)
        self.engine = engine if callable(engine) and not hasattr(engine, "global_samples") else (lambda: engine)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)

    def __len__(self):
        return self.n

    def __iter__(self):
        e = self.engine()
        if not hasattr(e, "global_samples") or not hasattr(e, "train_batch_size"):
            raise ValueError(f"uckpt.data.GlobalResumableSampler: {type(e).__name__} is not a uckpt engine (no data "
                             f"position); iterate after deepspeed.initialize")
        batch = e.train_batch_size()
        per_epoch = self.n // batch * batch
        if per_epoch == 0:
            raise ValueError(f"uckpt.data.GlobalResumableSampler: the dataset has {self.n} samples, fewer than one "
                             f"global batch ({batch})")
        epoch, at = divmod(e.global_samples, per_epoch)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        yield from order[at:per_epoch]


def trainer_sampler(trainer, dataset=None):
    """The sampler for a Hugging Face Trainer's `_get_train_sampler` that resumes at uckpt's data position:

        class Trainer(transformers.Trainer):
            def _get_train_sampler(self, train_dataset=None):
                return uckpt.data.trainer_sampler(self, train_dataset)

    with TrainingArguments(ignore_data_skip=True, ...) (the Trainer would skip batches again otherwise). Its order
    is the Trainer's own (the permutation of data_seed, else seed, plus the epoch), from engine.global_samples:
    a resume continues at the sample the run stopped at, at any world size and any global batch."""
    args = trainer.args
    if not args.ignore_data_skip:
        raise ValueError("uckpt.data.trainer_sampler: the Trainer skips the batches of the steps it resumes after "
                         "unless TrainingArguments(ignore_data_skip=True); this sampler starts at the engine's data "
                         "position itself: set ignore_data_skip=True")
    seed = args.data_seed if args.data_seed is not None else args.seed
    return GlobalResumableSampler(trainer.train_dataset if dataset is None else dataset,
                                  lambda: trainer.model_wrapped, seed=seed)
