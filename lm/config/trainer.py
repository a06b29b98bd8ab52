"""The `trainer` group's settings (Lightning's Trainer and what training adds to it): each one's
default, meaning and bound, declared once here.

conf/trainer/base.yaml composes them (`- /trainer/settings@_here_: trainer`) and states no value; the
other options (auto, cpu, gpu, ddp, fsdp) name only what they change. Training checks them before
any data or model work (lm.training.settings.check_run_settings); Lightning itself checks
accelerator, devices and strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lm.config.settings import store
from lm.util.checks import require_choice
from lm.util.settings import Bound, Checked, boolean, fraction, integer, number, setting

PRECISIONS = ("auto", "32-true", "32", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true")
# `trainer.precision=32` arrives as an int: judged as typed on the command line, where it is the text 32.
PRECISION = Bound(" | ".join(PRECISIONS), lambda n, v: require_choice(n, str(v), PRECISIONS))


@dataclass(kw_only=True)
class TrainerSettings(Checked):
    in_float32: ClassVar[bool] = True  # gradient_clip_val scales float32 gradients
    accelerator: str = setting("auto", "cpu | gpu | auto (a GPU where CUDA is present)")
    devices: Any = setting(1, "devices per machine (processes, with strategy=ddp), or auto")
    strategy: str = setting("auto", "auto | ddp | fsdp (trainer=ddp and trainer=fsdp choose them)")
    num_nodes: int = setting(1, "machines", integer())
    # bf16 matmuls are ~100x slower on a CPU without bf16 instructions, or with oneDNN held below them
    # (lm.util.hardware)
    precision: str = setting("auto", "auto: bf16-mixed on a GPU and on a CPU with bf16 instructions (AVX512-BF16, "
                                     "AMX), else 32-true", PRECISION)
    max_steps: int = setting(400, "optimizer steps (the default recipe's: docs/training.md, "
                                  "\"The learning rates and steps with QK-norm\")", integer())
    val_every_n_steps: int = setting(100, "optimizer steps between validations", integer())
    limit_val_batches: int = setting(20, "batches per validation", integer())
    gradient_clip_val: float | None = setting(1.0, "the gradients' global norm is clipped to it; 0 or null: no "
                                                   "clipping", number(0, nullable=True))
    accumulate_grad_batches: int = setting(1, "batches per optimizer step", integer())
    stop_at_accuracy: float | None = setting(None, "stop once val/accuracy reaches it (e.g. 0.99: a solved recall "
                                                   "task costs no more steps); null: never", fraction(nullable=True))
    skip_nonfinite: bool = setting(False, "true: skip steps whose loss is NaN or inf instead of stopping", boolean())
    log_every_n_steps: int = setting(10, "optimizer steps between logged training losses", integer())
    progress_bar: bool = setting(True, "a progress bar while training", boolean())
    progress_refresh_steps: int = setting(5, "steps between the progress bar's updates", integer())


store("trainer", TrainerSettings, group="trainer/settings")

__all__ = ["PRECISIONS", "TrainerSettings"]
