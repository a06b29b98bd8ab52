"""Each bad input to a training run: one row, one line on stderr, exit code 2, nothing lost."""

from pathlib import Path

import pytest
import torch

from lm.training.run import train
from lm.util.cli import exit_on_user_error
from lm.util.errors import TrainingError


def corpus_file(tmp: Path, content: bytes, name: str = "text.txt") -> str:
    path = tmp / "corpus" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(content)
    return str(path)


def checkpoint_file(tmp: Path, content: bytes) -> str:
    path = tmp / "bad.ckpt"
    path.write_bytes(content)
    return str(path)


def good_checkpoint(train_config, tmp: Path) -> Path:
    return Path(train(train_config("trainer.max_steps=2", "run_name=good"))["last"])


def truncated(tmp: Path, train_config) -> str:
    return checkpoint_file(tmp, good_checkpoint(train_config, tmp).read_bytes()[:4000])


# (id, function of (tmp_path, train_config) -> overrides, expected part of the message)
CASES = [
    ("missing checkpoint", lambda t, c: [f"ckpt_path={t / 'nope.ckpt'}"], "does not exist"),
    ("truncated checkpoint", lambda t, c: [f"ckpt_path={truncated(t, c)}"], "is not a readable torch file"),
    ("corrupt checkpoint", lambda t, c: [f"ckpt_path={checkpoint_file(t, b'not a checkpoint at all')}"],
     "is not a readable torch file"),
    ("checkpoint of another shape", lambda t, c: [f"ckpt_path={good_checkpoint(c, t)}", "attn=gqa"],
     "does not match the configured model: n_kv_head=4 (config: 2)"),
    ("empty corpus", lambda t, c: [f"data.paths=[{corpus_file(t, b'')}]"], "is empty: no text to train on"),
    ("glob matching nothing", lambda t, c: [f"data.paths=[{t / 'none' / '*.txt'}]"], "matches no file"),
    ("corpus smaller than one sequence", lambda t, c: [f"data.paths=[{corpus_file(t, b'x = 1')}]"],
     "too small for a train and a validation sequence"),
    ("vocab too small for bytes", lambda t, c: ["data.vocab_size=100"], "data.vocab_size=100 is too small"),
    ("max_steps 0", lambda t, c: ["trainer.max_steps=0"], "trainer.max_steps=0 must be an integer >= 1"),
    ("negative lr", lambda t, c: ["optim.lr=-1"], "optim.lr=-1 must be a positive number"),
    ("beta1 above 1", lambda t, c: ["optim.beta1=1.5"], "optim.beta1=1.5 must be a number from 0 to 1"),
    ("validation every 0 steps", lambda t, c: ["trainer.val_every_n_steps=0"],
     "trainer.val_every_n_steps=0 must be an integer >= 1"),
    ("no validation batches", lambda t, c: ["trainer.limit_val_batches=0"],
     "trainer.limit_val_batches=0 must be an integer >= 1"),
    ("batch size a word", lambda t, c: ["data.batch_size=abc"], "data.batch_size='abc' must be an integer"),
    ("unknown precision", lambda t, c: ["trainer.precision=bogus"], "trainer.precision='bogus' is not one of"),
    ("negative workers", lambda t, c: ["data.num_workers=-1"], "data.num_workers=-1 must be an integer >= 0"),
    ("negative checkpoint interval", lambda t, c: ["checkpoint.every_n_steps=-5"],
     "checkpoint.every_n_steps=-5 must be an integer >= 1"),
    ("run_name leaving checkpoint_dir", lambda t, c: ["run_name=../../elsewhere"],
     "run_name='../../elsewhere' must name a folder inside checkpoint_dir"),
    ("resume with other data", lambda t, c: [f"ckpt_path={good_checkpoint(c, t)}", "data.vocab_size=600"],
     "a resumed run cannot change data.vocab_size (checkpoint: 512, now: 600)"),
    ("batch larger than the data", lambda t, c: ["data.batch_size=100000"],
     "data.batch_size=100000 is larger than the"),
    ("non-finite loss", lambda t, c: ["optim.lr=1e30", "optim.warmup_steps=1", "trainer.max_steps=30",
                                      "trainer.gradient_clip_val=null"], "at step"),
]


@pytest.mark.parametrize("make_overrides, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(train_config, tmp_path, capsys, make_overrides, message):
    overrides = make_overrides(tmp_path, train_config)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
        train(train_config(*overrides))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    # Progress bars may come first (tokenizing); the failure itself is one line, no traceback.
    assert len(errors) == 1 and err.strip().endswith(errors[0]) and message in errors[0], err
    assert "Traceback" not in err


def test_non_utf8_text_trains(train_config, tmp_path):
    text = corpus_file(tmp_path, "café naïve text, übrigens. ".encode("latin-1") * 400)
    assert train(train_config(f"data.paths=[{text}]", "trainer.max_steps=2"))["steps"] == 2


def test_non_finite_loss_keeps_the_last_good_checkpoint_or_skips(train_config, tmp_path):
    explode = ["optim.lr=1e30", "optim.warmup_steps=1", "trainer.max_steps=30", "trainer.gradient_clip_val=null",
               "checkpoint.every_n_steps=1"]
    with pytest.raises(TrainingError, match="at step"):
        train(train_config(*explode))
    last = tmp_path / "checkpoints" / "mha-nano" / "last.ckpt"
    state = torch.load(last, weights_only=True)["state_dict"]
    assert all(torch.isfinite(v).all() for v in state.values())  # the last good weights



def test_skip_nonfinite_skips_those_steps_and_trains_on(train_config, monkeypatch):
    from lm.training.module import LitLM

    real_loss, calls = LitLM.loss, {"n": 0}

    def loss_with_two_nans(self, batch):
        loss, n = real_loss(self, batch)
        calls["n"] += 1
        return (loss * float("nan"), n) if self.training and calls["n"] in (3, 4) else (loss, n)

    monkeypatch.setattr(LitLM, "loss", loss_with_two_nans)
    result = train(train_config("trainer.skip_nonfinite=true", "trainer.max_steps=6", "run_name=skipping"))
    assert result["steps"] == 6 and result["val_loss"] == result["val_loss"]  # finite, 6 real steps
