"""The MQAR recall task: examples, answer-only scoring, training and loading with data=mqar."""

import numpy as np
import pytest
import torch
from conftest import compose_config
from omegaconf import open_dict

from lm import load
from lm.data.mqar import IGNORE, RecallTask, number_tokenizer
from lm.training.module import next_token_loss, scored_batch
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


@pytest.mark.parametrize(("settings", "message"), [
    (dict(vocab_size=16, pairs=8), "data.pairs=8 is more than the 7 distinct keys"),
    (dict(seq_len=20, pairs=7), "data.pairs=7 does not fit data.seq_len=20"),
    (dict(examples=0), "data.examples=0"),
    (dict(examples=10**12), "data.examples=1000000000000 needs .* GiB .* more than this machine's .* GiB of RAM"),
    (dict(val_examples=10**12), "data.val_examples=1000000000000 needs"),
])
def test_impossible_settings_are_one_line(settings, message):
    with pytest.raises(DataError if "pairs" in message else ValueError, match=message):
        RecallTask(**settings)


def test_sizes_are_refused_by_the_bytes_they_take_against_the_ram(monkeypatch):
    """The rule: examples x bytes_per_example may not exceed the machine's RAM; the estimate is the
    peak that generating them really takes."""
    import tracemalloc

    task = RecallTask(vocab_size=512, seq_len=64, pairs=4, examples=500, val_examples=100)
    tracemalloc.start()  # numpy reports its arrays to tracemalloc
    task.generate("train")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert 0.95 < peak / (500 * task.bytes_per_example) < 1.05
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
    mean, n = next_token_loss(forward, (inputs, targets))
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
