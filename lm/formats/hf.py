"""Hugging Face `transformers` folders <-> native models.

Softmax MHA/GQA/MQA models are Llama (`LlamaForCausalLM`, `num_key_value_heads`); with QK-norm
in every layer they are Qwen3 (its q_norm and k_norm are ours: RMSNorm over the head dimension
before RoPE, with the model's epsilon); uniform sliding-window models are Mistral
(`sliding_window`). The layouts already agree where it matters: RoPE uses the rotate-half
pairing (i, i + hs/2) in all three, and Mistral's window (q - W < k <= q) is ours. What differs
is only packaging: our fused QKV and gate/up projections are split into Llama's separate ones on
export and fused again on import (lm.formats.weights holds that map).

Shapes: nh query heads, nkv K/V heads, hs head size, C d_model, F d_ff.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from lm.attention import SlidingSpec, SoftmaxSpec
from lm.data.tokenizer import EOT
from lm.formats import kimi_linear, qwen3_next
from lm.formats.checked import (
    build_checked,
    check_size_against_weights,
    read_json_object,
    read_safetensors,
    read_tokenizer,
)
from lm.formats.weights import from_hf_state_dict, to_hf_state_dict
from lm.model.config import ModelConfig
from lm.model.transformer import Transformer
from lm.util.checks import is_count
from lm.util.errors import CheckpointError, ConfigError, one_line
from lm.util.files import write_folder_atomically

# Our config field -> transformers' (Llama and Mistral share these names); read both ways.
CONFIG_KEYS = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "d_ff": "intermediate_size",
    "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
    "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
}


# What export takes, for its refusals.
EXPORTABLE = ("softmax (Llama; with qk_norm, Qwen3), one undilated sliding window in every layer (Mistral), Gated "
              "DeltaNet beside softmax with qk_norm and gate=elementwise (Qwen3-Next), and KDA beside NoPE MLA "
              "(Kimi Linear)")

# Options of ours that change what a layer computes, and why no transformers architecture takes
# them: naming the option is the whole refusal.
UNEXPORTABLE = {
    "gate": "Qwen3-Next, the transformers architecture with gated attention, gates every channel "
            "(gate=elementwise) and norms q and k (qk_norm=true)",
    "softcap": "Gemma 2, the transformers architecture that caps attention logits, also norms after each "
               "sublayer, scales the embeddings and caps the final logits, so it computes another model",
}


# The open models' stacks (conf/attn/qwen3_next.yaml, kimi_linear, gpt_oss, gemma3, olmo3, nanochat):
# transformers has a class for each model, but each class computes more than the stack alone, so an
# export would change the model. A refusal names the nearest class and what it adds.
NEAREST = {
    "kda": "Kimi Linear (KimiLinearForCausalLM) takes KDA layers beside MLA layers with rope=false and "
           "latent_norm=true (attn=kimi_linear), and no other kind",
    "gated_delta": "Qwen3-Next (Qwen3NextForCausalLM) takes Gated DeltaNet layers beside softmax layers with "
                   "qk_norm and gate=elementwise (attn=qwen3_next), and no other kind",
    "learned_sink": "gpt-oss (GptOssForCausalLM) has learned sinks, but only with mixture-of-experts blocks and "
                    "biased projections",
    "sliding+softmax": "Gemma 3 (Gemma3ForCausalLM) and OLMo 3 (Olmo3ForCausalLM) mix sliding and global layers, "
                       "but both also norm after each sublayer; Gemma 3 scales the embeddings and gives its local "
                       "layers another RoPE base, OLMo 3 normalises q and k across all heads together",
}


def nearest_class(specs: set) -> str | None:
    """What the transformers class nearest to this stack adds (NEAREST), or None when no open
    model's stack is near it."""
    kinds = {spec.kind for spec in specs}
    for kind in ("kda", "gated_delta"):
        if kind in kinds:
            return NEAREST[kind]
    if any(spec.options().get("learned_sink") for spec in specs):  # softmax's and sliding's option
        return NEAREST["learned_sink"]
    if {"sliding", "softmax"} <= kinds:
        return NEAREST["sliding+softmax"]
    return None


