"""Export to transformers' Kimi Linear (KimiLinearForCausalLM), for the stacks that compute exactly
what it computes: Kimi Delta Attention layers beside MLA layers without positional encoding
(attn=kimi_linear), with Kimi Linear's mixture of experts turned off (every layer's `mlp_layer_types`
entry "dense": the SwiGLU MLP) and its queries projected in full (q_lora_rank=None).

The layer options that make our layers Kimi Linear's (attn=kimi_linear sets them):
- MLA: `rope=false` (Kimi Linear's MLA rotates nothing; its qk_rope_head_dim part stays, shared by
  the heads), `latent_norm=true` (its kv_a_layernorm) and `q_rank=0`;
- KDA: `gate_bias=false` (its output gate's up-projection g_b_proj has no bias), one K/V head per head.

The two models differ in layout, not in what they compute, and the export rewrites the layout:
- our fused Q, K, V rows are its q_proj, k_proj and v_proj; the convolution over them is one
  nn.Conv1d weight (channels, 1, taps) over [q | k | v], as ours;
- our KDA's [W_down | W_b] rows are its forget gate's f_a_proj and its b_proj; W_up is f_b_proj,
  A_log (per head) is its (1, 1, heads, 1) parameter;
- our MLA's projections are its q_proj, kv_a_proj_with_mqa ([c | k_rope]), kv_b_proj (rows
  [k_nope | v] per head) and o_proj, with the latent norm's gain as kv_a_layernorm;
- it ties no embeddings (its class declares no tied weights), so a tied model writes its embedding
  twice, as embed_tokens and lm_head.

Epsilons: it L2-normalises KDA's q and k and normalises the latent with 1e-6 whatever its config
says, and norms KDA's output and the blocks with rms_norm_eps. Ours: KDA's L2 norm and output norm
take attn.norm_eps, the blocks model.norm_eps, the latent norm lm.attention.mla.LATENT_NORM_EPS
(1e-6); so export needs attn.norm_eps and model.norm_eps at 1e-6.

Shapes: nh heads, hs head size, C d_model, r kv_rank, dR rope_dim.
"""

from __future__ import annotations

import torch

from lm.attention.kda import KimiDeltaSpec
from lm.attention.mla import LatentSpec
from lm.formats.weights import mlp_and_norm_weights, split_qkv
from lm.model.config import ModelConfig
from lm.util.errors import ConfigError

L2_EPS = 1e-6  # transformers' Kimi Linear normalises KDA's q and k with this epsilon, whatever its config says


def layer_types(config: ModelConfig) -> list[str] | None:
    """Kimi Linear's `layer_types` for this stack ('linear_attention' for a KDA layer, 'full_attention'
    for an MLA layer), or None where some layer is neither."""
    types = []
    for spec in config.attention:
        if isinstance(spec, KimiDeltaSpec):
            types.append("linear_attention")
        elif type(spec) is LatentSpec:  # DSA's spec subclasses MLA's: its indexer is not Kimi Linear's
            types.append("full_attention")
        else:
            return None
    return types if "linear_attention" in types else None


def check_exportable(config: ModelConfig) -> None:
    """One ConfigError line for what Kimi Linear computes otherwise, on a stack of KDA and MLA layers."""
    types = layer_types(config)
    if types is None:
        return
    head = "cannot be exported to Kimi Linear"
    if "full_attention" not in types:
        raise ConfigError(f"a stack of KDA layers alone {head}: transformers' Kimi Linear reads the sequence length "
                          "from an MLA layer's cache, so it cannot decode without one; attn=kimi_linear has one MLA "
                          "layer in four")
    kdas = [spec for spec in config.attention if isinstance(spec, KimiDeltaSpec)]
    mlas = [spec.at(config.head_dim) for spec in config.attention if isinstance(spec, LatentSpec)]
    if config.n_kv_head != config.n_head:
        raise ConfigError(f"attn.n_kv_head={config.n_kv_head} {head}: its KDA gives every head its own state, where "
                          f"ours shares one among {config.kv_groups} query heads; export needs attn.n_kv_head equal "
                          "to model.n_head")
    if any(spec.gate_bias for spec in kdas):
        raise ConfigError(f"attn.gate_bias=true {head}: its KDA output gate's up-projection has no bias; train with "
                          "attn.gate_bias=false, as attn=kimi_linear does")
    if len({kernel(spec) for spec in kdas}) > 1:
        raise ConfigError(f"KDA layers with conv_size {sorted({s.conv_size for s in kdas})} {head}: its "
                          "linear_conv_kernel_dim is one for every layer (conv_size 0 counts as 1)")
    for option, wanted, why in (("rope", False, "its MLA rotates nothing (NoPE)"),
                                ("latent_norm", True, "its MLA RMS-normalises the latent (kv_a_layernorm)"),
                                ("q_rank", 0, "its MLA projects queries in full (q_lora_rank null) or else "
                                              "normalises the query bottleneck")):
        found = sorted({str(value).lower() if isinstance(value, bool) else str(value)  # as YAML writes it
                        for value in (getattr(spec, option) for spec in mlas) if value != wanted})
        if found:
            raise ConfigError(f"attn.{option}={found[0]} in an MLA layer {head}: {why}; attn=kimi_linear sets "
                              f"{option}={str(wanted).lower()}")
    if len({(spec.kv_rank, spec.rope_dim) for spec in mlas}) > 1:
        raise ConfigError(f"MLA layers with (kv_rank, rope_dim) {sorted({(s.kv_rank, s.rope_dim) for s in mlas})} "
                          f"{head}: its kv_lora_rank and qk_rope_head_dim are one for every layer")
    eps = sorted({spec.norm_eps for spec in kdas})
    if eps != [L2_EPS] or config.norm_eps != L2_EPS:
        raise ConfigError(f"model.norm_eps={config.norm_eps} with KDA's attn.norm_eps={eps} {head} exactly: it "
                          f"L2-normalises q and k with {L2_EPS} and norms KDA's output with the model's epsilon; "
                          f"train with model.norm_eps={L2_EPS} and attn.norm_eps at its default, {L2_EPS}")


