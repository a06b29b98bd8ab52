"""Distillation from a frozen teacher (the parent of an uptraining): the loss, its gradients, its settings."""

import copy
import csv
from pathlib import Path

import pytest
import torch

from lm import ConfigError, ModelConfig, Transformer
from lm.config.uptrain import UptrainOptions
from lm.data.mqar import IGNORE
from lm.formats.checkpoint import read_checkpoint
from lm.training.module import LitLM, OptimConfig
from lm.training.run import distillation_settings, train
from lm.util.settings import built

SMALL = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_ff=48, max_seq_len=32)


def small_model(seed, **overrides):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**SMALL, **overrides}))


def lit(student, teacher, distill=0.5, temperature=2.0):
    return LitLM(student, OptimConfig(), total_steps=10, teacher=teacher, distill=distill, temperature=temperature)


def text_batch(seed=0):
    return torch.randint(0, 61, (3, 17), generator=torch.Generator().manual_seed(seed))  # (B, T + 1)


def kl_by_hand(student_logits, teacher_logits, scored, temperature):
    """KL(p_teacher || p_student) at the temperature, averaged over the scored positions, by its definition."""
    p = torch.softmax(teacher_logits.double() / temperature, dim=-1)
    log_q = torch.log_softmax(student_logits.double() / temperature, dim=-1)
    per_position = (p * (p.log() - log_q)).sum(-1)
    return per_position[scored].mean()


def test_a_copy_of_the_model_as_teacher_adds_nothing():
    student = small_model(0)
    module = lit(student, copy.deepcopy(student))
    loss, ce, kl = module.training_losses(text_batch())
    assert abs(kl.item()) < 1e-6
    torch.testing.assert_close(loss, ce)
    plain, _ = LitLM(student, OptimConfig(), total_steps=10).loss(text_batch())
    torch.testing.assert_close(ce, plain)


