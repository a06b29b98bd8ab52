"""MHA (or GQA) -> multi-head latent attention (lm/attention/mla.py), after MHA2MLA (Ji et al., ACL 2025).

Shapes: N calibration tokens, C d_model, nh query heads, nkv K/V heads, hs head size, F = hs/2
frequency pairs, m = rope_dim/2 pairs kept, dn = hs - rope_dim, r kv_rank.

Two steps per layer, then a short uptraining (lm/training/uptraining.py):

1. Partial RoPE. MLA rotates only a shared key part of rope_dim dimensions, so each head keeps RoPE
   on m of its F frequency pairs (pair f = dimensions f and f + F in the rotate-half layout) and
   the other dimensions lose it. MHA2MLA's 2-norm rule ranks pair f of head h by how much it can
   contribute to q.k: mean_t |q_hf(t)| x mean_t |k_hf(t)| over calibration tokens (|.| the 2-norm
   of the pair). Because MLA shares one RoPE key, one set of pairs serves every head of the layer:
   the m pairs with the largest sum over heads. The shared key part starts as the mean over K/V
   heads of their keys on those pairs (mean-pooling, as MQA conversion does).
2. Low-rank keys and values. The rest of each head's key (dn dimensions) and its value (hs) are
   linear in x through the rows W = [W_k,nope,h ; W_v,h] for every head h, one (nh (dn + hs), C)
   matrix. Its truncated SVD W ~ U_r S_r V_r^T gives the latent's down-projection S_r^1/2 V_r^T and
   the up-projections U_r S_r^1/2 (keys and values jointly, MHA2MLA's SVD_joint): at r equal to
   W's rank the decompressed keys and values are the parent's exactly.
With q_rank > 0 the queries' projection is factored by its SVD the same way.
"""

from __future__ import annotations

import dataclasses

import torch

from lm.attention.mla import LatentSpec, check_query_rank
from lm.attention.softmax import SoftmaxSpec
from lm.formats.weights import split_qkv
from lm.model.config import ModelConfig
from lm.util.errors import ConfigError


def check_parent(config: ModelConfig, spec: LatentSpec) -> None:
    """One line for a parent or a target this conversion cannot take (before any data is read)."""
    for i, layer in enumerate(config.attention):
        if layer != SoftmaxSpec():
            raise ConfigError(f"layer {i} is {layer.describe()}; conversion to mla takes plain softmax layers "
                              "(MHA, GQA or MQA without gate, qk_norm, softcap or learned sink)")
    hs = config.head_dim
    spec = spec.at(hs)
    if spec.rope_dim >= hs:
        raise ConfigError(f"attn.rope_dim={spec.rope_dim} must be less than the checkpoint's head size {hs}")
    widest = min(config.d_model, config.n_head * (2 * hs - spec.rope_dim))
    if spec.kv_rank > widest:
        raise ConfigError(f"attn.kv_rank={spec.kv_rank} is more than the rank the checkpoint's keys and values can "
                          f"have, min(d_model={config.d_model}, n_head x (2 x {hs} - rope_dim)) = {widest}")
    check_query_rank(spec.q_rank, config.d_model)  # the bound training checks too
    if spec.rope_pairs is not None:
        raise ConfigError("attn.rope_pairs is chosen by the conversion (the 2-norm rule); leave it unset")
    if spec.latent_norm:
        raise ConfigError("attn.latent_norm=true cannot be converted into: the parent's keys and values are linear in "
                          "x, and a normalised latent is not, so no factorisation reproduces them; leave it false")


def check_inputs(config: ModelConfig, layer_inputs: list[torch.Tensor]) -> None:
    if len(layer_inputs) != config.n_layer:
        raise ConfigError(f"{len(layer_inputs)} layers of calibration activations for a {config.n_layer}-layer model")


def pair_norms(rows: torch.Tensor, x: torch.Tensor, heads: int) -> torch.Tensor:
    """Mean 2-norm of each head's frequency pairs over the tokens: rows (heads*hs, C), x (N, C) -> (heads, F)."""
    acts = (x @ rows.T.to(x.dtype)).view(x.shape[0], heads, 2, -1)  # (N, heads, 2, F): pair f is [:, :, :, f]
    return acts.norm(dim=2).mean(0)  # (heads, F)