def kernel(spec: KimiDeltaSpec) -> int:
    """The convolution's taps in Kimi Linear: ours without one (conv_size 0) still applies SiLU to the
    rows, which is its convolution of one tap of weight 1 (to_kimi_linear_state_dict writes ones)."""
    return max(spec.conv_size, 1)


def kimi_linear_config(config: ModelConfig, **extra):
    """The transformers KimiLinearConfig of a model of this config (check_exportable has passed)."""
    import transformers

    if not hasattr(transformers, "KimiLinearConfig"):
        raise ConfigError(f"export to Kimi Linear needs a transformers with KimiLinearForCausalLM (this is "
                          f"{transformers.__version__}): pip install -U transformers")
    hs = config.head_dim
    mla = next(spec.at(hs) for spec in config.attention if isinstance(spec, LatentSpec))
    kda = next(spec for spec in config.attention if isinstance(spec, KimiDeltaSpec))
    hf = transformers.KimiLinearConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head, num_key_value_heads=config.n_head,
        max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps, hidden_act="silu",
        tie_word_embeddings=False, attention_bias=False, layer_types=layer_types(config),
        mlp_layer_types=["dense"] * config.n_layer,
        q_lora_rank=None, kv_lora_rank=mla.kv_rank, qk_rope_head_dim=mla.rope_dim,
        qk_nope_head_dim=hs - mla.rope_dim, v_head_dim=hs,
        linear_head_dim=hs, linear_num_heads=config.n_head, linear_conv_kernel_dim=kernel(kda), **extra)
    hf.architectures = ["KimiLinearForCausalLM"]
    return hf


def to_kimi_linear_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> KimiLinearForCausalLM's."""
    nh, hs = config.n_head, config.head_dim
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"],
           "lm_head.weight": state["embed.weight" if config.tie_embeddings else "head.weight"]}
    for i, kind in enumerate(layer_types(config)):
        out.update(mlp_and_norm_weights(state, config, i))
        a, attn = f"blocks.{i}.attn.", f"model.layers.{i}.self_attn."
        if kind == "full_attention":
            out.update({attn + "q_proj.weight": state[a + "q_up.weight"],
                        attn + "kv_a_proj_with_mqa.weight": state[a + "kv_down.weight"],
                        attn + "kv_a_layernorm.weight": state[a + "latent_norm"],
                        attn + "kv_b_proj.weight": state[a + "kv_up.weight"],
                        attn + "o_proj.weight": state[a + "out.weight"]})
            continue
        q, k, v = split_qkv(state[a + "qkv.weight"], nh, nh, hs)  # (nh*hs, C) each
        down, b = state[a + "decay_and_write.weight"].split((hs, nh))  # (hs, C), (nh, C)
        conv = state.get(a + "conv", torch.ones(3 * nh * hs, 1))  # (channels, W); none: one tap of 1
        out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v,
                    attn + "conv1d.weight": conv[:, None, :],  # (channels, 1, W)
                    attn + "forget_gate.f_a_proj.weight": down,
                    attn + "forget_gate.f_b_proj.weight": state[a + "decay_up.weight"],
                    attn + "forget_gate.dt_bias": state[a + "dt_bias"],
                    attn + "forget_gate.A_log": state[a + "A_log"].view(1, 1, nh, 1),
                    attn + "b_proj.weight": b,
                    attn + "g_a_proj.weight": state[a + "gate_down.weight"],
                    attn + "g_b_proj.weight": state[a + "gate_up.weight"],
                    attn + "o_norm.weight": state[a + "out_norm"],
                    attn + "o_proj.weight": state[a + "out.weight"]})
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


__all__ = ["check_exportable", "kimi_linear_config", "layer_types", "to_kimi_linear_state_dict"]
