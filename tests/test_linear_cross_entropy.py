"""The chunked output layer and cross-entropy (lm.model.linear_cross_entropy) against its naive twin,
F.cross_entropy over the whole logits: values, gradients, ignored targets, accuracy, awkward chunks."""

import pytest
import torch
import torch.nn.functional as F

from lm.data.mqar import IGNORE
from lm.model.config import ModelConfig
from lm.model.linear_cross_entropy import linear_cross_entropy
from lm.model.transformer import Transformer
from lm.training.scoring import Scorer, next_token_loss


def operands(N=37, C=12, V=29, ignored=(3, 4, 5, 6, 7, 30), seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, C, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, C, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[list(ignored)] = IGNORE
    return hidden, weight, targets


@pytest.mark.parametrize("chunk", [1, 4, 5, 16, 37, 64])
def test_loss_and_gradients_equal_cross_entropy_over_the_whole_logits(chunk):
    # chunk 4 leaves positions 4-7 a chunk of ignored targets only; 16 and 5 leave a short last chunk
    hidden, weight, targets = operands()
    expected = F.cross_entropy(hidden @ weight.T, targets, reduction="sum", ignore_index=IGNORE)
    want_h, want_w = torch.autograd.grad(expected * 0.37, [hidden, weight])
    loss = linear_cross_entropy(hidden, weight, targets, chunk, IGNORE)
    got_h, got_w = torch.autograd.grad(loss * 0.37, [hidden, weight])  # a scale the backward must carry
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_h, want_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_w, want_w, rtol=1e-12, atol=1e-12)
    assert got_h[list(range(3, 8))].abs().max() == 0  # an ignored position gets no gradient


def test_accuracy_counts_the_scored_targets_the_arg_max_predicts():
    hidden, weight, targets = operands()
    logits = hidden @ weight.T
    scored = targets != IGNORE
    targets[:10] = torch.where(scored[:10], logits[:10].argmax(-1), IGNORE)  # some right for sure
    expected = int(((logits.argmax(-1) == targets) & scored).sum())
    assert expected >= 5
    with torch.no_grad():
        loss, correct = linear_cross_entropy(hidden, weight, targets, 6, IGNORE, accuracy=True)
    assert int(correct) == expected and not loss.requires_grad


def test_without_grad_it_makes_no_gradients():
    hidden, weight, targets = operands()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, 8, IGNORE)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.T, targets, reduction="sum",
                                                     ignore_index=IGNORE).detach())


def test_a_chunk_below_one_position_is_refused():
    hidden, weight, targets = operands()
    with pytest.raises(ValueError, match="chunk must be at least 1 position, got 0"):
        linear_cross_entropy(hidden, weight, targets, 0)


def tiny_model(**options) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=50, d_model=16, n_layer=2, n_head=2, d_ff=32, max_seq_len=16, **options)
    return Transformer(config).double()


@pytest.mark.parametrize("tie", [True, False])
def test_a_training_step_through_the_chunked_scorer_matches_the_plain_one(tie):
    # the head's weight is the embedding's when tied: both of its gradients must add up
    batch = torch.randint(0, 50, (3, 12))  # (B, T + 1): 33 positions, chunks of 7 leave 5
    grads = []
    for loss_chunk in (0, 7):
        model = tiny_model(tie_embeddings=tie)
        loss, n = next_token_loss(Scorer(model, loss_chunk), batch)
        loss.backward()
        grads.append((loss.detach(), n, {name: p.grad.clone() for name, p in model.named_parameters()}))
    (plain, n_plain, plain_grads), (chunked, n_chunked, chunked_grads) = grads
    assert n_plain == n_chunked == 33
    torch.testing.assert_close(chunked, plain, rtol=1e-12, atol=1e-12)
    assert plain_grads.keys() == chunked_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_validation_sums_match_under_the_chunked_scorer():
    model = tiny_model()
    inputs = torch.randint(0, 50, (2, 9))
    targets = torch.randint(0, 50, (2, 9))
    targets[0, :4] = IGNORE
    with torch.no_grad():
        plain = Scorer(model)((inputs, targets))
        chunked = Scorer(model, 4)((inputs, targets))
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-12, atol=1e-12)
    assert chunked[1] == plain[1] == 14 and int(chunked[2]) == int(plain[2])


def test_under_bf16_autocast_it_stays_near_the_plain_loss():
    # bf16 matmuls, float32 softmax as F.cross_entropy(logits.float()) takes them
    hidden, weight, targets = (t.detach().float() if t.is_floating_point() else t for t in operands(N=64, C=32))
    hidden.requires_grad_(), weight.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.cross_entropy((hidden @ weight.T).float(), targets, reduction="sum", ignore_index=IGNORE)
        loss = linear_cross_entropy(hidden, weight, targets, 16, IGNORE)
    want_h, want_w = torch.autograd.grad(expected, [hidden, weight])
    got_h, got_w = torch.autograd.grad(loss, [hidden, weight])
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=2e-3, atol=0)
    assert (got_h - want_h).norm() / want_h.norm() < 2e-2
    assert (got_w - want_w).norm() / want_w.norm() < 2e-2


def test_a_run_config_written_before_the_setting_builds_its_module_with_the_default():
    # an uptraining continues its source run's stored config, which older checkpoints wrote without it
    from types import SimpleNamespace

    from lm.config.compose import compose_train
    from lm.config.settings import plain
    from lm.config.train import TrainRun, TrainSettings
    from lm.training.setup import lightning_module
    from lm.training.start import Start

    stored = plain(compose_train(["logger=none"]))
    del stored["loss_chunk"]
    run = TrainRun.from_config(stored)
    assert run.loss_chunk == TrainSettings().loss_chunk == 512
    model = tiny_model()
    data = SimpleNamespace(tokenizer=SimpleNamespace(to_str=lambda: "{}"))
    lit = lightning_module(run, model, data, Start(model.config, vocab_from_tokenizer=True), {})
    assert lit._score.loss_chunk == 512


def test_a_reduction_other_than_sum_or_mean_is_refused():
    with pytest.raises(ValueError, match="reduction must be 'sum' or 'mean', got 'none'"):
        Scorer(tiny_model(), 4)(torch.randint(0, 50, (2, 5)), reduction="none")
