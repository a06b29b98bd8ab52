"""The `data` group's settings, one schema per source: each setting's default, meaning and bound,
declared once here (the recall task's defaults and bounds are RecallTask's, lm.data.mqar).

conf/data/*.yaml compose their source's schema (`- /data/settings@_here_: corpus`) and state only
what they change; `data_settings` makes a composed or stored `data` config the source's settings,
checked before any data is read, each setting named as typed (`data.batch_size`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lm.config.settings import plain, store
from lm.data.corpora import unknown_source
from lm.data.recall_task import RecallTask
from lm.util.errors import ConfigError
from lm.util.settings import Checked, boolean, built, fraction, integer, library_setting, redefault, setting


@dataclass(kw_only=True)
class DataSettings(Checked):
    """What every source takes."""

    source: str = setting(help="pystdlib | pystdlib_tests | text | hf | mqar: each data=<option> names its own")
    batch_size: int = setting(16, "sequences per batch (per device)", integer())
    num_workers: int = setting(0, "DataLoader worker processes; 0: the training process itself", integer(0))


@dataclass(kw_only=True)
class TextSettings(DataSettings):
    """What every text corpus takes: its tokenizer, its held-out share and where both are cached."""

    vocab_size: int = setting(8192, "the BPE tokenizer's vocabulary, trained on the corpus's training split",
                              integer())
    val_fraction: float = setting(0.05, "the share of files held out for validation, chosen by a hash of their "
                                        "path", fraction())
    cache_dir: str = setting(".cache/tokens", "tokenizer and token arrays, keyed by corpus and tokenizer settings")


@dataclass(kw_only=True)
class CorpusSettings(TextSettings):
    """Files: the standard library's source (pystdlib, pystdlib_tests) or your own (text)."""

    paths: list[str] | None = setting(None, "data=text: files, folders or globs ([file, dir/, \"glob/**/*.txt\"])")


@dataclass(kw_only=True)
class HubSettings(TextSettings):
    """`data=hf`: a `datasets.load_dataset` corpus, from the hub or a local folder."""

    name: str | None = setting(None, "a hub dataset name or a local folder (data=hf needs one)")
    config_name: str | None = setting(None, "the dataset's configuration, where it has several")
    split: str = setting("train", "the split read (held-out files are then chosen by val_fraction)")
    text_field: str = setting("text", "the column holding the text")
    streaming: bool = setting(False, "read the split as a stream instead of downloading it whole", boolean())
    data_files: Any = setting(None, "load_dataset's data_files: a file, a list or a mapping")
    max_docs: int | None = setting(None, "read at most this many documents (useful with streaming)",
                                   integer(1, nullable=True))


def recall_setting(name: str, help: str) -> Any:
    """A setting of the recall task whose default is RecallTask's own and whose bound it checks."""
    return library_setting(RecallTask, name, help)


@dataclass(kw_only=True)
class RecallSettings(DataSettings):
    """`data=mqar`: multi-query associative recall, generated from the seed (lm/data/mqar.py)."""

    batch_size: int = redefault(DataSettings, "batch_size", 64)
    vocab_size: int = recall_setting("vocab_size", "keys 1..vocab_size/2-1, values from vocab_size/2; token i is "
                                                   "the word \"i\" (no tokenizer is trained)")
    seq_len: int = recall_setting("seq_len", "tokens per example; at most model.max_seq_len")
    pairs: int = recall_setting("pairs", "key-value pairs per example, each key queried once later")
    mix: list | None = setting(None, "[[seq_len, pairs], ...]: train and validate on these together, each batch "
                                     "from one of them at its own length (Based's Figure 2), examples and "
                                     "val_examples shared equally; null: seq_len and pairs")
    mix_examples: list | None = setting(None, "training examples of each data.mix cell, in its order (Based's "
                                              "Figure 2: 100k at [64, 4], 20k at each other); null: data.examples "
                                              "shared equally")
    examples: int = recall_setting("examples", "training examples, reshuffled every epoch")
    val_examples: int = recall_setting("val_examples", "a fixed held-out set (its own random stream)")
    filler: str = recall_setting("filler", "the query region between queries: pad (token 0, Zoology's Figure 2) or "
                                           "random tokens")
    query_power: float = recall_setting("query_power", "a of the power law p(offset 2g) ~ (g+1)^(a-1) placing the "
                                                       "queries; 1.0: uniform")
    seed: int = recall_setting("seed", "of the generated examples")


SOURCES: dict[str, type[DataSettings]] = {"pystdlib": CorpusSettings, "pystdlib_tests": CorpusSettings,
                                          "text": CorpusSettings, "hf": HubSettings, "mqar": RecallSettings}


def data_source(values: Mapping) -> type[DataSettings]:
    """The settings class of the source `values["source"]` names; one line naming the sources for
    any other."""
    if values.get("source", "???") == "???":
        raise ConfigError("data.source is required: give data.source=...")
    source = values["source"]
    if source not in SOURCES:
        raise unknown_source(source)
    return SOURCES[source]


def data_settings(values: Mapping) -> DataSettings:
    """A `data` group as composed or stored, typed and checked, each setting named as typed (`data.batch_size`)."""
    values = plain(values)
    return built(data_source(values), values, "data.")


for _name, _cls in {"corpus": CorpusSettings, "hf": HubSettings, "mqar": RecallSettings}.items():
    store(_name, _cls, group="data/settings")

__all__ = ["CorpusSettings", "DataSettings", "HubSettings", "RecallSettings", "SOURCES", "TextSettings",
           "data_settings", "data_source"]
