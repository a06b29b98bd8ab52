"""LightningModule around an injected Transformer: loss, optimizer, schedule, metrics.

The network is built outside and passed in (lightning-hydra-template style), so the
model code stays free of Lightning and the same module trains any attention kind. How a batch is
scored (lm.training.scoring) and the distillation term (lm.training.distill) live apart, without
Lightning, for the evaluation and the benchmarks that need them alone.
"""

from __future__ import annotations

import time

import lightning as L
import torch
import torch.nn.functional as F

from lm.data.mqar import IGNORE
from lm.formats.checkpoint import FORMAT_VERSION
from lm.model.transformer import Transformer
from lm.training.distill import check_distillation, check_teacher, distillation_kl
from lm.training.optim import (
    OptimConfig,
    apply_settings,
    build_optimizer,
    schedule_of,
    warmup_cosine,  # noqa: F401  (lives in lm.training.optim; code written before it imports it from here)
)
from lm.training.scoring import Scorer, inputs_and_targets, loss_sums, next_token_loss
from lm.util.errors import ConfigError, TrainingError
from lm.util.files import write_atomically


def check_same_optimizer(checkpoint: dict, name: str) -> None:
    """One ConfigError line where a checkpoint to continue was trained by another optimizer: its
    state (AdamW's moments, Muon's momentum) cannot carry over. Before any state is restored, except
    under FSDP, whose Lightning strategy loads the weights and the optimizer's state first."""
    saved = ((checkpoint.get("lm") or {}).get("run_config") or {}).get("optim") or {}
    trained_with = saved.get("name", "adamw")  # runs from before optim=muon existed trained with AdamW
    if "optimizer_states" in checkpoint and trained_with != name:
        raise ConfigError(f"the checkpoint was trained with optim={trained_with}; continue it with "
                          f"optim={trained_with}, or start optim={name} from its weights with init_from")


