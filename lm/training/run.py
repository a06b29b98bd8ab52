"""`train(cfg)`: one training run from a resolved Hydra config. Scripts and tests call it.

It builds the data module, the model and the Lightning trainer from the config, fits,
validates once more at the end and prints a short sample from the trained model.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from lm.attention import layer_specs
from lm.data.modules import make_data_module
from lm.formats.checkpoint import model_state_dict, read_checkpoint, stored_model_config
from lm.generation.decode import generate
from lm.model.config import ConfigError, ModelConfig
from lm.model.transformer import Transformer
from lm.training.interrupt import StopOnSignal
from lm.training.module import AtomicCheckpointIO, LitLM, OptimConfig, check_distillation
from lm.util.checks import require_choice, require_fraction, require_int, require_positive
from lm.util.distributed import is_main_process, quiet_other_ranks, say
from lm.util.files import RunLock, remove_stale_temporaries, run_folder, write_atomically
from lm.util.memory import keep_freed_memory
from lm.util.paths import resolve_path

# Lightning's own use of a deprecated torch API; nothing a user can act on.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
# The run folder always holds tokenizer.json before the first checkpoint; train() says
# itself when an earlier run's checkpoints are about to be replaced.
warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
# Resuming mid-epoch is exact here: the data module restarts its shuffle at the checkpoint's batch.
warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended")


class DropAdverts(logging.Filter):
    """Lightning logs an advert for its cloud logger at every run ("💡 Tip: ..."): not about this run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip")


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(DropAdverts())


def model_config_from(cfg: DictConfig, vocab_size: int) -> ModelConfig:
    """ModelConfig from the `model` and `attn` groups; the vocabulary comes from the tokenizer."""
    model = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k != "name"}
    attn = OmegaConf.to_container(cfg.attn, resolve=True)
    attn.pop("name", None)
    n_kv_head = attn.pop("n_kv_head", None)
    kind, pattern, every = attn.pop("kind", None), attn.pop("pattern", None), attn.pop("global_every", None)
    if (kind is None) == (pattern is None):
        raise ConfigError(f"give attn.kind (one kind for every layer) or attn.pattern (one per layer), "
                          f"not {'both' if kind else 'neither'}")
    specs = layer_specs(pattern or kind, model["n_layer"], attn, every)
    return ModelConfig(vocab_size=vocab_size, attention=specs, n_kv_head=n_kv_head, **model)


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX): there a bf16 matmul
    runs ~3.5x fp32's rate (measured on an AMD EPYC with AVX512-BF16); on a CPU without them,
    ~100x slower (an AVX2 EPYC)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def pick_precision(trainer_cfg: DictConfig) -> str:
    """`precision: auto` is bf16-mixed on a GPU and on a CPU with bf16 instructions, and 32-true on
    other CPUs, where bf16 matmuls are about 100x slower than fp32."""
    if trainer_cfg.precision != "auto":
        return str(trainer_cfg.precision)
    accelerator = trainer_cfg.accelerator
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return "bf16-mixed" if on_gpu or cpu_multiplies_bf16() else "32-true"


def make_logger(cfg: DictConfig, run_dir: Path, wandb_run_id: str | None = None):
    kind = cfg.logger.kind
    if kind == "none":
        return False
    if kind == "csv":
        return L.pytorch.loggers.CSVLogger(save_dir=str(run_dir), name="csv")
    if kind == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        # Offline unless the environment asks for online: `wandb sync` uploads later.
        if "WANDB_MODE" not in os.environ and "WANDB_API_KEY" not in os.environ:
            os.environ["WANDB_MODE"] = "offline"
        # A resumed run continues its wandb run (same id) instead of starting a second one.
        logger = WandbLogger(project=cfg.logger.project, name=cfg.run_name, save_dir=str(run_dir),
                             config=OmegaConf.to_container(cfg, resolve=True), id=wandb_run_id,
                             resume="allow" if wandb_run_id else None)
        # Lightning always hands wandb.init an `anonymous` argument (None when unused), which wandb
        # has deprecated and warns about at every run; leaving it out means the same to wandb.
        logger._wandb_init.pop("anonymous", None)
        return logger
    raise ConfigError(f"logger.kind={kind!r} is not one of 'wandb', 'csv', 'none'")


