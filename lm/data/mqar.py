"""Multi-query associative recall (MQAR), the synthetic recall task of Zoology (Arora et al. 2023).

An example is `pairs` key-value pairs followed by a query region of random tokens in which every
key appears once more, at a random position; the target at that position is the key's value.
Loss and accuracy count only those answer positions, so chance accuracy is 1 / (number of values)
and a model scores well only if it recalls the pairs it read. Keys come from the lower half of the
vocabulary and values from the upper half (token 0 is never a key or a value):

    inputs   k1 v1 k2 v2 ... kP vP | r r k2 r r r kP r k1 r ...
    targets  -  -  -  -  ... -  -  | - - v2 - - - vP - v1 - ...

Zoology spaces the queries with a power law, so most sit close to the pairs; here they are spread
uniformly over the query region, which asks for recall over the whole sequence. Examples come from
numpy's generator seeded with (seed, split), so the same settings give the same data on every
machine, and the held-out examples never depend on how many training examples there are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import Dataset

from lm.data.windows import ShuffledDataModule
from lm.util.checks import require_fits_in_memory, require_int
from lm.util.errors import DataError

IGNORE = -100  # targets that are not answers (F.cross_entropy's ignore_index)
SPLIT_SALT = {"train": 0, "val": 1}


@dataclass(frozen=True)
class RecallTask:
    vocab_size: int = 256
    seq_len: int = 128
    pairs: int = 8
    examples: int = 20_000  # training examples; the epoch is reshuffled every pass
    val_examples: int = 1_000
    seed: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "pairs", "examples", "val_examples"):
            require_int(f"data.{name}", getattr(self, name), minimum=1)
        require_int("data.seed", self.seed, minimum=0)
        if self.pairs > self.n_keys:
            raise DataError(f"data.pairs={self.pairs} is more than the {self.n_keys} distinct keys "
                            f"data.vocab_size={self.vocab_size} allows (keys are 1..vocab_size/2-1)")
        if 3 * self.pairs > self.seq_len:
            raise DataError(f"data.pairs={self.pairs} does not fit data.seq_len={self.seq_len}: "
                            f"{self.pairs} pairs and {self.pairs} queries need at least {3 * self.pairs} positions")
        # Examples are generated in memory at once: a count no machine holds is refused here, not by the OS.
        require_fits_in_memory("data.examples", self.examples, self.bytes_per_example, DataError)
        require_fits_in_memory("data.val_examples", self.val_examples, self.bytes_per_example, DataError)

    @property
    def bytes_per_example(self) -> int:
        """Bytes `generate` holds per example at its peak, in int64/float64 numbers: a random draw and
        its argsort as wide as the keys or values, later inputs and targets beside the query draw, and
        at the end inputs, targets and the returned copy."""
        T, P = self.seq_len, self.pairs
        draws = 2 * max(self.n_keys, self.vocab_size - self.first_value) + P
        queries = T + 2 * (T - 2 * P) + 2 * P
        return 8 * max(draws, queries, 3 * T + 2 * P)

    @property
    def n_keys(self) -> int:
        return self.vocab_size // 2 - 1

    @property
    def first_value(self) -> int:
        return self.vocab_size // 2

    def generate(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each (n, seq_len) int64; targets are IGNORE except at answers."""
        n = self.examples if split == "train" else self.val_examples
        rng = np.random.default_rng([self.seed, SPLIT_SALT[split]])
        P, T = self.pairs, self.seq_len
        n_values = self.vocab_size - self.first_value
        # Distinct keys and distinct values per row: the first P of a random permutation.
        keys = 1 + rng.random((n, self.n_keys)).argsort(axis=1)[:, :P]  # (n, P)
        values = self.first_value + rng.random((n, n_values)).argsort(axis=1)[:, :P]  # (n, P)
        inputs = rng.integers(1, self.vocab_size, size=(n, T))  # the query region's filler
        inputs[:, 0:2 * P:2], inputs[:, 1:2 * P:2] = keys, values
        # Each key is asked once, at P distinct random positions of the query region.
        region = T - 2 * P
        slots = 2 * P + rng.random((n, region)).argsort(axis=1)[:, :P]  # (n, P)
        rows = np.arange(n)[:, None]  # (n, 1)
        inputs[rows, slots] = keys
        targets = np.full((n, T), IGNORE, dtype=np.int64)
        targets[rows, slots] = values
        return inputs.astype(np.int64), targets


class RecallExamples(Dataset):
    def __init__(self, task: RecallTask, split: str):
        inputs, targets = task.generate(split)
        self.inputs, self.targets = torch.from_numpy(inputs), torch.from_numpy(targets)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.targets[i]


def number_tokenizer(vocab_size: int) -> Tokenizer:
    """Token i is written as the number i: checkpoints of a recall model load, and generate.py
    reads prompts such as "3 130 7 141 3", without training a tokenizer."""
    tokenizer = Tokenizer(models.WordLevel({str(i): i for i in range(vocab_size)}, unk_token="0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


class RecallDataModule(ShuffledDataModule):
    """MQAR examples for training (`data=mqar`): generated in memory once, no tokenizer training."""

    is_text = False

    def __init__(self, task: RecallTask, batch_size: int, num_workers: int = 0):
        super().__init__()
        require_int("data.batch_size", batch_size)
        if batch_size > task.examples:
            raise DataError(f"data.batch_size={batch_size} is larger than data.examples={task.examples}")
        self.task, self.batch_size, self.num_workers, self.seed = task, batch_size, num_workers, task.seed
        self.tokenizer = number_tokenizer(task.vocab_size)

    @classmethod
    def from_config(cls, data_cfg, max_seq_len: int) -> RecallDataModule:
        fields = ("vocab_size", "seq_len", "pairs", "examples", "val_examples", "seed")
        task = RecallTask(**{name: data_cfg[name] for name in fields})
        if task.seq_len > max_seq_len:
            raise DataError(f"data.seq_len={task.seq_len} is longer than the model's context "
                            f"model.max_seq_len={max_seq_len}")
        return cls(task, data_cfg["batch_size"], data_cfg.get("num_workers", 0))

    def prepare_data(self) -> None:
        pass

    def setup(self, stage: str | None = None) -> None:
        if not hasattr(self, "train_set"):
            self.train_set = RecallExamples(self.task, "train")
            self.val_set = RecallExamples(self.task, "val")
