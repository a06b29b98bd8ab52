"""The output layer and the cross-entropy in one, a chunk of positions at a time.

Shapes: N positions scored, C d_model, V vocab size, n the positions of one chunk.

The plain loss, `F.cross_entropy(hidden @ weight.T, targets)`, holds the (N, V) logits whole, then
its log-softmax, then their gradient: at the default training batch (16 x 256 positions, vocab
8192) three 134 MB tensors, each read and written by its own pass from main memory. On a 2-core
AVX2 CPU those passes cost about as much as the output layer's three matmuls themselves. Here each
chunk's (n, V) logits are made, turned into their gradient (softmax - one-hot) in place while they are
in cache, and folded straight into the gradients of the hidden states and of the weight; the loss
is a scalar, so its backward only scales the gradients already made. Liger-Kernel's fused linear
cross-entropy does the same on a GPU (Cut Cross-Entropy, Wijmans et al. 2024, recomputes the logits in
the backward instead); here the chunks are plain PyTorch ops. The naive twin is F.cross_entropy over the whole logits
(tests/test_linear_cross_entropy.py).
"""

from __future__ import annotations

import torch


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `targets` under softmax(hidden @ weight.T); the gradients are made in
    the forward, chunk by chunk, when `with_grad` (the caller knows whether autograd will ask)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, ignore_index, with_grad, accuracy):
        N = hidden.shape[0]
        # The loss and the softmax in float32 at least, as F.cross_entropy(logits.float()) takes them
        # under bf16 autocast; float64 inputs stay float64.
        dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        loss = torch.zeros((), dtype=dtype, device=hidden.device)
        correct = torch.zeros((), dtype=torch.long, device=hidden.device) if accuracy else None
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        grad_weight = torch.zeros_like(weight, dtype=dtype) if with_grad else None
        for start in range(0, N, chunk):
            h, t = hidden[start:start + chunk], targets[start:start + chunk]  # (n, C), (n,)
            scored = t != ignore_index  # (n,)
            t = torch.where(scored, t, 0)  # an ignored row picks any class; its weight below is 0
            log_probs = torch.log_softmax((h @ weight.T).to(dtype), dim=-1)  # (n, V)
            picked = log_probs.gather(1, t[:, None]).squeeze(1)  # (n,)
            loss -= torch.where(scored, picked, 0.0).sum()
            if accuracy:
                correct += ((log_probs.argmax(-1) == t) & scored).sum()
            if with_grad:
                # d loss / d logits = softmax - one-hot per scored row; ignored rows are zeroed by
                # scaling the (n, C) operands, not the (n, V) chunk.
                grad_logits = log_probs.exp_()  # (n, V), in place: the chunk is not read again
                grad_logits.scatter_add_(1, t[:, None], grad_logits.new_full((len(t), 1), -1.0))
                weight_of_row = scored.to(grad_logits.dtype)[:, None]  # (n, 1)
                grad_hidden[start:start + chunk] = (grad_logits @ weight) * weight_of_row
                grad_weight += grad_logits.T @ (h * weight_of_row)
        if with_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return (loss, correct) if accuracy else loss

    @staticmethod
    @torch.autograd.function.once_differentiable  # its gradients are made, not traced: no second derivative
    def backward(ctx, grad_loss, *_):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 512,
                         ignore_index: int = -100, accuracy: bool = False):
    """Summed cross-entropy (0-dim; float32, or float64 for float64 inputs) of `targets` (N,) under
    the logits hidden (N, C) @ weight (V, C).T, made `chunk` positions at a time; targets equal to
    `ignore_index` are not scored. With `accuracy`, also the number of scored targets the arg-max
    predicts (0-dim long): (loss, correct). Equal to F.cross_entropy(hidden @ weight.T, targets,
    reduction="sum") up to rounding, and so are its gradients with respect to hidden and weight."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 position, got {chunk}")
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk, ignore_index, with_grad, accuracy)