def resume_path(cfg: DictConfig, run_dir: Path) -> tuple[str | None, dict]:
    """The checkpoint to continue from and its "lm" entry, checked by the safe loader before
    Lightning opens it; (None, {}) for a fresh run."""
    path = None
    if cfg.get("ckpt_path"):
        path = resolve_path(cfg.ckpt_path)
        if not path.is_file():
            raise ConfigError(f"ckpt_path={str(cfg.ckpt_path)!r} does not exist")
    elif cfg.resume:
        path = run_dir / "last.ckpt"
        if not path.is_file():
            raise ConfigError(f"resume=true but run {cfg.run_name!r} has no checkpoint at {path}")
    if path is None:
        return None, {}
    ckpt = read_checkpoint(path)  # weights_only: refuses code, names corruption
    entry = ckpt["lm"]
    saved = stored_model_config(entry, model_state_dict(ckpt), f"checkpoint {str(path)!r}").to_dict()
    requested = model_config_from(cfg, saved["vocab_size"]).to_dict() if not cfg.get("init_from") else saved
    differences = [f"{k}={saved.get(k)!r} (config: {v!r})" for k, v in requested.items() if saved.get(k) != v]
    if differences:
        raise ConfigError(f"checkpoint {str(path)!r} does not match the configured model: {', '.join(differences)}")
    changed = changed_data_settings(entry.get("run_config") or {}, cfg)
    if changed:
        raise ConfigError(f"a resumed run cannot change {', '.join(changed)}: the checkpoint was trained on "
                          "other data settings; start afresh (resume=false or another run_name) to change them")
    return str(path), entry


# Data settings a resumed run may change: they decide neither which text nor which batches.
DATA_SETTINGS_FREE_ON_RESUME = ("num_workers", "cache_dir")


def changed_data_settings(stored_run_config: dict, cfg: DictConfig) -> list[str]:
    """`data.<key> (checkpoint: a, now: b)` for each data setting that differs from the stored run's."""
    stored = stored_run_config.get("data")
    if not isinstance(stored, dict):
        return []  # an uptrained or hand-made checkpoint records no data settings
    now = OmegaConf.to_container(cfg.data, resolve=True)
    keys = sorted((set(stored) | set(now)) - set(DATA_SETTINGS_FREE_ON_RESUME))
    return [f"data.{k} (checkpoint: {stored.get(k)!r}, now: {now.get(k)!r})"
            for k in keys if stored.get(k) != now.get(k)]


