"""DeepSeek Sparse Attention beyond the shared tables (which run its examples through the naive twin,
causality, the caches, host reads, compile, checkpoints and the benchmark rows): dense MLA when top_k
covers the sequence, the selection and output against flash-linear-attention's naive DSA (fla-core, a
test dependency), the indexer's KL by its definition and where its gradient goes, the training loss
that adds it, the decoding step's fixed k rows, and one line for every bad option."""

from __future__ import annotations

import math
import re

import pytest
import torch
from test_attention import assert_same_values_and_grads
from test_gated_delta import fla_naive

from lm import ModelConfig, Transformer
from lm.attention import LayerShape
from lm.attention.dsa import SparseLatentSpec, index_scores, top_k_mask, top_k_slots
from lm.attention.mla import LatentSpec
from lm.attention.rope import RotaryEmbedding
from lm.model.generation_cache import GenerationCache
from lm.training.module import LitLM, OptimConfig
from lm.util.errors import ConfigError

SHAPE = LayerShape(d_model=32, n_head=4, n_kv_head=4, head_dim=8)


def layer_and_input(spec, T, dtype=torch.float64, seed=0, B=2):
    """The layer with every parameter away from its initial value, and x (B, T, C), cos, sin."""
    torch.manual_seed(seed)
    layer = spec.build(SHAPE).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(B, T, SHAPE.d_model, dtype=dtype, requires_grad=True)
    cos, sin = (t.to(dtype) for t in RotaryEmbedding(SHAPE.head_dim, 10000.0)(torch.arange(T)))
    return layer, x, cos, sin


@pytest.mark.parametrize("T, top_k", [(9, 9), (9, 50), (20, 20)])
@pytest.mark.parametrize("q_rank", [0, 6])
def test_top_k_covering_the_sequence_is_dense_mla(T, top_k, q_rank):
    """The layer against an MLA layer holding the same weights, in float64: outputs, and gradients
    to the input and to every MLA weight; the indexer gets no gradient from the output."""
    spec = SparseLatentSpec(kv_rank=10, rope_dim=4, q_rank=q_rank, top_k=top_k, index_heads=3)
    dsa, x, cos, sin = layer_and_input(spec, T)
    mla = LatentSpec(kv_rank=10, rope_dim=4, q_rank=q_rank).build(SHAPE).double()
    missing, unexpected = mla.load_state_dict(dsa.state_dict(), strict=False)
    assert not missing and all(k.startswith("indexer.") for k in unexpected)
    names = [name for name, _ in mla.named_parameters()]
    out, expected = dsa(x, cos, sin), mla(x, cos, sin)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    grad_out = torch.randn_like(out)
    ours = torch.autograd.grad(out, [x, *(dsa.get_parameter(n) for n in names)], grad_out, retain_graph=True)
    theirs = torch.autograd.grad(expected, [x, *(mla.get_parameter(n) for n in names)], grad_out)
    for name, a, b in zip(["x", *names], ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=name)
    indexer_grads = torch.autograd.grad(out.sum(), list(dsa.indexer.parameters()), allow_unused=True,
                                        materialize_grads=True)
    assert all(g.abs().max() == 0 for g in indexer_grads)


def test_the_masked_path_over_every_earlier_position_is_mla_attention():
    """The sparse path's SDPA under a selection mask, given every earlier position, against MLA's
    causal SDPA: values and gradients (the path short sequences skip is the one long ones take)."""
    layer, x, cos, sin = layer_and_input(SparseLatentSpec(kv_rank=10, rope_dim=4, top_k=3), 11)
    q, latent = layer.queries(x, cos, sin), layer.latent(x, cos, sin)
    causal = torch.ones(11, 11, dtype=torch.bool).tril().expand(2, 11, 11)
    assert_same_values_and_grads(layer.attend_selected(q, latent, causal), layer.attend(q, latent), (q, latent))


