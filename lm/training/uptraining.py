"""Uptraining (Ainslie et al. 2023): convert a checkpoint to fewer K/V heads (GQA, MQA) or to
multi-head latent attention (MHA2MLA, lm/formats/to_latent.py), then continue training it briefly
on the source run's data and tokenizer with a fresh optimizer, optionally distilling the frozen
parent's next-token distribution into it.

`uptrain(run)` is what scripts/uptrain.py runs, on its typed settings (lm.config.uptrain.UptrainRun);
lm.studies.uptrain_ablation runs the ablation with it.
A run stopped by SIGINT or SIGTERM keeps its last.ckpt and prints the command that continues it
(the same one with resume=true): the conversion is redone (deterministic), the checkpoint's
weights, optimizer, schedule and step replace it, and the settings that decide the run (uptrain.*,
the target, the seed, the source) must be the ones it started with.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from lm.attention.mla import LatentSpec
from lm.config.data import data_settings
from lm.config.train import TrainRun
from lm.config.uptrain import UptrainRun
from lm.data.modules import TokenDataModule
from lm.formats.calibration import attention_inputs
from lm.formats.checkpoint import (
    build_checked,
    model_state_dict,
    read_checkpoint,
    save_checkpoint,
    stored_model_config,
)
from lm.formats.convert import check_convertible, to_grouped
from lm.formats.to_latent import check_parent, to_latent
from lm.model.config import ModelConfig
from lm.model.transformer import Transformer
from lm.training.distill import check_distillation
from lm.training.run import train
from lm.training.scoring import evaluate_loss, inputs_and_targets
from lm.util.errors import ConfigError, RunInterrupted
from lm.util.files import run_folder
from lm.util.paths import resolve_path


@dataclass(frozen=True)
class Target:
    """What the checkpoint converts to: `n_kv_head` softmax K/V heads, or `latent` (MLA)."""

    n_kv_head: int | None = None
    latent: LatentSpec | None = None

    @property
    def name(self) -> str:
        if self.latent is not None:
            sizes = [f"{tag}{size}" for tag, size in (("r", self.latent.kv_rank), ("d", self.latent.rope_dim))
                     if size is not None]  # a size left to the head size shows once the parent is read (`at`)
            return "-".join(["mla", *sizes])
        return variant_name(self.n_kv_head)

    def at(self, head_dim: int) -> Target:
        """The target with the sizes MLA leaves to the parent's head size filled in."""
        return self if self.latent is None else Target(latent=self.latent.at(head_dim))


def variant_name(n_kv_head: int) -> str:
    return "mqa" if n_kv_head == 1 else f"gqa{n_kv_head}"


def conversion_target(cfg: UptrainRun) -> Target:
    """The `attn` settings as a target: attn=mla (with its attn.* options), or attn.n_kv_head=N."""
    attn = cfg.attn
    kind = attn.get("kind")
    for key in ("pattern", "global_every", "last_kind"):  # a stack of kinds: the conversion makes one kind
        if attn.get(key) is not None:
            raise ConfigError(f"attn.{key}={attn[key]} is not a conversion target: uptraining converts every layer "
                              "to one kind, softmax GQA/MQA (attn.n_kv_head=N) or attn=mla")
    if kind == "mla":
        options = {k: v for k, v in attn.items() if k not in ("name", "kind", "n_kv_head", "global_every", "last_kind")
                   and v is not None}
        return Target(latent=LatentSpec(**options))
    if kind == "dsa":
        raise ConfigError("attn=dsa is not a conversion target: its lightning indexer has no counterpart in the "
                          "parent's weights to be converted from; convert to attn=mla, which DSA's main attention is")
    if kind not in (None, "softmax"):
        raise ConfigError(f"attn={attn.get('name', kind)} is not a conversion target; uptraining converts to "
                          "softmax GQA/MQA (attn.n_kv_head=N) or to multi-head latent attention (attn=mla)")
    if attn.get("n_kv_head") is None:
        raise ConfigError("give the target: attn.n_kv_head=N (GQA; 1 is MQA) or attn=mla [attn.kv_rank=R]")
    return Target(n_kv_head=attn["n_kv_head"])


