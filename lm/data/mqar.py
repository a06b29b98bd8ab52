"""MQAR for training (`data=mqar`): the recall task's examples (lm.data.recall_task, where the task
and its data are described) as a Dataset, the tokenizer of its number tokens, and the data module.
The task lives apart so that what reads its settings (lm.config, the studies' plans) loads no
Lightning."""

from __future__ import annotations

import bisect
import itertools

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import DataLoader, Dataset

from lm.data.recall_task import FILLERS, IGNORE, PAD, RecallTask, mix_tasks
from lm.data.windows import CellShuffle, ShuffledDataModule
from lm.util.checks import require_int
from lm.util.errors import DataError


class RecallExamples(Dataset):
    """The examples of one task, or of a mix of several one cell after another, each cell's at its
    own length: item i is (inputs, targets) of its cell's seq_len. `sizes` gives each cell's count."""

    def __init__(self, task: RecallTask | list[RecallTask], split: str):
        tasks = [task] if isinstance(task, RecallTask) else list(task)
        cells = [task.generate(split) for task in tasks]
        self.inputs = [torch.from_numpy(inputs) for inputs, _ in cells]  # each (n_cell, seq_len_cell)
        self.targets = [torch.from_numpy(targets) for _, targets in cells]
        self.sizes = [len(inputs) for inputs in self.inputs]
        self.firsts = list(itertools.accumulate(self.sizes, initial=0))[:-1]  # each cell's first index

    def __len__(self) -> int:
        return sum(self.sizes)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        cell = bisect.bisect_right(self.firsts, i) - 1
        row = i - self.firsts[cell]
        return self.inputs[cell][row], self.targets[cell][row]

    def cell_batches(self, batch_size: int, rank: int, world: int) -> list[list[int]]:
        """Validation's batches, in order: this rank's share of each cell (every world-th example,
        so the ranks' shares are disjoint), `batch_size` at a time, never two cells in one batch."""
        batches = []
        for first, size in zip(self.firsts, self.sizes, strict=True):
            mine = list(range(first + rank, first + size, world))
            batches += [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
        return batches


def number_tokenizer(vocab_size: int) -> Tokenizer:
    """Token i is written as the number i: checkpoints of a recall model load, and generate.py
    reads prompts such as "3 130 7 141 3", without training a tokenizer."""
    tokenizer = Tokenizer(models.WordLevel({str(i): i for i in range(vocab_size)}, unk_token="0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


class RecallDataModule(ShuffledDataModule):
    """MQAR examples for training (`data=mqar`): generated in memory once, no tokenizer training.
    `data.mix` (a list of [seq_len, pairs]) trains and validates on several tasks at once instead
    of data.seq_len and data.pairs, each batch drawn from one of them at its own length."""

    is_text = False

    def __init__(self, task: RecallTask | list[RecallTask], batch_size: int, num_workers: int = 0):
        super().__init__()
        require_int("data.batch_size", batch_size)
        tasks = [task] if isinstance(task, RecallTask) else list(task)
        fewest = min(t.examples for t in tasks)  # every batch comes from one cell of a mix
        if batch_size > fewest:
            share = f"each cell's share of data.examples ({fewest})" if len(tasks) > 1 else f"data.examples={fewest}"
            raise DataError(f"data.batch_size={batch_size} is larger than {share}")
        self.task, self.batch_size, self.num_workers, self.seed = task, batch_size, num_workers, tasks[0].seed
        self.tokenizer = number_tokenizer(tasks[0].vocab_size)

    @classmethod
    def from_settings(cls, data, max_seq_len: int) -> RecallDataModule:
        """The module `data=mqar`'s settings describe (lm.config.data.RecallSettings)."""
        if data.mix:
            task = mix_tasks(data, list(data.mix))
            longest = max(t.seq_len for t in task)
        else:
            task = RecallTask(vocab_size=data.vocab_size, seq_len=data.seq_len, pairs=data.pairs,
                              examples=data.examples, val_examples=data.val_examples, seed=data.seed,
                              filler=data.filler, query_power=data.query_power)
            longest = task.seq_len
        if longest > max_seq_len:
            raise DataError(f"data.seq_len={longest} is longer than the model's context "
                            f"model.max_seq_len={max_seq_len}")
        return cls(task, data.batch_size, data.num_workers)

    def train_sampler(self, start_batch: int, rank: int, world: int):
        if len(self.train_set.sizes) == 1:  # one task: the plain epoch shuffle
            return super().train_sampler(start_batch, rank, world)
        return CellShuffle(self.train_set.sizes, self.seed, self.batch_size, start_batch, rank, world)

    def val_dataloader(self) -> DataLoader:
        batches = self.val_set.cell_batches(self.batch_size, *self._rank_and_world())
        return DataLoader(self.val_set, batch_sampler=batches, num_workers=self.num_workers)

    def prepare_data(self) -> None:
        pass

    def setup(self, stage: str | None = None) -> None:
        if not hasattr(self, "train_set"):
            self.train_set = RecallExamples(self.task, "train")
            self.val_set = RecallExamples(self.task, "val")


__all__ = ["FILLERS", "IGNORE", "PAD", "RecallDataModule", "RecallExamples", "RecallTask", "mix_tasks",
           "number_tokenizer"]