def fla_inputs(layer, x, cos, sin):
    """The layer's own tensors in fla's layout: q (B, T, nh, hs), k and v (B, T, nh, hs) decompressed,
    q_idx (B, T, HI, DI), k_idx (B, T, DI), w_idx (B, T, HI) (fla applies 1/sqrt(DI) itself)."""
    q, latent = layer.queries(x, cos, sin), layer.latent(x, cos, sin)
    k, v = layer.decompress(latent)  # (B, nh, T, hs) each
    index_q, index_w, index_k = layer.index(x, cos, sin)
    w_idx = index_w[..., 0].transpose(1, 2) * math.sqrt(layer.indexer.dim)  # (B, HI, T, 1) -> (B, T, HI)
    return [t.transpose(1, 2) for t in (q, k, v, index_q)] + [index_k[:, 0], w_idx]


@pytest.mark.parametrize("T, top_k", [(40, 7), (33, 16), (12, 1)])
def test_the_selection_and_the_output_equal_flas_naive_dsa(T, top_k):
    """fla/ops/dsa/naive.py on the layer's own queries, keys, values and indexer tensors (float32, as
    fla computes): the same positions chosen for every query, and the same layer output. Eight index
    heads with weights of one sign leave no tie at the k-th score, asserted, so the sets are unique."""
    naive = fla_naive("dsa")
    spec = SparseLatentSpec(kv_rank=10, rope_dim=4, top_k=top_k, index_heads=8, index_dim=6)
    layer, x, cos, sin = layer_and_input(spec, T, dtype=torch.float32, seed=T)
    layer.eval()
    with torch.no_grad():
        layer.indexer.weights.weight.abs_()
        x.abs_()  # positive inputs: every head weight positive
        q, k, v, q_idx, k_idx, w_idx = fla_inputs(layer, x, cos, sin)
        theirs, indices = naive.naive_dsa(q, k, v, q_idx, k_idx, w_idx, topk=top_k, return_indices=True)
        ours = layer(x, cos, sin)
        index_q, index_w, index_k = layer.index(x, cos, sin)
        scores = index_scores(index_q, index_w, index_k).double()  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    ranked = scores.masked_fill(~causal, float("-inf")).sort(-1, descending=True).values  # (B, T, T)
    rows = torch.arange(top_k, T)  # queries with more earlier positions than k
    assert (ranked[:, rows, top_k - 1] - ranked[:, rows, top_k] > 1e-4).all(), "a tie at the k-th score"
    chosen = top_k_mask(scores, causal, top_k)
    theirs_chosen = torch.zeros(2, T, T + 1, dtype=torch.bool).scatter(-1, indices.masked_fill(indices < 0, T),
                                                                       True)[..., :T]
    assert torch.equal(chosen, theirs_chosen)
    read = torch.arange(1, T + 1).clamp(max=top_k)  # (T,): min(t + 1, k) positions each
    assert torch.equal(chosen.sum(-1), read[None].expand(2, T))
    torch.testing.assert_close(ours, layer.merge(theirs.transpose(1, 2)), atol=1e-5, rtol=1e-5)


def test_ties_go_to_the_earlier_positions_whatever_the_layout():
    """Exact ties (an all-zero ReLU scores 0) at the k-th place: the earliest tied positions fill the
    places left, in one row of the full matrix or one decoding row alike."""
    scores = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, 0.0]])  # (T=1, S=6)
    visible = torch.tensor([[True, True, False, True, True, True]])  # slot 2 padding
    assert top_k_mask(scores, visible, 3).tolist() == [[True, True, False, False, True, False]]
    assert top_k_mask(scores, visible, 4).tolist() == [[True, True, False, True, True, False]]
    assert top_k_mask(scores, visible, 9).tolist() == visible.tolist()  # fewer visible than k: all of them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_decoding_steps_slots_are_the_selection_masks_choice(dtype):
    """top_k_slots (one int64 key per position for 32-bit and narrower scores) against top_k_mask (a
    threshold, ties filled by position) on scores with many exact ties, -0 and +0 among them, and
    rows with fewer visible positions than k: the same positions, the places past them invalid."""
    g = torch.Generator().manual_seed(0)
    scores = (torch.randint(-3, 4, (3, 5, 40), generator=g) / 2).to(dtype)  # (B, T, S): few values, many ties
    scores[0, 0, :10] = -0.0
    visible = torch.rand(3, 5, 40, generator=g) < 0.6
    visible[1, 2] = False
    visible[1, 2, :3] = True  # 3 visible positions, fewer than k
    for k in (1, 4, 7, 40, 50):
        indices, valid = top_k_slots(scores, visible, k)
        chosen = torch.zeros(3, 5, 41, dtype=torch.bool).scatter(-1, indices.masked_fill(~valid, 40), True)[..., :40]
        assert torch.equal(chosen, top_k_mask(scores, visible, k)), k
        assert torch.equal(valid.sum(-1), visible.sum(-1).clamp(max=k))


