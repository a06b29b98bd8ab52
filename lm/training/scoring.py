"""Scoring a batch's next-token targets: the cross-entropy, the targets scored and how many the
arg-max predicts, chunked or whole, and the token-weighted loss over many batches. Training,
validation, the evaluation script and the benchmarks share it; it needs no Lightning.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lm.data.recall_task import IGNORE
from lm.model.linear_cross_entropy import linear_cross_entropy
from lm.model.transformer import Transformer


def inputs_and_targets(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of text windows (B, T + 1) predicts batch[:, 1:] from batch[:, :-1]; a batch that is
    already a pair (inputs, targets), each (B, T), marks the positions not scored with IGNORE."""
    if isinstance(batch, (tuple, list)):
        return batch[0], batch[1]
    return batch[:, :-1], batch[:, 1:]


class Scorer:
    """Scores a batch's next-token targets, as training and validation take them: the model's
    final hidden states (compiled with `compile`), then the head and the cross-entropy `loss_chunk`
    positions at a time (lm.model.linear_cross_entropy), which never holds the (B*T, V) logits
    whole; with `loss_chunk` 0 the plain head and F.cross_entropy over every logit (`scored_batch`).
    A recall batch (inputs, targets) scores its answers alone: the head and the loss run on the
    positions whose target is not IGNORE (a few per example), the same sums as over every logit.
    `logits` is the model's forward, compiled alike, for what needs the logits themselves."""

    def __init__(self, model: Transformer, loss_chunk: int = 0, compile: bool = False):
        self.model, self.loss_chunk = model, loss_chunk
        self.logits = torch.compile(model) if compile else model
        # the hidden states are asked for by a chunked loss and by a recall batch's answers; a module
        # of logits alone (not a Transformer) is scored whole
        has_head = isinstance(model, Transformer)
        self.hidden = (torch.compile(model.hidden) if compile else model.hidden) if has_head else None

    def __call__(self, batch, reduction: str = "sum", accuracy: bool = True):
        """(cross-entropy, targets scored, targets the arg-max predicts right or None); `reduction`
        "sum" or "mean" over the targets scored."""
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        answers_only = not isinstance(batch, torch.Tensor) and self.hidden is not None
        if not (self.loss_chunk or answers_only):
            return scored_batch(self.logits, batch, reduction, accuracy)
        inputs, targets = inputs_and_targets(batch)  # (B, T) each
        hidden = self.hidden(inputs).flatten(0, 1)  # (B*T, C)
        targets = targets.flatten()  # (B*T,)
        if answers_only:
            scored = targets != IGNORE  # (B*T,)
            hidden, targets = hidden[scored], targets[scored]  # (N, C), (N,): the answers alone
        if self.loss_chunk:
            scored = linear_cross_entropy(hidden, self.model.head.weight, targets, self.loss_chunk, IGNORE, accuracy)
            loss, correct = scored if accuracy else (scored, None)
        else:
            logits = self.model.head(hidden)  # (N, V)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # as scored_batch does
            loss = F.cross_entropy(logits, targets, reduction="sum")
            correct = (logits.argmax(-1) == targets).sum() if accuracy else None
        if reduction == "mean":
            loss = loss / (targets != IGNORE).sum()  # on the device: no sync
        return loss, scored_count(batch, targets), correct


def scored_count(batch, targets: torch.Tensor) -> int:
    """How many targets a batch scores: a text batch every one; counting a recall batch's answers
    syncs, but only there."""
    return targets.numel() if isinstance(batch, torch.Tensor) else int((targets != IGNORE).sum())


def next_token_loss(scorer: Scorer, batch, reduction: str = "mean") -> tuple[torch.Tensor, int]:
    """Cross-entropy of the batch's targets, and the number of targets scored."""
    loss, n, _ = scorer(batch, reduction, accuracy=False)
    return loss, n


def scored_batch(forward, batch, reduction: str = "sum", accuracy: bool = True):
    """(cross-entropy, targets scored, targets the arg-max predicts right or None) from the logits
    forward(inputs) (B, T, V), held whole: the naive twin of the chunked loss."""
    inputs, targets = inputs_and_targets(batch)  # (B, T) each
    logits = forward(inputs).flatten(0, 1)  # (B*T, V)
    targets = targets.flatten()  # (B*T,)
    # float32 at least (bf16 logits under autocast); float64 stays float64, as in the chunked loss
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits, targets, reduction=reduction, ignore_index=IGNORE)
    correct = (logits.argmax(-1) == targets).sum() if accuracy else None  # IGNORE never equals an id
    return loss, scored_count(batch, targets), correct


def loss_sums(scorer: Scorer, batch) -> torch.Tensor:
    """(3,) float on the batch's device: the summed cross-entropy of the targets scored, their
    number and how many of them the arg-max predicts. A tensor, not numbers, so validation steps
    queue on the device without waiting for each other."""
    loss_sum, n, correct = scorer(batch)
    return torch.stack([loss_sum.detach(), torch.tensor(float(n), device=loss_sum.device), correct.float()])


@dataclass
class LossTotals:
    nll: float  # summed cross-entropy (nats) of the targets scored
    targets: int
    correct: int  # targets the arg-max predicts

    @property
    def loss(self) -> float:
        return self.nll / self.targets

    @property
    def accuracy(self) -> float:
        return self.correct / self.targets


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, batches: Iterable) -> LossTotals:
    """The loss of `model` over all the batches, token-weighted: what the studies and
    scripts/eval.py report, summed from the same `loss_sums` as LitLM's validation (which adds
    them up itself, across ranks). Each batch is a text batch (B, T + 1) or a pair (inputs,
    targets) with IGNORE where a target is not scored. Added up in float64 on the host, so a
    long evaluation loses no precision (and MPS, which has no float64, works too)."""
    device = next(model.parameters()).device
    scorer = Scorer(model)
    total = torch.zeros(3, dtype=torch.float64)
    for batch in batches:
        batch = batch.to(device) if isinstance(batch, torch.Tensor) else [part.to(device) for part in batch]
        total += loss_sums(scorer, batch).cpu().double()
    nll, targets, correct = total.tolist()
    return LossTotals(nll=nll, targets=int(targets), correct=int(correct))
