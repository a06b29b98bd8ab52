"""Multi-head latent attention beyond the shared tables (which run its examples through the
equivalence, causality, cache, compile and benchmark tests): the absorbed step against the
decompressed computation written out, its cache size, int8, NoPE, and one line for every bad option."""

import math

import pytest
import torch

from lm import ModelConfig, Transformer, generate, quantize_int8
from lm.attention import LayerShape
from lm.attention.mla import LatentSpec
from lm.attention.rope import RotaryEmbedding
from lm.model.generation_cache import GenerationCache
from lm.util.errors import ConfigError


def model(spec, n_head=4, d_model=32, dtype=torch.float64):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=61, n_layer=2, d_model=d_model, n_head=n_head, d_ff=48, max_seq_len=40,
                         attention=spec)
    return Transformer(config).to(dtype).eval()


def test_the_absorbed_step_equals_attention_over_decompressed_keys_and_values():
    """One decoding step in the latent space against softmax over every head's decompressed K/V,
    written out from the weights (float64)."""
    torch.manual_seed(0)
    layer = LatentSpec(kv_rank=10, rope_dim=4, q_rank=6).build(LayerShape(32, 4, 4, 8)).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    cos, sin = (t.double() for t in RotaryEmbedding(8, 10000.0)(torch.arange(9)))
    q, latent = layer.queries(x, cos, sin), layer.latent(x, cos, sin)  # (B, nh, T, hs), (B, 1, T, r + dR)
    keys, values = layer.decompress(latent)  # (B, nh, T, hs) each
    scores = q[:, :, -1:] @ keys.transpose(-1, -2) / math.sqrt(8)  # the last position over all: (B, nh, 1, T)
    expected = scores.softmax(-1) @ values  # (B, nh, 1, hs)
    context = GenerationCache(model(LatentSpec(kv_rank=10, rope_dim=4, q_rank=6)), torch.zeros(2, dtype=torch.long),
                              max_len=16)
    cache = layer.build_cache(context, 16)
    cache.attend(q[:, :, :8], latent[:, :, :8])
    context.advance(8)
    got = cache.decode(q[:, :, 8:], latent[:, :, 8:], context.lengths.clone())  # its own inputs, each row at slot 8
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n_head, d_model", [(4, 32), (8, 64)])
def test_the_cache_holds_the_latent_and_the_rope_key_whatever_the_heads(n_head, d_model):
    m = model(LatentSpec(kv_rank=12, rope_dim=4), n_head=n_head, d_model=d_model, dtype=torch.float32)
    context = GenerationCache(m, torch.zeros(3, dtype=torch.long), max_len=20)
    assert context.nbytes() == 2 * 3 * 20 * (12 + 4) * 4  # layers x batch x positions x (r + dR) x fp32
    assert context.nbytes() == 4 * sum(b.attn.generation_state().numel(20, 3) for b in m.blocks)


def test_int8_weights_decode_through_the_absorbed_cache():
    """Absorbing multiplies by kv_up's matrix itself: the int8 model dequantizes it, and its cached
    tokens equal its own recomputed ones."""
    m = quantize_int8(model(LatentSpec(kv_rank=12, rope_dim=4), dtype=torch.float32))
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    assert generate(m, prompts, 10) == generate(m, prompts, 10, use_cache=False)