def naive_kl(layer, x, cos, sin):
    """The indexer's loss by its definition, query by query: p the main attention's probabilities over
    the positions the query reads, averaged over heads; q the softmax of the index scores there."""
    B, T, _ = x.shape
    with torch.no_grad():
        q, latent = layer.queries(x, cos, sin), layer.latent(x, cos, sin)
        k, _ = layer.decompress(latent)
        index_q, index_w, index_k = layer.index(x, cos, sin)
    total = 0.0
    for b in range(B):
        for t in range(T):
            head_scores = [(index_q[b, j, t] @ index_k[b, 0, :t + 1].T).relu() * index_w[b, j, t]
                           for j in range(layer.indexer.heads)]
            scores = torch.stack(head_scores).sum(0)  # (t + 1,)
            keep = torch.arange(t + 1)
            if layer.phase == "sparse":
                keep = torch.sort(scores, descending=True, stable=True).indices[:layer.top_k]
            logits = (q[b, :, t, None] @ k[b][:, keep].transpose(-1, -2))[:, 0]  # (nh, |keep|)
            logits = logits / math.sqrt(layer.head_dim)
            p = logits.softmax(-1).mean(0)
            total = total + (p * (p.log() - scores[keep].log_softmax(-1))).sum()
    return total / (B * T)


@pytest.mark.parametrize("phase", ["dense", "sparse"])
def test_the_indexer_kl_is_its_definition_and_trains_the_indexer_alone(phase):
    """In training the layer leaves KL(p || softmax(I)) in aux_loss (float64, against the query-by-query
    sum); its gradient reaches the indexer's weights and nothing else, the output's reaches everything
    but the indexer (the indexer reads x detached, p is a target)."""
    spec = SparseLatentSpec(kv_rank=10, rope_dim=4, top_k=4, index_heads=3, phase=phase)
    layer, x, cos, sin = layer_and_input(spec, 13)
    out = layer(x, cos, sin)
    torch.testing.assert_close(layer.aux_loss, naive_kl(layer, x, cos, sin), atol=1e-10, rtol=1e-10)
    named = dict(layer.named_parameters())
    x_grad, *aux_grads = torch.autograd.grad(layer.aux_loss, [x, *named.values()], allow_unused=True,
                                             materialize_grads=True)
    assert x_grad.abs().max() == 0
    for name, grad in zip(named, aux_grads, strict=True):
        assert (grad.abs().max() > 0) == name.startswith("indexer."), name
    out_grads = torch.autograd.grad(out.sum(), list(named.values()), allow_unused=True, materialize_grads=True)
    for name, grad in zip(named, out_grads, strict=True):
        assert (grad.abs().max() > 0) == (not name.startswith("indexer.")), name
    layer.eval()
    layer(x, cos, sin)
    assert layer.aux_loss is None  # scoring and generation leave no loss behind


def tiny_model(attention, seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_ff=48, max_seq_len=32,
                                   attention=attention))


def test_the_training_loss_adds_every_layers_kl():
    """LitLM's loss is the cross-entropy plus the sum of the layers' KL terms; models without one, and
    any forward outside training, give no auxiliary loss."""
    model = tiny_model(SparseLatentSpec(kv_rank=10, rope_dim=4, top_k=4, index_heads=2))
    module = LitLM(model, OptimConfig(), total_steps=10)
    batch = torch.randint(0, 61, (3, 17), generator=torch.Generator().manual_seed(0))  # (B, T + 1)
    loss, ce, kl = module.training_losses(batch)
    layers = [block.attn.aux_loss for block in model.blocks]
    assert kl is None and all(a is not None and a > 0 for a in layers)
    torch.testing.assert_close(loss, ce + layers[0] + layers[1])
    torch.testing.assert_close(model.aux_loss(), layers[0] + layers[1])
    loss.backward()
    assert all(block.attn.indexer.q_proj.weight.grad.abs().max() > 0 for block in model.blocks)
    with torch.no_grad():
        model(batch)
    assert model.aux_loss() is None
    plain = tiny_model("softmax").train()
    plain(batch)
    assert plain.aux_loss() is None


