"""MQAR for training (`data=mqar`): the recall task's examples (lm.data.recall_task, where the task
and its data are described) as a Dataset, the tokenizer of its number tokens, and the data module.
The task lives apart so that what reads its settings (lm.config, the studies' plans) loads no
Lightning."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import Dataset

from lm.data.recall_task import FILLERS, IGNORE, PAD, RecallTask, mix_tasks, mixed_examples
from lm.data.windows import ShuffledDataModule
from lm.util.checks import require_int
from lm.util.errors import DataError


class RecallExamples(Dataset):
    """The examples of one task, or of several right-padded to the longest (`mixed_examples`)."""

    def __init__(self, task: RecallTask | list[RecallTask], split: str):
        inputs, targets = task.generate(split) if isinstance(task, RecallTask) else mixed_examples(task, split)
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
    """MQAR examples for training (`data=mqar`): generated in memory once, no tokenizer training.
    `data.mix` (a list of [seq_len, pairs]) trains and validates on several tasks at once instead
    of data.seq_len and data.pairs."""

    is_text = False

    def __init__(self, task: RecallTask | list[RecallTask], batch_size: int, num_workers: int = 0):
        super().__init__()
        require_int("data.batch_size", batch_size)
        tasks = [task] if isinstance(task, RecallTask) else list(task)
        examples = sum(t.examples for t in tasks)
        if batch_size > examples:
            raise DataError(f"data.batch_size={batch_size} is larger than data.examples={examples}")
        self.task, self.batch_size, self.num_workers, self.seed = task, batch_size, num_workers, tasks[0].seed
        self.tokenizer = number_tokenizer(tasks[0].vocab_size)

    @classmethod
    def from_config(cls, data_cfg, max_seq_len: int) -> RecallDataModule:
        mix = data_cfg.get("mix")
        if mix:
            task = mix_tasks(data_cfg, list(mix))
            longest = max(t.seq_len for t in task)
        else:
            fields = ("vocab_size", "seq_len", "pairs", "examples", "val_examples", "seed", "filler", "query_power")
            task = RecallTask(**{name: data_cfg[name] for name in fields if name in data_cfg})
            longest = task.seq_len
        if longest > max_seq_len:
            raise DataError(f"data.seq_len={longest} is longer than the model's context "
                            f"model.max_seq_len={max_seq_len}")
        return cls(task, data_cfg["batch_size"], data_cfg["num_workers"])

    def prepare_data(self) -> None:
        pass

    def setup(self, stage: str | None = None) -> None:
        if not hasattr(self, "train_set"):
            self.train_set = RecallExamples(self.task, "train")
            self.val_set = RecallExamples(self.task, "val")


__all__ = ["FILLERS", "IGNORE", "PAD", "RecallDataModule", "RecallExamples", "RecallTask", "mix_tasks",
           "mixed_examples", "number_tokenizer"]
