"""The uptraining ablation of Ainslie et al. 2023 from one multi-head teacher, and the methods since.

Arms: the teacher itself, every (K/V heads, init, fraction) uptrained from it, plus GQA trained
from random weights for each fraction's number of steps, plus `study.methods`: named conversions
(a target such as attn=mla, an init, a distillation weight) at each fraction. For each: val loss right after
conversion and after uptraining (the same validation batches for all, and for the teacher),
decode tokens/s and cache bytes per token. lm/studies/engine.py runs the arms and keeps their
records in <study.out>/records/, reused while their settings (the teacher's bytes among them)
match. Writes results.json, results.md and val_loss.png (lm/studies/report.py).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from lm.config.data import data_settings
from lm.config.train import TrainRun
from lm.config.uptrain import UptrainOptions, UptrainRun
from lm.data.modules import TokenDataModule
from lm.formats.checkpoint import load, model_state_dict, read_checkpoint, stored_model_config
from lm.model.config import ModelConfig
from lm.model.transformer import Transformer
from lm.studies.ablation_report import ablation_table, uptraining_plot
from lm.studies.decode_speed import decode_speed
from lm.studies.engine import Arm, machine, recorded_settings, run_arms
from lm.studies.report import write_results
from lm.training.run import train
from lm.training.scoring import evaluate_loss
from lm.training.uptraining import (
    Target,
    check_conversion,
    check_uptrain_settings,
    continued_run_config,
    conversion_target,
    uptrain,
    variant_name,
)
from lm.util.checks import as_list
from lm.util.errors import ConfigError
from lm.util.paths import resolve_path
from lm.util.settings import defaults

PROMPT_TOKENS = 32  # of the first validation sequence, at most a quarter of the context: the decoding prompt


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Measuring:
    """What every arm is measured with: the teacher run's first validation batches and a prompt
    from them. Made on first use, so a study whose arms are all reused reads no data."""

    def __init__(self, source_run: dict, tokenizer_json: str, val_batches: int | None, decode_tokens: int):
        self.source_run, self.tokenizer_json = source_run, tokenizer_json
        self.val_batches, self.decode_tokens = val_batches, decode_tokens

    @functools.cached_property
    def data(self) -> TokenDataModule:
        data = TokenDataModule.from_settings(data_settings(self.source_run["data"]),
                                           self.source_run["model"]["max_seq_len"], tokenizer_json=self.tokenizer_json)
        data.setup()
        return data

    @functools.cached_property
    def prompt(self) -> list[int]:
        return self.data.val_set[0][: min(PROMPT_TOKENS, self.source_run["model"]["max_seq_len"] // 4)].tolist()

    def val_loss(self, model: Transformer) -> float:
        """Token-weighted over the first `val_batches` validation batches (all when None), as training reports it."""
        return evaluate_loss(model, itertools.islice(self.data.val_dataloader(), self.val_batches)).loss

    def decoding(self, model: Transformer) -> dict:
        measured = decode_speed(model, self.prompt, self.decode_tokens)
        return {"decode_tokens_per_s": measured.tokens_per_s,
                "cache_bytes_per_token": measured.cache_bytes / measured.tokens}


def teacher_figures(ckpt: Path, steps: int, measuring: Measuring) -> dict:
    teacher, _ = load(ckpt)
    loss = measuring.val_loss(teacher)
    return {"kv_heads": teacher.config.n_kv_head, "init": "teacher", "fraction": None, "steps": steps,
            "val_loss_before": loss, "val_loss_after": loss, **measuring.decoding(teacher), "history": []}


def trained_figures(result: dict, measuring: Measuring) -> dict:
    model, _ = load(result["last"])
    return {"steps": result["steps"], "val_loss_before": result["val_loss_before"],
            "val_loss_after": result["val_loss"], **measuring.decoding(model), "history": result["val_history"]}


def plan(cfg: DictConfig) -> list[Arm]:
    """The teacher, then every (K/V heads, init, fraction) uptrained, then the scratch arms; every
    arm's settings checked before the checkpoint is read."""
    check_study_settings(cfg)
    ckpt = resolve_path(cfg.ckpt)
    source = read_checkpoint(ckpt)
    source_run, tokenizer_json = source["lm"]["run_config"], source["lm"]["tokenizer"]
    source_steps = int(source["global_step"])
    teacher = stored_model_config(source["lm"], model_state_dict(source), f"checkpoint {str(ckpt)!r}")
    check_grid(cfg, teacher)  # every arm's conversion, before the first (the teacher's) runs
    out = resolve_path(cfg.study.out)
    runs = out / "runs"
    measuring = Measuring(source_run, tokenizer_json, cfg.uptrain.limit_val_batches, cfg.study.decode_tokens)
    # What every figure depends on besides an arm's own run: the teacher's exact bytes (a retrained
    # teacher at the same path reruns everything) and the measurement.
    measured_with = {"source_sha256": file_sha256(ckpt), "limit_val_batches": cfg.uptrain.limit_val_batches,
                     "decode_tokens": cfg.study.decode_tokens, "prompt_tokens": PROMPT_TOKENS}
    arms = [Arm("teacher", {"ckpt": str(cfg.ckpt), **measured_with},
                lambda: teacher_figures(ckpt, source_steps, measuring), log=runs / "teacher.log")]
    for kv_heads in as_list("study.kv_heads", cfg.study.kv_heads):
        for init in as_list("study.inits", cfg.study.inits):
            for fraction in as_list("study.fractions", cfg.study.fractions):
                name = f"{variant_name(kv_heads)}-{init}-{fraction}"
                arm_cfg = OmegaConf.merge(cfg, {"attn": {"n_kv_head": kv_heads}, "run_name": f"study-{name}",
                                                "checkpoint_dir": str(runs),
                                                "uptrain": {"init": init, "fraction": fraction, "steps": None}})
                arms.append(Arm(name, {**uptrained_arm_settings(arm_cfg), **measured_with},
                                lambda c=arm_cfg: trained_figures(uptrain(UptrainRun.from_config(c)), measuring),
                                labels={"kv_heads": kv_heads, "target": variant_name(kv_heads), "init": init,
                                        "fraction": fraction},
                                log=runs / f"study-{name}" / "train.log"))
    for method in cfg.study.get("methods") or []:
        for fraction in as_list("study.fractions", cfg.study.fractions):
            arms.append(method_arm(cfg, method, fraction, runs, measured_with, measuring, teacher))
    if cfg.study.scratch:
        kv_heads = max(as_list("study.kv_heads", cfg.study.kv_heads))
        study = UptrainRun.from_config(cfg)  # the settings every scratch arm continues the source run with
        for fraction in as_list("study.fractions", cfg.study.fractions):
            name = f"{variant_name(kv_heads)}-scratch-{fraction}"
            steps = math.ceil(fraction * source_steps)
            # Same steps, schedule and data as the uptrained arms; only the weights start random.
            run = continued_run_config(source_run, study, steps, kv_heads, f"study-{name}")
            with open_dict(run):
                run.checkpoint_dir = str(runs)
                run.uptrain = {"init": "scratch", "steps": steps}  # what the arm's record names it
            scratch = TrainRun.from_config({**OmegaConf.to_container(run, resolve=True), "uptrain": None})
            arms.append(Arm(name, {**recorded_settings(run), **measured_with},
                            lambda r=scratch: trained_figures(train(r, tokenizer_json=tokenizer_json,
                                                                    validate_first=True), measuring),
                            labels={"kv_heads": kv_heads, "target": variant_name(kv_heads), "init": "scratch",
                                    "fraction": fraction},
                            log=runs / f"study-{name}" / "train.log"))
    return arms


