"""State-dict conversions. `to_grouped`: multi-head (or grouped) K/V heads -> fewer K/V heads.

Ainslie et al. 2023 (GQA) build a grouped-query model from a multi-head one by mean-pooling
the key and value projection heads of each group, then continue pre-training briefly
("uptraining"). Here group g of the new model takes the current K/V heads g*r .. g*r+r-1,
r = current n_kv_head / new n_kv_head. Pooling the projection weights is exact for RoPE
models: the rotation is the same linear map for every head, so it commutes with the mean.

Gated DeltaNet layers hold more per K/V head than the fused Q/K/V rows: the short convolution's
taps over the K and V channels, the decay's and write strength's projection rows (W_a, W_b) and the
per-head A_log and dt_bias. Each follows its K/V head: a group's mean under "mean" (and "random",
which draws only the K/V projection rows afresh: a head's forgetting is not what it stores), its first
head's under "first". A kind holding any other tensor whose shape depends on the K/V heads has no
grouped form here and is refused in one line (`check_convertible`) before any weight is touched.

`align_heads` ("aligned" init, after arXiv 2412.20677): heads that compute the same thing in
rotated coordinates average to something worse than either, so before pooling each head of a
group is rotated to agree with the group's first head on calibration activations, the inverse
folded into the query rows (keys) or the output columns (values): the parent's function is
unchanged by the rotation alone.

Shapes: nh query heads, nkv K/V heads (before), m K/V heads (after), hs head size, C d_model,
N calibration tokens.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from lm.attention.projections import ProjectionOptions
from lm.formats.weights import split_qkv
from lm.model.config import ModelConfig
from lm.model.transformer import Transformer
from lm.util.errors import ConfigError

INITS = ("mean", "first", "random", "aligned")
QKV_WEIGHT = re.compile(r"^blocks\.\d+\.attn\.qkv\.weight$")
# Per kind, the layer's tensors beside qkv.weight that hold one slice per K/V head, and their layout:
# "qkv" rows (channels) laid out as the fused [Q heads | K heads | V heads], or ("heads", parts): dim 0
# is `parts` consecutive blocks of one entry (row) per K/V head. Kinds not named hold none.
PER_HEAD_TENSORS: dict[str, dict[str, str | tuple[str, int]]] = {
    "gated_delta": {"conv": "qkv", "decay_and_write.weight": ("heads", 2), "A_log": ("heads", 1),
                    "dt_bias": ("heads", 1)},
}
# Kinds whose keys meet queries only through q.k after rotate-half RoPE, which a rotation of each
# frequency pair of both leaves unchanged.
ALIGNABLE = ("softmax", "sliding")


def to_grouped(state_dict: dict[str, torch.Tensor], config: ModelConfig, n_kv_head: int, init: str = "mean",
               seed: int = 0, layer_inputs: list[torch.Tensor] | None = None
               ) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """(new state dict, new config) with `n_kv_head` K/V heads; Q, O, MLP, norms and embeddings
    are copied untouched. init: "mean" of each group's heads, its "first" head, "random"
    (normal(0, init_std), the model's own initialisation), or "aligned": the mean after
    `align_heads` on `layer_inputs` (which then also changes Q and O, without changing the parent's function)."""
    if init not in INITS:
        raise ConfigError(f"init={init!r} is not one of {list(INITS)}")
    check_convertible(config, n_kv_head, init)
    without = [i for i in range(config.n_layer) if f"blocks.{i}.attn.qkv.weight" not in state_dict]
    if without:  # e.g. MLA, whose keys and values come from a latent: there are no K/V heads to pool
        raise ConfigError(f"layer {without[0]} ({config.attention[without[0]].describe()}) has no per-head K/V "
                          "projections to pool; GQA/MQA conversion takes softmax-family parents")
    if init == "aligned":
        state_dict = align_heads(state_dict, config, layer_inputs, n_kv_head)
        init = "mean"
    new_config = dataclasses.replace(config, n_kv_head=n_kv_head)
    generator = torch.Generator().manual_seed(seed)
    per_head = per_head_tensors(config)
    converted = {}
    for name, tensor in state_dict.items():
        if QKV_WEIGHT.match(name):
            tensor = _group_qkv(tensor, config, n_kv_head, init, generator)
        elif name in per_head:
            tensor = _group_per_head(tensor, per_head[name], config, n_kv_head, "mean" if init == "random" else init)
        converted[name] = tensor.clone()
    return converted, new_config


def per_head_tensors(config: ModelConfig) -> dict[str, str | tuple[str, int]]:
    """Full state-dict name -> layout of each tensor beside qkv.weight that holds one slice per K/V head."""
    return {f"blocks.{i}.attn.{name}": layout for i, spec in enumerate(config.attention)
            for name, layout in PER_HEAD_TENSORS.get(spec.kind, {}).items()}


def check_convertible(config: ModelConfig, n_kv_head: int, init: str = "mean") -> None:
    """One ConfigError line, before any weight is read or pooled, unless every layer of `config` has a
    grouped form with `n_kv_head` K/V heads under `init`: each tensor whose shape follows the K/V heads
    is the fused Q/K/V weight or one PER_HEAD_TENSORS names (compared on the meta device, no memory)."""
    check_target(config, n_kv_head)
    if init == "aligned":
        for i, spec in enumerate(config.attention):
            if spec.kind not in ALIGNABLE:
                raise ConfigError(f"layer {i} is of kind {spec.kind!r}; aligned init supports {list(ALIGNABLE)}")
    if n_kv_head == config.n_kv_head:
        return
    known = {f"blocks.{i}.attn.qkv.weight" for i in range(config.n_layer)} | set(per_head_tensors(config))
    before = _meta_shapes(config)
    after = _meta_shapes(dataclasses.replace(config, n_kv_head=n_kv_head))
    for name, shape in before.items():
        if name not in known and (name not in after or after[name] != shape):
            layer = int(name.split(".")[1]) if name.startswith("blocks.") else None
            kind = config.attention[layer].kind if layer is not None else "the model"
            raise ConfigError(f"{name} (kind {kind!r}, shape {tuple(shape)}) changes shape with the K/V heads and "
                              f"has no grouped form: the checkpoint cannot be converted to n_kv_head={n_kv_head}")


def _meta_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """Every tensor's shape of the model `config` builds, on the meta device (no memory, no values)."""
    with torch.device("meta"):
        return {name: tensor.shape for name, tensor in Transformer(config).state_dict().items()}


def check_target(config: ModelConfig, n_kv_head: int) -> None:
    """One ConfigError line unless the config's K/V heads split into `n_kv_head` equal groups."""
    current = config.n_kv_head
    if isinstance(n_kv_head, bool) or not isinstance(n_kv_head, int) or n_kv_head < 1:
        raise ConfigError(f"n_kv_head={n_kv_head!r} must be a positive integer")
    if config.n_head % n_kv_head:
        raise ConfigError(f"n_head={config.n_head} is not divisible by n_kv_head={n_kv_head}")
    if n_kv_head > current:
        raise ConfigError(f"n_kv_head={n_kv_head} is more than the checkpoint's {current} K/V heads; "
                          "conversion only merges heads")
    if current % n_kv_head:
        raise ConfigError(f"the checkpoint's {current} K/V heads do not split into n_kv_head={n_kv_head} equal groups")


def _group_qkv(weight: torch.Tensor, config: ModelConfig, m: int, init: str,
               generator: torch.Generator) -> torch.Tensor:
    """The fused Q/K/V projection with K and V reduced to m heads."""
    nkv, hs = config.n_kv_head, config.head_dim
    q, k, v = split_qkv(weight, config.n_head, nkv, hs)
    return torch.cat((q, _pool(k, nkv, m, hs, init, generator, config.init_std),
                      _pool(v, nkv, m, hs, init, generator, config.init_std)))


def _group_per_head(tensor: torch.Tensor, layout: str | tuple[str, int], config: ModelConfig, m: int,
                    init: str) -> torch.Tensor:
    """A per-K/V-head tensor beside qkv.weight reduced to m heads, each group's "mean" or "first"."""
    nkv, hs = config.n_kv_head, config.head_dim
    if layout == "qkv":  # channels in the fused layout, e.g. gated delta's convolution (channels, taps)
        q, k, v = split_qkv(tensor, config.n_head, nkv, hs)
        return torch.cat((q, _pool(k, nkv, m, hs, init, None, 0.0), _pool(v, nkv, m, hs, init, None, 0.0)))
    _, parts = layout
    blocks = tensor.reshape(parts, nkv, -1)  # (parts, nkv, rest): one row per K/V head in each block
    pooled = torch.cat([_pool(block, nkv, m, 1, init, None, 0.0) for block in blocks])  # (parts*m, rest)
    return pooled.reshape(parts * m, *tensor.shape[1:])


def _pool(rows: torch.Tensor, nkv: int, m: int, hs: int, init: str, generator: torch.Generator | None,
          std: float) -> torch.Tensor:
    C = rows.shape[1]
    heads = rows.view(m, nkv // m, hs, C)  # (m, r, hs, C): group g holds heads g*r .. g*r+r-1
    if init == "mean":
        pooled = heads.mean(dim=1)
    elif init == "first":
        pooled = heads[:, 0]
    else:
        pooled = torch.randn(m, hs, C, generator=generator, dtype=rows.dtype) * std
    return pooled.reshape(m * hs, C)  # (m*hs, C)


def align_heads(state_dict: dict[str, torch.Tensor], config: ModelConfig, layer_inputs: list[torch.Tensor] | None,
                n_kv_head: int) -> dict[str, torch.Tensor]:
    """A copy of `state_dict` (same config, same function) in which every K/V head is rotated to
    agree best with the first head of its group of the `n_kv_head` groups, on `layer_inputs`
    (per layer the attention's input x, (N, C), e.g. lm.formats.calibration.attention_inputs)."""
    check_target(config, n_kv_head)
    _check_alignable(config, layer_inputs)
    aligned = {name: tensor.clone() for name, tensor in state_dict.items()}
    for i, x in enumerate(layer_inputs):
        qkv, out = f"blocks.{i}.attn.qkv.weight", f"blocks.{i}.attn.out.weight"
        aligned[qkv], aligned[out] = _align_layer(state_dict[qkv], state_dict[out], x, config, n_kv_head)
    return aligned


def _check_alignable(config: ModelConfig, layer_inputs: list[torch.Tensor] | None) -> None:
    if layer_inputs is None:
        raise ConfigError("init='aligned' needs layer_inputs: each layer's attention input on calibration tokens "
                          "(lm.formats.calibration.attention_inputs)")
    if len(layer_inputs) != config.n_layer:
        raise ConfigError(f"layer_inputs has {len(layer_inputs)} entries; the model has n_layer={config.n_layer}")
    for i, (spec, x) in enumerate(zip(config.attention, layer_inputs, strict=True)):
        if x.dim() != 2 or x.shape[1] != config.d_model:
            raise ConfigError(f"layer_inputs[{i}] has shape {tuple(x.shape)}; expected (N, d_model={config.d_model})")
        if spec.kind not in ALIGNABLE:
            raise ConfigError(f"layer {i} is of kind {spec.kind!r}; aligned init supports {list(ALIGNABLE)}")
        # A per-channel gain after the projection does not commute with a rotation of the channels.
        if isinstance(spec, ProjectionOptions) and spec.qk_norm:
            raise ConfigError(f"layer {i} has qk_norm=True, which aligned init cannot rotate through")
        if isinstance(spec, ProjectionOptions) and spec.gate == "elementwise":
            raise ConfigError(f"layer {i} has gate='elementwise', which aligned init cannot rotate through")


def _align_layer(qkv: torch.Tensor, out: torch.Tensor, x: torch.Tensor, config: ModelConfig,
                 m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's fused Q/K/V weight and output weight with each K/V head aligned to its group's first."""
    nh, nkv, hs, C = config.n_head, config.n_kv_head, config.head_dim, config.d_model
    x = x.double()
    # float64 copies (the caller's tensors stay as they were): q (nh, hs, C), k and v (nkv, hs, C)
    q, k, v = (rows.to(torch.float64, copy=True).view(-1, hs, C) for rows in split_qkv(qkv, nh, nkv, hs))
    o = out.to(torch.float64, copy=True).view(C, nh, hs).transpose(0, 1)  # (nh, C, hs): query head h's columns
    r, g = nkv // m, nh // nkv  # K/V heads per new group, query heads per current K/V head
    for j in range(nkv):
        ref = j - j % r
        if j == ref:
            continue
        readers = slice(j * g, (j + 1) * g)  # the query heads that read K/V head j
        cos, sin = pair_rotations(x @ k[j].T, x @ k[ref].T)
        k[j], q[readers] = rotate_pairs(k[j], cos, sin), rotate_pairs(q[readers], cos, sin)
        rotation = procrustes(x @ v[j].T, x @ v[ref].T)  # values V_j R ~ V_ref
        # V_j R = x (R^T W_vj)^T; the output y R of each reader meets O_h R so that y R (O_h R)^T = y O_h^T.
        v[j] = rotation.T @ v[j]
        o[readers] = o[readers] @ rotation
    fused = torch.cat((q, k, v)).reshape(-1, C)  # (nh*hs + 2*nkv*hs, C)
    return fused.to(qkv.dtype), o.transpose(0, 1).reshape(C, nh * hs).to(out.dtype)  # (C, nh*hs)


def pair_rotations(keys: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (hs/2,) of the rotation of each RoPE pair (dims f, f + hs/2) of `keys` (N, hs)
    that best matches `reference` (N, hs) in least squares. A proper rotation (SO(2)), never a
    reflection: only a rotation commutes with RoPE's rotation of the same pair."""
    a1, a2 = keys.chunk(2, dim=-1)  # (N, hs/2) each: the rotate-half layout (lm.attention.rope)
    b1, b2 = reference.chunk(2, dim=-1)
    # max over phi of sum b . R(phi) a = cos(phi) sum(a.b) + sin(phi) sum(a x b)
    angle = torch.atan2((a1 * b2 - a2 * b1).sum(0), (a1 * b1 + a2 * b2).sum(0))  # (hs/2,)
    return angle.cos(), angle.sin()


def rotate_pairs(rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Projection rows (..., hs, C) whose outputs are the old ones with pair f rotated by (cos, sin) (hs/2,)."""
    first, second = rows.chunk(2, dim=-2)  # (..., hs/2, C) each
    cos, sin = cos[:, None], sin[:, None]  # (hs/2, 1)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-2)


def procrustes(values: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The orthogonal R (hs, hs), reflections allowed, minimising |values R - reference| (Kabsch):
    U V^T of the SVD of values^T reference."""
    u, _, vh = torch.linalg.svd(values.T @ reference)
    return u @ vh
