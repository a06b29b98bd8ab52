"""Checkpoints written by an older lm keep loading and keep their meaning.

tests/fixtures/v1/ holds tiny models saved by checkpoint format 1 (see make_v1_fixtures.py)
with the logits they gave then on a fixed input; today's code must reproduce them exactly."""

from pathlib import Path

import pytest
import torch

import lm

V1 = Path(__file__).parent / "fixtures" / "v1"
NAMES = ["gqa", "sliding-per-layer", "sliding-global-every", "hybrid"]


def assert_same_function(logits: torch.Tensor, stored: torch.Tensor) -> None:
    """The logits the old code computed, to float rounding: a kernel may be rewritten (linear
    attention's chunkwise op was, after these fixtures were written) and round differently, but a
    changed meaning (a default, a layout, a missing option) moves logits by far more than 1e-5."""
    torch.testing.assert_close(logits, stored, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_format_1_checkpoint_loads_with_identical_logits(name):
    model, tokenizer = lm.load(V1 / f"{name}.ckpt")
    with torch.no_grad():
        logits = model(torch.load(V1 / "input.pt", weights_only=True))
    assert_same_function(logits, torch.load(V1 / f"{name}.logits.pt", weights_only=True))
    assert tokenizer.get_vocab_size() == 300


def test_format_1_export_folder_loads_with_identical_logits():
    model, _ = lm.load(V1 / "sliding-per-layer-export")
    with torch.no_grad():
        logits = model(torch.load(V1 / "input.pt", weights_only=True))
    assert_same_function(logits, torch.load(V1 / "sliding-per-layer.logits.pt", weights_only=True))


def test_checkpoints_are_written_in_format_2_and_a_newer_format_is_refused(tmp_path):
    from lm.formats.checkpoint import FORMAT_VERSION, read_checkpoint, save_checkpoint

    model, tokenizer = lm.load(V1 / "hybrid.ckpt")
    path = save_checkpoint(tmp_path / "again.ckpt", model.state_dict(), model.config, tokenizer.to_str())
    entry = read_checkpoint(path)["lm"]
    assert entry["format_version"] == FORMAT_VERSION == 2
    assert [layer["kind"] for layer in entry["model_config"]["attention"]] == ["linear", "sliding", "linear", "softmax"]
    assert entry["model_config"]["attention"][1] == {"kind": "sliding", "gate": "none", "qk_norm": False, "window": 4,
                                                     "dilation": 1, "sink_tokens": 0, "learned_sink": False,
                                                     "softcap": None}
    again, _ = lm.load(path)
    with torch.no_grad():
        logits = again(torch.load(V1 / "input.pt", weights_only=True))
    assert_same_function(logits, torch.load(V1 / "hybrid.logits.pt", weights_only=True))

    ckpt = torch.load(path, weights_only=True)
    ckpt["lm"]["format_version"] = 3
    torch.save(ckpt, tmp_path / "future.ckpt")
    with pytest.raises(lm.util.errors.CheckpointError) as err:
        lm.load(tmp_path / "future.ckpt")
    assert str(err.value).endswith("has format_version=3; this lm reads versions 1, 2; a newer lm wrote it: "
                                   "upgrade lm to read it")
