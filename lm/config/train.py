"""scripts/train.py's settings: its own keys beside its groups (TrainSettings: each one's default,
meaning and bound, declared once here), and the whole run they make with the groups (TrainRun).

conf/train.yaml composes TrainSettings first (`train_settings`), its groups and overrides on top;
the script turns the composed config into a TrainRun at its edge (`TrainRun.from_config`), which
checks every setting as it is built, and `lm.training.train` takes that. A run config stored
before a setting existed takes its default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from omegaconf import DictConfig

from lm.config.attn import AttnSettings
from lm.config.data import DataSettings, data_source
from lm.config.logger import LoggerSettings
from lm.config.model import ModelSettings
from lm.config.optim import MuonConfig, OptimConfig, optimizer_class
from lm.config.settings import plain, store
from lm.config.trainer import TrainerSettings
from lm.config.uptrain import Uptraining
from lm.util.errors import ConfigError
from lm.util.settings import (
    Checked,
    boolean,
    built,
    group,
    integer,
    number,
    optional_group,
    required_group,
    setting,
    training_seed,
)

RUN_NAME = "${attn.name}-${model.name}"  # the default run name: the attention's and the shape's


@dataclass(kw_only=True)
class CheckpointSettings(Checked):
    every_n_steps: int | None = setting(100, "last.ckpt every n optimizer steps as well as at each validation "
                                             "(null: only there)", integer(1, nullable=True))


@dataclass(kw_only=True)
class SampleSettings(Checked):
    prompt: str = setting("def ", "the text the sample continues")
    max_new_tokens: int = setting(48, "tokens to add (0: no sample)", integer(0))
    temperature: float = setting(0.8, "0 is greedy", number(0))
    top_k: int | None = setting(50, "keep the k likeliest tokens; null: no top-k filter", integer(1, nullable=True))
    seed: int | None = setting(0, "null: a different sample each run", integer(0, nullable=True))


@dataclass(kw_only=True)
class TrainSettings(Checked):
    run_name: str = setting(RUN_NAME, "checkpoints/<run_name>/; resume=true continues it")
    seed: int | None = setting(0, "of the weights' initialisation and the data's order", training_seed())
    resume: bool = setting(False, "continue checkpoints/<run_name>/last.ckpt", boolean())
    ckpt_path: str | None = setting(None, "or continue from this checkpoint")
    init_from: str | None = setting(None, "start from these weights and their tokenizer (a checkpoint, or a "
                                          "transformers Llama/Mistral folder) with a fresh optimizer; model/attn "
                                          "are then the checkpoint's")
    compile: bool = setting(False, "torch.compile the model (inductor; CPU or GPU; the first step compiles)",
                            boolean())
    loss_chunk: int = setting(512, "positions whose logits the training and validation loss makes at a time: the "
                                   "head, the cross-entropy and their gradients chunk by chunk, never the whole "
                                   "(tokens, vocab) logits (lm.model.linear_cross_entropy); 0: the plain head and "
                                   "F.cross_entropy over every logit", integer(0))
    checkpoint_dir: str = setting("checkpoints", "where checkpoints/<run_name>/ goes")
    checkpoint: CheckpointSettings = group(CheckpointSettings)
    sample: SampleSettings = group(SampleSettings, "a short continuation printed at the end of training")


# The recipe scripts/train.py trained with before model=nano and optim=muon (Muon, wsd) became its
# defaults: the tiny model (6.3M parameters), AdamW with the cosine schedule, 500 steps, and the loss
# made from the whole logits at once (loss_chunk=0). The studies (compare, the frontier) train their
# arms with it, so their committed records hold until a study is rerun on purpose, and `bench.py
# recipe` measures the default against it.
ADAMW_RECIPE = ("model=tiny", "optim=adamw", "trainer.max_steps=500", "loss_chunk=0")


@dataclass(kw_only=True)
class TrainRun(TrainSettings):
    """One training run, every setting typed and checked: TrainSettings with the groups conf/train.yaml
    composes. `attn` says which kind each layer is, with the kinds' options (lm.config.attn); `uptrain` is
    set by uptraining (lm.training.uptraining), which continues a converted model with this run."""

    attn: AttnSettings
    model: ModelSettings = required_group(ModelSettings, "the shape (model=<option>)")
    data: DataSettings = required_group(DataSettings, "the data (data=<option>)", choose=data_source)
    trainer: TrainerSettings = group(TrainerSettings, "Lightning's Trainer and what training adds to it")
    optim: OptimConfig = group(MuonConfig, "the optimizer and its schedule (optim=<option>)", choose=optimizer_class)
    logger: LoggerSettings = group(LoggerSettings)
    uptrain: Uptraining | None = optional_group(Uptraining, "the uptraining this run is (lm.training.uptraining)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.run_name == RUN_NAME:  # a run built in Python: the default as composing would resolve it
            self.run_name = f"{self.attn.name or self.attn.kind or 'hybrid'}-{self.model.name}"

    @classmethod
    def from_config(cls, cfg: DictConfig | Mapping) -> TrainRun:
        """The run a composed (or stored) config describes, resolved and checked: a script's edge."""
        values = dict(plain(cfg))
        attn = values.pop("attn", None)
        if not isinstance(attn, Mapping):
            raise ConfigError("a training run needs its attn group (attn=<option>)")
        return built(cls, {**values, "attn": AttnSettings.from_dict(attn)})

    def to_dict(self) -> dict:
        """Every setting as plain data, groups as the command line spells them: what a checkpoint and
        the logger record of the run."""
        return {**dataclasses.asdict(self), "attn": self.attn.to_dict()}


store("train_settings", TrainSettings)

__all__ = ["ADAMW_RECIPE", "CheckpointSettings", "RUN_NAME", "SampleSettings", "TrainRun", "TrainSettings"]
