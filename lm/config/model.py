"""The `model` group's settings: the shape a run builds. Each is ModelConfig's own field (lm.model.config),
with its default and meaning, and ModelConfig owns the bounds: a model built in code and one trained
from the command line check the same way. The group adds the shape's name and its QK-norm choice;
the vocabulary is the tokenizer's and the K/V heads and kinds are the `attn` group's.

conf/model/*.yaml compose them (`- /model/settings@_here_: model`) and state only the shape they
name (layers, width, heads); training turns them into a ModelConfig with the `attn` group's layers
(lm.training.settings.model_config_from).
"""

from __future__ import annotations

import dataclasses

from lm.config.settings import store
from lm.model.config import ModelConfig
from lm.util.settings import Checked, boolean, library_setting, setting

# ModelConfig's fields that another part of a run sets: the tokenizer (vocab_size), the attn group (the rest).
NOT_THE_SHAPES = ("vocab_size", "n_kv_head", "attention")

# ModelSettings: the shape's name, every field of ModelConfig but NOT_THE_SHAPES' (its default and meaning), and
# the shape's QK-norm choice, which reaches the specs of the kinds that have it (lm.training.settings).
ModelSettings = dataclasses.make_dataclass("ModelSettings", [
    ("name", str, setting("custom", "the shape's name, in the run's default name (run_name: <attn>-<model>)")),
    *[(f.name, f.type, library_setting(ModelConfig, f.name, f.metadata["help"]))
      for f in dataclasses.fields(ModelConfig) if f.name not in NOT_THE_SHAPES],
    ("qk_norm", "bool | None", setting(None, "QK-norm (RMS-normalised queries and keys) in every layer whose attention "
                                             "kind has it, unless attn.qk_norm says otherwise; null: each kind's own "
                                             "choice", boolean(nullable=True))),
], bases=(Checked,), kw_only=True)
ModelSettings.__module__ = __name__  # where it is declared, for pickling and for reading its repr

store("model", ModelSettings, group="model/settings")

__all__ = ["NOT_THE_SHAPES", "ModelSettings"]