class AtomicCheckpointIO(L.pytorch.plugins.TorchCheckpointIO):
    """Lightning's checkpoints through write_atomically: a kill or a full disk during a save
    leaves the previous file whole, and a write error is one clear line."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        write_atomically(path, lambda tmp: torch.save(checkpoint, tmp))


class NonFiniteWatch:
    """The first training loss that was not finite and its step, kept on the loss's device: recording
    costs no host sync, so an accelerator's steps queue without waiting for each other. `check` reads
    them (one sync) where the host waits anyway: every `trainer.log_every_n_steps` batches, as Lightning
    logs; at each validation; before each checkpoint is written, so last.ckpt stays the last good one."""

    def __init__(self):
        self.step: torch.Tensor | None = None  # () int64: -1 while every loss was finite
        self.loss: torch.Tensor | None = None  # () float32: the first loss that was not
        self.unread = 0  # losses recorded since the last check
        self.saved = False  # whether the run has a good checkpoint: one written by it, or the one it resumed

    def record(self, loss: torch.Tensor, step: int) -> None:
        loss = loss.detach().float()
        if self.step is None:
            self.step = torch.full((), -1, dtype=torch.long, device=loss.device)
            self.loss = torch.zeros((), device=loss.device)
        first = ~torch.isfinite(loss) & (self.step < 0)
        self.step = torch.where(first, step, self.step)
        self.loss = torch.where(first, loss, self.loss)
        self.unread += 1

    def check(self) -> None:
        """TrainingError, in one line, once a loss was not finite."""
        self.unread = 0
        if self.step is not None and int(self.step) >= 0:
            kept = "with the last good checkpoint kept" if self.saved else "before any checkpoint was written"
            raise TrainingError(f"loss is {float(self.loss)} at step {int(self.step)}; stopping {kept} "
                                "(trainer.skip_nonfinite=true skips such steps instead)")


class LitLM(L.LightningModule):
    def __init__(self, model: Transformer, optim: OptimConfig, total_steps: int,
                 tokenizer_json: str | None = None, run_config: dict | None = None, compile: bool = False,
                 loss_chunk: int = 0,
                 provenance: dict | None = None, skip_nonfinite: bool = False, corpus_fingerprint: str | None = None,
                 teacher: Transformer | None = None, distill: float = 0.0, temperature: float = 1.0):
        """With `distill` > 0 the training loss adds distill * T^2 * KL(teacher || model) at temperature
        T (Hinton et al. 2015: T^2 keeps the gradient's scale as T changes) to the cross-entropy;
        validation stays plain cross-entropy, so runs with and without it compare."""
        super().__init__()
        check_distillation(distill, temperature, teacher)
        check_teacher(model, teacher)
        self.model = model
        self.optim = optim
        self.total_steps = total_steps
        self.tokenizer_json = tokenizer_json
        self.run_config = run_config or {}
        self.provenance = provenance or {}
        self.skip_nonfinite = skip_nonfinite
        self.corpus_fingerprint = corpus_fingerprint
        self.skipped_steps = 0
        self.skipped_in_a_row = 0
        # (optimizer step, val loss, val accuracy, training seconds so far) of every validation
        self.val_history: list[tuple[int, float, float, float]] = []
        self.train_seconds = 0.0  # time in training steps, validation excluded, over every resumed part
        self.train_tokens = 0
        # What the steps run: not a module, so its compiled callables stay out of the module tree and
        # checkpoints hold the plain model's parameter names once, loadable with or without compile.
        self._score = Scorer(model, loss_chunk, compile)
        # The frozen teacher is kept out of the module tree the same way: no teacher weights in the
        # checkpoints, the optimizer or the DDP/FSDP wrapping, and Lightning's train() leaves it in eval mode.
        if teacher is not None:
            teacher.eval().requires_grad_(False)
        object.__setattr__(self, "_teacher", teacher)
        self.distill, self.temperature = float(distill), float(temperature)
        self._batch_start, self._batch_tokens, self._batch_counted = 0.0, 0, True  # no step in progress
        self._val_sums: list[torch.Tensor] = []
        self.last_val_step = -1
        self.watch = NonFiniteWatch()

    def loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        return next_token_loss(self._score, batch)

    def training_losses(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(loss to minimise, cross-entropy, KL to the teacher or None without distillation). The
        loss also adds what the model's layers computed beside their outputs (Transformer.aux_loss,
        logged as train/aux): DSA's indexer KL."""
        loss, ce, kl = self.model_losses(batch)
        aux = self.model.aux_loss()
        return (loss if aux is None else loss + aux), ce, kl

    def model_losses(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not self.distill:
            ce, _ = self.loss(batch)
            return ce, ce, None
        inputs, targets = inputs_and_targets(batch)  # (B, T) each
        logits = self._score.logits(inputs)  # (B, T, V)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)
        with torch.no_grad():
            teacher_logits = self._teacher(inputs)  # (B, T, V)
        kl = distillation_kl(logits, teacher_logits, targets, self.temperature)
        return ce + self.distill * self.temperature**2 * kl, ce, kl

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        loss, ce, kl = self.training_losses(batch)
        # Skipping a step needs its loss on the host before backward: one sync a step, the price of
        # trainer.skip_nonfinite. Without it the loss is watched on the device (NonFiniteWatch).
        if self.skip_nonfinite and not torch.isfinite(loss):
            self.skipped_steps += 1
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row > 20:
                raise TrainingError(f"loss was not finite for 20 batches in a row up to step {self.global_step}; "
                                    "the weights themselves have diverged")
            self.log("train/skipped_nonfinite", float(self.skipped_steps))
            return None  # Lightning skips backward and the optimizer step
        self.skipped_in_a_row = 0
        self.watch.record(loss, self.global_step)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/ce", ce)
        if kl is not None:
            self.log("train/kl", kl)
        aux = self.model.aux_loss()  # what the forward above left: logged beside the loss it joined
        if aux is not None:
            self.log("train/aux", aux.detach())
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def on_fit_start(self) -> None:
        if self._teacher is not None:
            self._teacher.to(self.device)  # not a submodule, so Lightning does not move it

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        inputs, _ = inputs_and_targets(batch)
        self._batch_tokens = inputs.numel() * self.trainer.world_size
        self._batch_start = time.perf_counter()
        self._batch_counted = False

    def count_batch(self) -> float:
        """Add the step's tokens and time to the run's totals, once; the step's seconds. A save
        inside the step (a periodic or a signal's last.ckpt: callbacks Lightning calls before this
        module's batch-end hook) counts the step it saves, so a resumed run's totals stay exact."""
        seconds = time.perf_counter() - self._batch_start
        if not self._batch_counted:
            self.train_seconds += seconds
            self.train_tokens += self._batch_tokens
            self._batch_counted = True
        return seconds

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self.watch.unread >= self.trainer.log_every_n_steps:  # when Lightning's logging syncs anyway
            self.watch.check()
        seconds = self.count_batch()
        self.log("train/tokens_per_s", self._batch_tokens / seconds, prog_bar=True)

    def on_before_optimizer_step(self, optimizer) -> None:
        # Measured before Lightning clips, so a spike shows in the log.
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.log("train/grad_norm", torch.nn.utils.get_total_norm(grads))

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self._val_sums.append(loss_sums(self._score, batch))

    def on_train_end(self) -> None:
        self.watch.check()

    def on_validation_epoch_end(self) -> None:
        self.watch.check()  # before the callbacks save at this validation
        sums = torch.stack(self._val_sums).sum(0)  # (3,): loss, targets, correct
        self._val_sums.clear()
        total_loss, total_tokens, total_correct = self.trainer.strategy.reduce(sums, reduce_op="sum")
        val_loss = total_loss / total_tokens  # token-weighted, exact over the whole val set
        accuracy = total_correct / total_tokens  # arg-max next token (recall data: the answers)
        # Already summed over ranks above; sync_dist only tells Lightning the value is global.
        self.log("val/loss", val_loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", val_loss.exp(), sync_dist=True)
        self.log("val/accuracy", accuracy, sync_dist=True)
        self.last_val_step = self.global_step
        self.val_history.append((self.global_step, float(val_loss), float(accuracy), self.train_seconds))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning's mixed-precision plugin refuses to clip for a fused optimizer, because float16's
        gradient scaler would unscale inside it; bf16-mixed has no scaler, so its gradients are
        clipped as they are, by norm, as the other precisions clip them."""
        if gradient_clip_val and self.trainer.precision == "bf16-mixed" and gradient_clip_algorithm in (None, "norm"):
            torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        """One optimizer (optim=muon: Muon and AdamW behind one, lm.training.muon) and one schedule
        scaling every group's learning rate, stepped per optimizer step (lm.training.optim)."""
        optimizer = build_optimizer(self.model, self.optim)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_of(self.optim, self.total_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_train_start(self) -> None:
        """Apply this run's optimizer settings over the ones a resumed checkpoint restored: the
        restored optimizer and schedule would go on with the old learning rate while the run's
        config says the new one. (A fresh run sets the same values again; nothing changes.)"""
        apply_settings(self.optimizers().optimizer, self.lr_schedulers(), self.optim)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        check_same_optimizer(checkpoint, self.optim.name)
        self.watch.saved = True  # the checkpoint this run continues stays the last good one
        # Checkpoints written before the callable left the module tree hold every weight a second
        # time under "_forward." (or "_forward._orig_mod." when compiled); the "model." copy is the one.
        # Under FSDP, Lightning's strategy has already taken "state_dict" out and loaded it (strictly:
        # a checkpoint with the old copy does not resume there).
        state = checkpoint.get("state_dict", {})
        for key in [k for k in state if k.startswith("_forward.")]:
            del state[key]
        # A resumed run goes on counting its history, time and tokens where it stopped
        # (checkpoints written before these were kept start the count afresh).
        progress = checkpoint.get("lm", {}).get("progress") or {}
        self.val_history = [tuple(row) for row in progress.get("val_history", [])]
        self.train_seconds = float(progress.get("train_seconds", 0.0))
        self.train_tokens = int(progress.get("train_tokens", 0))
        self.last_val_step = int(progress.get("last_val_step", -1))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.watch.check()
        if not all(torch.isfinite(p).all() for p in self.model.parameters()):
            # Refusing here aborts the save, so the previous checkpoint stays the last good one.
            kept = "with the last good checkpoint kept" if self.watch.saved else "before any checkpoint was written"
            raise TrainingError(f"the weights are no longer finite at step {self.global_step}; stopping {kept}")
        self.watch.saved = True  # this checkpoint is a good one
        self.count_batch()
        # Everything needed to use the weights, as plain data (safe for weights_only loading).
        checkpoint["lm"] = {
            "format_version": FORMAT_VERSION,
            "model_config": self.model.config.to_dict(),
            "tokenizer": self.tokenizer_json,
            "run_config": self.run_config,
            "provenance": self.provenance,
            "corpus_fingerprint": self.corpus_fingerprint,
            "progress": {"val_history": [list(row) for row in self.val_history], "train_seconds": self.train_seconds,
                         "train_tokens": self.train_tokens, "last_val_step": self.last_val_step},
            "wandb_run_id": getattr(getattr(self.logger, "experiment", None), "id", None)
            if isinstance(self.logger, L.pytorch.loggers.WandbLogger) else None,
        }
