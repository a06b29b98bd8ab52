"""The decoder-only transformer: embed -> Block x n_layer -> RMSNorm -> head.

Llama-style: pre-norm RMSNorm, rotary positions, SwiGLU MLP (or ReLU², `mlp`), no biases. The model knows
nothing of attention internals: each block builds its layer from its spec (lm.attention.base).
Shapes: B batch, T sequence length, C d_model, V vocab size.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lm.attention.base import AttentionLayer
from lm.attention.rope import RotaryEmbedding
from lm.model.config import ModelConfig
from lm.model.generation_cache import GenerationCache
from lm.model.layers import MLPS, NO_MLP, RMSNorm
from lm.model.short_conv import ShortConv
from lm.util.errors import ConfigError


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.short_conv = ShortConv(config.d_model, config.short_conv) if config.short_conv else None
        spec = config.attention[layer_idx]
        self.attn = spec.build(config.layer_shape(layer_idx))
        if not isinstance(self.attn, AttentionLayer):  # its hooks' defaults live there (lm.attention.base)
            raise ConfigError(f"attention kind {spec.kind!r} built a {type(self.attn).__name__}; a kind's layer "
                            "must subclass lm.attention.AttentionLayer")
        # model.mlp=none: a block of its mixer alone (Based's recall models, zoology's Identity state mixer)
        has_mlp = config.mlp != NO_MLP
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps) if has_mlp else None
        self.mlp = MLPS[config.mlp](config.d_model, config.d_ff) if has_mlp else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                pos: torch.Tensor | None = None, conv_cache=None) -> torch.Tensor:
        h = self.attn_norm(x)
        if self.short_conv is not None:
            h = self.short_conv(h, conv_cache, pos)
        x = x + self.attn(h, cos, sin, cache, pos)
        return x + self.mlp(self.mlp_norm(x)) if self.mlp is not None else x


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta)
        # Full-attention layers were trained on at most max_seq_len positions; sliding and
        # linear layers have no such limit.
        self.context_limited = any(block.attn.context_limited for block in self.blocks)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2 n_layer)
        so the residual stream's variance does not grow with depth (GPT-2, Radford et al. 2019), or
        zero with `zero_init_out` (modded-nanogpt): every block starts as the identity on the residual
        stream, and the first step moves the blocks only through their output projections (the inner
        weights' gradients pass through those zeros)."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norm gains stay at one
            residual_out = name.endswith(("attn.out.weight", "attn.out_proj.weight", "mlp.down.weight"))
            if residual_out and self.config.zero_init_out:
                nn.init.zeros_(p)
                continue
            scale = 1 / math.sqrt(2 * self.config.n_layer) if residual_out else 1.0
            nn.init.normal_(p, mean=0.0, std=std * scale)
        for block in self.blocks:
            block.attn.reset_own_parameters()

    def forward(self, idx: torch.Tensor, cache: GenerationCache | None = None) -> torch.Tensor:
        """Logits (B, T, V) for token ids idx (B, T).

        With a `cache` (lm.model.generation_cache), idx holds the next T tokens after those the cache has
        seen: positions continue from there and each layer attends through its cache.
        """
        return self.head(self.hidden(idx, cache))

    def hidden(self, idx: torch.Tensor, cache: GenerationCache | None = None) -> torch.Tensor:
        """The final normalised hidden states (B, T, C) that the head turns into logits: what the
        training loss takes when it applies the head itself, chunk by chunk
        (lm.model.linear_cross_entropy)."""
        T = idx.shape[1]
        seen = cache.seen if cache is not None else 0
        if self.context_limited and seen + T > self.config.max_seq_len:
            raise ValueError(f"sequence of {seen + T} tokens exceeds max_seq_len={self.config.max_seq_len}")
        if cache is None:
            cos, sin = self.rope(torch.arange(T, device=idx.device))  # (T, hs/2) each
        else:
            cos, sin = self.rope(cache.positions(T))  # (B, T, hs/2) each: rows count from their first real token
        x = self.embed(idx)  # (B, T, C)
        for i, block in enumerate(self.blocks):
            if cache is None:
                x = block(x, cos, sin)
            else:
                x = block(x, cos, sin, cache.layers[i], conv_cache=cache.short_convs[i])
        if cache is not None:
            cache.advance(T)
        return self.norm(x)

    def decode_step(self, idx: torch.Tensor, cache: GenerationCache, pos: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) of one new token per row, idx (B, 1), each at its row's slot pos (B,) (a 0-dim
        long tensor: every row at that slot), usually `cache.lengths`.

        Every shape is fixed and nothing syncs with the host, so this is the function
        `torch.compile(fullgraph=True)` takes (lm.generation.decode). It neither checks the context limit
        nor advances the cache: the caller does both on the host, outside the compiled graph."""
        pos = pos.expand(idx.shape[0])  # (B,)
        cos, sin = self.rope(cache.decode_positions(pos))  # (B, 1, hs/2) each
        x = self.embed(idx)  # (B, 1, C)
        for block, layer_cache, conv_cache in zip(self.blocks, cache.layers, cache.short_convs, strict=True):
            x = block(x, cos, sin, layer_cache, pos, conv_cache)
        return self.head(self.norm(x[:, -1]))  # (B, V)

    def aux_loss(self) -> torch.Tensor | None:
        """The sum of the auxiliary losses the layers left in their last forward (AttentionLayer.aux_loss:
        DSA's indexer KL in training), or None where none did. The training loss adds it; a layer's own
        loss weights itself, since only that layer knows what its loss trains."""
        losses = [block.attn.aux_loss for block in self.blocks if block.attn.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def num_params(self) -> int:
        """Distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) by the PaLM appendix B count:
        6 per weight of every matmul plus 12 * n_layer * d_model * T for attention scores."""
        # The short convolutions' taps count like matmul weights: 2 FLOPs each per token, x3 with backward.
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, (nn.Linear, ShortConv)))
        c = self.config
        return 6 * matmul_weights + 12 * c.n_layer * c.n_head * c.head_dim * seq_len
