"""Checkpoints written by an older lm keep loading and keep their meaning.

tests/fixtures/v1/ holds tiny models saved by checkpoint format 1 (see make_v1_fixtures.py)
with the logits they gave then on a fixed input; today's code must reproduce them exactly."""

from pathlib import Path

import pytest
import torch

import lm

V1 = Path(__file__).parent / "fixtures" / "v1"
NAMES = ["gqa", "sliding-per-layer", "sliding-global-every", "hybrid"]


@pytest.mark.parametrize("name", NAMES)
def test_format_1_checkpoint_loads_with_identical_logits(name):
    model, tokenizer = lm.load(V1 / f"{name}.ckpt")
    with torch.no_grad():
        logits = model(torch.load(V1 / "input.pt", weights_only=True))
    assert torch.equal(logits, torch.load(V1 / f"{name}.logits.pt", weights_only=True))
    assert tokenizer.get_vocab_size() == 300


def test_format_1_export_folder_loads_with_identical_logits():
    model, _ = lm.load(V1 / "sliding-per-layer-export")
    with torch.no_grad():
        logits = model(torch.load(V1 / "input.pt", weights_only=True))
    assert torch.equal(logits, torch.load(V1 / "sliding-per-layer.logits.pt", weights_only=True))