PRECISIONS = ("auto", "32-true", "32", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true")


def check_run_settings(cfg: DictConfig) -> None:
    """Every number the run will use, checked before any data or model work starts."""
    t, o, d = cfg.trainer, cfg.optim, cfg.data
    for name in ("max_steps", "val_every_n_steps", "limit_val_batches", "accumulate_grad_batches",
                 "log_every_n_steps", "progress_refresh_steps"):
        require_int(f"trainer.{name}", t[name], minimum=1)
    require_choice("trainer.precision", str(t.precision), PRECISIONS)
    require_positive("optim.lr", o.lr)
    require_int("optim.warmup_steps", o.warmup_steps, minimum=0)
    for name in ("beta1", "beta2", "min_lr_ratio"):
        value = o[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ConfigError(f"optim.{name}={value!r} must be a number from 0 to 1")
    if isinstance(o.weight_decay, bool) or not isinstance(o.weight_decay, (int, float)) or not o.weight_decay >= 0:
        raise ConfigError(f"optim.weight_decay={o.weight_decay!r} must be a number >= 0")
    require_int("data.batch_size", d.batch_size)
    if "val_fraction" in d:
        require_fraction("data.val_fraction", d.val_fraction)
    if cfg.seed is not None:
        require_int("seed", cfg.seed, minimum=0)
    if "num_workers" in d:
        require_int("data.num_workers", d.num_workers, minimum=0)
    every = (cfg.get("checkpoint") or {}).get("every_n_steps")
    if every is not None:
        require_int("checkpoint.every_n_steps", every)
    if t.get("stop_at_accuracy") is not None:
        require_fraction("trainer.stop_at_accuracy", t.stop_at_accuracy)


def distillation_settings(cfg: DictConfig, teacher: Transformer | None) -> tuple[float, float]:
    """(weight, temperature) of distillation from `teacher`: `uptrain.distill` and `uptrain.temperature`
    when the run has an uptrain section, else (0, 1.0): none."""
    uptrain = cfg.get("uptrain") or {}
    distill, temperature = uptrain.get("distill", 0), uptrain.get("temperature", 1.0)
    check_distillation(distill, temperature, teacher)
    return float(distill), float(temperature)


def weights_from(path: str) -> tuple[ModelConfig, dict, str]:
    """(config, weights, tokenizer JSON) of a checkpoint or transformers folder to start from."""
    from lm.formats.checkpoint import load

    model, tokenizer = load(resolve_path(path))
    return model.config, model.state_dict(), tokenizer.to_str()


def make_strategy(trainer_cfg: DictConfig):
    """`fsdp` shards each transformer Block as one unit; other names go to Lightning as they are."""
    if trainer_cfg.strategy == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from lm.model.transformer import Block

        return FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full")
    return trainer_cfg.strategy


def progress_bar(trainer_cfg: DictConfig) -> list:
    if not trainer_cfg.progress_bar:
        return []
    return [L.pytorch.callbacks.TQDMProgressBar(refresh_rate=trainer_cfg.progress_refresh_steps)]


def early_stop(trainer_cfg: DictConfig) -> list:
    """Stop at the validation where val/accuracy first reaches `trainer.stop_at_accuracy` (Zoology
    stops its recall runs at 0.99); never for lack of progress."""
    threshold = trainer_cfg.get("stop_at_accuracy")
    if threshold is None:
        return []
    return [L.pytorch.callbacks.EarlyStopping(monitor="val/accuracy", mode="max", stopping_threshold=threshold,
                                              patience=sys.maxsize, check_on_train_epoch_end=False, verbose=False)]


def train(cfg: DictConfig, model_config: ModelConfig | None = None, init_state: dict | None = None,
          tokenizer_json: str | None = None, provenance: dict | None = None, validate_first: bool = False,
          teacher: Transformer | None = None) -> dict:
    """Fit the configured model; returns the final val loss and where the checkpoints are.

    Uptraining passes the converted `model_config` and its weights (`init_state`), the source
    run's tokenizer and the conversion's `provenance`; `validate_first` measures the starting
    weights (`val_loss_before`); `teacher`, the frozen parent, is distilled from with the weight
    and temperature of `uptrain.distill` and `uptrain.temperature` (lm.training.module.LitLM).
    """
    started = time.perf_counter()
    quiet_other_ranks()
    check_run_settings(cfg)
    keep_freed_memory()
    distill, temperature = distillation_settings(cfg, teacher)
    if cfg.get("init_from") and model_config is None:
        model_config, init_state, tokenizer_json = weights_from(cfg.init_from)
    # Validate the model settings before spending time on data; the tokenizer fixes the
    # final vocabulary size later.
    if model_config is None:
        model_config_from(cfg, cfg.data.vocab_size)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    run_dir = run_folder(resolve_path(cfg.checkpoint_dir), cfg.run_name)
    # Under DDP every rank runs train(); rank 0, which writes the checkpoints, holds the run's lock.
    lock = RunLock(run_dir, cfg.run_name) if is_main_process() else contextlib.nullcontext()
    with lock:
        remove_stale_temporaries(run_dir)
        return _train_locked(cfg, run_dir, model_config, init_state, tokenizer_json, provenance, validate_first,
                             started, dict(teacher=teacher, distill=distill, temperature=temperature))


def _train_locked(cfg: DictConfig, run_dir: Path, model_config: ModelConfig | None, init_state: dict | None,
                  tokenizer_json: str | None, provenance: dict | None, validate_first: bool,
                  started: float, distillation: dict) -> dict:
    ckpt_path, resumed = resume_path(cfg, run_dir)
    if resumed and tokenizer_json is None:
        # A resumed run keeps the ids its weights were trained with, whatever the corpus is now.
        tokenizer_json = resumed.get("tokenizer")

    data = make_data_module(cfg.data, cfg.model.max_seq_len, cfg.seed, tokenizer_json)
    data.prepare_data()
    data.setup("fit")
    corpus_fingerprint = getattr(getattr(data, "corpus", None), "fingerprint", None)
    if resumed.get("corpus_fingerprint") not in (None, corpus_fingerprint):
        say("note: the corpus has changed since the checkpoint; the run continues on the new text "
            "with the tokenizer it was trained with")
    model = Transformer(model_config or model_config_from(cfg, data.tokenizer.get_vocab_size()))
    if init_state is not None:
        model.load_state_dict(init_state)

    if ckpt_path is None and (run_dir / "last.ckpt").exists():
        say(f"note: starting run {cfg.run_name!r} afresh; its checkpoints will be replaced "
            "(resume=true continues it)")
    if is_main_process():  # one writer under DDP, and never a half-written file
        write_atomically(run_dir / "tokenizer.json", lambda tmp: data.tokenizer.save(str(tmp)))
    run_config = OmegaConf.to_container(cfg, resolve=True)
    lit = LitLM(model, OptimConfig(**cfg.optim), total_steps=cfg.trainer.max_steps,
                tokenizer_json=data.tokenizer.to_str(), run_config=run_config, compile=cfg.compile,
                provenance=provenance, skip_nonfinite=bool(cfg.trainer.get("skip_nonfinite", False)),
                corpus_fingerprint=corpus_fingerprint, **distillation)

    precision = pick_precision(cfg.trainer)
    say(f"run {cfg.run_name}: {model.num_params() / 1e6:.2f}M parameters, n_head={model.config.n_head} "
        f"n_kv_head={model.config.n_kv_head}, precision={precision}, checkpoints in {run_dir}"
        + (f", resuming {ckpt_path}" if ckpt_path else ""))
    say(f"attention: {model.config.describe_attention()}")
    # Two callbacks: Lightning's `save_last` only refreshes last.ckpt when the best one changes.
    best = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=run_dir, filename="best", monitor="val/loss", mode="min", save_top_k=1, enable_version_counter=False
    )
    last = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=run_dir, filename="last", monitor=None, save_top_k=1, enable_version_counter=False
    )
    stop = StopOnSignal(run_dir / "last.ckpt")
    checkpoint_callbacks = [best, last, stop, *early_stop(cfg.trainer)]
    every = (cfg.get("checkpoint") or {}).get("every_n_steps")
    if every:  # a third writer of last.ckpt: Lightning saves either per n steps or per validation, not both
        checkpoint_callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=run_dir, filename="last", monitor=None, save_top_k=1, enable_version_counter=False,
            every_n_train_steps=every))
    t = cfg.trainer
    trainer = L.Trainer(
        accelerator=t.accelerator, devices=t.devices, strategy=make_strategy(t), num_nodes=t.num_nodes,
        precision=precision, max_steps=t.max_steps, val_check_interval=min(t.val_every_n_steps, t.max_steps),
        check_val_every_n_epoch=None, limit_val_batches=t.limit_val_batches,
        gradient_clip_val=t.gradient_clip_val, accumulate_grad_batches=t.accumulate_grad_batches,
        log_every_n_steps=t.log_every_n_steps, num_sanity_val_steps=0,
        logger=make_logger(cfg, run_dir, resumed.get("wandb_run_id")),
        plugins=[AtomicCheckpointIO()],
        callbacks=[*checkpoint_callbacks, *progress_bar(t)], enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
        use_distributed_sampler=False,  # the data module shards by rank itself (lm.data.windows.EpochShuffle)
    )
    if validate_first:
        trainer.validate(lit, datamodule=data, verbose=False)
    with stop:
        try:
            trainer.fit(lit, datamodule=data, ckpt_path=ckpt_path)
        except SIGTERMException:
            if stop.signum is None:
                raise
    stop.raise_if_stopped()
    if lit.last_val_step != trainer.global_step:
        # max_steps is not a multiple of the validation interval: measure the final weights
        # and make `last.ckpt` hold them.
        trainer.validate(lit, datamodule=data, verbose=False)
        trainer.save_checkpoint(run_dir / "last.ckpt")
    # The last validation, also when it happened before a resume that had no steps left to take.
    _, val_loss, val_accuracy, _ = lit.val_history[-1]
    result = {"val_loss": val_loss, "val_accuracy": val_accuracy, "run_dir": str(run_dir),
              "last": str(run_dir / "last.ckpt"), "best": best.best_model_path, "steps": trainer.global_step,
              "best_val_loss": float(best.best_model_score) if best.best_model_score is not None else None,
              "val_history": lit.val_history, "train_seconds": lit.train_seconds,
              "train_tokens_per_s": lit.train_tokens / lit.train_seconds if lit.train_seconds else None}
    if validate_first:
        result["val_loss_before"] = lit.val_history[0][1]
    if trainer.is_global_zero and cfg.sample.max_new_tokens > 0 and data.is_text:
        result["sample"] = sample_text(model, data.tokenizer, cfg.sample)
    # wandb prints its own run summary when it finishes: before ours, so ours ends the output.
    if isinstance(trainer.logger, L.pytorch.loggers.WandbLogger):
        trainer.logger.experiment.finish()
    result["wall_seconds"] = time.perf_counter() - started
    if trainer.is_global_zero:
        print("\n".join(summary_lines(cfg.run_name, result)))
    return result


