"""MHA/GQA -> MLA conversion (lm/formats/to_latent.py): the SVD step on its own at a rank that loses
nothing, the RoPE pairs the 2-norm rule keeps, and one line for what cannot convert."""

import pytest
import torch

from lm.attention import SoftmaxSpec
from lm.attention.mla import LatentSpec
from lm.attention.rope import apply_rope
from lm.formats.calibration import attention_inputs
from lm.formats.to_latent import rank_rope_pairs, split_dims, to_latent
from lm.formats.weights import split_qkv
from lm.model.config import ModelConfig
from lm.model.transformer import Transformer
from lm.util.errors import ConfigError


def parent(n_kv_head=4, attention="softmax"):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=61, n_layer=2, d_model=32, n_head=4, n_kv_head=n_kv_head, d_ff=48,
                         max_seq_len=32, attention=attention)
    return Transformer(config).double().eval()


def calibration(model):
    return attention_inputs(model, [torch.randint(0, 61, (2, 24))])


def converted(model, spec):
    state, config = to_latent(model.state_dict(), model.config, spec, calibration(model))
    child = Transformer(config).double().eval()
    child.load_state_dict(state)
    return child


@pytest.mark.parametrize("n_kv_head", [4, 2])
@pytest.mark.parametrize("q_rank", [0, 32])
def test_at_a_lossless_rank_the_latent_gives_back_the_parents_keys_values_and_queries(n_kv_head, q_rank):
    """kv_rank = min(d_model, rows) = 32 loses nothing: the non-RoPE keys and the values decompressed
    from the latent are the parent's exactly, and so are the queries (RoPE on the kept pairs only)."""
    model = parent(n_kv_head)
    child = converted(model, LatentSpec(kv_rank=32, rope_dim=4, q_rank=q_rank))
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    cos, sin = (t.double() for t in model.rope(torch.arange(9)))
    for block, twin in zip(model.blocks, child.blocks, strict=True):
        layer = twin.attn
        nope, rope = split_dims(8, tuple(layer.rope_pairs.tolist()))
        q, k, v = block.attn.heads(x, cos, sin)  # the parent's, RoPE on every pair: (B, h, T, hs)
        k_plain = block.attn.qkv(x).view(2, 9, 4 + 2 * n_kv_head, 8).transpose(1, 2)[:, 4:4 + n_kv_head]
        group = 4 // n_kv_head
        keys, values = layer.decompress(layer.latent(x, cos, sin))  # (B, nh, T, hs) each
        torch.testing.assert_close(keys[..., :4], k_plain[:, :, :, nope].repeat_interleave(group, 1), rtol=0,
                                   atol=1e-12)
        torch.testing.assert_close(values, v.repeat_interleave(group, 1), rtol=0, atol=1e-12)
        queries = layer.queries(x, cos, sin)
        q_plain = block.attn.qkv(x).view(2, 9, 4 + 2 * n_kv_head, 8).transpose(1, 2)[:, :4]
        torch.testing.assert_close(queries[..., :4], q_plain[..., nope], rtol=0, atol=1e-12)
        torch.testing.assert_close(queries[..., 4:], q[..., rope], rtol=0, atol=1e-12)  # same angles as the parent's


def test_below_a_lossless_rank_the_svd_keeps_the_best_approximation():
    """Eckart-Young: the rank-r factors reconstruct the joint K/V rows with the error of the dropped
    singular values, no more."""
    model = parent()
    child = converted(model, LatentSpec(kv_rank=10, rope_dim=4))
    layer = child.blocks[0].attn
    q, k, v = split_qkv(model.blocks[0].attn.qkv.weight, 4, 4, 8)
    nope, _ = split_dims(8, tuple(layer.rope_pairs.tolist()))
    rows = torch.cat((k.view(4, 8, 32)[:, nope], v.view(4, 8, 32)), dim=1).reshape(-1, 32)
    approx = layer.kv_up.weight @ layer.kv_down.weight[:10]
    dropped = torch.linalg.svdvals(rows)[10:]
    torch.testing.assert_close((rows - approx).norm(), dropped.norm(), rtol=1e-9, atol=0)


def test_the_two_norm_rule_keeps_the_pairs_where_queries_and_keys_are_large():
    torch.manual_seed(0)
    x = torch.randn(50, 16, dtype=torch.float64)
    q, k = torch.randn(2 * 8, 16, dtype=torch.float64) * 0.1, torch.randn(8, 16, dtype=torch.float64) * 0.1
    for rows, heads in ((q, 2), (k, 1)):  # pair 3 (dims 3 and 7) of every head made 10x larger
        view = rows.view(heads, 2, 4, 16)  # (heads, halves, F, C)
        view[:, :, 3] *= 10
    q.view(2, 2, 4, 16)[:, :, 1] *= 10  # pair 1: large queries, ordinary keys: ranks below pair 3
    assert rank_rope_pairs(q, k, x, n_head=2, n_kv_head=1, keep=1) == (3,)
    assert rank_rope_pairs(q, k, x, n_head=2, n_kv_head=1, keep=2) == (1, 3)


@pytest.mark.parametrize("spec, attention, message", [
    (LatentSpec(kv_rank=33, rope_dim=4), "softmax",
     "attn.kv_rank=33 is more than the rank the checkpoint's keys and values can have, "
     "min(d_model=32, n_head x (2 x 8 - rope_dim)) = 32"),
    (LatentSpec(kv_rank=8, rope_dim=8), "softmax", "attn.rope_dim=8 must be less than the checkpoint's head size 8"),
    (LatentSpec(kv_rank=8, rope_dim=4), SoftmaxSpec(qk_norm=True), "conversion to mla takes plain softmax layers"),
    (LatentSpec(kv_rank=8, rope_dim=4), "linear", "layer 0 is linear("),
    (LatentSpec(kv_rank=8, rope_dim=4, q_rank=40), "softmax", "attn.q_rank=40 is more than d_model=32"),
    (LatentSpec(kv_rank=8, rope_dim=4, latent_norm=True), "softmax", "attn.latent_norm=true cannot be converted into"),
])
def test_what_cannot_convert_is_one_line(spec, attention, message):
    model = parent(attention=attention)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        to_latent(model.state_dict(), model.config, spec, calibration(model))


def test_rope_on_the_kept_pairs_matches_the_parents_rotation_of_those_dimensions():
    """The MLA layer rotates its RoPE part with the chosen pairs' frequencies: the same angles the
    parent applies to those dimensions (split_dims's layout is apply_rope's)."""
    torch.manual_seed(0)
    x = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    cos, sin = (t.double() for t in Transformer(ModelConfig(vocab_size=5, n_layer=1, d_model=8, n_head=1)).rope(
        torch.arange(5)))
    _, rope = split_dims(8, (0, 2))
    whole = apply_rope(x, cos, sin)[..., rope]
    part = apply_rope(x[..., rope], cos[:, [0, 2]], sin[:, [0, 2]])
    torch.testing.assert_close(part, whole, rtol=0, atol=1e-14)


def test_an_mla_model_does_not_pool_into_gqa():
    from lm.formats.convert import to_grouped

    mla = converted(parent(), LatentSpec(kv_rank=8, rope_dim=4))
    with pytest.raises(ConfigError, match=r"layer 0 \(mla\(kv_rank=8, .*\) has no per-head K/V projections to pool"):
        to_grouped(mla.state_dict(), mla.config, 2)
