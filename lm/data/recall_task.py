"""Multi-query associative recall (MQAR), the synthetic recall task of Zoology (Arora et al. 2023).

An example is `pairs` key-value pairs followed by a query region in which every key appears once
more; the target at that position is the key's value. Loss and accuracy count only those answer
positions, so chance accuracy is 1 / (number of values) and a model scores well only if it
recalls the pairs it read. Keys come from the lower half of the vocabulary and values from the
upper half; token 0 is never a key or a value:

    inputs   k1 v1 k2 v2 ... kP vP | k2 0 0 0 kP 0 k1 0 ...
    targets  -  -  -  -  ... -  -  | v2 - - - vP - v1 - ...

As in Zoology (zoology/data/multiquery_ar.py, the settings of its Figure 2):
- queries sit at even offsets of the query region, so no query is followed by a value;
- the offset 2g of a query is drawn with probability proportional to (g + 1)^(a - 1), a power law
  (`query_power` a = 0.01: most queries close to the pairs, as repeated bigrams are in text);
  a = 1 draws the offsets uniformly;
- the rest of the region is the pad token 0 (`filler: pad`), never a key or a value; `filler:
  random` fills it with random tokens instead, which puts decoy keys among the queries.

Examples are generated in blocks of BLOCK, block b from numpy's generator seeded with (seed,
split, b): the same settings give the same data on every machine, the first n training examples
do not depend on how many there are (a study that trains longer sees the same examples first),
and the held-out examples come from a stream of their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lm.util.checks import require_fits_in_memory, require_int
from lm.util.errors import DataError

IGNORE = -100  # targets that are not answers (F.cross_entropy's ignore_index)
PAD = 0  # the filler of the query region: never a key or a value
SPLIT_SALT = {"train": 0, "val": 1, "test": 2}  # test: examples neither training nor validation saw
FILLERS = ("pad", "random")
BLOCK = 1024  # examples generated together: one random stream each, and the bound on generation's memory


@dataclass(frozen=True)
class RecallTask:
    vocab_size: int = 256
    seq_len: int = 128
    pairs: int = 8
    examples: int = 20_000  # training examples; the epoch is reshuffled every pass
    val_examples: int = 1_000
    seed: int = 0
    filler: str = "pad"  # "pad": token 0 between the queries; "random": random tokens (decoy keys among them)
    query_power: float = 0.01  # a of the power law over query offsets; 1.0: uniform

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "pairs", "examples", "val_examples"):
            require_int(f"data.{name}", getattr(self, name), minimum=1)
        require_int("data.seed", self.seed, minimum=0)
        if self.filler not in FILLERS:
            raise DataError(f"data.filler={self.filler!r} is not one of {', '.join(FILLERS)}")
        power = self.query_power
        if isinstance(power, bool) or not isinstance(power, (int, float)) or not 0 < power <= 1:
            raise DataError(f"data.query_power={power!r} must be a number in (0, 1]: the power law's a "
                            "(Zoology uses 0.01; 1 places the queries uniformly)")
        if self.pairs > self.n_keys:
            raise DataError(f"data.pairs={self.pairs} is more than the {self.n_keys} distinct keys "
                            f"data.vocab_size={self.vocab_size} allows (keys are 1..vocab_size/2-1)")
        if 4 * self.pairs > self.seq_len:
            raise DataError(f"data.pairs={self.pairs} does not fit data.seq_len={self.seq_len}: {self.pairs} pairs "
                            f"and {self.pairs} queries at even offsets need at least {4 * self.pairs} positions")
        # The examples are held in memory: a count no machine holds is refused here, not by the OS.
        require_fits_in_memory("data.examples", self.examples, self.bytes_per_example, DataError)
        require_fits_in_memory("data.val_examples", self.val_examples, self.bytes_per_example, DataError)

    @property
    def bytes_per_example(self) -> int:
        """The inputs and targets kept per example (int64 each); generating adds one block's
        temporaries on top, a few MB whatever the count."""
        return 16 * self.seq_len

    @property
    def n_keys(self) -> int:
        return self.vocab_size // 2 - 1

    @property
    def first_value(self) -> int:
        return self.vocab_size // 2

    @property
    def query_slots(self) -> int:
        """The even offsets of the query region a query may take."""
        return (self.seq_len - 2 * self.pairs) // 2

    def query_weights(self) -> np.ndarray:
        """(query_slots,) the power law p(g) ~ (g + 1)^(a - 1) over the slot at offset 2g, normalised."""
        p = np.arange(1, self.query_slots + 1, dtype=np.float64) ** (self.query_power - 1)
        return p / p.sum()

    def generate(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each (n, seq_len) int64; targets are IGNORE except at answers."""
        n = self.examples if split == "train" else self.val_examples
        inputs = np.empty((n, self.seq_len), dtype=np.int64)
        targets = np.empty((n, self.seq_len), dtype=np.int64)
        for block in range(math.ceil(n / BLOCK)):  # written in place: the peak is the result and one block
            rows = slice(block * BLOCK, min(n, (block + 1) * BLOCK))
            block_inputs, block_targets = self.generate_block(split, block)
            inputs[rows], targets[rows] = block_inputs[:rows.stop - rows.start], block_targets[:rows.stop - rows.start]
        return inputs, targets

    def generate_block(self, split: str, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Examples block * BLOCK .. (block + 1) * BLOCK - 1 of the split: always a whole block, so an
        example is the same whatever the count that ends in its block."""
        rng = np.random.default_rng([self.seed, SPLIT_SALT[split], block])
        n, P, T = BLOCK, self.pairs, self.seq_len
        keys = 1 + distinct_draws(rng, n, self.n_keys, P)  # (n, P)
        values = self.first_value + distinct_draws(rng, n, self.vocab_size - self.first_value, P)  # (n, P)
        if self.filler == "pad":
            inputs = np.full((n, T), PAD, dtype=np.int64)
        else:
            inputs = rng.integers(1, self.vocab_size, size=(n, T))
        inputs[:, 0:2 * P:2], inputs[:, 1:2 * P:2] = keys, values
        # P distinct slots per row, drawn without replacement in proportion to the power law: the
        # P largest of log p + Gumbel noise (the Gumbel-top-k trick) are such a draw.
        gumbel = -np.log(-np.log(rng.random((n, self.query_slots))))  # (n, slots)
        slots = np.argsort(np.log(self.query_weights()) + gumbel, axis=1)[:, ::-1][:, :P]  # (n, P)
        positions = 2 * P + 2 * slots  # (n, P)
        # The keys are asked in a random order: the i-th key goes to the i-th drawn slot.
        rows = np.arange(n)[:, None]  # (n, 1)
        inputs[rows, positions] = keys
        targets = np.full((n, T), IGNORE, dtype=np.int64)
        targets[rows, positions] = values
        return inputs, targets


def distinct_draws(rng: np.random.Generator, n: int, high: int, k: int) -> np.ndarray:
    """(n, k) int64: k distinct integers from [0, high) in each row, uniformly. Few of many are drawn
    and the rows with a repeat drawn again (cheap at Zoology's 8192-token vocabulary); many of few
    take the first k of a random permutation. A row of k draws has no repeat with probability about
    exp(-k^2 / 2 high) (the birthday bound): past k^2 > high redrawing would loop for long (64 of 256
    values: one row in 3000 without a repeat), so those take the permutation; where 4 k > high chose
    it before, k^2 > high does too, so the data of every setting that generated quickly is unchanged."""
    if 4 * k > high or k * k > high:
        return rng.random((n, high)).argsort(axis=1)[:, :k]
    draws = rng.integers(0, high, size=(n, k))
    while True:
        ordered = np.sort(draws, axis=1)
        repeats = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)  # (n,)
        if not repeats.any():
            return draws
        draws[repeats] = rng.integers(0, high, size=(int(repeats.sum()), k))


def mix_tasks(data, mix: list) -> list[RecallTask]:
    """One RecallTask per (seq_len, pairs) of `data.mix`, each with its data.mix_examples count where
    that is given, else an equal share of data.examples (rounded up); data.val_examples shared
    equally, and every other setting of `data` (lm.config.data.RecallSettings)."""
    shared = dict(vocab_size=data.vocab_size, seed=data.seed, filler=data.filler, query_power=data.query_power)
    counts = data.mix_examples
    if counts is None:
        counts = [math.ceil(data.examples / len(mix))] * len(mix)
    elif isinstance(counts, (str, bytes)) or not hasattr(counts, "__len__") or len(counts) != len(mix):
        raise DataError(f"data.mix_examples={counts!r} must be a list of one count per data.mix cell "
                        f"({len(mix)})")
    tasks = []
    for entry, examples in zip(mix, counts, strict=True):
        if isinstance(entry, (str, bytes)) or not hasattr(entry, "__len__") or len(entry) != 2:
            raise DataError(f"data.mix entry {entry!r} must be [seq_len, pairs]")
        seq_len, pairs = list(entry)
        try:
            tasks.append(RecallTask(seq_len=seq_len, pairs=pairs, examples=examples,
                                    val_examples=math.ceil(data.val_examples / len(mix)), **shared))
        except ValueError as e:  # a count out of its bound, named as the mix's
            raise DataError(f"data.mix_examples entry {examples!r} for [{seq_len}, {pairs}]: {e}") from None
    return tasks
