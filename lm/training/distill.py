"""Distillation from a parent model: the KL term and the checks that its weight, temperature and
teacher make one. Uptraining's settings check them before any checkpoint is read; no Lightning.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lm.data.recall_task import IGNORE
from lm.model.transformer import Transformer
from lm.util.errors import ConfigError


def distillation_kl(logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    """KL(p_teacher || p_student) of the softmaxes at `temperature`, a mean over the positions
    scored (targets not IGNORE): logits (B, T, V) each, targets (B, T)."""
    student = F.log_softmax(logits.float().flatten(0, 1) / temperature, dim=-1)  # (B*T, V)
    teacher = F.log_softmax(teacher_logits.float().flatten(0, 1) / temperature, dim=-1)  # (B*T, V)
    per_position = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1)  # (B*T,)
    scored = (targets.flatten() != IGNORE).to(per_position.dtype)  # a mask, not an index: no host sync
    return (per_position * scored).sum() / scored.sum().clamp(min=1)


# The largest logit or loss (in nats) float32 training meets is far below this; the distillation's
# weight and temperature are bounded so that scaling one by them stays a finite float32.
FLOAT32_SCALE = 1e4


def check_distillation(distill: float, temperature: float, teacher: Transformer | None,
                       teacher_needed: bool = True) -> None:
    """One ConfigError line unless the weight, temperature and teacher make a distillation (or none).
    Both are checked in float32, where they are used (logits / T, distill T^2 KL): a value that
    overflows there or rounds to zero means nothing. `teacher_needed=False`: the values alone, before
    the teacher is read."""
    if isinstance(distill, bool) or not isinstance(distill, (int, float)) or not 0 <= distill < math.inf:
        raise ConfigError(f"uptrain.distill={distill!r} must be a finite number >= 0")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
        raise ConfigError(f"uptrain.temperature={temperature!r} must be a positive number")
    largest = torch.finfo(torch.float32).max / FLOAT32_SCALE  # 3e34: times a loss or logit, still finite
    lowest, highest = 1 / largest, largest ** 0.5  # logits / T and T^2 x KL finite in float32
    if not lowest <= temperature <= highest:
        raise ConfigError(f"uptrain.temperature={temperature!r} must be from {lowest:.0e} to {highest:.0e}: the "
                          "logits are divided by it, and the KL scaled by its square, in float32")
    weight = distill * temperature ** 2
    if weight > largest:
        raise ConfigError(f"uptrain.distill={distill!r} overflows float32, where the loss adds distill x "
                          f"temperature^2 x KL: distill x temperature^2 must be at most {largest:.0e}")
    if distill > 0 and torch.tensor(weight, dtype=torch.float32).item() == 0:
        raise ConfigError(f"uptrain.distill={distill!r} rounds to zero in float32, where the loss adds distill x "
                          "temperature^2 x KL: give 0 for no distillation, or a larger weight")
    if distill > 0 and teacher is None and teacher_needed:
        raise ConfigError(f"uptrain.distill={distill!r} needs a teacher (the parent model); none was given")


def check_teacher(model: Transformer, teacher: Transformer | None) -> None:
    if teacher is not None and teacher.config.vocab_size != model.config.vocab_size:
        raise ConfigError(f"the teacher's vocab_size={teacher.config.vocab_size} differs from the model's "
                          f"{model.config.vocab_size}: distillation compares their next-token distributions")
