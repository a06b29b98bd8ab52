"""What a conversion fits to besides the weights: each layer's attention input on a few batches
of the training corpus (MHA2MLA ranks RoPE frequencies on them; aligned pooling rotates heads
to agree on them).

Shapes: N calibration tokens, C d_model, B batch, T sequence length.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lm.model.transformer import Transformer


@torch.no_grad()
def attention_inputs(model: Transformer, batches: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Per layer, the input x of its attention (the block's normalised hidden state) at every
    token of `batches` (token ids, (B, T) each), as one (N, C) float64 tensor."""
    captured: list[list[torch.Tensor]] = [[] for _ in model.blocks]
    hooks = [block.attn.register_forward_pre_hook(lambda _, args, i=i: captured[i].append(args[0].flatten(0, 1)))
             for i, block in enumerate(model.blocks)]  # args[0]: x (B, T, C) -> (B*T, C)
    was_training = model.training
    model.eval()
    try:
        for ids in batches:
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    if not captured[0]:
        raise ValueError("no calibration batches: the conversion needs at least one")
    return [torch.cat(rows).double() for rows in captured]