def check_conversion(source_config: ModelConfig, target: Target, init: str) -> None:
    """One ConfigError line unless `source_config` converts to `target` under `init`: K/V heads that
    split its heads into equal groups of a kind with a grouped form, or an MLA target whose sizes its
    head size and width hold. Reads no weight and no data (the studies check every arm with it
    before the first runs)."""
    if target.latent is None:
        check_convertible(source_config, target.n_kv_head, init)
    else:
        check_parent(source_config, target.latent)


def check_uptrain_settings(cfg: UptrainRun) -> None:
    """What depends on two settings, before the checkpoint is read (each setting's own bound, those this
    run leaves unused such as `fraction` beside `steps` too, was checked as the settings were built)."""
    u = cfg.uptrain
    check_distillation(u.distill, u.temperature, None, teacher_needed=False)  # in float32, where the loss uses them
    resume = cfg.resume
    if resume and cfg.study is not None:
        raise ConfigError("resume=true continues one uptraining run; a study continues its own arms when the same "
                          "command runs again")
    if resume and u.steps == 0:
        raise ConfigError("resume=true continues an uptraining run; uptrain.steps=0 converts only, with no run "
                          "to continue")


def budget(cfg: UptrainRun, source_steps: int) -> int:
    """Uptraining steps: `uptrain.steps`, or `uptrain.fraction` of the source run's steps."""
    if cfg.uptrain.steps is not None:
        return cfg.uptrain.steps
    return math.ceil(cfg.uptrain.fraction * source_steps)


