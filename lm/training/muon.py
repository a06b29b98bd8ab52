"""Muon for the hidden matrices and AdamW for the rest, as one optimizer Lightning can drive.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; Liu et al. 2025,
"Muon is Scalable for LLM Training") replaces each matrix's momentum by its nearest semi-orthogonal
matrix (a Newton-Schulz iteration), so every direction of the update moves by about the same amount.
torch.optim.Muon does the arithmetic; this file adds only what it lacks:

- `SplitMuon`: a weight that stacks several matrices in its rows (our fused Q/K/V, the MLP's
  gate/up) is orthogonalised matrix by matrix, as if each were its own parameter. Each block has its
  own scale and spectrum; orthogonalising the stack would equalise the singular values of Q, K and V
  together, so the block with the largest gradient would set the others' step.
- `MuonAdamW`: a SplitMuon and an AdamW behind one torch Optimizer, whose param groups (Muon's
  first) and per-parameter state are the two optimizers' own, shared: an LR scheduler, gradient
  clipping, the precision plugins and state_dict/load_state_dict see one optimizer.

Shapes: a fused weight (R, C) holds matrices of r_1 + r_2 + ... = R rows each, in row order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


class SplitMuon(torch.optim.Muon):
    """torch.optim.Muon where each weight named in `fused_rows` (parameter -> the row counts of the
    matrices stacked in it) is updated as that many separate matrices: momentum, Newton-Schulz,
    the shape's learning-rate adjustment and weight decay all per block of rows. The momentum
    buffer stays one tensor of the weight's shape, so the state is the one torch.optim.Muon keeps."""

    def __init__(self, params, fused_rows: Mapping[nn.Parameter, tuple[int, ...]] | None = None, **settings):
        super().__init__(params, **settings)
        self.fused_rows = dict(fused_rows or {})
        held = {p for group in self.param_groups for p in group["params"]}
        for p, rows in self.fused_rows.items():
            if p not in held:
                raise ValueError(f"a fused weight {tuple(p.shape)} is not among this optimizer's parameters")
            if sum(rows) != p.shape[0] or min(rows) < 1:
                raise ValueError(f"rows {tuple(rows)} do not cut a fused weight of {p.shape[0]} rows")

    def _init_group(self, group, params_with_grad: list, grads: list, muon_momentum_bufs: list) -> bool:
        """torch's own gathering, then each fused weight, its gradient and its momentum buffer
        replaced in the lists by row views, one per matrix: torch's step updates the views in
        place, which writes the blocks back into the weight and its buffer."""
        has_complex = super()._init_group(group, params_with_grad, grads, muon_momentum_bufs)
        rows = [self.fused_rows.get(p) for p in params_with_grad]
        for tensors in (params_with_grad, grads, muon_momentum_bufs):
            tensors[:] = [view for tensor, r in zip(tensors, rows, strict=True)
                          for view in (tensor.split(r) if r else (tensor,))]
        return has_complex


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over two: `muon`'s param groups, then `adamw`'s. step() runs the closure
    once (the forward and backward pass), then both optimizers' steps."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw
        super().__init__(muon.param_groups + adamw.param_groups, defaults={})
        self._share()

    def _share(self) -> None:
        """Point both optimizers at this one's groups and state (load_state_dict replaces them)."""
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "muon" in self.__dict__:  # an unpickled copy holds no optimizers to point
            self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

