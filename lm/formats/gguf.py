"""GGUF export for llama.cpp (and Ollama, LM Studio, transformers' GGUF loader), through the `gguf`
package that llama.cpp maintains: its writer, its tensor-name table and its quantizers.

Softmax models (MHA, GQA, MQA) are the `llama` architecture. The weights go through the same
transformers layout as the Hugging Face export (lm.formats.weights), then get GGUF's names from gguf's
own table, with one change of layout: llama.cpp's llama rotates adjacent pairs (2i, 2i+1) where we
(and transformers) rotate (i, i + hs/2), so each Q and K head's rows are interleaved, as llama.cpp's
own converter does; loaders undo it. Our byte-level BPE tokenizer is GGUF's `gpt2` model with the
GPT-2 pre-tokenizer, `<|endoftext|>` a control token used as BOS, EOS and padding, no BOS added.

Shapes: nh query heads, nkv K/V heads, hs head size, C d_model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from lm.attention import SoftmaxSpec
from lm.data.tokenizer import EOT
from lm.formats.weights import to_hf_state_dict
from lm.model.transformer import Transformer
from lm.util.errors import ConfigError
from lm.util.files import write_atomically

TYPES = ("f32", "f16", "q8_0")


def interleave_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Q or K rows (n_heads*hs, C), each head [first half | second half] -> pairs side by side."""
    rows, C = weight.shape
    hs = rows // n_heads
    return weight.view(n_heads, 2, hs // 2, C).transpose(1, 2).reshape(rows, C)  # (nh, hs/2, 2, C) flattened


def check_exportable(model: Transformer) -> None:
    if model.config.short_conv:
        raise ConfigError(f"model.short_conv={model.config.short_conv} has no GGUF equivalent: llama.cpp's llama "
                          "architecture does not convolve the input of its attention layers")
    if model.config.mlp != "swiglu":
        raise ConfigError(f"model.mlp={model.config.mlp} has no GGUF equivalent: llama.cpp's llama architecture's "
                          "MLP is SwiGLU (train with model.mlp=swiglu to export)")
    kinds = set(model.config.attention)
    if kinds == {SoftmaxSpec(qk_norm=True)}:
        raise ConfigError("attn.qk_norm=True has no GGUF equivalent here: the llama architecture does not normalise "
                          "queries and keys (train with model.qk_norm=null to export; format=hf exports it as Qwen3)")
    if kinds != {SoftmaxSpec()}:
        raise ConfigError(f"attention {model.config.describe_attention()} has no GGUF equivalent that llama.cpp runs "
                          "exactly; GGUF export takes softmax MHA/GQA/MQA models (the llama architecture)")


def export_gguf(model: Transformer, tokenizer: Tokenizer, out: str | Path, dtype: str = "f32") -> Path:
    """Write a single .gguf file: weights as `dtype` (f32, f16 or q8_0; 1-D tensors stay f32)."""
    try:
        import gguf
    except ImportError:
        raise ConfigError("GGUF export needs the gguf package: pip install -e .[gguf]") from None
    if dtype not in TYPES:
        raise ConfigError(f"gguf_type={dtype!r} is not one of {list(TYPES)}")
    check_exportable(model)
    c = model.config
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]

    def write(path: Path) -> None:
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_name("lm")
        writer.add_context_length(c.max_seq_len)
        writer.add_embedding_length(c.d_model)
        writer.add_block_count(c.n_layer)
        writer.add_feed_forward_length(c.d_ff)
        writer.add_head_count(c.n_head)
        writer.add_head_count_kv(c.n_kv_head)
        writer.add_rope_dimension_count(c.head_dim)
        writer.add_rope_freq_base(c.rope_theta)
        writer.add_layer_norm_rms_eps(c.norm_eps)
        writer.add_vocab_size(c.vocab_size)
        writer.add_file_type(file_type)
        add_tokenizer(writer, tokenizer, c.vocab_size)
        for name, tensor in gguf_tensors(model, gguf):
            add_tensor(writer, gguf, name, tensor, dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    out = Path(out)
    return write_atomically(out, write)


def gguf_tensors(model: Transformer, gguf) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) of every weight, Q and K rows interleaved for llama.cpp's RoPE."""
    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.n_layer)
    tensors = []
    for hf_name, weight in to_hf_state_dict(model.state_dict(), c).items():
        if hf_name.endswith("q_proj.weight"):
            weight = interleave_rope_rows(weight, c.n_head)
        elif hf_name.endswith("k_proj.weight"):
            weight = interleave_rope_rows(weight, c.n_kv_head)
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        if name is None:
            raise ConfigError(f"gguf has no llama tensor name for {hf_name}")
        tensors.append((name, weight.float().numpy()))
    return tensors


def add_tensor(writer, gguf, name: str, array: np.ndarray, dtype: str) -> None:
    if array.ndim == 1 or dtype == "f32":  # norms stay f32, as llama.cpp's converter keeps them
        writer.add_tensor(name, array.astype(np.float32))
    elif dtype == "f16" or array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]:
        # Q8_0 works on blocks of 32 along a row; rows of another length stay f16, as in llama.cpp's converter
        writer.add_tensor(name, array.astype(np.float16))
    else:
        quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)


def add_tokenizer(writer, tokenizer: Tokenizer, vocab_size: int) -> None:
    import gguf

    spec = json.loads(tokenizer.to_str())
    if spec["model"]["type"] != "BPE" or spec.get("pre_tokenizer", {}).get("type") != "ByteLevel":
        raise ConfigError("GGUF export writes byte-level BPE tokenizers (lm's own); this one is "
                          f"{spec['model']['type']} / {spec.get('pre_tokenizer', {}).get('type')}")
    tokens = [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]
    # A model may have more embedding rows than tokens; llama.cpp wants one entry per row.
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    eot = tokenizer.token_to_id(EOT)
    types = [gguf.TokenType.CONTROL if i == eot else gguf.TokenType.NORMAL for i in range(len(tokens))]
    types[tokenizer.get_vocab_size():] = [gguf.TokenType.UNUSED] * (vocab_size - tokenizer.get_vocab_size())
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eot)
    writer.add_eos_token_id(eot)
    writer.add_pad_token_id(eot)
    writer.add_add_bos_token(False)
