"""Hugging Face `transformers` folders <-> native models.

Softmax MHA/GQA/MQA models are Llama (`LlamaForCausalLM`, `num_key_value_heads`); uniform
sliding-window models are Mistral (`sliding_window`). The layouts already agree where it
matters: RoPE uses the rotate-half pairing (i, i + hs/2) in both, and Mistral's window
(q - W < k <= q) is ours. What differs is only packaging: our fused QKV and gate/up
projections are split into Llama's separate ones on export and fused again on import.

Shapes: nh query heads, nkv K/V heads, hs head size, C d_model, F d_ff.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lm.attention import option
from lm.attention.sliding import SlidingWindowAttention
from lm.config import ModelConfig
from lm.errors import CheckpointError, ConfigError
from lm.model import Transformer
from lm.tokenizer import EOT


def hf_architecture(config: ModelConfig) -> str:
    """'llama' or 'mistral', or a ConfigError naming what transformers has no equivalent for."""
    if config.attention == "softmax":
        return "llama"
    if config.attention == "sliding":
        window = option(config, SlidingWindowAttention, "window")
        dilation = option(config, SlidingWindowAttention, "dilation")
        if isinstance(window, (list, tuple)) or isinstance(dilation, (list, tuple)) or dilation != 1:
            raise ConfigError("attention=sliding with per-layer windows or dilation has no transformers "
                              "equivalent; only a uniform window exports (as Mistral)")
        if option(config, SlidingWindowAttention, "global_every"):
            raise ConfigError("attention=sliding with global_every layers has no transformers equivalent")
        return "mistral"
    raise ConfigError(f"attention={config.attention} has no transformers equivalent; "
                      "export takes softmax (Llama) and uniform sliding-window (Mistral) models")


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    c = model.config
    q_size, kv_size = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    sd = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    for i, block in enumerate(model.blocks):
        p = f"model.layers.{i}."
        q, k, v = block.attn.qkv.weight.split((q_size, kv_size, kv_size))  # rows of the fused projection
        gate, up = block.mlp.gate_up.weight.split(c.d_ff)  # (F, C) each
        sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                   p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": block.attn.out.weight,
                   p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                   p + "mlp.down_proj.weight": block.mlp.down.weight,
                   p + "input_layernorm.weight": block.attn_norm.weight,
                   p + "post_attention_layernorm.weight": block.mlp_norm.weight})
    if not c.tie_embeddings:
        sd["lm_head.weight"] = model.head.weight
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


def export_hf(model: Transformer, tokenizer: Tokenizer, out: str | Path) -> Path:
    """Write a folder `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load offline."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("export to Hugging Face needs transformers: pip install -e .[hf]") from None
    from safetensors.torch import save_file

    c = model.config
    arch = hf_architecture(c)
    eot = tokenizer.token_to_id(EOT)
    common = dict(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff,
                  num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
                  head_dim=c.head_dim, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
                  rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings, hidden_act="silu",
                  bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, torch_dtype="float32")
    if arch == "llama":
        hf_config = transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
        hf_config.architectures = ["LlamaForCausalLM"]
    else:
        hf_config = transformers.MistralConfig(sliding_window=option(c, SlidingWindowAttention, "window"), **common)
        hf_config.architectures = ["MistralForCausalLM"]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(out)
    transformers.GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                                  max_length=c.max_seq_len).save_pretrained(out)
    save_file(to_hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOT, eos_token=EOT,
                                                pad_token=EOT, model_max_length=c.max_seq_len)
    fast.save_pretrained(out)
    return out


def is_hf_folder(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def config_from_hf(values: dict, folder: Path) -> ModelConfig:
    kind = values.get("model_type")
    if kind not in ("llama", "mistral"):
        raise CheckpointError(f"{str(folder)!r} holds model_type={kind!r}; import reads llama and mistral")
    unsupported = [name for name in ("attention_bias", "mlp_bias") if values.get(name)]
    if values.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={values['hidden_act']}")
    rope = values.get("rope_scaling") or values.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        unsupported.append(f"rope_type={rope.get('rope_type', rope.get('type'))}")
    if unsupported:
        raise CheckpointError(f"{str(folder)!r} uses {', '.join(unsupported)}, which lm's model does not have")
    d_model, n_head = values["hidden_size"], values["num_attention_heads"]
    if values.get("head_dim") not in (None, d_model // n_head):
        raise CheckpointError(f"{str(folder)!r} has head_dim={values['head_dim']} != hidden_size / heads")
    window = values.get("sliding_window") if kind == "mistral" else None
    return ModelConfig(
        vocab_size=values["vocab_size"], n_layer=values["num_hidden_layers"], d_model=d_model, n_head=n_head,
        n_kv_head=values.get("num_key_value_heads") or n_head, d_ff=values["intermediate_size"],
        max_seq_len=values["max_position_embeddings"], rope_theta=float(rope.get("rope_theta", values.get(
            "rope_theta", 10000.0))), norm_eps=values["rms_norm_eps"],
        tie_embeddings=bool(values.get("tie_word_embeddings", False)),
        attention="sliding" if window else "softmax", attention_options={"window": window} if window else {},
    )


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for name in files:
        if not (folder / name).is_file():
            raise CheckpointError(f"{str(folder)!r} has no {name} (only safetensors weights are read)")
        weights.update(load_file(str(folder / name)))
    return weights


def load_hf(folder: str | Path, device: str | torch.device = "cpu",
            values: dict | None = None) -> tuple[Transformer, Tokenizer]:
    """(model in eval mode, tokenizer) from a local Llama or Mistral folder (`values`: its
    config.json when the caller has read it already)."""
    folder = Path(folder)
    config = config_from_hf(values or json.loads((folder / "config.json").read_text()), folder)
    hf = read_hf_weights(folder)
    try:
        state = _native_state(hf, config)
    except KeyError as e:
        raise CheckpointError(f"{str(folder)!r} lacks the weight {e.args[0]}") from None
    model = Transformer(config)
    model.load_state_dict(state)
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"{str(folder)!r} has no tokenizer.json (a fast tokenizer is needed)")
    return model.to(device).eval(), Tokenizer.from_file(str(folder / "tokenizer.json"))


def _native_state(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Llama's separate projections fused back into ours: rows [q | k | v] and [gate | up]."""
    state = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    for i in range(config.n_layer):
        p = f"model.layers.{i}."
        state[f"blocks.{i}.attn.qkv.weight"] = torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        state[f"blocks.{i}.attn.out.weight"] = hf[p + "self_attn.o_proj.weight"]
        gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
        state[f"blocks.{i}.mlp.gate_up.weight"] = torch.cat((gate, up))
        state[f"blocks.{i}.mlp.down.weight"] = hf[p + "mlp.down_proj.weight"]
        state[f"blocks.{i}.attn_norm.weight"] = hf[p + "input_layernorm.weight"]
        state[f"blocks.{i}.mlp_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
    state["head.weight"] = hf["model.embed_tokens.weight"] if config.tie_embeddings else hf["lm_head.weight"]
    return {k: v.float() for k, v in state.items()}
