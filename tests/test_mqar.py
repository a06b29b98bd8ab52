"""The MQAR recall task: examples, answer-only scoring, training and loading with data=mqar."""

import copy
import math

import numpy as np
import pytest
import torch
from conftest import compose_config
from omegaconf import open_dict

from lm import ModelConfig, Transformer, load
from lm.config.data import RecallSettings
from lm.data.mqar import IGNORE, RecallDataModule, RecallTask, mix_tasks, number_tokenizer
from lm.data.windows import CellShuffle
from lm.training.scoring import Scorer, scored_batch
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
    from lm.config.train import TrainRun
    from lm.training.run import train

    cfg = compose_config("train", [
        "data=mqar", "data.seq_len=32", "data.pairs=4", "data.examples=64", "data.val_examples=16",
        "data.batch_size=8", "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.d_ff=64",
        "model.max_seq_len=32", "attn=linear", "trainer=cpu", "trainer.max_steps=4", "trainer.val_every_n_steps=2",
        "trainer.progress_bar=false", "logger=csv",
    ])
    with open_dict(cfg):
        cfg.checkpoint_dir = str(tmp_path)
    result = train(TrainRun.from_config(cfg))
    assert 0.0 <= result["val_accuracy"] <= 1.0 and "sample" not in result  # recall data prints no text sample
    assert [h[0] for h in result["val_history"]] == [2, 4]
    assert result["val_history"][-1][3] > 0 and result["train_tokens_per_s"] > 0
    model, tokenizer = load(result["last"])
    assert model.config.vocab_size == 256 and tokenizer.encode("1 200").ids == [1, 200]
    metrics = (tmp_path / cfg.run_name / "csv").rglob("metrics.csv")
    assert any("val/accuracy" in path.read_text().splitlines()[0] for path in metrics)


def test_a_sequence_longer_than_the_model_is_refused_before_training(tmp_path):
    from lm.config.train import TrainRun
    from lm.training.run import train

    cfg = compose_config("train", ["data=mqar", "data.seq_len=64", "model.max_seq_len=32", "logger=none"])
    with open_dict(cfg):
        cfg.checkpoint_dir = str(tmp_path)
    with pytest.raises(DataError, match="data.seq_len=64 is longer than the model's context model.max_seq_len=32"):
        train(TrainRun.from_config(cfg))


@pytest.mark.parametrize(("threshold", "steps"), [(None, [4, 8, 12]), (0.999, [4, 8, 12]), (1e-9, [4])])
def test_training_stops_once_accuracy_passes_the_threshold(tmp_path, threshold, steps):
    """trainer.stop_at_accuracy ends the run at the first validation above it (Zoology stops at 0.99):
    at 1e-9 the first (after 4 steps at a high learning rate, some answers are values, right by
    chance), at 0.999 none."""
    from lm.config.train import TrainRun
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
    result = train(TrainRun.from_config(cfg))
    assert [h[0] for h in result["val_history"]] == steps and result["steps"] == steps[-1], result["val_history"]
    if threshold == 1e-9:
        assert result["val_accuracy"] > threshold
    _, ckpt = load(result["last"])  # the checkpoint of the stopped run loads


def test_a_threshold_that_is_not_an_accuracy_is_one_line(tmp_path):
    from lm.config.train import TrainRun
    from lm.model.config import ConfigError
    from lm.training.run import train

    cfg = compose_config("train", ["data=mqar", "trainer.stop_at_accuracy=1.5", "logger=none"])
    with open_dict(cfg):
        cfg.checkpoint_dir = str(tmp_path)
    with pytest.raises(ConfigError, match=r"trainer.stop_at_accuracy=1.5 must be a number between 0 and 1"):
        train(TrainRun.from_config(cfg))


MIX_DATA = {"vocab_size": 32, "seed": 0, "filler": "pad", "query_power": 0.01, "examples": 40, "val_examples": 10,
            "batch_size": 4, "num_workers": 0}


def mix_settings(**changes) -> RecallSettings:
    """data=mqar's settings, typed as a run holds them, with MIX_DATA's values and `changes`."""
    return RecallSettings(source="mqar", **{**MIX_DATA, **changes})


def mix_module(cells=((16, 2), (32, 4), (24, 3))) -> RecallDataModule:
    module = RecallDataModule.from_settings(mix_settings(mix=[list(c) for c in cells]), max_seq_len=32)
    module.setup()
    return module


def test_a_mix_keeps_each_cell_at_its_own_length():
    module = mix_module()
    tasks = mix_tasks(mix_settings(), [[16, 2], [32, 4], [24, 3]])
    assert module.train_set.sizes == [14, 14, 14]  # 40 examples shared equally, rounded up
    for cell, task in enumerate(tasks):
        inputs, targets = task.generate("train")  # the reference: each cell's task alone
        first = sum(module.train_set.sizes[:cell])
        for row in (0, 13):
            x, y = module.train_set[first + row]
            assert x.shape == (task.seq_len,) and (x.numpy() == inputs[row]).all() and (y.numpy() == targets[row]).all()


