"""What a training config asks for, checked before any data or model work starts: every number the
run uses (`check_run_settings`), the model it describes (`model_config_from`) and the weight and
temperature of distillation (`distillation_settings`)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from lm.attention import layer_specs
from lm.config.train import check_train_settings
from lm.model.config import ModelConfig, check_layers_build
from lm.model.transformer import Transformer
from lm.training.module import check_distillation
from lm.training.optim import check_optim_settings, optim_config
from lm.util.checks import require_choice, require_fraction, require_int
from lm.util.errors import ConfigError

PRECISIONS = ("auto", "32-true", "32", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true")


def model_config_from(cfg: DictConfig, vocab_size: int) -> ModelConfig:
    """ModelConfig from the `model` and `attn` groups; the vocabulary comes from the tokenizer."""
    model = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k != "name"}
    attn = OmegaConf.to_container(cfg.attn, resolve=True)
    attn.pop("name", None)
    n_kv_head = attn.pop("n_kv_head", None)
    kind, pattern, every = attn.pop("kind", None), attn.pop("pattern", None), attn.pop("global_every", None)
    last_kind = attn.pop("last_kind", None)
    if (kind is None) == (pattern is None):
        raise ConfigError(f"give attn.kind (one kind for every layer) or attn.pattern (kinds, repeated over the "
                          f"layers), not {'both' if kind else 'neither'}")
    specs = layer_specs(pattern if pattern is not None else kind, model["n_layer"], attn, every, last_kind=last_kind)
    config = ModelConfig(vocab_size=vocab_size, attention=specs, n_kv_head=n_kv_head, **model)
    check_layers_build(config)  # sizes bounded by the model's shape, before any data or training
    return config


def check_run_settings(cfg: DictConfig) -> None:
    """Every number the run will use, checked before any data or model work starts."""
    t, o, d = cfg.trainer, cfg.optim, cfg.data
    for name in ("max_steps", "val_every_n_steps", "limit_val_batches", "accumulate_grad_batches",
                 "log_every_n_steps", "progress_refresh_steps"):
        require_int(f"trainer.{name}", t[name], minimum=1)
    require_choice("trainer.precision", str(t.precision), PRECISIONS)
    check_optim_settings(optim_config(o), t.get("strategy", "auto"))  # lm.training.optim
    require_int("data.batch_size", d.batch_size)
    if "val_fraction" in d:
        require_fraction("data.val_fraction", d.val_fraction)
    check_train_settings(cfg)  # run_name, seed, resume, ..., checkpoint.*, sample.* (lm/config/train.py)
    if "num_workers" in d:
        require_int("data.num_workers", d.num_workers, minimum=0)
    if t.get("stop_at_accuracy") is not None:
        require_fraction("trainer.stop_at_accuracy", t.stop_at_accuracy)


def distillation_settings(cfg: DictConfig, teacher: Transformer | None) -> tuple[float, float]:
    """(weight, temperature) of distillation from `teacher`: `uptrain.distill` and `uptrain.temperature`
    when the run has an uptrain section, else (0, 1.0): none."""
    uptrain = cfg.get("uptrain") or {}
    distill, temperature = uptrain.get("distill", 0), uptrain.get("temperature", 1.0)
    check_distillation(distill, temperature, teacher)
    return float(distill), float(temperature)
