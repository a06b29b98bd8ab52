"""The pieces `train(run)` puts together: the data module, the LightningModule around the model, and
the Lightning Trainer with its checkpoint writers, logger, strategy and precision."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lm.config.logger import LOGGERS
from lm.config.train import TrainRun
from lm.config.trainer import TrainerSettings
from lm.data.modules import make_data_module
from lm.model.transformer import Transformer
from lm.training.interrupt import StopOnSignal
from lm.training.module import AtomicCheckpointIO, LitLM
from lm.training.start import Start
from lm.util.distributed import is_main_process, say
from lm.util.files import write_atomically
from lm.util.hardware import cpu_multiplies_bf16

# ---------------------------------------------------------------------------- data and module


def prepared_data(run: TrainRun, start: Start, run_dir: Path):
    """The data module, set up for fitting with the start's tokenizer (None: one trained on the
    corpus), that tokenizer saved in the run folder beside the checkpoints."""
    data = make_data_module(run.data, run.model.max_seq_len, run.seed, start.tokenizer_json)
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


def lightning_module(run: TrainRun, model: Transformer, data, start: Start, distillation: dict) -> LitLM:
    """LitLM around `model`, with what its checkpoints record (tokenizer, run config, provenance, corpus)."""
    return LitLM(model, run.optim, total_steps=run.trainer.max_steps, tokenizer_json=data.tokenizer.to_str(),
                 run_config=run.to_dict(), compile=run.compile, provenance=start.provenance,
                 corpus_fingerprint=corpus_fingerprint(data), loss_chunk=run.loss_chunk,
                 skip_nonfinite=run.trainer.skip_nonfinite, **distillation)


# ---------------------------------------------------------------------------- the trainer


@dataclass
class Saves:
    """The checkpoint writers the run reads back: `best` (by val/loss) and `stop` (last.ckpt on a signal)."""

    best: ModelCheckpoint
    stop: StopOnSignal


def make_trainer(run: TrainRun, run_dir: Path, precision: str, wandb_run_id: str | None) -> tuple[L.Trainer, Saves]:
    t = run.trainer
    saves = Saves(best=ModelCheckpoint(dirpath=run_dir, filename="best", monitor="val/loss", mode="min", save_top_k=1,
                                       enable_version_counter=False),
                  stop=StopOnSignal(run_dir / "last.ckpt"))
    trainer = L.Trainer(
        accelerator=t.accelerator, devices=t.devices, strategy=make_strategy(t), num_nodes=t.num_nodes,
        precision=precision, max_steps=t.max_steps, val_check_interval=min(t.val_every_n_steps, t.max_steps),
        check_val_every_n_epoch=None, limit_val_batches=t.limit_val_batches,
        gradient_clip_val=t.gradient_clip_val, accumulate_grad_batches=t.accumulate_grad_batches,
        log_every_n_steps=t.log_every_n_steps, num_sanity_val_steps=0,
        logger=make_logger(run, run_dir, wandb_run_id),
        plugins=[AtomicCheckpointIO()],
        callbacks=[*checkpoint_writers(run, run_dir, saves), *progress_bar(t)], enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
        use_distributed_sampler=False,  # the data module shards by rank itself (lm.data.windows.EpochShuffle)
    )
    return trainer, saves


def checkpoint_writers(run: TrainRun, run_dir: Path, saves: Saves) -> list:
    """best.ckpt, last.ckpt at each validation, last.ckpt on a signal, and every
    `checkpoint.every_n_steps` steps. Two writers of last.ckpt besides the signal's: Lightning's
    `save_last` only refreshes it when the best one changes, and one ModelCheckpoint saves either
    per n steps or per validation, not both."""
    last = ModelCheckpoint(dirpath=run_dir, filename="last", monitor=None, save_top_k=1, enable_version_counter=False)
    writers = [saves.best, last, saves.stop, *early_stop(run.trainer)]
    every = run.checkpoint.every_n_steps
    if every:
        writers.append(ModelCheckpoint(dirpath=run_dir, filename="last", monitor=None, save_top_k=1,
                                       enable_version_counter=False, every_n_train_steps=every))
    return writers


def pick_precision(trainer: TrainerSettings) -> str:
    """`precision: auto` is bf16-mixed on a GPU and on a CPU with bf16 instructions, and 32-true on
    other CPUs, where bf16 matmuls are about 100x slower than fp32."""
    if trainer.precision != "auto":
        return str(trainer.precision)
    accelerator = trainer.accelerator
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return "bf16-mixed" if on_gpu or cpu_multiplies_bf16() else "32-true"


def make_logger(run: TrainRun, run_dir: Path, wandb_run_id: str | None = None):
    kind = run.logger.kind
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
        logger = WandbLogger(project=run.logger.project, name=run.run_name, save_dir=str(run_dir),
                             config=run.to_dict(), id=wandb_run_id,
                             resume="allow" if wandb_run_id else None)
        # Lightning always hands wandb.init an `anonymous` argument (None when unused), which wandb
        # has deprecated and warns about at every run; leaving it out means the same to wandb.
        logger._wandb_init.pop("anonymous", None)
        return logger
    raise AssertionError(f"logger.kind={kind!r}: LoggerSettings admits {LOGGERS}")


def make_strategy(trainer: TrainerSettings):
    """`fsdp` shards each transformer Block as one unit; other names go to Lightning as they are."""
    if trainer.strategy == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from lm.model.transformer import Block

        return FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full")
    return trainer.strategy


def progress_bar(trainer: TrainerSettings) -> list:
    if not trainer.progress_bar:
        return []
    return [L.pytorch.callbacks.TQDMProgressBar(refresh_rate=trainer.progress_refresh_steps)]


def early_stop(trainer: TrainerSettings) -> list:
    """Stop at the validation where val/accuracy first reaches `trainer.stop_at_accuracy` (Zoology
    stops its recall runs at 0.99); never for lack of progress."""
    threshold = trainer.stop_at_accuracy
    if threshold is None:
        return []
    return [L.pytorch.callbacks.EarlyStopping(monitor="val/accuracy", mode="max", stopping_threshold=threshold,
                                              patience=sys.maxsize, check_on_train_epoch_end=False, verbose=False)]
