"""Token windows, the epoch shuffle that shards by rank, and the LightningDataModule base they share."""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lm.util.errors import DataError


class TokenWindows(Dataset):
    """Non-overlapping windows of seq_len + 1 tokens: input is [:-1], target is [1:]."""

    def __init__(self, tokens: np.ndarray, seq_len: int, split: str):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len
        if self.n < 1:
            raise DataError(f"the {split} split has {len(tokens)} tokens, fewer than one sequence of "
                            f"seq_len+1={seq_len + 1}; use more text or a smaller model.max_seq_len")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))


class EpochShuffle(torch.utils.data.Sampler):
    """This process' share of a shuffle that is a function of (seed, epoch) alone.

    Global batch g of an epoch is order[g*B*W : (g+1)*B*W] for batch size B and W processes,
    and process r takes the r-th block of B of it: together the processes see exactly the
    batches one process with batch B*W would, without overlap. It can start mid-epoch: on
    resume the data module starts it at the global batch the checkpoint had reached."""

    def __init__(self, n: int, seed: int, batch_size: int, start_batch: int = 0, rank: int = 0, world_size: int = 1):
        self.n, self.seed, self.batch_size, self.rank, self.world_size = n, seed, batch_size, rank, world_size
        self.batches_per_epoch = self.count_batches()
        self.start_epoch, start_in_epoch = divmod(start_batch, self.batches_per_epoch)
        self.offset = start_in_epoch * batch_size
        self.epoch = self.start_epoch

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this before every epoch (through its distributed wrapper too), so the
        order never depends on how often the sampler was iterated."""
        self.epoch = epoch

    def _skip(self) -> int:
        return self.offset if self.epoch == self.start_epoch else 0

    def count_batches(self) -> int:
        return self.n // (self.batch_size * self.world_size)  # the remainder is dropped, as drop_last does

    def epoch_order(self) -> torch.Tensor:
        """(batches_per_epoch * B * W,) the epoch's examples, global batch after global batch."""
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return order[: self.batches_per_epoch * self.batch_size * self.world_size]

    def __iter__(self):
        B, W = self.batch_size, self.world_size
        mine = self.epoch_order().view(-1, W, B)[:, self.rank].flatten()  # (batches*B,)
        return iter(mine[self._skip():].tolist())

    def __len__(self) -> int:
        # The whole epoch's, also when it starts mid-epoch: a resumed Lightning loop counts the batches
        # the checkpoint had done among the epoch's (its progress restarts at them) and ends the epoch at
        # this length. Less the skipped part, it would end the epoch that many batches early, dropping
        # them, and go on to the next.
        return self.batches_per_epoch * self.batch_size


class CellShuffle(EpochShuffle):
    """EpochShuffle over examples kept in cells (a recall mix: each cell its own sequence length),
    in which every global batch comes from one cell, so a batch is never padded to a longer cell's
    length (Based's Figure 2 draws its batches so). Epoch e shuffles each cell c's examples with
    the generator seeded (seed, e, c), cuts them into global batches (a cell's remainder dropped),
    and orders all the batches with the generator seeded (seed, e). `sizes`: examples per cell,
    the cells one after another in the dataset's indices."""

    def __init__(self, sizes: list[int], seed: int, batch_size: int, start_batch: int = 0, rank: int = 0,
                 world_size: int = 1):
        self.sizes = list(sizes)
        super().__init__(sum(self.sizes), seed, batch_size, start_batch, rank, world_size)

    def count_batches(self) -> int:
        return sum(size // (self.batch_size * self.world_size) for size in self.sizes)

    def epoch_order(self) -> torch.Tensor:
        group = self.batch_size * self.world_size
        batches, first = [], 0
        for cell, size in enumerate(self.sizes):
            rows = first + np.random.default_rng([self.seed, self.epoch, cell]).permutation(size)  # (size,)
            whole = size // group
            batches.append(torch.from_numpy(rows[: whole * group]).view(whole, group))  # (whole, B*W)
            first += size
        every = torch.cat(batches)  # (batches_per_epoch, B*W)
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(every))
        return every[torch.from_numpy(order)].flatten()  # (batches_per_epoch * B * W,)


class ShuffledDataModule(L.LightningDataModule):
    """Loaders over `train_set` and `val_set` (set by a subclass's setup): the training order is
    EpochShuffle's, so a resumed run continues at the batch it stopped at, and validation is
    split across ranks without overlap."""

    batch_size: int
    seed: int
    num_workers: int
    is_text = True  # False: examples are not text, and no text sample is printed after training

    def _rank_and_world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        # Resuming: Lightning restores the step count before asking for the dataloader, so the
        # shuffle starts at the global batch the checkpointed run had reached.
        trainer = getattr(self, "trainer", None)
        start_batch = trainer.global_step * trainer.accumulate_grad_batches if trainer is not None else 0
        sampler = self.train_sampler(start_batch, *self._rank_and_world())
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                          num_workers=self.num_workers)

    def train_sampler(self, start_batch: int, rank: int, world: int) -> EpochShuffle:
        return EpochShuffle(len(self.train_set), self.seed, self.batch_size, start_batch, rank, world)

    def val_dataloader(self) -> DataLoader:
        rank, world = self._rank_and_world()
        shard = list(range(rank, len(self.val_set), world))  # each rank a disjoint share; losses are summed
        return DataLoader(torch.utils.data.Subset(self.val_set, shard), batch_size=self.batch_size, shuffle=False,
                          num_workers=self.num_workers)
