"""Export to transformers' Qwen3-Next (Qwen3NextForCausalLM), for the stacks that compute exactly
what it computes: Gated DeltaNet layers beside softmax layers with QK-norm and an elementwise
sigmoid output gate (attn=qwen3_next; gated softmax layers alone too), with Qwen3-Next's mixture of experts
turned off (num_experts=0: every block's MLP is the dense SwiGLU) and RoPE over whole heads
(partial_rotary_factor=1; the released models rotate a quarter of each head).

transformers 5 or later: earlier releases spell RoPE's settings otherwise (Qwen3NextConfig's
`partial_rotary_factor` defaulted to a quarter there) or have no Qwen3-Next.

The two models differ in layout, not in what they compute, and the export rewrites the layout:
- Qwen3-Next's RMSNorms of the blocks, of the model and of q and k are zero-centred: they scale by
  (1 + w) where ours scale by w, so the export writes w - 1 (its DeltaNet's output norm scales by w,
  as ours does);
- its softmax layers project each head's query and gate together, rows [q_h | gate_h] per head;
- its DeltaNet projects [q_h | k_h | v_h | z_h] per head in one matrix (z the output gate) and
  [b_h | a_h] per head in another, where ours keeps rows [Q | K | V], the gate, and [a | b];
- its convolution is an nn.Conv1d weight, (channels, 1, taps).

Shapes: nh heads, hs head size, C d_model, W the convolution's taps.
"""

from __future__ import annotations

import torch

from lm.attention import SoftmaxSpec
from lm.attention.gated_delta import GatedDeltaSpec
from lm.formats.weights import mlp_and_norm_weights, split_qkv
from lm.model.config import ModelConfig
from lm.util.errors import ConfigError

GATED_SOFTMAX = SoftmaxSpec(gate="elementwise", qk_norm=True)  # Qwen3-Next's full-attention layer
L2_EPS = 1e-6  # transformers' Qwen3-Next normalises q and k with this epsilon, whatever its config says


def layer_types(config: ModelConfig) -> list[str] | None:
    """Qwen3-Next's `layer_types` for this stack ('linear_attention' for a Gated DeltaNet layer,
    'full_attention' for a gated softmax layer with QK-norm), or None where some layer is neither."""
    types = []
    for spec in config.attention:
        if isinstance(spec, GatedDeltaSpec) and spec.conv_size:  # chunk_size and backend: how, not what
            types.append("linear_attention")
        elif spec == GATED_SOFTMAX:
            types.append("full_attention")
        else:
            return None
    return types


def check_exportable(config: ModelConfig) -> None:
    """One ConfigError line for what Qwen3-Next computes otherwise, on a stack of its two layers."""
    types = layer_types(config)
    if types is None or "linear_attention" not in types:
        return
    if "full_attention" not in types:
        raise ConfigError("a stack of Gated DeltaNet layers alone cannot be exported to Qwen3-Next: transformers' "
                          "Qwen3-Next reads the sequence length from a full-attention layer's cache, so it cannot "
                          "decode without one; attn=qwen3_next has one softmax layer in four")
    if config.n_kv_head != config.n_head:
        raise ConfigError(f"attn.n_kv_head={config.n_kv_head} cannot be exported to Qwen3-Next: its DeltaNet gives "
                          f"every value head its own state, where ours shares one K/V state among {config.kv_groups} "
                          "query heads; export needs attn.n_kv_head equal to model.n_head")
    deltanets = [spec for spec in config.attention if isinstance(spec, GatedDeltaSpec)]
    if len({spec.conv_size for spec in deltanets}) > 1:
        raise ConfigError(f"Gated DeltaNet layers with conv_size {sorted({s.conv_size for s in deltanets})} cannot be "
                          "exported to Qwen3-Next: its linear_conv_kernel_dim is one for every layer")
    eps = sorted({spec.norm_eps for spec in deltanets})
    if eps != [L2_EPS] or config.norm_eps != L2_EPS:
        raise ConfigError(f"model.norm_eps={config.norm_eps} with the DeltaNet's attn.norm_eps={eps} cannot be "
                          f"exported to Qwen3-Next exactly: it L2-normalises q and k with {L2_EPS} and norms the "
                          f"DeltaNet's output with the model's epsilon; train with model.norm_eps={L2_EPS} and "
                          f"attn.norm_eps at its default, {L2_EPS}")


