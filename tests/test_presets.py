"""The open models' attention stacks as one-line configs (conf/attn/qwen3_next.yaml, kimi_linear,
gemma3, gpt_oss, olmo3, nanochat), and every conf/attn YAML at the default model's size: composed
as training composes it, each decodes with its caches exactly as it recomputes (float64); each
preset lays its layers out as its source's config does at the source's own depth; export refuses
each, naming the transformers class nearest to it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, compose_config

import lm
from lm import ConfigError, Transformer, generate
from lm.data.tokenizer import train_tokenizer
from lm.formats.hf import export_hf
from lm.model.generation_cache import GenerationCache
from lm.training.settings import model_config_of

ROOT = Path(__file__).resolve().parents[1]
ATTN_CONFIGS = sorted(p.stem for p in (ROOT / "conf" / "attn").glob("*.yaml"))
PRESETS = ["qwen3_next", "kimi_linear", "gemma3", "gpt_oss", "olmo3", "nanochat"]
VOCAB = 97
GLOBAL_KINDS = {"softmax", "mla"}  # every other kind here is local: a window or a recurrent state


def model_config(name: str, *overrides: str):
    """The model `python scripts/train.py model=tiny attn=<name> [overrides]` builds."""
    return model_config_of(compose_config("train", ["model=tiny", f"attn={name}", *overrides]), VOCAB)


def tiny_model(name: str) -> Transformer:
    """tiny's 4 layers, 6 heads and 256 positions (which the presets' windows are scaled to), at a
    width of 48 (head size 8) so that float64 stays quick."""
    torch.manual_seed(0)
    return Transformer(model_config(name, "model.d_model=48", "model.d_ff=96")).double().eval()


def test_the_presets_are_conf_attn_configs():
    assert set(PRESETS) <= set(ATTN_CONFIGS)


@pytest.mark.parametrize("name", ATTN_CONFIGS)
def test_every_attn_config_decodes_with_its_caches_as_it_recomputes(name):
    """At tiny's depth, heads and context in float64: a prompt prefilled in uneven
    chunks then fed token by token past 128 positions (olmo3's window; the others' rings wrap many
    times) gives every position's logits as one forward does; greedy generation of two prompts of
    different lengths through the fixed-shape decoding step equals recomputing the prefix."""
    model = tiny_model(name)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, 140), generator=g)
    with torch.no_grad():
        full = model(idx)  # (2, 140, V)
        cache = GenerationCache(model, pad=torch.zeros(2, dtype=torch.long), max_len=140)
        pieces = [model(idx[:, a:b], cache=cache) for a, b in ((0, 57), (57, 58), (58, 131))]
        pieces += [model(idx[:, t:t + 1], cache=cache) for t in range(131, 140)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)  # float64's tolerances: equal to rounding
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (121, 9)]
    cached = generate(model, prompts, 12)
    assert cached == generate(model, prompts, 12, use_cache=False)
    assert [len(row) for row in cached] == [133, 21]


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_quantizes_to_int8_and_decodes_as_its_rounded_float_twin(name):
    """Every preset at its own settings (its mixes of kinds, gates, sinks, latents) takes int8 weights:
    its cached decoding gives the logits of the float model whose weights are the int8-rounded ones
    (test_generation.rounded_twin), to float32's rounding. Every kind alone: test_generation."""
    from test_generation import rounded_twin

    model = tiny_model(name).float()
    quantized = lm.quantize_int8(model, "dequant")
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = rounded_twin(model)(idx)  # (2, 16, V)
        cache = GenerationCache(quantized, pad=torch.zeros(2, dtype=torch.long), max_len=16)
        pieces = [quantized(idx[:, :9], cache=cache)] + [quantized(idx[:, t:t + 1], cache=cache) for t in range(9, 16)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, atol=1e-4, rtol=1e-4)


def test_each_preset_at_the_tiny_models_four_layers():
    kinds = {name: [spec.kind for spec in model_config(name).attention] for name in PRESETS}
    assert kinds == {
        "qwen3_next": ["gated_delta"] * 3 + ["softmax"],
        "kimi_linear": ["kda"] * 3 + ["mla"],
        "gemma3": ["sliding"] * 3 + ["softmax"],
        "gpt_oss": ["sliding", "softmax"] * 2,
        "olmo3": ["sliding"] * 3 + ["softmax"],
        "nanochat": ["sliding"] * 3 + ["softmax"],
    }
    qwen = model_config("qwen3_next").attention[3]
    assert (qwen.gate, qwen.qk_norm) == ("elementwise", True)  # the gated softmax layer
    assert model_config("kimi_linear").attention[3].rope is False  # NoPE MLA
    assert {s.learned_sink for s in model_config("gpt_oss").attention} == {True}  # sinks on both kinds
    windows = {name: {s.window for s in model_config(name).attention if s.kind == "sliding"}
               for name in ("gemma3", "gpt_oss", "olmo3", "nanochat")}
    assert windows == {"gemma3": {8}, "gpt_oss": {8}, "olmo3": {128}, "nanochat": {64}}
    for name in ("gemma3", "olmo3", "nanochat"):
        assert {s.qk_norm for s in model_config(name).attention} == {True}


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_builds_at_every_depth_with_local_and_global_layers(name):
    """From two layers up, stacks shorter than their pattern included (the comparison's 2-layer
    models): the first layer local, one layer global at least, and the last one global but in
    gpt-oss, which alternates from a sliding layer at any depth, as its config does."""
    cfg = compose_config("train", ["model=tiny", f"attn={name}"])
    for n_layer in range(2, 10):
        cfg.model.n_layer = n_layer  # as model.n_layer=<n> on the command line sets it, without composing again
        kinds = [spec.kind for spec in model_config_of(cfg, VOCAB).attention]
        assert len(kinds) == n_layer and kinds[0] not in GLOBAL_KINDS
        if name == "gpt_oss":
            assert kinds == (["sliding", "softmax"] * n_layer)[:n_layer]
        else:
            assert kinds[-1] in GLOBAL_KINDS


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_trains_and_its_checkpoint_decodes_as_it_recomputes(name, train_config):
    """The whole path at the test models' 2 layers: compose, train, save, load, generate."""
    from lm.training.run import train

    result = train(train_config(f"attn={name}", "trainer.max_steps=2", "trainer.val_every_n_steps=2"))
    assert result["steps"] == 2 and result["val_loss"] < 6.5  # ln 512 = 6.24 at initialisation
    model, _ = lm.load(result["last"])
    assert model.config.attention == model_config_of(compose_config("train", [f"attn={name}", *TINY_MODEL]),
                                                       VOCAB).attention
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4]]
    assert generate(model, prompts, 20) == generate(model, prompts, 20, use_cache=False)


