"""Muon for the hidden matrices and AdamW for the rest, as one optimizer Lightning can drive.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; Liu et al. 2025,
"Muon is Scalable for LLM Training") replaces each matrix's momentum by its nearest semi-orthogonal
matrix (a Newton-Schulz iteration), so every direction of the update moves by about the same amount.
torch.optim.Muon does the arithmetic; this file adds only what it lacks:

- `SplitMuon`: a weight that stacks several matrices in its rows (our fused Q/K/V, the MLP's
  gate/up) is orthogonalised matrix by matrix, as if each were its own parameter. Each block has its
  own scale and spectrum; orthogonalising the stack would equalise the singular values of Q, K and V
  together, so the block with the largest gradient would set the others' step.
- `newton_schulz_in`: torch.optim.Muon runs its Newton-Schulz iteration in bf16, which costs ~16x
  fp32's time on a CPU without bf16 instructions (an AVX2 EPYC: 606 against 37 ms for a 768 x 288
  matrix, one thread). SplitMuon's `ns_dtype` runs the same iteration in float32 there.
- `MuonAdamW`: a SplitMuon and an AdamW behind one torch Optimizer, whose param groups (Muon's
  first) and per-parameter state are the two optimizers' own, shared: an LR scheduler, gradient
  clipping, the precision plugins and state_dict/load_state_dict see one optimizer.

Shapes: a fused weight (R, C) holds matrices of r_1 + r_2 + ... = R rows each, in row order.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial

import torch
import torch.optim._muon as torch_muon
from torch import nn

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_SWAP = threading.Lock()  # the swap below changes a module global every torch.optim.Muon in the process reads


def newton_schulz(matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration (x <- a x + (b G + c G^2) x, G = x x^T)
    in `dtype` instead of bf16 only; with dtype=torch.bfloat16 it is torch's own, bit for bit."""
    a, b, c = coefficients
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.to(dtype)
    x = x.T if tall else x  # (short side, long side): the Gram matrix is the smaller square
    x = x / x.norm().clamp(min=eps)  # spectral norm at most one
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@contextmanager
def newton_schulz_in(dtype: torch.dtype) -> Iterator[None]:
    """torch.optim.Muon's step with its Newton-Schulz iteration in `dtype`. torch offers no option
    for it, so the step's module-level function is swapped for `newton_schulz` while the step runs
    (checked against torch's own in tests/test_optim.py, so a torch that renames it fails there)."""
    if dtype == torch.bfloat16:
        yield
        return
    with _SWAP:  # one step at a time holds the swap: another thread's Muon never sees it half done
        own = torch_muon._zeropower_via_newtonschulz
        torch_muon._zeropower_via_newtonschulz = partial(newton_schulz, dtype=dtype)
        try:
            yield
        finally:
            torch_muon._zeropower_via_newtonschulz = own


class SplitMuon(torch.optim.Muon):
    """torch.optim.Muon where each weight named in `fused_rows` (parameter -> the row counts of the
    matrices stacked in it) is updated as that many separate matrices: momentum, Newton-Schulz,
    the shape's learning-rate adjustment and weight decay all per block of rows. The momentum
    buffer stays one tensor of the weight's shape, so the state is the one torch.optim.Muon keeps.
    `ns_dtype` (NS_DTYPES: bfloat16, torch's, or float32) is the dtype of the Newton-Schulz iteration."""

    def __init__(self, params, fused_rows: Mapping[nn.Parameter, tuple[int, ...]] | None = None,
                 ns_dtype: str = "bfloat16", **settings):
        super().__init__(params, **settings)
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype={ns_dtype!r} is not one of {', '.join(NS_DTYPES)}")
        self.ns_dtype = ns_dtype
        self.fused_rows = dict(fused_rows or {})
        held = {p for group in self.param_groups for p in group["params"]}
        for p, rows in self.fused_rows.items():
            if p not in held:
                raise ValueError(f"a fused weight {tuple(p.shape)} is not among this optimizer's parameters")
            if sum(rows) != p.shape[0] or min(rows) < 1:
                raise ValueError(f"rows {tuple(rows)} do not cut a fused weight of {p.shape[0]} rows")

    def step(self, closure=None):  # torch's step is no_grad itself
        with newton_schulz_in(NS_DTYPES[self.ns_dtype]):
            return super().step(closure)

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

