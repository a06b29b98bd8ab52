"""What a training run asks for beyond each setting's own bound (which a TrainRun checked as it was
built, lm.config.train): the model it describes (`model_config_from`), what depends on two groups
(`check_run_settings`) and the weight and temperature of distillation (`distillation_settings`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from lm.attention import layer_specs
from lm.attention.projections import ProjectionOptions
from lm.config.attn import AttnSettings
from lm.config.model import ModelSettings
from lm.config.settings import plain
from lm.config.train import TrainRun
from lm.config.uptrain import UptrainOptions
from lm.model.config import ModelConfig, check_layers_build
from lm.model.transformer import Transformer
from lm.training.distill import check_distillation
from lm.training.optim import check_optim_settings
from lm.util.settings import built


def model_config_from(shape: ModelSettings, attn: AttnSettings, vocab_size: int) -> ModelConfig:
    """ModelConfig from the `model` and `attn` groups; the vocabulary comes from the tokenizer."""
    model = dataclasses.asdict(shape)
    del model["name"]  # the shape's name, for the run's name only
    qk_norm = model.pop("qk_norm")  # the shape's own choice, for the kinds that have QK-norm
    specs = layer_specs(attn.pattern if attn.pattern is not None else attn.kind, shape.n_layer, attn.options,
                        attn.global_every, last_kind=attn.last_kind)
    if qk_norm is not None and attn.options.get("qk_norm") is None:  # attn.qk_norm, when given, decides instead
        specs = [dataclasses.replace(spec, qk_norm=qk_norm) if isinstance(spec, ProjectionOptions) else spec
                 for spec in specs]
    config = ModelConfig(vocab_size=vocab_size, attention=specs, n_kv_head=attn.n_kv_head, **model)
    check_layers_build(config)  # sizes bounded by the model's shape, before any data or training
    return config


def model_config_of(cfg: Mapping, vocab_size: int) -> ModelConfig:
    """model_config_from the `model` and `attn` groups of a composed or stored config (a study's arm)."""
    values = plain(cfg)
    return model_config_from(built(ModelSettings, values["model"], "model."), AttnSettings.from_dict(values["attn"]),
                             vocab_size)


def check_run_settings(run: TrainRun) -> None:
    """What no single group can check alone, before any data or model work starts."""
    check_optim_settings(run.optim, run.trainer.strategy)  # lm.training.optim


def distillation_settings(uptrain: UptrainOptions | None, teacher: Transformer | None) -> tuple[float, float]:
    """(weight, temperature) of distillation from `teacher`: `uptrain.distill` and `uptrain.temperature`
    of an uptraining run, else (0, 1.0): none."""
    distill, temperature = (uptrain.distill, uptrain.temperature) if uptrain else (0.0, 1.0)
    check_distillation(distill, temperature, teacher)
    return float(distill), float(temperature)
