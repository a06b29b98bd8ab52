"""The short causal convolution before attention (model.short_conv): the fast path against its
twin, what it stores, and where it cannot go. Its caches are held by tests/test_generation.py
(`<kind>+conv` rows: chunked prefill, ragged batches and the fixed-shape step, each as one forward)."""

import pytest
import torch

from lm import ModelConfig, Transformer
from lm.formats.gguf import check_exportable
from lm.formats.hf import hf_architecture
from lm.model.config import ConfigError
from lm.model.generation_cache import GenerationCache
from lm.model.short_conv import ShortConv


@pytest.mark.parametrize(("taps", "T"), [(1, 5), (2, 1), (3, 2), (4, 9), (5, 17)])
def test_the_convolution_equals_its_sum_over_taps_in_values_and_gradients(taps, T):
    torch.manual_seed(taps)
    conv = ShortConv(6, taps).double()
    torch.nn.init.normal_(conv.weight)
    h = torch.randn(2, T, 6, dtype=torch.float64, requires_grad=True)
    fast, naive = conv(h), conv.naive_forward(h)
    torch.testing.assert_close(fast, naive)
    g = torch.randn_like(fast)
    fast_grads = torch.autograd.grad(fast, (h, conv.weight), g)
    naive_grads = torch.autograd.grad(naive, (h, conv.weight), g)
    for a, b in zip(fast_grads, naive_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_each_position_mixes_only_itself_and_the_taps_before_it():
    """A change at position t moves the output at t .. t+W-1 and nowhere else."""
    torch.manual_seed(0)
    conv = ShortConv(4, 3).double()
    torch.nn.init.normal_(conv.weight)
    h = torch.randn(1, 10, 4, dtype=torch.float64)
    moved = h.clone()
    moved[0, 4] += 1.0
    changed = (conv(moved) - conv(h)).abs().sum(-1)[0] > 0  # (T,)
    assert changed.tolist() == [t in (4, 5, 6) for t in range(10)]


def model(short_conv, **kw):
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=40, n_layer=2, d_model=16, n_head=2, d_ff=32, max_seq_len=32,
                                   short_conv=short_conv, **kw)).eval()


def test_the_model_stores_the_taps_and_its_cache_holds_the_window():
    m = model(4)
    assert m.config.to_dict()["short_conv"] == 4
    assert ModelConfig.from_dict(m.config.to_dict()) == m.config
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters() if "short_conv" in n}
    assert shapes == {f"blocks.{i}.short_conv.weight": (16, 4) for i in range(2)}
    without = GenerationCache(model(0), pad=torch.zeros(3, dtype=torch.long), max_len=20)
    with_conv = GenerationCache(m, pad=torch.zeros(3, dtype=torch.long), max_len=20)
    assert with_conv.nbytes() - without.nbytes() == 2 * 3 * 3 * 16 * 4  # layers x B x (W-1) x C x fp32
    # A model saved before the option existed has none.
    old = {k: v for k, v in model(0).config.to_dict().items() if k != "short_conv"}
    assert ModelConfig.from_dict(old).short_conv == 0


def test_zero_taps_are_the_plain_model_and_learned_ones_act():
    plain, convolved = model(0), model(3)
    missing, unexpected = convolved.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and sorted(missing) == ["blocks.0.short_conv.weight", "blocks.1.short_conv.weight"]
    idx = torch.randint(0, 40, (1, 12))
    with torch.no_grad():
        for block in convolved.blocks:
            block.short_conv.weight.zero_()
        torch.testing.assert_close(convolved(idx), plain(idx))
        convolved.blocks[0].short_conv.weight.fill_(0.5)
        assert not torch.allclose(convolved(idx), plain(idx), atol=1e-3)


def test_a_bad_value_is_one_line():
    for bad in (-1, 2.5, "3", True):
        with pytest.raises(ConfigError, match="short_conv="):
            ModelConfig(short_conv=bad)


def test_export_refuses_it_by_name():
    with pytest.raises(ConfigError, match="model.short_conv=3 cannot be exported to transformers"):
        hf_architecture(model(3).config)
    with pytest.raises(ConfigError, match="model.short_conv=3 has no GGUF equivalent"):
        check_exportable(model(3))