def batches_of(order: list[int], batch_size: int) -> list[list[int]]:
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def test_every_training_batch_comes_from_one_cell_and_an_epoch_sees_each_cell_once():
    sizes = [14, 9, 20]
    cell_of = np.repeat(np.arange(3), sizes)
    shuffle = CellShuffle(sizes, seed=3, batch_size=4)
    shuffle.set_epoch(0)
    epoch = list(shuffle)
    batches = batches_of(epoch, 4)
    assert len(batches) == shuffle.batches_per_epoch == 3 + 2 + 5  # each cell's remainder dropped
    assert all(len(set(cell_of[b])) == 1 for b in batches)
    assert len(set(epoch)) == len(epoch)  # no example twice in an epoch
    assert sorted(int(np.sum(cell_of[epoch] == c)) for c in range(3)) == sorted([12, 8, 20])
    assert len({int(cell_of[b[0]]) for b in batches[:4]}) > 1  # the cells' batches are interleaved
    assert list(shuffle) == epoch  # a function of (seed, epoch) alone
    shuffle.set_epoch(1)
    assert list(shuffle) != epoch


def test_cell_batches_shard_by_rank_and_resume_at_the_batch_reached():
    sizes = [14, 9, 20]
    whole = CellShuffle(sizes, seed=1, batch_size=4)  # one process, batch 4
    halves = [CellShuffle(sizes, seed=1, batch_size=2, rank=r, world_size=2) for r in range(2)]
    for s in (whole, *halves):
        s.set_epoch(0)
    global_batches = batches_of(list(whole), 4)
    mine = [batches_of(list(h), 2) for h in halves]
    assert [a + b for a, b in zip(*mine, strict=True)] == global_batches  # two ranks see one process's batches
    resumed = CellShuffle(sizes, seed=1, batch_size=4, start_batch=len(global_batches) + 3)
    resumed.set_epoch(1)  # start_batch past the first epoch: the second epoch from its fourth batch
    whole.set_epoch(1)
    assert list(resumed) == list(whole)[3 * 4:]


def test_a_mix_gives_each_cell_its_own_count_where_mix_examples_says_so():
    """Based's Figure 2 trains on 100k examples at (64, 4) and 20k at each other cell: a batch then
    comes from the first cell five times as often."""
    tasks = mix_tasks(mix_settings(mix_examples=[80, 16, 24]), [[16, 2], [32, 4], [24, 3]])
    assert [t.examples for t in tasks] == [80, 16, 24]
    assert len({t.val_examples for t in tasks}) == 1  # validation stays shared equally
    module = RecallDataModule(tasks, batch_size=8)
    module.setup("fit")
    assert module.train_set.sizes == [80, 16, 24]
    order = CellShuffle(module.train_set.sizes, 0, 8).epoch_order().view(-1, 8)  # (batches, B)
    cells = [int(b[0] >= 80) + int(b[0] >= 96) for b in order]  # which cell each batch's rows come from
    assert [cells.count(c) for c in range(3)] == [10, 2, 3]
    assert mix_tasks(mix_settings(), [[16, 2], [32, 4]])[0].examples == math.ceil(MIX_DATA["examples"] / 2)


@pytest.mark.parametrize(("counts", "message"), [
    ([80, 16], r"^data.mix_examples=\[80, 16\] must be a list of one count per data.mix cell \(3\)$"),
    (80, r"^data.mix_examples=80 must be a list of one count per data.mix cell \(3\)$"),
    ([80, 0, 24], r"^data.mix_examples entry 0 for \[32, 4\]: data.examples=0 must be"),
])
def test_mix_examples_that_do_not_fit_the_mix_are_refused_in_one_line(counts, message):
    with pytest.raises(DataError, match=message):
        mix_tasks(mix_settings(mix_examples=counts), [[16, 2], [32, 4], [24, 3]])


def test_validation_batches_never_mix_cells_and_cover_each_rank_s_share_once():
    module = mix_module()
    batches = module.val_set.cell_batches(3, rank=0, world=1)
    cell_of = np.repeat(np.arange(3), module.val_set.sizes)
    assert all(len(set(cell_of[b])) == 1 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(len(module.val_set)))
    ranks = [sorted(i for b in module.val_set.cell_batches(3, r, 2) for i in b) for r in range(2)]
    assert not set(ranks[0]) & set(ranks[1]) and sorted(ranks[0] + ranks[1]) == list(range(len(module.val_set)))
    shapes = {tuple(x.shape) for x, _ in module.val_dataloader()}
    assert shapes <= {(b, t) for b in (1, 2, 3, 4) for t in (16, 32, 24)} and {s[1] for s in shapes} == {16, 24, 32}


def test_a_cell_smaller_than_a_batch_is_one_line():
    data = mix_settings(examples=9, mix=[[16, 2], [32, 4], [24, 3]])
    with pytest.raises(DataError, match=r"^data.batch_size=4 is larger than each cell's share of data.examples \(3\)"):
        RecallDataModule.from_settings(data, max_seq_len=32)


@pytest.mark.parametrize("loss_chunk", [0, 5])
def test_a_recall_batch_scored_at_its_answers_equals_the_whole_logits(loss_chunk):
    """The naive twin: every position's logits and F.cross_entropy over them, IGNORE left out."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=32, n_layer=2, d_model=32, n_head=4, d_ff=64, max_seq_len=32))
    task = RecallTask(vocab_size=32, seq_len=24, pairs=3, examples=6, val_examples=1)
    batch = [torch.from_numpy(a) for a in task.generate("train")]
    twin = copy.deepcopy(model)
    loss, n, correct = Scorer(model, loss_chunk)(batch, "mean")
    want, want_n, want_correct = scored_batch(twin, batch, "mean")
    assert n == want_n == 18 and int(correct) == int(want_correct)
    torch.testing.assert_close(loss, want)
    loss.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