def summary_lines(run_name: str, result: dict) -> list[str]:
    """The block that ends a run: what it reached, where it is, how fast it went, what it writes."""
    ppl = math.exp(result["val_loss"]) if result["val_loss"] < 709 else math.inf  # exp(710) overflows a float
    lines = [f"== run {run_name} finished ==",
             f"final val loss   {result['val_loss']:.4f} (ppl {ppl:,.1f}), accuracy {result['val_accuracy']:.4f}, "
             f"after {result['steps']} steps"]
    if "val_loss_before" in result:
        lines.append(f"val loss before  {result['val_loss_before']:.4f} (the starting weights)")
    if result["best"] and result["best_val_loss"] is not None:
        lines.append(f"best checkpoint  {shown_path(result['best'])} (val loss {result['best_val_loss']:.4f})")
    lines.append(f"last checkpoint  {shown_path(result['last'])}")
    if result["train_tokens_per_s"]:
        lines.append(f"throughput       {result['train_tokens_per_s']:,.0f} tokens/s in training steps "
                     f"({format_seconds(result['train_seconds'])} of them)")
    lines.append(f"wall time        {format_seconds(result['wall_seconds'])}")
    if "sample" in result:
        lines.append(f"sample:\n{result['sample']}")
    return lines


def shown_path(path: str) -> str:
    """A path relative to the working folder when it lies inside it, as the user typed it."""
    path = Path(path)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def format_seconds(seconds: float) -> str:
    """`38.2 s`, `14 min 52 s`, `3 h 07 min`."""
    if seconds < 59.95:  # what rounds to 60.0 reads as a minute
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def sample_text(model: Transformer, tokenizer, sample_cfg: DictConfig) -> str:
    model.eval()
    prompt_ids = tokenizer.encode(sample_cfg.prompt).ids
    max_new = sample_cfg.max_new_tokens
    if model.context_limited:
        max_new = min(max_new, model.config.max_seq_len - len(prompt_ids))
    out = generate(model, [prompt_ids], max_new, temperature=sample_cfg.temperature, top_k=sample_cfg.top_k,
                   seed=sample_cfg.seed)
    return tokenizer.decode(out[0])
