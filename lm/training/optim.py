"""What a run optimises with: the `optim` group's settings (lm.config.optim: `optim=adamw`, the default, or
`optim=muon`), their checks, which optimizer each parameter goes to, and the learning-rate schedule.

`optim=adamw`: AdamW for every parameter; weight decay on the matrices, not on norms, biases or
embeddings. `optim=muon`: Muon (lm.training.muon) for the hidden matrices, the weights of the
blocks' nn.Linear layers, each fused weight orthogonalised per matrix it holds; AdamW for the rest
(embeddings, the output head, norms, biases, convolution taps, per-head vectors and scalars), each
side with its own learning rate and weight decay. Either way one schedule scales every group's
learning rate: linear warm-up, then `cosine`, `wsd` or `linear` decay to `min_lr_ratio`, or `constant`.

Which parameters are matrices for Muon is declared, not guessed from shapes: a 2-D parameter is an
nn.Linear weight, or its module names it in `adamw_parameters` (a tuple of its own parameters'
names, e.g. gated delta's convolution taps); a weight stacking several matrices is named by its
module's `fused_rows()` (own weight name -> the row counts of its matrices, in row order). Both are
declared with their defaults on lm.attention.base.WeightDeclarations, which every attention layer
subclasses; the model's own layers (lm.model) are declared here, beside the placement that reads them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from lm.attention.base import WeightDeclarations
from lm.config.optim import MuonConfig, OptimConfig
from lm.model.layers import SwiGLU
from lm.model.short_conv import ShortConv
from lm.model.transformer import Transformer
from lm.training.muon import MuonAdamW, SplitMuon
from lm.util.distributed import say
from lm.util.errors import ConfigError
from lm.util.hardware import multiplies_bf16


def check_optim_settings(o: OptimConfig, strategy: str | None = None) -> None:
    """One ConfigError line naming the key, for what the optimizer cannot train with under this trainer
    (each setting's own bound its config checked as it was built: lm.config.optim)."""
    if isinstance(o, MuonConfig) and "fsdp" in str(strategy).lower():
        raise ConfigError(f"optim=muon cannot train under trainer.strategy={strategy}: Newton-Schulz needs each "
                          "whole matrix and FSDP shards them across devices; use trainer=ddp")


# ---------------------------------------------------------------------------- which optimizer


def model_layer_declarations(module: nn.Module) -> tuple[tuple[str, ...], dict[str, tuple[int, ...]]]:
    """What the model's own layers would declare, as the attention kinds' layers do for themselves."""
    if isinstance(module, Transformer):
        return ("embed.weight", "head.weight"), {}  # tokens in and out: AdamW, as Jordan et al. and Liu et al. do
    if isinstance(module, ShortConv):
        return ("weight",), {}  # (C, taps): convolution taps, one small filter per channel
    if isinstance(module, SwiGLU):
        return (), {"gate_up.weight": (module.d_ff, module.d_ff)}  # rows [gate | up], as split_gate_up cuts them
    return (), {}


def declarations(module: nn.Module) -> tuple[tuple[str, ...], dict[str, tuple[int, ...]]]:
    """(own parameters that are not matrices for Muon, own fused weights -> the rows of each matrix)."""
    adamw, rows = model_layer_declarations(module)
    if isinstance(module, WeightDeclarations):
        return (*adamw, *module.adamw_parameters), {**rows, **module.fused_rows()}
    return adamw, rows


@dataclass
class Placement:
    """Each parameter's optimizer, by name (a tied head is the embedding, named once)."""

    muon: dict[str, nn.Parameter] = field(default_factory=dict)  # the hidden matrices
    rows: dict[str, tuple[int, ...]] = field(default_factory=dict)  # those that stack several: each one's rows
    adamw: dict[str, nn.Parameter] = field(default_factory=dict)  # AdamW, with weight decay
    adamw_no_decay: dict[str, nn.Parameter] = field(default_factory=dict)  # norms, biases, scalars, embeddings


def placement(model: nn.Module) -> Placement:
    """Muon for the 2-D weights of nn.Linear layers that no layer declares otherwise; AdamW for the
    rest. A 2-D parameter that is neither an nn.Linear weight nor declared is one ConfigError line."""
    declared, rows, linear_weights, owners = set(), {}, set(), {}
    for prefix, module in model.named_modules():
        at = f"{prefix}." if prefix else ""
        adamw, fused = declarations(module)
        declared.update(at + name for name in adamw)
        rows.update({at + name: r for name, r in fused.items()})
        if isinstance(module, nn.Linear):
            linear_weights.add(at + "weight")
        owners.update({at + name: module for name, _ in module.named_parameters(recurse=False)})
    embedding = model.embed.weight if isinstance(model, Transformer) else None
    placed = Placement()
    for name, p in model.named_parameters():
        if p.dim() < 2 or p is embedding:
            placed.adamw_no_decay[name] = p
        elif name in declared or p.dim() > 2:
            placed.adamw[name] = p
        elif name in linear_weights:
            placed.muon[name] = p
        else:
            raise ConfigError(f"optim=muon: {name} {tuple(p.shape)} is a 2-D parameter but not an nn.Linear weight; "
                              f"{type(owners[name]).__name__} must name it in adamw_parameters (declared on "
                              "lm.attention.base.WeightDeclarations, which it must subclass) if it is no matrix "
                              "for Muon (taps, per-head vectors), or hold it in an nn.Linear if it is one")
    for name, r in rows.items():
        if name not in placed.muon:
            raise ValueError(f"{name} is declared a fused weight but is no hidden matrix (it goes to AdamW)")
        placed.rows[name] = tuple(r)
    return placed


def adamw_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """optim=adamw: (decayed, not decayed). Decay matmul weights only; norms and embeddings are not
    decayed (a tied head is the embedding, so it is not decayed either)."""
    embedding = model.embed.weight
    decay = [p for p in model.parameters() if p.dim() >= 2 and p is not embedding]
    no_decay = [p for p in model.parameters() if p.dim() < 2 or p is embedding]
    return decay, no_decay


def group_settings(o: OptimConfig) -> list[dict]:
    """Each param group's settings, in the order `build_optimizer` makes the groups: (Muon's,)
    AdamW's decayed, AdamW's not decayed. Resuming applies them again over the checkpoint's."""
    muon = isinstance(o, MuonConfig)
    lr, decay = (o.adamw_lr, o.adamw_weight_decay) if muon else (o.lr, o.weight_decay)
    adamw = [{"lr": lr, "weight_decay": decay, "betas": (o.beta1, o.beta2)},
             {"lr": lr, "weight_decay": 0.0, "betas": (o.beta1, o.beta2)}]
    if not muon:
        return adamw
    return [{"lr": o.lr, "weight_decay": o.weight_decay, "momentum": o.momentum, "nesterov": o.nesterov,
             "ns_steps": o.ns_steps, "adjust_lr_fn": o.adjust_lr}, *adamw]


def ns_dtype(setting: str, device: torch.device) -> str:
    """optim.ns_dtype with auto resolved: bfloat16 where bf16 matmuls are fast, float32 elsewhere."""
    if setting != "auto":
        return setting
    return "bfloat16" if multiplies_bf16(device) else "float32"


def build_optimizer(model: nn.Module, o: OptimConfig) -> torch.optim.Optimizer:
    """torch.optim.AdamW for optim=adamw; MuonAdamW (one optimizer over SplitMuon and AdamW) for optim=muon."""
    settings = group_settings(o)
    if not isinstance(o, MuonConfig):
        groups = [{"params": params, **s} for params, s in zip(adamw_split(model), settings, strict=True)]
        return torch.optim.AdamW(groups, fused=o.fused)
    placed = placement(model)
    dtype = ns_dtype(o.ns_dtype, next(model.parameters()).device)
    if o.ns_dtype == "auto":  # a choice made by the hardware is said, as trainer.precision=auto's is
        say(f"optim.ns_dtype=auto: Newton-Schulz in {dtype}")
    muon = SplitMuon([{"params": list(placed.muon.values()), **settings[0]}],
                     fused_rows={placed.muon[name]: r for name, r in placed.rows.items()}, ns_dtype=dtype)
    adamw = torch.optim.AdamW([{"params": list(placed.adamw.values()), **settings[1]},
                               {"params": list(placed.adamw_no_decay.values()), **settings[2]}], fused=o.fused)
    return MuonAdamW(muon, adamw)


# ---------------------------------------------------------------------------- the schedule


def lr_multiplier(step: int, schedule: str, warmup_steps: int, total_steps: int, min_ratio: float,
                  decay_fraction: float) -> float:
    """The learning rate at optimizer step `step` (from 0) as a fraction of the peak: linear warm-up
    to 1 over warmup_steps, then
    - cosine: cosine decay to min_ratio at total_steps;
    - linear: linear decay to min_ratio at total_steps;
    - wsd (warm-up, stable, decay): 1 until the last decay_fraction of total_steps (never before
      warm-up ends), then linear decay to min_ratio at total_steps;
    - constant: 1, never depending on total_steps.
    Steps past total_steps stay at min_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    start = warmup_steps
    if schedule == "wsd":
        start = max(warmup_steps, total_steps - round(decay_fraction * total_steps))
        if step < start:
            return 1.0
    progress = min(1.0, (step - start) / max(1, total_steps - start))
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1 - (1 - min_ratio) * progress


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1, then cosine decay to min_ratio at total_steps."""
    return lr_multiplier(step, "cosine", warmup_steps, total_steps, min_ratio, decay_fraction=0.0)


def schedule_of(o: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """The run's multiplier of every group's learning rate, by optimizer step. A plain closure, not
    an object: LambdaLR saves an object's attributes in the checkpoint and would restore the old
    run's total, where a resumed run must follow its own config (a changed trainer.max_steps)."""
    return lambda step: lr_multiplier(step, o.schedule, o.warmup_steps, total_steps, o.min_lr_ratio,
                                      o.decay_fraction)


def apply_settings(optimizer: torch.optim.Optimizer, scheduler, o: OptimConfig) -> None:
    """Apply this run's optimizer settings over those a resumed checkpoint restored, each group's
    learning rate at the schedule's current step. (A fresh run sets the same values again.)"""
    step = scheduler.last_epoch  # the schedule's position: optimizer steps taken so far
    settings = group_settings(o)
    for group, s, multiplier in zip(optimizer.param_groups, settings, scheduler.lr_lambdas, strict=True):
        group.update({k: v for k, v in s.items() if k != "lr"})
        group["initial_lr"] = s["lr"]
        group["lr"] = s["lr"] * multiplier(step)
    scheduler.base_lrs = [s["lr"] for s in settings]