def hf_architecture(config: ModelConfig) -> tuple[str, int | None]:
    """('llama', None), ('qwen3', None), ('mistral', window), ('qwen3_next', None), ('kimi_linear', None),
    or a ConfigError naming what transformers lacks."""
    if config.short_conv:
        raise ConfigError(f"model.short_conv={config.short_conv} cannot be exported to transformers: no Llama-family "
                          "architecture convolves the input of its attention layers")
    if config.mlp != "swiglu":
        raise ConfigError(f"model.mlp={config.mlp} cannot be exported to transformers: the Llama family's MLP is "
                          "SwiGLU (train with model.mlp=swiglu to export)")
    if qwen3_next.layer_types(config) is not None:
        qwen3_next.check_exportable(config)
        return "qwen3_next", None
    if kimi_linear.layer_types(config) is not None:
        kimi_linear.check_exportable(config)
        return "kimi_linear", None
    specs = set(config.attention)
    near = nearest_class(specs)
    if near is not None:
        raise ConfigError(f"attention {config.describe_attention()} has no transformers equivalent: the nearest "
                          f"class, {near}; export takes {EXPORTABLE}")
    for spec in specs:
        options = spec.options()  # a kind without the option computes without it
        for option, why in UNEXPORTABLE.items():
            if options.get(option) not in (None, "none"):
                raise ConfigError(f"attn.{option}={options[option]} cannot be exported to transformers: {why}")
    if any(spec.kind == "mla" for spec in specs):
        raise ConfigError("attn=mla cannot be exported to transformers on its own: DeepSeek-V2/V3, its MLA "
                          "architectures, are not among export's targets; MLA layers with rope=false and "
                          "latent_norm=true export beside KDA layers as Kimi Linear (attn=kimi_linear)")
    if any(spec.kind == "dsa" for spec in specs):
        raise ConfigError("attn=dsa cannot be exported to transformers: DeepSeek-V3.2, its sparse attention "
                          "architecture, feeds its indexer the query latent and uses mixture-of-experts "
                          "blocks, so no architecture there computes this layer")
    if specs == {SoftmaxSpec()}:
        return "llama", None
    if specs == {SoftmaxSpec(qk_norm=True)}:
        return "qwen3", None
    spec = specs.pop() if len(specs) == 1 else None
    if isinstance(spec, SlidingSpec) and spec == SlidingSpec(window=spec.window):
        return "mistral", spec.window  # undilated, no sinks: exactly Mistral's window
    raise ConfigError(f"attention {config.describe_attention()} has no transformers equivalent; export takes "
                      f"{EXPORTABLE}")


def hf_config(config: ModelConfig, **extra):
    """The transformers LlamaConfig, Qwen3Config, MistralConfig, Qwen3NextConfig or KimiLinearConfig of a model of
    this config."""
    import transformers

    arch, window = hf_architecture(config)
    if arch == "qwen3_next":
        return qwen3_next.qwen3_next_config(config, **extra)
    if arch == "kimi_linear":
        return kimi_linear.kimi_linear_config(config, **extra)
    values = {theirs: getattr(config, ours) for ours, theirs in CONFIG_KEYS.items()}
    values.update(head_dim=config.head_dim, hidden_act="silu", attention_bias=False, **extra)
    if arch == "llama":
        hf = transformers.LlamaConfig(mlp_bias=False, **values)
        hf.architectures = ["LlamaForCausalLM"]
    elif arch == "qwen3":
        hf = transformers.Qwen3Config(use_sliding_window=False, **values)
        hf.architectures = ["Qwen3ForCausalLM"]
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
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOT, eos_token=EOT,
                                                pad_token=EOT, model_max_length=c.max_seq_len)

    def write_into(folder: Path) -> None:
        config.save_pretrained(folder)
        # No max_length: transformers warns when it meets one beside the caller's max_new_tokens, and
        # the context limit already is config.json's max_position_embeddings.
        transformers.GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot).save_pretrained(folder)
        convert = {"qwen3_next": qwen3_next.to_qwen3_next_state_dict,
                   "kimi_linear": kimi_linear.to_kimi_linear_state_dict}.get(config.model_type, to_hf_state_dict)
        state = convert(model.state_dict(), c)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        fast.save_pretrained(folder)

    return write_folder_atomically(Path(out), write_into)


