"""The `optim` group's settings: each optimizer's defaults, meanings and bounds, declared once here.

conf/optim/adamw.yaml and muon.yaml compose them (`- /optim/settings@_here_: <name>`) and state no
value; lm.training.optim builds the optimizer and the schedule from them and checks them
(`check_optim_settings`: these bounds, then what depends on the trainer). A run config written
before a setting existed takes its default here (an old run meant adamw with a cosine schedule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from lm.config.settings import plain, store
from lm.util.checks import require_choice, require_int, require_unit
from lm.util.errors import ConfigError
from lm.util.settings import Bound, Checked, boolean, built, choice, integer, number, positive, redefault, setting

SCHEDULES = ("cosine", "wsd", "linear", "constant")
ADJUST_LR = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn
NS_DTYPE = ("auto", "bfloat16", "float32")  # auto: bfloat16 where bf16 matmuls are fast (lm.util.hardware)

UNIT = Bound("a number from 0 to 1", require_unit)
DECAY = number(0)
MOMENTUM = number(0, 1, open_high=True)
NS_STEPS = Bound("an integer from 1 to 99", lambda n, v: require_int(n, v, minimum=1, maximum=99))


@dataclass
class OptimConfig(Checked):
    """`optim=adamw`: AdamW for every parameter, then a learning-rate schedule over trainer.max_steps."""
    in_float32: ClassVar[bool] = True  # its rates and decays scale float32 tensors

    name: str = setting("adamw", "the optimizer: adamw | muon (optim=muon chooses its group)")
    lr: float = setting(2e-3, "peak learning rate, reached when warm-up ends", positive())
    min_lr_ratio: float = setting(0.1, "the learning rate at trainer.max_steps, as a fraction of the peak (every "
                                       "schedule but constant ends there)", UNIT)
    warmup_steps: int = setting(50, "linear warm-up from lr / warmup_steps to lr over these optimizer steps",
                                integer(0))
    schedule: str = setting("cosine", "after warm-up: cosine, linear (decay over all the steps left), wsd "
                                      "(constant at lr, then linear decay over the last decay_fraction of "
                                      "trainer.max_steps) or constant (lr to the end, whatever trainer.max_steps: "
                                      "a run continued under a higher max_steps is the same run made longer)",
                            choice(SCHEDULES))
    decay_fraction: float = setting(0.2, "wsd only: the share of trainer.max_steps its final decay takes",
                                    number(0, 1, open_low=True))
    weight_decay: float = setting(0.1, "decoupled; on matrices only, not on norms or embeddings", DECAY)
    beta1: float = setting(0.9, "AdamW's first-moment decay", UNIT)
    beta2: float = setting(0.95, "AdamW's second-moment decay", UNIT)
    fused: bool = setting(True, "torch's fused AdamW kernel", boolean())


@dataclass
class MuonConfig(OptimConfig):
    """`optim=muon`: Muon for the hidden matrices (the blocks' nn.Linear weights; fused Q/K/V and
    gate/up per matrix), AdamW for the rest (embeddings, the head, norms, convolution taps, per-head
    vectors); one schedule scales both. `lr` and `weight_decay` are Muon's; `adamw_lr` and
    `adamw_weight_decay`, with beta1, beta2 and fused, are AdamW's."""

    name: str = setting("muon", "the optimizer: adamw | muon (optim=adamw chooses its group)")
    # schedule and decay_fraction: the best of the measured recipe table; lr and adamw_lr: the best of the grid
    # swept with QK-norm (docs/training.md, "The learning rates and steps with QK-norm")
    lr: float = setting(0.02, "Muon's peak learning rate, for the hidden matrices", positive())
    weight_decay: float = setting(0.01, "Muon's decoupled weight decay: each step multiplies the matrices by "
                                        "1 - lr * weight_decay", DECAY)
    momentum: float = setting(0.95, "Muon's momentum", MOMENTUM)
    nesterov: bool = setting(True, "Nesterov momentum", boolean())
    ns_steps: int = setting(5, "Newton-Schulz iterations per update", NS_STEPS)
    # torch.optim.Muon's bf16 iteration costs ~16x fp32's time on a CPU without bf16 instructions.
    ns_dtype: str = setting("auto", "the Newton-Schulz iteration's dtype: auto (bfloat16 on a GPU and on a CPU "
                                    "with bf16 instructions, else float32) | bfloat16 | float32", choice(NS_DTYPE))
    # original: sqrt(max(1, rows/cols)), Jordan et al.; match_rms_adamw: 0.2 sqrt(max(rows, cols)), Liu et al.
    # 2025, which lets lr take AdamW's value.
    adjust_lr: str = setting("original", "the matrix shape's scaling of lr: original | match_rms_adamw",
                             choice(ADJUST_LR))
    schedule: str = redefault(OptimConfig, "schedule", "wsd")
    decay_fraction: float = redefault(OptimConfig, "decay_fraction", 0.4)
    adamw_lr: float = setting(1.2e-2, "AdamW's peak learning rate, for everything that is not a hidden matrix",
                              positive())
    adamw_weight_decay: float = setting(0.1, "AdamW's weight decay, on its 2-D parameters but the embedding "
                                             "(never norms, biases)", DECAY)


CONFIGS: dict[str, type[OptimConfig]] = {"adamw": OptimConfig, "muon": MuonConfig}


def optimizer_class(settings: Mapping) -> type[OptimConfig]:
    """The config class of the optimizer `settings["name"]` names; a key it does not take is one
    ConfigError line naming what it takes. A run config stored before `optim.name` existed names
    none: those runs trained with AdamW."""
    name = settings.get("name", "adamw")
    require_choice("optim.name", name, CONFIGS)
    keys = [f.name for f in dataclasses.fields(CONFIGS[name])]
    for key in settings:
        if key not in keys:
            raise ConfigError(f"optim.{key} is not a setting of optim={name}; it takes {', '.join(keys)}")
    own = set(keys) - {f.name for f in dataclasses.fields(OptimConfig)}
    if own and not own & set(settings):  # optim.name=muon typed over adamw's group: its lr is AdamW's
        raise ConfigError(f"optim.name={name} takes its settings from its group: choose it with optim={name}")
    return CONFIGS[name]


def optim_settings(values: Mapping) -> OptimConfig:
    """An `optim` group as composed or stored, typed and checked, each setting named as typed (`optim.lr`)."""
    values = plain(values)
    return built(optimizer_class(values), values, "optim.")

for _name, _cls in CONFIGS.items():
    store(_name, _cls, group="optim/settings")

__all__ = ["ADJUST_LR", "CONFIGS", "NS_DTYPE", "SCHEDULES", "MuonConfig", "OptimConfig", "optim_settings",
           "optimizer_class"]