def rank_rope_pairs(q_rows: torch.Tensor, k_rows: torch.Tensor, x: torch.Tensor, n_head: int, n_kv_head: int,
                    keep: int) -> tuple[int, ...]:
    """The `keep` frequency pairs with the largest sum over query heads of |q_hf| |k_hf| (MHA2MLA's
    2-norm rule, made layer-wide), in increasing order."""
    q_norm = pair_norms(q_rows, x, n_head)  # (nh, F)
    k_norm = pair_norms(k_rows, x, n_kv_head).repeat_interleave(n_head // n_kv_head, dim=0)  # (nh, F)
    score = (q_norm * k_norm).sum(0)  # (F,)
    return tuple(sorted(score.topk(keep).indices.tolist()))


def split_dims(hs: int, pairs: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of a head's dimensions: those that lose RoPE (dn, in order) and the RoPE part in the
    layout apply_rope expects (first halves of the kept pairs, then their second halves)."""
    F = hs // 2
    rope = torch.tensor([*pairs, *(p + F for p in pairs)])
    nope = torch.tensor([d for d in range(hs) if d not in set(rope.tolist())])
    return nope, rope


def factor(w: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w (rows, C) ~ up (rows, rank) @ down (rank, C) by truncated SVD, the singular values split evenly."""
    U, S, Vh = torch.linalg.svd(w.double(), full_matrices=False)
    root = S[:rank].sqrt()
    return (U[:, :rank] * root).to(w.dtype), (root[:, None] * Vh[:rank]).to(w.dtype)


def latent_layer(qkv: torch.Tensor, x: torch.Tensor, config: ModelConfig, spec: LatentSpec
                 ) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """One layer's fused Q/K/V weight and calibration inputs -> the MLA layer's weights (without
    `out`, which is unchanged) and the RoPE pairs it keeps."""
    nh, nkv, hs, C = config.n_head, config.n_kv_head, config.head_dim, config.d_model
    q, k, v = split_qkv(qkv, nh, nkv, hs)  # (nh*hs, C), (nkv*hs, C), (nkv*hs, C)
    pairs = rank_rope_pairs(q, k, x, nh, nkv, spec.rope_dim // 2)
    nope, rope = split_dims(hs, pairs)
    q_heads = q.view(nh, hs, C)
    k_heads = k.view(nkv, hs, C).repeat_interleave(nh // nkv, dim=0)  # (nh, hs, C): the K/V head each query reads
    v_heads = v.view(nkv, hs, C).repeat_interleave(nh // nkv, dim=0)  # (nh, hs, C)
    weights = {}
    q_rows = torch.cat((q_heads[:, nope], q_heads[:, rope]), dim=1).reshape(nh * hs, C)  # per head [nope | rope]
    if spec.q_rank:
        weights["q_up.weight"], weights["q_down.weight"] = factor(q_rows, spec.q_rank)
    else:
        weights["q_up.weight"] = q_rows
    kv_rows = torch.cat((k_heads[:, nope], v_heads), dim=1).reshape(-1, C)  # (nh*(dn+hs), C): per head [k_nope | v]
    up, down = factor(kv_rows, spec.kv_rank)
    k_rope = k.view(nkv, hs, C)[:, rope].mean(0)  # (dR, C): one RoPE key for all heads, pooled
    weights["kv_up.weight"] = up
    weights["kv_down.weight"] = torch.cat((down, k_rope))  # [c rows | k_rope rows], (r + dR, C)
    return weights, pairs


def to_latent(state_dict: dict[str, torch.Tensor], config: ModelConfig, spec: LatentSpec,
              layer_inputs: list[torch.Tensor]) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """(new state dict, new config): every layer MLA with `spec`'s ranks and its own chosen RoPE
    pairs; the output projections, MLP, norms and embeddings are copied. layer_inputs: each layer's
    attention input on calibration tokens (lm.formats.calibration.attention_inputs)."""
    check_parent(config, spec)
    check_inputs(config, layer_inputs)
    spec = spec.at(config.head_dim)  # the stored spec names its sizes, whatever the head size becomes
    converted, specs = {}, []
    for name, tensor in state_dict.items():
        if not name.endswith(".attn.qkv.weight"):
            converted[name] = tensor.clone()
    for i in range(config.n_layer):
        weights, pairs = latent_layer(state_dict[f"blocks.{i}.attn.qkv.weight"], layer_inputs[i], config, spec)
        converted.update({f"blocks.{i}.attn.{key}": w.contiguous() for key, w in weights.items()})
        specs.append(dataclasses.replace(spec, rope_pairs=pairs))
    return converted, dataclasses.replace(config, attention=specs, n_kv_head=config.n_head)