def continued_run_config(source_run: dict, cfg: UptrainRun, steps: int, target: Target | int,
                         run_name: str) -> DictConfig:
    """The source run's config with what uptraining changes: its length, warm-up, name, logger
    and the conversion, so the run's config records what was done."""
    run = OmegaConf.create(source_run)
    every = cfg.uptrain.val_every_n_steps or max(1, steps // cfg.uptrain.evaluations)
    with open_dict(run):
        run.run_name = run_name
        run.seed = cfg.seed
        run.resume, run.ckpt_path = cfg.resume, None
        run.checkpoint_dir = cfg.checkpoint_dir
        if isinstance(target, int):
            target = Target(n_kv_head=target)
        if target.latent is not None:
            run.attn = {"name": target.name, **target.latent.to_dict()}
        else:
            run.attn.n_kv_head = target.n_kv_head
            run.attn.name = target.name
        run.trainer.max_steps = steps
        run.trainer.val_every_n_steps = every
        if cfg.uptrain.limit_val_batches is not None:
            run.trainer.limit_val_batches = cfg.uptrain.limit_val_batches
        run.trainer.progress_bar = cfg.progress_bar
        # what a non-finite loss does (the advice its error gives): the uptraining's own setting
        run.trainer.skip_nonfinite = cfg.trainer.skip_nonfinite
        # The source run's optimizer and schedule shape (its own warm-up, then cosine or wsd) over the short budget.
        run.optim.warmup_steps = max(1, round(cfg.uptrain.warmup_fraction * steps))
        run.logger = dataclasses.asdict(cfg.logger)
        run.sample.max_new_tokens = cfg.sample_tokens
        run.uptrain = dataclasses.asdict(cfg.uptrain)
        run.uptrain.source = str(cfg.ckpt)
    return run


class Calibration:
    """The source run's data, read once: a few training batches to fit a conversion to (MHA2MLA's
    RoPE ranking, aligned pooling) and the validation batches training reports on."""

    def __init__(self, source_run: dict, tokenizer_json: str, cfg: UptrainRun):
        self.data = TokenDataModule.from_settings(data_settings(source_run["data"]),
                                                source_run["model"]["max_seq_len"], tokenizer_json=tokenizer_json)
        self.data.setup()
        self.batches = cfg.uptrain.calibration_batches
        limit = cfg.uptrain.limit_val_batches
        if limit is None:
            limit = source_run.get("trainer", {}).get("limit_val_batches")
        self.val_batches = limit if isinstance(limit, int) and not isinstance(limit, bool) else None

    def layer_inputs(self, model: Transformer) -> list:
        loader = self.data.train_dataloader()
        return attention_inputs(model, (inputs_and_targets(b)[0] for b in itertools.islice(loader, self.batches)))

    def val_loss(self, model: Transformer) -> float:
        return evaluate_loss(model, itertools.islice(self.data.val_dataloader(), self.val_batches)).loss


def convert(parent: Transformer, source_state: dict, target: Target, cfg: UptrainRun,
            calibration) -> tuple[dict, ModelConfig]:
    """The converted (state dict, config); `calibration()` reads data only when the method fits to activations."""
    init, source_config = cfg.uptrain.init, parent.config
    if target.latent is None and init != "aligned":
        return to_grouped(source_state, source_config, target.n_kv_head, init=init, seed=cfg.seed)
    inputs = calibration().layer_inputs(parent)
    if target.latent is not None:
        return to_latent(source_state, source_config, target.latent, inputs)
    return to_grouped(source_state, source_config, target.n_kv_head, init=init, seed=cfg.seed, layer_inputs=inputs)


def uptrain(cfg: UptrainRun) -> dict:
    """Convert `cfg.ckpt` to the `cfg.attn` target and uptrain it (or, with resume=true, continue the
    run a signal stopped); returns train()'s result plus the val loss right after conversion, the
    parent's and the provenance."""
    check_uptrain_settings(cfg)
    source_path = resolve_path(cfg.ckpt)
    source = read_checkpoint(source_path)
    what = f"checkpoint {str(source_path)!r}"
    source_state = model_state_dict(source)
    source_config = stored_model_config(source["lm"], source_state, what)
    target = conversion_target(cfg)
    check_conversion(source_config, target, cfg.uptrain.init)  # one line, before any weight is built or pooled
    parent = build_checked(source_config, source_state, what)  # names, shapes and finite values, before converting
    target = target.at(source_config.head_dim)
    source_steps = int(source.get("global_step", 0))
    steps = budget(cfg, source_steps)
    check_distillation(cfg.uptrain.distill, cfg.uptrain.temperature, parent)
    tokenizer_json = source["lm"]["tokenizer"]
    source_run = source["lm"].get("run_config") or {}
    if (steps or target.latent is not None or cfg.uptrain.init == "aligned") and not source_run.get("data"):
        raise ConfigError(f"checkpoint {str(cfg.ckpt)!r} records no training run to continue or calibrate on "
                          "(no run_config.data)")
    run = None
    if steps:
        run_name = cfg.run_name or f"{source_run.get('run_name', 'source')}-{target.name}-{cfg.uptrain.init}"
        run = continued_run_config(source_run, cfg, steps, target, run_name)
        if cfg.resume:
            check_resumable(run, cfg)
    calibration = functools.cache(lambda: Calibration(source_run, tokenizer_json, cfg))  # read only if needed
    state, config = convert(parent, source_state, target, cfg, calibration)
    provenance = {"source": str(cfg.ckpt), "source_step": source_steps, "init": cfg.uptrain.init,
                  "fraction": cfg.uptrain.fraction if cfg.uptrain.steps is None else None, "steps": steps,
                  "n_kv_head_from": source_config.n_kv_head, "n_kv_head_to": target.n_kv_head,
                  "target": target.name, "distill": cfg.uptrain.distill}
    if target.latent is not None:
        provenance["rope_pairs"] = [list(spec.rope_pairs) for spec in config.attention]
    if steps == 0:
        return converted_only(cfg, state, config, tokenizer_json, source_run, provenance,
                              f"{source_config.describe_attention()} -> {target.name} ({cfg.uptrain.init})")
    parent_loss = calibration().val_loss(parent)
    provenance["parent_val_loss"] = parent_loss
    resuming = bool(run.resume)
    print(f"{'continuing the uptraining' if resuming else 'uptraining'} {source_config.n_kv_head} K/V heads -> "
          f"{target.name} ({cfg.uptrain.init} init) for {steps} steps ({steps / max(1, source_steps):.1%} of the "
          f"source run's {source_steps}); the parent's val loss {parent_loss:.4f}"
          + ("" if resuming else ", the converted model's is measured at step 0"))
    distilling = cfg.uptrain.distill
    try:
        result = train(TrainRun.from_config(run), model_config=config, init_state=state, tokenizer_json=tokenizer_json,
                       provenance=provenance, validate_first=not resuming, teacher=parent if distilling else None)
    except RunInterrupted as e:
        raise RunInterrupted(e.signum, e.step, e.saved, f"{resume_command()} continues the run") from None
    if resuming:  # the converted weights were scored at step 0 of the run's first part
        result["val_loss_before"] = result["val_history"][0][1]
    result["provenance"] = provenance
    result["parent_val_loss"] = parent_loss
    return result


def converted_only(cfg: UptrainRun, state: dict, config: ModelConfig, tokenizer_json: str, source_run: dict,
                   provenance: dict, conversion: str) -> dict:
    """uptrain.steps=0: the converted checkpoint in `out`, written only once the converted weights
    have built their model (a checkpoint that would not load is never written)."""
    if not cfg.out:
        raise ConfigError("uptrain.steps=0 converts only: give out=<folder> for the converted checkpoint")
    build_checked(config, state, f"the converted model ({conversion})")
    out = resolve_path(cfg.out)
    path = save_checkpoint(out / "last.ckpt", state, config, tokenizer_json, source_run, provenance)
    (out / "tokenizer.json").write_text(tokenizer_json)
    print(f"converted {conversion}: {path}")
    return {"last": str(path), "provenance": provenance, "steps": 0}


# What decides an uptraining run besides its source: a resumed run must have them as they were.
RESUME_FIXED = ("seed", "attn", "uptrain")


def check_resumable(run: DictConfig, cfg: UptrainRun) -> None:
    """One line unless the run folder holds a last.ckpt of this uptraining (same source, target,
    uptrain.* and seed) to continue; read before any data or conversion work."""
    last = run_folder(resolve_path(cfg.checkpoint_dir), run.run_name) / "last.ckpt"
    if not last.is_file():
        raise ConfigError(f"resume=true but run {run.run_name!r} has no checkpoint at {last}")
    stored = read_checkpoint(last)["lm"].get("run_config") or {}
    now = OmegaConf.to_container(run, resolve=True)
    stored_source, source = (stored.get("uptrain") or {}).get("source"), now["uptrain"]["source"]
    if not isinstance(stored_source, str) or resolve_path(stored_source) != resolve_path(source):
        raise ConfigError(f"resume=true: {last} continues an uptraining of {stored_source!r}, not ckpt={source!r}")
    changed = [f"{key}={now_value!r} (checkpoint: {was!r})"
               for key, was, now_value in changed_values(stored, now, RESUME_FIXED) if key != "uptrain.source"]
    if changed:
        raise ConfigError(f"resume=true continues the uptraining as it started; {', '.join(changed[:3])}"
                          + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
                          + "; start afresh (resume=false or another run_name) to change them")


def changed_values(stored: dict, now: dict, keys: tuple[str, ...]) -> list[tuple[str, object, object]]:
    """(dotted key, stored value, value now) for each setting under `keys` that differs."""
    def flat(value, prefix):
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}.{key}").items()}
        return {prefix: value}

    before = {k: v for key in keys for k, v in flat(stored.get(key), key).items()}
    after = {k: v for key in keys for k, v in flat(now.get(key), key).items()}
    missing = None
    return [(k, before.get(k, missing), after.get(k, missing)) for k in sorted(before.keys() | after.keys())
            if before.get(k, missing) != after.get(k, missing)]


def resume_command() -> str:
    """The command that continues this run: scripts/uptrain.py with the overrides it was given and
    resume=true, or, outside the script, words saying so."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return "the same settings with resume=true"
    hydra = HydraConfig.get()
    overrides = [o for o in hydra.overrides.task if o.split("=", 1)[0].lstrip("+~") != "resume"]
    name = [] if hydra.job.config_name == "uptrain" else ["--config-name", hydra.job.config_name]
    script = Path("scripts") / "uptrain.py"
    return f"`python {shlex.join([str(script), *name, *overrides, 'resume=true'])}`"
