"""The MQAR recall task: examples, answer-only scoring, training and loading with data=mqar."""

import numpy as np
import pytest
import torch
from conftest import compose_config
from omegaconf import open_dict

from lm import load
from lm.data.mqar import IGNORE, RecallTask, number_tokenizer
from lm.training.scoring import scored_batch
from lm.util.errors import DataError


def test_every_answer_is_the_value_of_the_queried_key():
    task = RecallTask(vocab_size=64, seq_len=48, pairs=6, examples=50)
    inputs, targets = task.generate("train")
    assert inputs.shape == targets.shape == (50, 48)
    for row_in, row_t in zip(inputs, targets, strict=True):
        keys, values = row_in[0:12:2], row_in[1:12:2]
        assert len(set(keys)) == 6 and len(set(values)) == 6  # distinct keys, distinct values
        assert keys.max() < 32 <= values.min() and keys.min() >= 1
        answers = np.flatnonzero(row_t != IGNORE)
        assert len(answers) == 6 and answers.min() >= 12  # each key asked once, after the pairs
        asked = dict(zip(keys.tolist(), values.tolist(), strict=True))
        assert sorted(row_in[answers].tolist()) == sorted(keys.tolist())
        for position in answers:
            assert row_t[position] == asked[row_in[position]]


def test_examples_follow_the_seed_and_the_held_out_set_is_its_own():
    a, b = RecallTask(seed=3), RecallTask(seed=3, examples=500)
    assert np.array_equal(a.generate("val")[0], b.generate("val")[0])  # independent of the training size
    assert np.array_equal(a.generate("train")[0][:5], RecallTask(seed=3).generate("train")[0][:5])
    assert not np.array_equal(a.generate("train")[0][:5], RecallTask(seed=4).generate("train")[0][:5])
    assert not np.array_equal(a.generate("train")[0][:1000], a.generate("val")[0])


def test_the_query_region_is_pad_between_queries_at_even_offsets():
    """Zoology's Figure 2 layout: no token in the region but the queries and the pad 0, the
    queries at even offsets, so no value follows a query in the input."""
    task = RecallTask(vocab_size=64, seq_len=64, pairs=4, examples=300)
    inputs, targets = task.generate("train")
    region = inputs[:, 8:]
    asked = targets[:, 8:] != IGNORE  # (n, 56)
    assert (region[~asked] == 0).all() and (region[asked] > 0).all()
    assert not asked[:, 1::2].any()  # odd offsets never hold a query
    random_filler = RecallTask(vocab_size=64, seq_len=64, pairs=4, examples=300, filler="random").generate("train")[0]
    assert (random_filler[:, 8:] > 0).all()  # random tokens, some of them keys (decoys)
    assert np.isin(random_filler[:, 8:], np.arange(1, 32)).mean() > 0.3


def zoology_slot_frequencies(task: RecallTask, n: int) -> np.ndarray:
    """How often each query slot is taken when the slots are drawn the way Zoology's generator
    draws them: numpy's choice without replacement, row by row."""
    rng = np.random.default_rng(7)
    counts = np.zeros(task.query_slots)
    for _ in range(n):
        counts[rng.choice(task.query_slots, size=task.pairs, replace=False, p=task.query_weights())] += 1
    return counts / n


@pytest.mark.parametrize("power", [0.01, 0.5, 1.0])
def test_query_slots_follow_the_power_law_drawn_without_replacement(power):
    task = RecallTask(vocab_size=64, seq_len=64, pairs=4, examples=20_000, query_power=power)
    inputs, targets = task.generate("train")
    ours = (targets[:, 8::2] != IGNORE).mean(axis=0)  # (slots,): how often each even offset holds a query
    np.testing.assert_allclose(ours, zoology_slot_frequencies(task, 20_000), atol=0.015)
    if power == 1.0:
        np.testing.assert_allclose(ours, task.pairs / task.query_slots, atol=0.015)  # uniform
    else:
        assert ours[0] > 2 * ours[-1]  # the queries crowd towards the pairs


def test_blocks_make_the_first_examples_independent_of_the_count():
    short, long = RecallTask(examples=1500), RecallTask(examples=3000)
    for a, b in zip(short.generate("train"), long.generate("train"), strict=True):
        assert np.array_equal(a, b[:1500])


@pytest.mark.parametrize(("settings", "message"), [
    (dict(vocab_size=16, pairs=8), "data.pairs=8 is more than the 7 distinct keys"),
    (dict(seq_len=27, pairs=7), "data.pairs=7 does not fit data.seq_len=27: .* at least 28 positions"),
    (dict(filler="zeros"), "data.filler='zeros' is not one of pad, random"),
    (dict(query_power=0), "data.query_power=0 must be a number in \\(0, 1\\]"),
    (dict(query_power=1.5), "data.query_power=1.5 must be"),
    (dict(examples=0), "data.examples=0"),
    (dict(examples=10**12), "data.examples=1000000000000 needs .* GiB .* more than this machine's .* GiB of RAM"),
    (dict(val_examples=10**12), "data.val_examples=1000000000000 needs"),
])
def test_impossible_settings_are_one_line(settings, message):
    with pytest.raises(DataError if "data.examples" not in message else ValueError, match=message):
        RecallTask(**settings)