def source_globals(name: str) -> tuple[int, set[int]]:
    """(the source model's depth, its global layers counted from 1), from its own config: transformers'
    config classes where their rule is the released model's, else the released config's list."""
    import transformers

    def full(layer_types):
        return {i + 1 for i, t in enumerate(layer_types) if t == "full_attention"}

    if name == "qwen3_next":  # Qwen3-Next-80B-A3B: 48 layers, full_attention_interval 4
        return 48, full(transformers.Qwen3NextConfig(num_hidden_layers=48).layer_types)
    if name == "gemma3":  # Gemma 3 4B: 34 layers, sliding_window_pattern 6
        return 34, full(transformers.Gemma3TextConfig(num_hidden_layers=34).layer_types)
    if name == "gpt_oss":  # gpt-oss-20b: 24 layers alternating
        return 24, full(transformers.GptOssConfig(num_hidden_layers=24).layer_types)
    if name == "olmo3":  # Olmo-3-1025-7B: 32 layers; OLMo-core forces the last layer full, here already so
        return 32, full(transformers.Olmo3Config(num_hidden_layers=32).layer_types)
    if name == "kimi_linear":  # Kimi-Linear-48B-A3B config.json, linear_attn_config.full_attn_layers
        return 27, {4, 8, 12, 16, 20, 24, 27}
    if name == "nanochat":  # gpt.py's _compute_window_sizes for d20: "SSSL" tiled, the final layer L
        return 20, {i + 1 for i in range(20) if "SSSL"[i % 4] == "L"} | {20}
    raise KeyError(name)


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_at_its_sources_depth_has_its_sources_global_layers(name):
    depth, theirs = source_globals(name)
    ours = {i + 1 for i, spec in enumerate(model_config(name, f"model.n_layer={depth}").attention)
            if spec.kind in GLOBAL_KINDS}
    if name == "gemma3":  # the one departure: its last layer is global too, so 4 layers keep one
        assert ours - theirs == {depth} and depth not in theirs
        theirs = theirs | {depth}
    assert ours == theirs


@pytest.mark.parametrize("name, architecture, layer_types", [
    ("qwen3_next", "Qwen3NextForCausalLM", ["linear_attention"] * 3 + ["full_attention"]),
    ("kimi_linear", "KimiLinearForCausalLM", ["linear_attention"] * 3 + ["full_attention"]),
])
def test_the_open_model_presets_export_to_their_transformers_class_with_its_logits(name, architecture, layer_types,
                                                                                    tmp_path):
    """attn=qwen3_next and attn=kimi_linear at model.norm_eps=1e-6: transformers' Qwen3NextForCausalLM and
    KimiLinearForCausalLM compute what they do, their mixtures of experts off (and RoPE over whole heads
    in Qwen3-Next; queries projected in full in Kimi Linear)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = compose_config("train", ["model=tiny", f"attn={name}", "model.norm_eps=1e-6", "model.d_model=48"])
    tokenizer = train_tokenizer(iter(["def f(x): return x + 1\n" * 20]), 300)
    model = Transformer(model_config_of(cfg, tokenizer.get_vocab_size())).eval()
    export_hf(model, tokenizer, tmp_path / "out")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == architecture
    assert theirs.config.layer_types == layer_types
    vocab = tokenizer.get_vocab_size()
    idx = torch.randint(0, vocab, (2, 80), generator=torch.Generator().manual_seed(1))  # past the recurrent chunk
    with torch.no_grad():
        assert (model(idx) - theirs(input_ids=idx).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("name, nearest", [
    ("gpt_oss", "the nearest class, gpt-oss (GptOssForCausalLM) has learned sinks, but only with mixture-of-experts"),
    ("gemma3", "the nearest class, Gemma 3 (Gemma3ForCausalLM) and OLMo 3 (Olmo3ForCausalLM) mix sliding and global"),
    ("olmo3", "the nearest class, Gemma 3 (Gemma3ForCausalLM) and OLMo 3 (Olmo3ForCausalLM) mix sliding and global"),
    ("nanochat", "the nearest class, Gemma 3 (Gemma3ForCausalLM) and OLMo 3 (Olmo3ForCausalLM) mix sliding and"),
])
def test_export_refuses_each_preset_naming_the_nearest_transformers_class(name, nearest, tmp_path):
    model = Transformer(model_config(name))
    tokenizer = train_tokenizer(iter(["def f(x): return x + 1\n" * 20]), 300)
    with pytest.raises(ConfigError) as refused:
        export_hf(model, tokenizer, tmp_path / "out")
    said = str(refused.value)
    assert said.startswith(f"attention {model.config.describe_attention()} has no transformers equivalent: ")
    assert nearest in said and "\n" not in said
    assert not (tmp_path / "out").exists()
