import re

import pytest
import torch

from lm import ModelConfig, Transformer
from lm.attention import LayerShape
from lm.attention.reference import causal_softmax_attention
from lm.attention.softmax import SoftmaxAttention, SoftmaxSpec
from lm.formats.weights import split_qkv
from lm.util.errors import ConfigError

SMALL = dict(vocab_size=97, n_layer=2, d_model=64, n_head=4, d_ff=96, max_seq_len=32)


def model(n_kv_head: int, **overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**SMALL, "n_kv_head": n_kv_head, **overrides})).eval()


@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_logits_shape_and_kv_projection_size(n_kv_head):
    m = model(n_kv_head)
    idx = torch.randint(0, 97, (3, 11))
    assert m(idx).shape == (3, 11, 97)
    head_dim = 64 // 4
    qkv_rows = m.blocks[0].attn.qkv.weight.shape[0]
    assert qkv_rows == (4 + 2 * n_kv_head) * head_dim  # K and V only get n_kv_head heads


def test_gqa_equals_mha_whose_kv_heads_repeat_within_groups():
    """A GQA model computes what an MHA model computes when each group's K/V heads are copies."""
    gqa = model(2)
    mha = model(4)
    state = gqa.state_dict()
    hs, nh, nkv = 16, 4, 2
    for i in range(2):
        w = state[f"blocks.{i}.attn.qkv.weight"]
        q, k, v = split_qkv(w, nh, nkv, hs)
        repeat = lambda t: t.view(nkv, hs, -1).repeat_interleave(nh // nkv, dim=0).reshape(nh * hs, -1)
        state[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q, repeat(k), repeat(v)])
    mha.load_state_dict(state)
    idx = torch.randint(0, 97, (2, 20))
    torch.testing.assert_close(mha(idx), gqa(idx), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_whole_model_equals_a_plain_reference_forward(n_kv_head):
    """The model against a from-scratch forward written with loops over heads from the same weights:
    RMSNorm, rotary angles as complex rotations, per-head masked softmax, SwiGLU, tied head."""
    m = model(n_kv_head, init_std=0.2).double()
    idx = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        # 1e-6, not 1e-10: the model takes its rotary angles in float32 even in a float64 model
        torch.testing.assert_close(m(idx), plain_forward(m, idx), atol=1e-6, rtol=1e-6)


def plain_forward(m: Transformer, idx: torch.Tensor) -> torch.Tensor:
    c = m.config
    nh, nkv, hs, T = c.n_head, c.n_kv_head, c.head_dim, idx.shape[1]

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.norm_eps) * w

    def rotate(x):  # x (T, hs): pair i with i + hs/2, rotate position t by t * theta^(-2i/hs)
        freqs = c.rope_theta ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)
        turn = torch.polar(torch.ones(T, hs // 2, dtype=torch.float64), torch.arange(T)[:, None] * freqs)
        z = torch.complex(x[:, : hs // 2], x[:, hs // 2 :]) * turn
        return torch.cat((z.real, z.imag), dim=-1)

    x = m.embed.weight[idx]  # (B, T, C)
    for block in m.blocks:
        h = rms(x, block.attn_norm.weight)
        wq, wk, wv = split_qkv(block.attn.qkv.weight, nh, nkv, hs)
        heads = []
        for b in range(idx.shape[0]):
            per_head = []
            for head in range(nh):
                kv = head // (nh // nkv)  # the K/V head this query head shares
                q = rotate(h[b] @ wq[head * hs:(head + 1) * hs].T)
                k = rotate(h[b] @ wk[kv * hs:(kv + 1) * hs].T)
                v = h[b] @ wv[kv * hs:(kv + 1) * hs].T
                scores = (q @ k.T) / hs**0.5
                scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
                per_head.append(scores.softmax(-1) @ v)
            heads.append(torch.cat(per_head, dim=-1))
        x = x + torch.stack(heads) @ block.attn.out.weight.T
        if c.mlp == "none":
            continue
        h = rms(x, block.mlp_norm.weight)
        if c.mlp == "relu2":
            hidden = torch.relu(h @ block.mlp.up.weight.T) ** 2
        else:
            gate, up = (h @ w.T for w in block.mlp.gate_up.weight.chunk(2))
            hidden = torch.nn.functional.silu(gate) * up
        x = x + hidden @ block.mlp.down.weight.T
    return rms(x, m.norm.weight) @ m.embed.weight.T


def test_relu_squared_model_equals_the_plain_reference_forward():
    m = Transformer(ModelConfig(vocab_size=97, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=48,
                                max_seq_len=32, init_std=0.2, mlp="relu2")).double()
    assert not hasattr(m.blocks[0].mlp, "gate_up")  # one matrix in, one out
    idx = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(m(idx), plain_forward(m, idx), atol=1e-6, rtol=1e-6)


def test_a_model_without_mlps_equals_the_plain_reference_forward():
    m = Transformer(ModelConfig(vocab_size=97, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=48,
                                max_seq_len=32, init_std=0.2, mlp="none")).double()
    assert not any("mlp" in name for name, _ in m.named_parameters())
    idx = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(m(idx), plain_forward(m, idx), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["softmax", "gated_delta", "mamba2"])
def test_zero_initialised_output_projections_make_every_block_the_identity(kind):
    config = ModelConfig(vocab_size=97, n_layer=2, d_model=32, n_head=4, d_ff=48, max_seq_len=32,
                         attention=kind, zero_init_out=True)
    m = Transformer(config)
    zeroed = [name for name, p in m.named_parameters() if p.dim() == 2 and not p.any()]
    assert len(zeroed) == 2 * config.n_layer, zeroed  # each block's attention output and MLP down projection
    idx = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(m(idx), m.head(m.norm(m.embed(idx))))


@pytest.mark.parametrize("field, value, message", [("mlp", "gelu", "mlp='gelu' is not one of swiglu, relu2, none"),
                                                   ("zero_init_out", 1, "zero_init_out=1 must be true or false")])
def test_bad_mlp_options_are_refused_in_one_line(field, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig(**{field: value})


@pytest.mark.parametrize("mlp", ["relu2", "none"])
def test_export_refuses_an_mlp_other_than_swiglu_by_name(mlp):
    from lm.formats.gguf import check_exportable
    from lm.formats.hf import hf_architecture

    other = model(4, mlp=mlp)
    with pytest.raises(ConfigError, match=f"model.mlp={mlp} cannot be exported to transformers"):
        hf_architecture(other.config)
    with pytest.raises(ConfigError, match=f"model.mlp={mlp} has no GGUF equivalent"):
        check_exportable(other)


@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_changing_a_future_token_leaves_earlier_logits_unchanged(n_kv_head):
    m = model(n_kv_head)
    idx = torch.randint(0, 97, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 97
    before, after = m(idx), m(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], atol=1e-6, rtol=0)
    assert (before[:, 10:] - after[:, 10:]).abs().max() > 1e-3


@pytest.mark.parametrize("n_head, n_kv_head", [(4, 4), (4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_sdpa_path_equals_naive_softmax_in_values_and_gradients(n_head, n_kv_head, T):
    attn = SoftmaxAttention(SoftmaxSpec(), LayerShape(8 * n_head, n_head, n_kv_head, 8)).double()
    torch.manual_seed(T)
    q = torch.randn(2, n_head, T, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, n_kv_head, T, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, n_kv_head, T, 8, dtype=torch.float64, requires_grad=True)
    fast = attn.attend(q, k, v)
    naive = causal_softmax_attention(q, k, v)
    torch.testing.assert_close(fast, naive, atol=1e-10, rtol=1e-10)
    grad_out = torch.randn_like(fast)
    fast_grads = torch.autograd.grad(fast, (q, k, v), grad_out)
    naive_grads = torch.autograd.grad(naive, (q, k, v), grad_out)
    for a, b in zip(fast_grads, naive_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_tied_head_shares_the_embedding_and_untied_does_not():
    tied, untied = model(4), model(4, tie_embeddings=False)
    assert tied.head.weight is tied.embed.weight
    assert untied.head.weight is not untied.embed.weight
    assert untied.num_params() - tied.num_params() == 97 * 64


def test_sequence_longer_than_the_context_is_refused():
    with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
        model(4)(torch.zeros(1, 33, dtype=torch.long))


def test_rope_matches_the_complex_rotation_it_stands_for():
    """Pairs (i, i + hs/2) rotate by position * theta^(-2i/hs), as multiplication by e^(i angle)."""
    from lm.attention.rope import RotaryEmbedding, apply_rope

    hs, T = 8, 5
    x = torch.randn(1, 1, T, hs, dtype=torch.float64)
    cos, sin = RotaryEmbedding(hs, 10000.0)(torch.arange(T))
    rotated = apply_rope(x, cos.double(), sin.double())
    inv_freq = 10000.0 ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq
    as_complex = torch.complex(x[..., : hs // 2], x[..., hs // 2 :]) * torch.polar(torch.ones_like(angles), angles)
    expected = torch.cat((as_complex.real, as_complex.imag), dim=-1)
    torch.testing.assert_close(rotated, expected)
