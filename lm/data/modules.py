"""The data modules a `data` config names: a text corpus through the token cache, or generated
recall examples (lm.data.mqar)."""

from __future__ import annotations

from pathlib import Path

from lm.data.corpora import Corpus, build_corpus
from lm.data.mqar import RecallDataModule
from lm.data.token_cache import TokenCache, build_token_cache
from lm.data.windows import ShuffledDataModule, TokenWindows
from lm.util.errors import DataError
from lm.util.paths import resolve_path


class TokenDataModule(ShuffledDataModule):
    def __init__(self, corpus: Corpus, cache_dir: Path, seq_len: int, batch_size: int, vocab_size: int,
                 val_fraction: float = 0.05, seed: int = 0, num_workers: int = 0, tokenizer_json: str | None = None):
        super().__init__()
        if batch_size < 1:
            raise DataError(f"data.batch_size={batch_size} must be >= 1")
        if not 0 < val_fraction < 1:
            raise DataError(f"data.val_fraction={val_fraction} must be between 0 and 1")
        self.corpus, self.cache_dir = corpus, Path(cache_dir)
        self.seq_len, self.batch_size, self.vocab_size = seq_len, batch_size, vocab_size
        self.val_fraction, self.seed, self.num_workers = val_fraction, seed, num_workers
        self.tokenizer_json = tokenizer_json
        self.cache: TokenCache | None = None

    @classmethod
    def from_settings(cls, data, seq_len: int, seed: int = 0, tokenizer_json: str | None = None) -> TokenDataModule:
        """The data module a text corpus's settings describe (lm.config.data.TextSettings)."""
        return cls(build_corpus(data), resolve_path(data.cache_dir), seq_len=seq_len, batch_size=data.batch_size,
                   vocab_size=data.vocab_size, val_fraction=data.val_fraction, seed=seed,
                   num_workers=data.num_workers, tokenizer_json=tokenizer_json)

    def prepare_data(self) -> None:
        self.cache = build_token_cache(self.corpus, self.cache_dir, self.vocab_size, self.val_fraction,
                                       min_val_tokens=self.seq_len + 1, tokenizer_json=self.tokenizer_json)

    def setup(self, stage: str | None = None) -> None:
        if self.cache is None:
            self.prepare_data()
        self.tokenizer = self.cache.tokenizer()
        self.train_set = TokenWindows(self.cache.tokens("train"), self.seq_len, "train")
        self.val_set = TokenWindows(self.cache.tokens("val"), self.seq_len, "val")
        if len(self.train_set) < self.batch_size:
            raise DataError(f"data.batch_size={self.batch_size} is larger than the {len(self.train_set)} "
                            f"training sequences of the corpus")


def make_data_module(data, seq_len: int, seed: int = 0, tokenizer_json: str | None = None) -> ShuffledDataModule:
    """The data module a run's `data` settings name (lm.config.data): a corpus of text, or generated
    recall examples."""
    if data.source == "mqar":
        return RecallDataModule.from_settings(data, seq_len)
    return TokenDataModule.from_settings(data, seq_len, seed, tokenizer_json)
