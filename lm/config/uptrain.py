"""scripts/uptrain.py's settings, and its ablation studies' (`--config-name uptrain_study`,
`uptrain_methods`): each one's default, meaning and bound, declared once here.

conf/uptrain_base.yaml composes `uptrain_settings` first (the logger and attn groups on top), and
conf/uptrain_study_base.yaml adds `uptrain_study_settings`; scripts/uptrain.py builds them (UptrainRun,
each setting checked as it is built) before the checkpoint is read, and uptraining adds what depends on two
settings (lm.training.uptraining.check_uptrain_settings).
The model, data, optimizer and the rest of the trainer are the source run's, so they are not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from lm.config.logger import LoggerSettings
from lm.config.settings import store
from lm.formats.convert import INITS
from lm.util.settings import (
    Checked,
    boolean,
    built,
    choice,
    each,
    group,
    integer,
    number,
    optional_group,
    positive,
    setting,
    training_seed,
)


@dataclass(kw_only=True)
class UptrainOptions(Checked):
    init: str = setting("mean", "how each group's K/V heads are formed (GQA/MQA; aligned: heads rotated to agree, "
                                "then mean)", choice(INITS))
    distill: float = setting(0.0, "w > 0 adds w T^2 KL(parent || model) to the loss; 0: no distillation", number(0))
    temperature: float = setting(1.0, "T of the distillation's softmax", positive())
    calibration_batches: int = setting(4, "training batches the conversion fits to (attn=mla's RoPE ranking, "
                                          "init=aligned)", integer())
    fraction: float = setting(0.05, "the share of the source run's optimizer steps to uptrain for (the paper's "
                                    "alpha)", number(0, 1))
    steps: int | None = setting(None, "an explicit number of steps instead of fraction; 0 converts only (needs out=)",
                                integer(0, nullable=True))
    warmup_fraction: float = setting(0.1, "warm-up, as a share of the uptraining steps; then the source run's "
                                          "schedule", number(0, 1, open_high=True))
    evaluations: int = setting(5, "validations over the run (when val_every_n_steps is null)", integer())
    val_every_n_steps: int | None = setting(None, "steps between validations; null: evaluations spread over the run",
                                            integer(1, nullable=True))
    limit_val_batches: int | None = setting(None, "validation batches; null: the source run's",
                                            integer(1, nullable=True))


@dataclass(kw_only=True)
class Uptraining(UptrainOptions):
    """What a training run records of the uptraining it is (lm.config.train.TrainRun.uptrain): the
    options and the checkpoint they converted."""

    source: str | None = setting(None, "the checkpoint converted (ckpt=)")


@dataclass(kw_only=True)
class UptrainTrainer(Checked):
    skip_nonfinite: bool = setting(False, "true: skip steps whose loss is NaN or inf instead of stopping (the rest "
                                          "of the trainer is the source run's)", boolean())


@dataclass(kw_only=True)
class UptrainSettings(Checked):
    ckpt: str = setting(help="the multi-head (or grouped) source checkpoint")
    uptrain: UptrainOptions = group(UptrainOptions, "the conversion and the continued training")
    trainer: UptrainTrainer = group(UptrainTrainer)
    out: str | None = setting(None, "with uptrain.steps=0: the folder for the converted last.ckpt and tokenizer.json")
    run_name: str | None = setting(None, "checkpoints/<run_name>/; null: <source run>-<gqaN|mqa|mla-rR-dD>-<init>")
    resume: bool = setting(False, "continue checkpoints/<run_name>/last.ckpt of an interrupted uptraining (the "
                                  "command a stopped run prints)", boolean())
    seed: int | None = setting(0, "of the data's order and any random initialisation", training_seed())
    checkpoint_dir: str = setting("checkpoints", "where checkpoints/<run_name>/ goes")
    progress_bar: bool = setting(True, "a progress bar while training", boolean())
    sample_tokens: int = setting(48, "tokens of a sampled continuation printed at the end; 0: none", integer(0))


@dataclass(kw_only=True)
class StudyGrid(Checked):
    kv_heads: list[int] = setting(help="the K/V heads each conversion targets", bound=each(integer()),
                                  factory=lambda: [1, 2])
    inits: list[str] = setting(help="the pooling of each group's heads", bound=each(choice(INITS)),
                               factory=lambda: ["mean", "first", "random"])
    fractions: list[float] = setting(help="shares of the source run's steps", bound=each(number(0, 1, open_low=True)),
                                     factory=lambda: [0.05, 0.10])
    scratch: bool = setting(True, "also train the largest kv_heads from random weights for each budget's steps",
                            boolean())
    out: str = setting("checkpoints/uptrain_study", "results.json, results.md, val_loss.png, records/, runs/")
    decode_tokens: int = setting(128, "greedy tokens per arm for the decode tokens/s figure", integer())
    methods: list = setting(help="named conversions beside the grid: [{name, attn, init, distill, temperature}] "
                                 "(conf/uptrain_methods.yaml)", factory=list)


@dataclass(kw_only=True)
class UptrainStudySettings:
    study: StudyGrid = group(StudyGrid, "the ablation: every kv_heads x init x fraction from one source checkpoint")


@dataclass(kw_only=True)
class UptrainRun(UptrainSettings):
    """What scripts/uptrain.py runs, typed: its settings, the logger group, the conversion's target and,
    for a study (`--config-name uptrain_study`), its grid. `attn` is the target as given, `attn.n_kv_head=N`
    or attn=mla with its options, which lm.training.uptraining.conversion_target reads and checks."""

    logger: LoggerSettings = group(LoggerSettings)
    attn: dict = field(default_factory=dict)
    study: StudyGrid | None = optional_group(StudyGrid, "the ablation's grid (--config-name uptrain_study)")

    @classmethod
    def from_config(cls, cfg: DictConfig) -> UptrainRun:
        """The run a composed config describes: the target's attn settings as given (their `${model.n_head}`
        has no model group to resolve against here), everything else resolved, then built and checked."""
        rest = [key for key in cfg if key != "attn"]
        values = OmegaConf.to_container(OmegaConf.masked_copy(cfg, rest), resolve=True)
        attn = OmegaConf.to_container(cfg.attn, resolve=False) if cfg.get("attn") is not None else {}
        return built(cls, {**values, "attn": attn})


store("uptrain_settings", UptrainSettings)
store("uptrain_study_settings", UptrainStudySettings)

__all__ = ["StudyGrid", "UptrainOptions", "UptrainRun", "Uptraining", "UptrainSettings", "UptrainStudySettings",
           "UptrainTrainer"]
