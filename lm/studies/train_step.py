"""The one training step the studies and the benchmarks time: forward, loss, backward and a fused
AdamW step, as one callable of a batch (the comparison's training speed; bench.py train's rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def train_step_fn(model: torch.nn.Module, logits_of, autocast: torch.dtype | None = None):
    """One training step: forward (under bf16 autocast when `autocast` says, as `bf16-mixed`
    trains), loss in float32 at least from the whole logits, backward, fused AdamW."""

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast(batch.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            logits = logits_of(model, batch[:, :-1])  # (B, T, V)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 up to float32; float64 stays
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    return optimizer_step_fn(model, loss_of)


def optimizer_step_fn(model: torch.nn.Module, loss_of):
    """loss_of(batch), its backward and a fused AdamW step, as one callable of the batch that returns
    the loss (detached; reading it is the caller's sync, not the step's)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = loss_of(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step