@pytest.mark.parametrize("options, shape, message", [
    ({"rope_dim": 3}, (32, 4, 8), "rope_dim=3 must be even: RoPE rotates pairs of dimensions"),
    ({"rope_dim": 0}, (32, 4, 8), "rope_dim=0 must be an integer >= 2"),
    ({"kv_rank": 0}, (32, 4, 8), "kv_rank=0 must be an integer >= 1"),
    ({"q_rank": -1}, (32, 4, 8), "q_rank=-1 must be an integer >= 0"),
    ({"rope_dim": 8, "kv_rank": 4}, (32, 4, 8), "rope_dim=8 must be less than the head size 8"),
    ({"rope_dim": 4, "kv_rank": 49}, (32, 4, 8), "kv_rank=49 is more than the 48 numbers it decompresses into"),
    ({"rope_dim": 4, "rope_pairs": [1]}, (32, 4, 8), "rope_pairs=[1] must be rope_dim/2 = 2 distinct pairs"),
    ({"rope_dim": 4, "rope_pairs": [1, 1]}, (32, 4, 8), "rope_pairs=[1, 1] must be rope_dim/2 = 2 distinct pairs"),
    ({"rope_dim": 4, "rope_pairs": [0, 4], "kv_rank": 8}, (32, 4, 8), "rope_pairs=[0, 4] names a pair past the "
                                                                       "head's 4 frequency pairs"),
    ({"rope_dim": 4, "rope_pairs": "01"}, (32, 4, 8), "rope_pairs='01' must be a list of frequency pair indices"),
    ({"rope": "no"}, (32, 4, 8), "rope='no' must be true or false"),
    ({"rope": False, "rope_pairs": [0, 2]}, (32, 4, 8), "rope_pairs=[0, 2] with rope=false: NoPE rotates nothing"),
])
def test_a_bad_option_is_one_line(options, shape, message):
    d_model, n_head, head_dim = shape
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as raised:
        LatentSpec(**options).build(LayerShape(d_model, n_head, n_head, head_dim))
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("d_model, n_head, expected", [(384, 6, (96, 16)), (288, 6, (72, 12)), (32, 4, (12, 2)),
                                                       (32, 2, (24, 4))])
def test_sizes_left_unset_follow_the_head_size_and_are_stored_explicitly(d_model, n_head, expected):
    """kv_rank 3 hs/2 and rope_dim hs/4 (even, at least 2): every head size from the toy study's 8
    up builds, and the model config (what a checkpoint stores) names the sizes it got."""
    config = ModelConfig(vocab_size=61, n_layer=2, d_model=d_model, n_head=n_head, d_ff=48, max_seq_len=40,
                         attention="mla")
    assert {(spec.kv_rank, spec.rope_dim) for spec in config.attention} == {expected}
    assert config.to_dict()["attention"][0]["kv_rank"] == expected[0]
    layer = Transformer(config).blocks[0].attn
    assert layer.kv_down.out_features == sum(expected)  # the cached [c | k_rope] row
    # Given sizes are kept; rope_pairs alone sets rope_dim.
    assert LatentSpec(kv_rank=5).at(64) == LatentSpec(kv_rank=5, rope_dim=16)
    assert LatentSpec(rope_pairs=[0, 3]).at(64).rope_dim == 4


@pytest.mark.parametrize("rope", [True, False])
def test_nope_rotates_neither_the_queries_nor_the_shared_key(rope):
    """With rope=false (Kimi Linear's MLA) the layer ignores the angles it is given: its output at
    shuffled positions' angles is the same; with RoPE the same swap changes it, so the check can fail."""
    torch.manual_seed(0)
    layer = LatentSpec(kv_rank=10, rope_dim=4, rope=rope).build(LayerShape(32, 4, 4, 8)).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    angles = RotaryEmbedding(8, 10000.0)
    cos, sin = (t.double() for t in angles(torch.arange(9)))
    other_cos, other_sin = (t.double() for t in angles(torch.randperm(9) * 7))
    outputs = [f(x, c, s) for f in (layer, layer.naive_forward) for c, s in ((cos, sin), (other_cos, other_sin))]
    torch.testing.assert_close(outputs[0], outputs[2], rtol=0, atol=1e-12)  # the fast path is its naive twin
    same = [torch.allclose(outputs[i], outputs[i + 1], rtol=0, atol=1e-12) for i in (0, 2)]
    assert same == [not rope, not rope]
    # The shared key part is still there, unrotated: the cache row keeps r + dR numbers.
    assert layer.generation_state().head_dim == 14


def test_an_mla_model_stored_before_the_rope_option_loads_rotating():
    """A checkpoint's stored layers from before NoPE have no `rope`: they load as they computed then."""
    config = ModelConfig(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_ff=48, max_seq_len=40,
                         attention=LatentSpec(kv_rank=12, rope_dim=4))
    stored = config.to_dict()
    for layer in stored["attention"]:
        assert layer.pop("rope") is True
    assert ModelConfig.from_dict(stored) == config