def check_grid(cfg: DictConfig, teacher: ModelConfig) -> None:
    """One line naming the entry as typed unless the teacher converts to each `study.kv_heads` under
    each `study.inits` (K/V heads that split its heads into groups)."""
    for kv_heads in as_list("study.kv_heads", cfg.study.kv_heads):
        for init in as_list("study.inits", cfg.study.inits):
            try:
                check_conversion(teacher, Target(n_kv_head=kv_heads), init)
            except ConfigError as e:
                raise ConfigError(f"study.kv_heads entry {kv_heads} (init {init}): {e}") from None


def uptrained_arm_settings(arm_cfg: DictConfig) -> dict:
    """An uptrained arm's recorded settings without the study's grid: a longer list must not rerun
    the arms already in it."""
    settings = recorded_settings(arm_cfg)
    del settings["study"]
    return settings


def check_study_settings(cfg: DictConfig) -> None:
    """The grid's lists and numbers (UptrainStudySettings), named as typed; each arm's uptrain settings
    are checked as it is planned (lm.training.uptraining.check_uptrain_settings), all before the
    teacher is read."""
    check_uptrain_settings(UptrainRun.from_config(cfg))  # each setting checked as it is built


METHOD_KEYS = {"name", "attn", "init", "distill", "temperature"}


