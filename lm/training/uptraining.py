"""Uptraining (Ainslie et al. 2023): convert a checkpoint to fewer K/V heads, then continue
training it briefly on the source run's data and tokenizer with a fresh optimizer.

`uptrain(cfg)` is what scripts/uptrain.py runs; lm.studies.uptrain_ablation runs the paper's ablation with it.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf, open_dict

from lm.formats.checkpoint import (
    build_checked,
    model_state_dict,
    read_checkpoint,
    save_checkpoint,
    stored_model_config,
)
from lm.formats.convert import to_grouped
from lm.training.run import train
from lm.util.errors import ConfigError
from lm.util.paths import resolve_path


def variant_name(n_kv_head: int) -> str:
    return "mqa" if n_kv_head == 1 else f"gqa{n_kv_head}"


def budget(cfg: DictConfig, source_steps: int) -> int:
    """Uptraining steps: `uptrain.steps`, or `uptrain.fraction` of the source run's steps."""
    if cfg.uptrain.steps is not None:
        steps = cfg.uptrain.steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"uptrain.steps={steps!r} must be an integer >= 0")
        return steps
    fraction = cfg.uptrain.fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ConfigError(f"uptrain.fraction={fraction!r} must be between 0 and 1")
    return math.ceil(fraction * source_steps)


def continued_run_config(source_run: dict, cfg: DictConfig, steps: int, n_kv_head: int, run_name: str) -> DictConfig:
    """The source run's config with what uptraining changes: its length, warm-up, name, logger
    and the conversion, so the run's config records what was done."""
    run = OmegaConf.create(source_run)
    every = cfg.uptrain.val_every_n_steps or max(1, steps // cfg.uptrain.evaluations)
    with open_dict(run):
        run.run_name = run_name
        run.seed = cfg.seed
        run.resume, run.ckpt_path = False, None
        run.checkpoint_dir = cfg.checkpoint_dir
        run.attn.n_kv_head = n_kv_head
        run.attn.name = variant_name(n_kv_head)
        run.trainer.max_steps = steps
        run.trainer.val_every_n_steps = every
        if cfg.uptrain.limit_val_batches is not None:
            run.trainer.limit_val_batches = cfg.uptrain.limit_val_batches
        run.trainer.progress_bar = cfg.progress_bar
        # The source run's schedule shape (warm-up then cosine) over the short budget.
        run.optim.warmup_steps = max(1, round(cfg.uptrain.warmup_fraction * steps))
        run.logger = OmegaConf.to_container(cfg.logger, resolve=True)
        run.sample.max_new_tokens = cfg.sample_tokens
        run.uptrain = OmegaConf.to_container(cfg.uptrain, resolve=True)
        run.uptrain.source = str(cfg.ckpt)
    return run


def uptrain(cfg: DictConfig) -> dict:
    """Convert `cfg.ckpt` to `cfg.attn.n_kv_head` K/V heads and uptrain it; returns train()'s result
    plus the val loss right after conversion and the provenance."""
    source_path = resolve_path(cfg.ckpt)
    source = read_checkpoint(source_path)
    what = f"checkpoint {str(source_path)!r}"
    source_state = model_state_dict(source)
    source_config = stored_model_config(source["lm"], source_state, what)
    build_checked(source_config, source_state, what)  # names, shapes and finite values, before converting
    n_kv_head = cfg.attn.n_kv_head
    state, config = to_grouped(source_state, source_config, n_kv_head, init=cfg.uptrain.init, seed=cfg.seed)
    source_steps = int(source.get("global_step", 0))
    steps = budget(cfg, source_steps)
    provenance = {"source": str(cfg.ckpt), "source_step": source_steps, "init": cfg.uptrain.init,
                  "fraction": cfg.uptrain.fraction if cfg.uptrain.steps is None else None, "steps": steps,
                  "n_kv_head_from": source_config.n_kv_head, "n_kv_head_to": n_kv_head}
    tokenizer_json = source["lm"]["tokenizer"]
    source_run = source["lm"].get("run_config") or {}
    if steps == 0:
        if not cfg.out:
            raise ConfigError("uptrain.steps=0 converts only: give out=<folder> for the converted checkpoint")
        out = resolve_path(cfg.out)
        path = save_checkpoint(out / "last.ckpt", state, config, tokenizer_json, source_run, provenance)
        (out / "tokenizer.json").write_text(tokenizer_json)
        print(f"converted {source_config.n_kv_head} -> {n_kv_head} K/V heads ({cfg.uptrain.init}): {path}")
        return {"last": str(path), "provenance": provenance, "steps": 0}
    if not source_run.get("data"):
        raise ConfigError(f"checkpoint {str(cfg.ckpt)!r} records no training run to continue (no run_config.data)")
    run_name = cfg.run_name or f"{source_run.get('run_name', 'source')}-{variant_name(n_kv_head)}-{cfg.uptrain.init}"
    run = continued_run_config(source_run, cfg, steps, n_kv_head, run_name)
    print(f"uptraining {source_config.n_kv_head} -> {n_kv_head} K/V heads ({cfg.uptrain.init} init) for {steps} steps "
          f"({steps / max(1, source_steps):.1%} of the source run's {source_steps})")
    result = train(run, model_config=config, init_state=state, tokenizer_json=tokenizer_json,
                   provenance=provenance, validate_first=True)
    result["provenance"] = provenance
    return result