@pytest.mark.parametrize("distill, temperature", [(0.5, 2.0), (1.0, 1.0), (3.0, 0.5)])
def test_the_loss_adds_the_weighted_kl_to_the_teacher(distill, temperature):
    student, teacher = small_model(0), small_model(1)
    batch = text_batch()
    loss, ce, kl = lit(student, teacher, distill, temperature).training_losses(batch)
    with torch.no_grad():
        student_logits, teacher_logits = student(batch[:, :-1]), teacher(batch[:, :-1])
    expected_kl = kl_by_hand(student_logits, teacher_logits, torch.ones(3, 16, dtype=torch.bool), temperature)
    assert expected_kl > 1e-3  # two different models: the test could fail
    torch.testing.assert_close(kl.double(), expected_kl, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(ce, torch.nn.functional.cross_entropy(student_logits.flatten(0, 1),
                                                                     batch[:, 1:].flatten()))
    torch.testing.assert_close(loss, ce + distill * temperature**2 * kl)


def test_the_kl_is_a_mean_over_the_scored_positions_only():
    """A recall batch (inputs, targets) scores its answers only; the other positions add nothing."""
    student, teacher = small_model(0), small_model(1)
    inputs = text_batch()[:, :-1]
    targets = torch.full_like(inputs, IGNORE)
    targets[:, [3, 9]] = inputs[:, [4, 10]]
    _, _, kl = lit(student, teacher, 1.0, 1.5).training_losses((inputs, targets))
    with torch.no_grad():
        expected = kl_by_hand(student(inputs), teacher(inputs), targets != IGNORE, 1.5)
    torch.testing.assert_close(kl.double(), expected, rtol=1e-4, atol=1e-7)


def test_gradients_reach_the_student_only_and_the_teacher_is_no_part_of_the_module():
    student, teacher = small_model(0), small_model(1)
    teacher.train()
    module = lit(student, teacher)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    loss, _, _ = module.training_losses(text_batch())
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
    assert all(name.startswith("model.") for name in module.state_dict())
    teacher_ids = {id(p) for p in teacher.parameters()}
    assert not any(id(p) in teacher_ids for p in module.parameters())


def test_a_tiny_run_with_a_teacher_logs_the_kl_and_saves_no_teacher(train_config):
    cfg = train_config("trainer.max_steps=2", "trainer.val_every_n_steps=2", "trainer.limit_val_batches=1",
                       "trainer.log_every_n_steps=1", "sample.max_new_tokens=0")
    cfg.uptrain = UptrainOptions(distill=0.5, temperature=2.0)
    teacher = Transformer(ModelConfig(vocab_size=512, n_layer=1, d_model=32, n_head=2, d_ff=32, max_seq_len=32))
    before = {name: p.clone() for name, p in teacher.state_dict().items()}
    result = train(cfg, teacher=teacher)
    state = read_checkpoint(result["last"])["state_dict"]
    assert state and all(name.startswith("model.") for name in state)
    assert all(torch.equal(before[name], p) for name, p in teacher.state_dict().items())  # frozen
    header, *rows = metrics(result["run_dir"])
    assert {"train/loss", "train/ce", "train/kl"} <= set(header)
    steps = [{name: float(row[header.index(name)]) for name in ("train/loss", "train/ce", "train/kl")}
             for row in rows if row[header.index("train/kl")]]
    assert steps
    for step in steps:  # what was minimised is the cross-entropy plus distill * T^2 * KL
        assert step["train/kl"] > 0
        assert step["train/loss"] == pytest.approx(step["train/ce"] + 0.5 * 2.0**2 * step["train/kl"], rel=1e-5)


def metrics(run_dir):
    """The CSV logger's rows, header first."""
    (path,) = Path(run_dir).glob("csv/*/metrics.csv")
    return list(csv.reader(path.open()))


@pytest.mark.parametrize("uptrain, message", [
    ({"distill": -0.5}, r"^uptrain.distill=-0.5 must be a finite number >= 0$"),
    ({"distill": True}, r"^uptrain.distill=True must be a finite number >= 0$"),
    ({"distill": "lots"}, r"^uptrain.distill='lots' must be a finite number >= 0$"),
    ({"temperature": 0}, r"^uptrain.temperature=0 must be a positive number$"),
    ({"temperature": False}, r"^uptrain.temperature=False must be a positive number$"),
    # checked in float32, where the loss uses them
    ({"distill": 1e308}, r"^uptrain.distill=1e\+308 overflows float32"),
    ({"distill": 1e-50}, r"^uptrain.distill=1e-50 rounds to zero in float32"),
    ({"distill": 1.0, "temperature": 1e-300}, r"^uptrain.temperature=1e-300 must be from 3e-35 to 2e\+17"),
])
def test_bad_distillation_settings_fail_in_one_line(uptrain, message):
    with pytest.raises(ConfigError, match=message):
        distillation_settings(built(UptrainOptions, uptrain, "uptrain."), small_model(1))


def test_settings_default_to_no_distillation():
    assert distillation_settings(None, None) == (0.0, 1.0)  # not an uptraining
    assert distillation_settings(UptrainOptions(init="mean"), None) == (0.0, 1.0)
    assert distillation_settings(UptrainOptions(distill=2, temperature=3), small_model(1)) == (2.0, 3.0)


def test_distilling_without_a_teacher_is_refused_before_any_data_work(train_config, tmp_path):
    cfg = train_config()
    cfg.uptrain = UptrainOptions(distill=0.5)
    cfg.data.cache_dir = str(tmp_path / "cache")
    message = r"^uptrain.distill=0.5 needs a teacher \(the parent model\); none was given$"
    with pytest.raises(ConfigError, match=message):
        train(cfg)
    assert not (tmp_path / "cache").exists()


def test_a_teacher_of_another_vocabulary_is_refused():
    with pytest.raises(ConfigError, match=r"^the teacher's vocab_size=62 differs from the model's 61: "):
        lit(small_model(0), small_model(1, vocab_size=62))
