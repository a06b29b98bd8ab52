"""Hugging Face `transformers` folders <-> native models.

Softmax MHA/GQA/MQA models are Llama (`LlamaForCausalLM`, `num_key_value_heads`); uniform
sliding-window models are Mistral (`sliding_window`). The layouts already agree where it
matters: RoPE uses the rotate-half pairing (i, i + hs/2) in both, and Mistral's window
(q - W < k <= q) is ours. What differs is only packaging: our fused QKV and gate/up
projections are split into Llama's separate ones on export and fused again on import
(lm.weights holds that map).

Shapes: nh query heads, nkv K/V heads, hs head size, C d_model, F d_ff.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lm.attention import SlidingSpec, SoftmaxSpec
from lm.config import ModelConfig
from lm.errors import CheckpointError, ConfigError
from lm.model import Transformer
from lm.tokenizer import EOT
from lm.weights import from_hf_state_dict, to_hf_state_dict

# Our config field -> transformers' (Llama and Mistral share these names); read both ways.
CONFIG_KEYS = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "d_ff": "intermediate_size",
    "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
    "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
}


def hf_architecture(config: ModelConfig) -> tuple[str, int | None]:
    """('llama', None), ('mistral', window), or a ConfigError naming what transformers lacks."""
    specs = set(config.attention)
    if specs == {SoftmaxSpec()}:
        return "llama", None
    spec = specs.pop() if len(specs) == 1 else None
    if isinstance(spec, SlidingSpec) and spec == SlidingSpec(window=spec.window):
        return "mistral", spec.window  # undilated, no sinks: exactly Mistral's window
    raise ConfigError(f"attention {config.describe_attention()} has no transformers equivalent; export takes "
                      "softmax (Llama) and one undilated sliding window in every layer (Mistral)")


def hf_config(config: ModelConfig, **extra):
    """The transformers LlamaConfig or MistralConfig of a model of this config."""
    import transformers

    arch, window = hf_architecture(config)
    values = {theirs: getattr(config, ours) for ours, theirs in CONFIG_KEYS.items()}
    values.update(head_dim=config.head_dim, hidden_act="silu", attention_bias=False, **extra)
    if arch == "llama":
        hf = transformers.LlamaConfig(mlp_bias=False, **values)
        hf.architectures = ["LlamaForCausalLM"]
    else:
        hf = transformers.MistralConfig(sliding_window=window, **values)
        hf.architectures = ["MistralForCausalLM"]
    return hf


def export_hf(model: Transformer, tokenizer: Tokenizer, out: str | Path) -> Path:
    """Write a folder `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load offline."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("export to Hugging Face needs transformers: pip install -e .[hf]") from None
    from safetensors.torch import save_file

    c = model.config
    eot = tokenizer.token_to_id(EOT)
    config = hf_config(c, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, torch_dtype="float32")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    transformers.GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                                  max_length=c.max_seq_len).save_pretrained(out)
    save_file(to_hf_state_dict(model.state_dict(), c), str(out / "model.safetensors"), metadata={"format": "pt"})
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
    required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings", "rms_norm_eps"]
    missing = [key for key in required if values.get(key) is None]
    if missing:
        raise CheckpointError(f"{str(folder)!r}: config.json lacks {', '.join(missing)}")
    if values.get("head_dim") not in (None, values["hidden_size"] // values["num_attention_heads"]):
        raise CheckpointError(f"{str(folder)!r} has head_dim={values['head_dim']} != hidden_size / heads")
    fields = {ours: values[theirs] for ours, theirs in CONFIG_KEYS.items() if values.get(theirs) is not None}
    fields["rope_theta"] = float(rope.get("rope_theta", values.get("rope_theta", 10000.0)))
    fields["tie_embeddings"] = bool(values.get("tie_word_embeddings", False))
    window = values.get("sliding_window") if kind == "mistral" else None
    return ModelConfig(**fields, attention=SlidingSpec(window=window) if window else SoftmaxSpec())


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
        state = from_hf_state_dict(hf, config)
    except KeyError as e:
        raise CheckpointError(f"{str(folder)!r} lacks the weight {e.args[0]}") from None
    model = Transformer(config)
    model.load_state_dict(state)
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"{str(folder)!r} has no tokenizer.json (a fast tokenizer is needed)")
    return model.to(device).eval(), Tokenizer.from_file(str(folder / "tokenizer.json"))