def test_sizes_are_refused_by_the_bytes_they_take_against_the_ram(monkeypatch):
    """The rule: examples x bytes_per_example may not exceed the machine's RAM; the estimate is the
    peak that generating them really takes, but for one block's temporaries."""
    import tracemalloc

    task = RecallTask(vocab_size=512, seq_len=64, pairs=4, examples=40_000, val_examples=100)
    tracemalloc.start()  # numpy reports its arrays to tracemalloc
    task.generate("train")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert 1.0 < peak / (40_000 * task.bytes_per_example) < 1.1
    monkeypatch.setattr("lm.util.checks.physical_memory_bytes", lambda: 500 * task.bytes_per_example)
    RecallTask(vocab_size=512, seq_len=64, pairs=4, examples=500, val_examples=500)  # exactly the RAM: accepted
    with pytest.raises(DataError, match="data.examples=501 needs"):
        RecallTask(vocab_size=512, seq_len=64, pairs=4, examples=501)
    with pytest.raises(DataError, match="data.val_examples=501 needs"):
        RecallTask(vocab_size=512, seq_len=64, pairs=4, val_examples=501, examples=10)


def test_only_answers_are_scored_and_accuracy_counts_them():
    inputs = torch.tensor([[5, 9, 7, 5, 3]])
    targets = torch.tensor([[IGNORE, IGNORE, IGNORE, 9, IGNORE]])
    vocab = 12

    def forward(x):  # right at the answer, wrong everywhere else
        logits = torch.zeros(*x.shape, vocab)
        logits[:, :, 0] = 5.0
        logits[0, 3, 9] = 10.0
        return logits

    loss_sum, n, correct = scored_batch(forward, (inputs, targets))
    assert n == 1 and int(correct) == 1
    expected = torch.nn.functional.cross_entropy(forward(inputs)[0, 3:4], torch.tensor([9]))
    assert torch.allclose(loss_sum, expected)
    mean, n, _ = scored_batch(forward, (inputs, targets), reduction="mean")
    assert n == 1 and torch.allclose(mean, expected)


def test_the_number_tokenizer_round_trips():
    tokenizer = number_tokenizer(256)
    assert tokenizer.encode("3 130 7 141 3").ids == [3, 130, 7, 141, 3]
    assert tokenizer.decode([3, 130]) == "3 130"
    assert tokenizer.get_vocab_size() == 256


def test_train_on_mqar_logs_accuracy_and_the_checkpoint_loads(tmp_path):
    from lm.training.run import train

    cfg = compose_config("train", [
        "data=mqar", "data.seq_len=32", "data.pairs=4", "data.examples=64", "data.val_examples=16",
        "data.batch_size=8", "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.d_ff=64",
        "model.max_seq_len=32", "attn=linear", "trainer=cpu", "trainer.max_steps=4", "trainer.val_every_n_steps=2",
        "trainer.progress_bar=false", "logger=csv",
    ])
    with open_dict(cfg):
        cfg.checkpoint_dir = str(tmp_path)
    result = train(cfg)
    assert 0.0 <= result["val_accuracy"] <= 1.0 and "sample" not in result  # recall data prints no text sample
    assert [h[0] for h in result["val_history"]] == [2, 4]
    assert result["val_history"][-1][3] > 0 and result["train_tokens_per_s"] > 0
    model, tokenizer = load(result["last"])
    assert model.config.vocab_size == 256 and tokenizer.encode("1 200").ids == [1, 200]
    metrics = (tmp_path / cfg.run_name / "csv").rglob("metrics.csv")
    assert any("val/accuracy" in path.read_text().splitlines()[0] for path in metrics)


def test_a_sequence_longer_than_the_model_is_refused_before_training(tmp_path):
    from lm.training.run import train

    cfg = compose_config("train", ["data=mqar", "data.seq_len=64", "model.max_seq_len=32", "logger=none"])
    with open_dict(cfg):
        cfg.checkpoint_dir = str(tmp_path)
    with pytest.raises(DataError, match="data.seq_len=64 is longer than the model's context model.max_seq_len=32"):
        train(cfg)


@pytest.mark.parametrize(("threshold", "steps"), [(None, [4, 8, 12]), (0.999, [4, 8, 12]), (1e-9, [4])])
def test_training_stops_once_accuracy_passes_the_threshold(tmp_path, threshold, steps):
    """trainer.stop_at_accuracy ends the run at the first validation above it (Zoology stops at 0.99):
    at 1e-9 the first (after 4 steps at a high learning rate, some answers are values, right by
    chance), at 0.999 none."""
    from lm.training.run import train

    cfg = compose_config("train", [
        "data=mqar", "data.vocab_size=16", "data.seq_len=16", "data.pairs=2", "data.examples=64",
        "data.val_examples=256", "data.batch_size=8", "model.n_layer=1", "model.d_model=16", "model.n_head=2",
        "model.d_ff=32", "model.max_seq_len=16", "optim.lr=0.02", "optim.warmup_steps=0", "trainer=cpu",
        "trainer.max_steps=12", "trainer.val_every_n_steps=4",
        "trainer.progress_bar=false", "logger=none", f"trainer.stop_at_accuracy={threshold}".replace("None", "null"),
    ])
    with open_dict(cfg):
        cfg.checkpoint_dir = str(tmp_path)
    result = train(cfg)
    assert [h[0] for h in result["val_history"]] == steps and result["steps"] == steps[-1], result["val_history"]
    if threshold == 1e-9:
        assert result["val_accuracy"] > threshold
    _, ckpt = load(result["last"])  # the checkpoint of the stopped run loads


def test_a_threshold_that_is_not_an_accuracy_is_one_line(tmp_path):
    from lm.model.config import ConfigError
    from lm.training.run import train

    cfg = compose_config("train", ["data=mqar", "trainer.stop_at_accuracy=1.5", "logger=none"])
    with open_dict(cfg):
        cfg.checkpoint_dir = str(tmp_path)
    with pytest.raises(ConfigError, match=r"trainer.stop_at_accuracy=1.5 must be a number between 0 and 1"):
        train(cfg)
