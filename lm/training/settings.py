"""What a training config asks for, checked before any data or model work starts: every number the
run uses (`check_run_settings`), the model it describes (`model_config_from`) and the weight and
temperature of distillation (`distillation_settings`)."""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, OmegaConf

from lm.attention import layer_specs
from lm.attention.projections import ProjectionOptions
from lm.config.data import check_data_settings
from lm.config.model import ModelSettings
from lm.config.settings import check_settings, setting_value
from lm.config.train import check_train_settings
from lm.config.trainer import TrainerSettings
from lm.config.uptrain import UptrainOptions
from lm.model.config import ModelConfig, check_layers_build
from lm.model.transformer import Transformer
from lm.training.distill import check_distillation
from lm.training.optim import check_optim_settings, optim_config
from lm.util.errors import ConfigError


def model_config_from(cfg: DictConfig, vocab_size: int) -> ModelConfig:
    """ModelConfig from the `model` and `attn` groups; the vocabulary comes from the tokenizer."""
    model = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k != "name"}
    qk_norm = model.pop("qk_norm", None)  # the shape's own choice, for the kinds that have QK-norm
    check_settings({"qk_norm": qk_norm}, ModelSettings, "model.")  # the rest ModelConfig checks itself
    attn = OmegaConf.to_container(cfg.attn, resolve=True)
    attn.pop("name", None)
    n_kv_head = attn.pop("n_kv_head", None)
    kind, pattern, every = attn.pop("kind", None), attn.pop("pattern", None), attn.pop("global_every", None)
    last_kind = attn.pop("last_kind", None)
    if (kind is None) == (pattern is None):
        raise ConfigError(f"give attn.kind (one kind for every layer) or attn.pattern (kinds, repeated over the "
                          f"layers), not {'both' if kind else 'neither'}")
    specs = layer_specs(pattern if pattern is not None else kind, model["n_layer"], attn, every, last_kind=last_kind)
    if qk_norm is not None and attn.get("qk_norm") is None:  # attn.qk_norm, when given, decides instead
        specs = [dataclasses.replace(spec, qk_norm=qk_norm) if isinstance(spec, ProjectionOptions) else spec
                 for spec in specs]
    config = ModelConfig(vocab_size=vocab_size, attention=specs, n_kv_head=n_kv_head, **model)
    check_layers_build(config)  # sizes bounded by the model's shape, before any data or training
    return config


def check_run_settings(cfg: DictConfig) -> None:
    """Every number the run will use, checked before any data or model work starts."""
    t, o, d = cfg.trainer, cfg.optim, cfg.data
    check_settings(t, TrainerSettings, "trainer.")  # lm/config/trainer.py
    check_optim_settings(optim_config(o), t.get("strategy"))  # lm.training.optim
    check_data_settings(d)  # lm/config/data.py
    check_train_settings(cfg)  # run_name, seed, resume, ..., checkpoint.*, sample.* (lm/config/train.py)


def distillation_settings(cfg: DictConfig, teacher: Transformer | None) -> tuple[float, float]:
    """(weight, temperature) of distillation from `teacher`: `uptrain.distill` and `uptrain.temperature`
    when the run has an uptrain section, else (0, 1.0): none."""
    uptrain = cfg.get("uptrain")
    distill, temperature = (setting_value(uptrain, UptrainOptions, name) for name in ("distill", "temperature"))
    check_distillation(distill, temperature, teacher)
    return float(distill), float(temperature)
