"""The pieces `train(cfg)` puts together: the data module, the LightningModule around the model, and
the Lightning Trainer with its checkpoint writers, logger, strategy and precision."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from lm.config.settings import setting_value
from lm.config.train import TrainSettings
from lm.config.trainer import TrainerSettings
from lm.data.modules import make_data_module
from lm.model.transformer import Transformer
from lm.training.interrupt import StopOnSignal
from lm.training.module import AtomicCheckpointIO, LitLM
from lm.training.optim import optim_config
from lm.training.start import Start
from lm.util.distributed import is_main_process, say
from lm.util.errors import ConfigError
from lm.util.files import write_atomically
from lm.util.hardware import cpu_multiplies_bf16

# ---------------------------------------------------------------------------- data and module


def prepared_data(cfg: DictConfig, start: Start, run_dir: Path):
    """The data module, set up for fitting with the start's tokenizer (None: one trained on the
    corpus), that tokenizer saved in the run folder beside the checkpoints."""
    data = make_data_module(cfg.data, cfg.model.max_seq_len, cfg.seed, start.tokenizer_json)
    data.prepare_data()
    data.setup("fit")
    if start.entry.get("corpus_fingerprint") not in (None, corpus_fingerprint(data)):
        say("note: the corpus has changed since the checkpoint; the run continues on the new text "
            "with the tokenizer it was trained with")
    if is_main_process():  # one writer under DDP, and never a half-written file
        write_atomically(run_dir / "tokenizer.json", lambda tmp: data.tokenizer.save(str(tmp)))
    return data


def corpus_fingerprint(data) -> str | None:
    """The text corpus's fingerprint; None for generated data (recall examples)."""
    return getattr(getattr(data, "corpus", None), "fingerprint", None)


def lightning_module(cfg: DictConfig, model: Transformer, data, start: Start, distillation: dict) -> LitLM:
    """LitLM around `model`, with what its checkpoints record (tokenizer, run config, provenance, corpus)."""
    return LitLM(model, optim_config(cfg.optim), total_steps=cfg.trainer.max_steps,
                 tokenizer_json=data.tokenizer.to_str(), run_config=OmegaConf.to_container(cfg, resolve=True),
                 compile=cfg.compile, provenance=start.provenance, corpus_fingerprint=corpus_fingerprint(data),
                 # a run config written before the setting (an uptraining's source run) takes its default
                 loss_chunk=setting_value(cfg, TrainSettings, "loss_chunk"),
                 skip_nonfinite=setting_value(cfg.trainer, TrainerSettings, "skip_nonfinite"), **distillation)


# ---------------------------------------------------------------------------- the trainer


@dataclass
class Saves:
    """The checkpoint writers the run reads back: `best` (by val/loss) and `stop` (last.ckpt on a signal)."""

    best: ModelCheckpoint
    stop: StopOnSignal


def make_trainer(cfg: DictConfig, run_dir: Path, precision: str, wandb_run_id: str | None) -> tuple[L.Trainer, Saves]:
    t = cfg.trainer
    saves = Saves(best=ModelCheckpoint(dirpath=run_dir, filename="best", monitor="val/loss", mode="min", save_top_k=1,
                                       enable_version_counter=False),
                  stop=StopOnSignal(run_dir / "last.ckpt"))
    trainer = L.Trainer(
        accelerator=t.accelerator, devices=t.devices, strategy=make_strategy(t), num_nodes=t.num_nodes,
        precision=precision, max_steps=t.max_steps, val_check_interval=min(t.val_every_n_steps, t.max_steps),
        check_val_every_n_epoch=None, limit_val_batches=t.limit_val_batches,
        gradient_clip_val=t.gradient_clip_val, accumulate_grad_batches=t.accumulate_grad_batches,
        log_every_n_steps=t.log_every_n_steps, num_sanity_val_steps=0,
        logger=make_logger(cfg, run_dir, wandb_run_id),
        plugins=[AtomicCheckpointIO()],
        callbacks=[*checkpoint_writers(cfg, run_dir, saves), *progress_bar(t)], enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
        use_distributed_sampler=False,  # the data module shards by rank itself (lm.data.windows.EpochShuffle)
    )
    return trainer, saves


def checkpoint_writers(cfg: DictConfig, run_dir: Path, saves: Saves) -> list:
    """best.ckpt, last.ckpt at each validation, last.ckpt on a signal, and every
    `checkpoint.every_n_steps` steps. Two writers of last.ckpt besides the signal's: Lightning's
    `save_last` only refreshes it when the best one changes, and one ModelCheckpoint saves either
    per n steps or per validation, not both."""
    last = ModelCheckpoint(dirpath=run_dir, filename="last", monitor=None, save_top_k=1, enable_version_counter=False)
    writers = [saves.best, last, saves.stop, *early_stop(cfg.trainer)]
    every = (cfg.get("checkpoint") or {}).get("every_n_steps")
    if every:
        writers.append(ModelCheckpoint(dirpath=run_dir, filename="last", monitor=None, save_top_k=1,
                                       enable_version_counter=False, every_n_train_steps=every))
    return writers


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
    threshold = setting_value(trainer_cfg, TrainerSettings, "stop_at_accuracy")
    if threshold is None:
        return []
    return [L.pytorch.callbacks.EarlyStopping(monitor="val/accuracy", mode="max", stopping_threshold=threshold,
                                              patience=sys.maxsize, check_on_train_epoch_end=False, verbose=False)]