def test_a_decoding_step_attends_over_top_k_rows_whatever_the_context(monkeypatch):
    """The main attention of a step reads k gathered rows, not the buffer: the rows it is given are
    k whether 64 or 512 slots are held (the indexer alone scores them all)."""
    from lm.attention.mla import LatentCache

    read = []
    real = LatentCache.latent_attention
    monkeypatch.setattr(LatentCache, "latent_attention", lambda self, q, keys, mask: read.append(keys.shape[2])
                        or real(self, q, keys, mask))
    for max_len in (64, 512):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(vocab_size=61, n_layer=1, d_model=32, n_head=4, d_ff=48, max_seq_len=max_len,
                                        attention=SparseLatentSpec(top_k=8))).eval()
        cache = GenerationCache(model, pad=torch.zeros(1, dtype=torch.long), max_len=max_len)
        cache.advance(40)
        with torch.no_grad():
            model.decode_step(torch.ones(1, 1, dtype=torch.long), cache, torch.tensor(40))
    assert read == [8, 8]


def test_the_cache_holds_the_latent_and_the_indexer_keys():
    layer = SparseLatentSpec(kv_rank=10, rope_dim=4, index_dim=6).build(SHAPE)
    assert layer.generation_state().numel(100, batch=3) == 3 * 100 * (10 + 4 + 6)
    assert SparseLatentSpec().at(64) == SparseLatentSpec(kv_rank=96, rope_dim=16, index_dim=32)


@pytest.mark.parametrize("options, message", [
    ({"top_k": 0}, "top_k=0 must be an integer >= 1"),
    ({"index_heads": 0}, "index_heads=0 must be an integer >= 1"),
    ({"index_dim": 1}, "index_dim=1 must be an integer >= 2"),
    ({"phase": "warmup"}, "phase='warmup' must be one of ['dense', 'sparse']"),
    ({"top_k": 2.5}, "top_k=2.5 must be an integer >= 1"),
    ({"rope_dim": 3}, "rope_dim=3 must be even"),
    ({"rope": False}, "rope=false (NoPE) is MLA's option"),
])
def test_a_bad_option_is_one_line(options, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        SparseLatentSpec(**options)


def test_an_index_dim_below_the_rope_part_is_one_line():
    with pytest.raises(ConfigError, match=r"^index_dim=2 must be at least rope_dim=4: the indexer rotates"):
        SparseLatentSpec(rope_dim=4, index_dim=2).build(SHAPE)


def test_a_dense_warm_up_continues_sparse_from_its_weights(tmp_path):
    """The warm-up's checkpoint, its layers switched to phase=sparse (docs/attention.md, DeepSeek sparse
    attention), loads as a sparse model with the same weights: it computes what the dense one does
    while a sequence is no longer than top_k, and differs past it."""
    import dataclasses

    from lm import load
    from lm.data.tokenizer import train_tokenizer
    from lm.formats.checkpoint import save_checkpoint

    torch.manual_seed(0)
    dense = Transformer(ModelConfig(vocab_size=300, n_layer=2, d_model=32, n_head=4, d_ff=48, max_seq_len=32,
                                    attention=SparseLatentSpec(top_k=6, phase="dense"), init_std=0.1)).eval()
    tokenizer = train_tokenizer(iter(["abc def " * 20]), 300)
    sparse_config = dataclasses.replace(dense.config, attention=[dataclasses.replace(spec, phase="sparse")
                                                                 for spec in dense.config.attention])
    path = save_checkpoint(tmp_path / "sparse-start.ckpt", dense.state_dict(), sparse_config, tokenizer.to_str())
    sparse, _ = load(path)
    assert [block.attn.phase for block in sparse.blocks] == ["sparse", "sparse"]
    idx = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(sparse(idx[:, :6]), dense(idx[:, :6]), atol=0, rtol=0)
        assert (sparse(idx)[:, 6:] - dense(idx)[:, 6:]).abs().max() > 1e-4