def method_arm(cfg: DictConfig, method, fraction: float, runs: Path, measured_with: dict, measuring: Measuring,
               teacher: ModelConfig) -> Arm:
    """One `study.methods` entry at one fraction: {name, attn (the target's attn settings), init
    (GQA/MQA pooling), distill, temperature}, checked against the `teacher`'s shape."""
    method = OmegaConf.to_container(method, resolve=True)
    unknown = sorted(set(method) - METHOD_KEYS) if isinstance(method, dict) else None
    if not isinstance(method, dict) or unknown or "name" not in method or "attn" not in method:
        raise ConfigError(f"study.methods entry {method!r} must be a mapping with name and attn, and at most "
                          f"{sorted(METHOD_KEYS)}" + (f" (not {unknown})" if unknown else ""))
    options = defaults(UptrainOptions)  # what a method leaves out is uptraining's own default
    converting = {key: method.get(key, options[key]) for key in ("init", "distill", "temperature")}
    distill = converting["distill"]
    name = f"{method['name']}-{fraction}"
    base = cfg.copy()
    OmegaConf.set_struct(base, False)  # a target brings attn keys the base lacks (kind, kv_rank, ...)
    arm_cfg = OmegaConf.merge(base, {"attn": method["attn"], "run_name": f"study-{name}", "checkpoint_dir": str(runs),
                                    "uptrain": {**converting, "fraction": fraction, "steps": None}})
    try:
        arm = UptrainRun.from_config(arm_cfg)
        check_uptrain_settings(arm)
        target = conversion_target(arm)
        check_conversion(teacher, target, arm.uptrain.init)
    except ConfigError as e:
        raise ConfigError(f"study.methods entry {method['name']!r}: {e}") from None
    init = "svd" if target.latent is not None else arm_cfg.uptrain.init
    kv_heads = target.n_kv_head if target.latent is None else \
        f"latent {target.latent.kv_rank}+{target.latent.rope_dim}"
    return Arm(name, {**uptrained_arm_settings(arm_cfg), **measured_with},
               lambda: trained_figures(uptrain(arm), measuring),
               labels={"kv_heads": kv_heads, "target": target.name,
                       "init": f"{init} + distill" if distill else init, "fraction": fraction},
               log=runs / f"study-{name}" / "train.log")


def describe(r: dict) -> str:
    heads = f"{r['kv_heads']} K/V heads" if isinstance(r["kv_heads"], int) else r["kv_heads"]
    return (f"{r['arm']:>22}: {heads}, val loss {r['val_loss_before']:.4f} -> "
            f"{r['val_loss_after']:.4f} in {r['steps']} steps, {r['decode_tokens_per_s']:.0f} tokens/s, "
            f"{r['cache_bytes_per_token']:,.0f} cache bytes/token")


def run_study(cfg: DictConfig) -> list[dict]:
    """What `scripts/uptrain.py --config-name uptrain_study` runs: every arm (reusing finished
    ones), then the outputs; returns the records, the teacher's first."""
    started = time.perf_counter()
    arms = plan(cfg)
    out = resolve_path(cfg.study.out)
    records = run_arms(arms, out / "records", describe)
    results = {"source": str(cfg.ckpt), "machine": machine(), "seconds": round(time.perf_counter() - started, 1),
               "settings": OmegaConf.to_container(cfg, resolve=True), "records": records}
    write_results(out, results, ablation_table(records), {"val_loss.png": uptraining_plot})
    return records