def is_hf_folder(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()






def check_model_type(values: dict, folder: Path) -> str:
    kind = values.get("model_type")
    if kind not in ("llama", "mistral", "qwen3"):
        raise CheckpointError(f"{str(folder)!r} holds model_type={kind!r}; import reads llama, mistral and qwen3")
    if kind == "qwen3" and values.get("use_sliding_window"):
        raise CheckpointError(f"{str(folder)!r} is a Qwen3 with use_sliding_window=true; import reads Qwen3 "
                              "with full attention in every layer")
    return kind


def config_from_hf(values: dict, folder: Path) -> ModelConfig:
    kind = check_model_type(values, folder)
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
    for key in ("hidden_size", "num_attention_heads"):
        if not is_count(values[key]):
            raise CheckpointError(f"{str(folder)!r} has {key}={values[key]!r}; it must be a positive integer")
    if values.get("head_dim") not in (None, values["hidden_size"] // values["num_attention_heads"]):
        raise CheckpointError(f"{str(folder)!r} has head_dim={values['head_dim']} != hidden_size / heads")
    fields = {ours: values[theirs] for ours, theirs in CONFIG_KEYS.items() if values.get(theirs) is not None}
    fields["rope_theta"] = float(rope.get("rope_theta", values.get("rope_theta", 10000.0)))
    fields["tie_embeddings"] = bool(values.get("tie_word_embeddings", False))
    window = values.get("sliding_window") if kind == "mistral" else None
    attention = SlidingSpec(window=window) if window else SoftmaxSpec(qk_norm=kind == "qwen3")
    try:
        return ModelConfig(**fields, attention=attention)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{str(folder)!r} has an unusable config.json: {e}") from None


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise CheckpointError(f"{str(index)!r} has no weight_map of names to files")
        files = sorted(set(weight_map.values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for name in files:
        path = folder / name
        if not path.resolve().is_relative_to(folder.resolve()):
            raise CheckpointError(f"{str(index)!r} names {name!r}, a file outside its folder")
        if not path.is_file():
            raise CheckpointError(f"{str(folder)!r} has no {name} (only safetensors weights are read)")
        weights.update(read_safetensors(path))
    return weights


def load_hf(folder: str | Path, device: str | torch.device = "cpu",
            values: dict | None = None) -> tuple[Transformer, Tokenizer]:
    """(model in eval mode, tokenizer) from a local Llama, Mistral or Qwen3 folder (`values`: its
    config.json when the caller has read it already). The config is checked against the
    weights before anything is built from it."""

    folder = Path(folder)
    values = values or read_json_object(folder / "config.json")
    check_model_type(values, folder)
    hf = read_hf_weights(folder)
    check_size_against_weights(values, hf, f"{str(folder)!r}", layer_prefix="model.layers.",
                               embedding="model.embed_tokens.weight",
                               names=("num_hidden_layers", "vocab_size", "hidden_size"))
    config = config_from_hf(values, folder)
    try:
        state = from_hf_state_dict(hf, config)
    except KeyError as e:
        raise CheckpointError(f"{str(folder)!r} lacks the weight {e.args[0]}") from None
    except RuntimeError as e:  # a weight of the wrong size cannot be split or reshaped as the config says
        raise CheckpointError(f"{str(folder)!r} has weights that disagree with config.json "
                              f"({one_line(e)})") from None
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"{str(folder)!r} has no tokenizer.json (a fast tokenizer is needed)")
    tokenizer_text = (folder / "tokenizer.json").read_text(encoding="utf-8", errors="replace")
    tokenizer = read_tokenizer(tokenizer_text, config.vocab_size, f"{str(folder)!r}")
    return build_checked(config, state, f"{str(folder)!r}").to(device).eval(), tokenizer