def qwen3_next_config(config: ModelConfig, **extra):
    """The transformers Qwen3NextConfig of a model of this config."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        raise ConfigError(f"export to Qwen3-Next needs transformers 5 or later (this is {transformers.__version__}, "
                          "whose Qwen3-Next rotates a quarter of each head or which has none): pip install -U "
                          "transformers")
    hs = config.head_dim
    hf = transformers.Qwen3NextConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
        num_key_value_heads=config.n_kv_head, head_dim=hs, max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta, "partial_rotary_factor": 1.0},
        layer_types=layer_types(config), num_experts=0, attention_bias=False,
        # check_exportable: every DeltaNet layer has one kernel; without one, transformers' default is unused
        linear_conv_kernel_dim=next((s.conv_size for s in config.attention if isinstance(s, GatedDeltaSpec)), 4),
        linear_num_key_heads=config.n_head, linear_num_value_heads=config.n_head,
        linear_key_head_dim=hs, linear_value_head_dim=hs, **extra)
    hf.architectures = ["Qwen3NextForCausalLM"]
    return hf


def zero_centred(gain: torch.Tensor) -> torch.Tensor:
    """Our RMSNorm gain w as Qwen3-Next's zero-centred one, which scales by (1 + w)."""
    return gain - 1


def per_head(*parts: torch.Tensor, heads: int) -> torch.Tensor:
    """Row blocks of `heads` heads each, interleaved head by head: [a_0 | b_0 | a_1 | b_1 | ...]."""
    return torch.cat([p.view(heads, -1, p.shape[-1]) for p in parts], dim=1).flatten(0, 1)  # (heads*rows, C)


def to_qwen3_next_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> Qwen3NextForCausalLM's."""
    nh, nkv, hs = config.n_head, config.n_kv_head, config.head_dim
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": zero_centred(state["norm.weight"])}
    if not config.tie_embeddings:
        out["lm_head.weight"] = state["head.weight"]
    for i, kind in enumerate(layer_types(config)):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out.update(mlp_and_norm_weights(state, config, i, norm=zero_centred))
        q, k, v = split_qkv(state[ours + "attn.qkv.weight"], nh, nkv, hs)  # (nh*hs, C), (nkv*hs, C) x 2
        if kind == "full_attention":
            attn = theirs + "self_attn."
            out.update({attn + "q_proj.weight": per_head(q, state[ours + "attn.gate.weight"], heads=nh),
                        attn + "k_proj.weight": k, attn + "v_proj.weight": v,
                        attn + "o_proj.weight": state[ours + "attn.out.weight"],
                        attn + "q_norm.weight": zero_centred(state[ours + "attn.q_norm"]),
                        attn + "k_norm.weight": zero_centred(state[ours + "attn.k_norm"])})
        else:
            attn = theirs + "linear_attn."
            a, b = state[ours + "attn.decay_and_write.weight"].chunk(2)  # (nkv, C) each
            out.update({attn + "in_proj_qkvz.weight": per_head(q, k, v, state[ours + "attn.output_gate.weight"],
                                                               heads=nh),
                        attn + "in_proj_ba.weight": per_head(b, a, heads=nh),
                        attn + "conv1d.weight": state[ours + "attn.conv"][:, None, :],  # (channels, 1, W)
                        attn + "A_log": state[ours + "attn.A_log"], attn + "dt_bias": state[ours + "attn.dt_bias"],
                        attn + "norm.weight": state[ours + "attn.out_norm"],
                        attn + "out_proj.weight": state[ours + "attn.out.weight"]})
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


__all__ = ["check_exportable", "layer_types", "qwen3_next_config", "to_qwen3_next_state_dict"]
