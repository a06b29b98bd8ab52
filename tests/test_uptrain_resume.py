"""An interrupted uptraining continues like training: SIGINT or SIGTERM saves last.ckpt and prints the
command that continues it; that command resumes the steps, the schedule and the distillation, and the
continued run follows the uninterrupted one's loss curve. A resume with other settings is one line."""

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_config, train_small_run
from test_reliability import losses_by_step, wait_for_step

from lm.config.uptrain import UptrainRun
from lm.formats.checkpoint import read_checkpoint
from lm.training.uptraining import uptrain
from lm.util.errors import USER_ERRORS

ROOT = Path(__file__).resolve().parents[1]


def uptrain_run(overrides: list[str]) -> UptrainRun:
    """scripts/uptrain.py's settings, as the script builds them from its command line."""
    return UptrainRun.from_config(compose_config("uptrain", overrides))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, small_corpus) -> Path:
    """A 4-head run whose settings the uptraining inherits: last.ckpt every 2 steps, a loss logged every step."""
    return train_small_run(tmp_path_factory.mktemp("resume-teacher"), small_corpus, "attn=mha",
                           "trainer.max_steps=6", "checkpoint.every_n_steps=2", "trainer.log_every_n_steps=1",
                           "run_name=teacher")


def settings(teacher, checkpoints, *overrides):
    return [f"ckpt={teacher}", f"checkpoint_dir={checkpoints}", "attn.n_kv_head=2", "uptrain.steps=40",
            "uptrain.distill=0.5", "uptrain.temperature=2.0", "uptrain.evaluations=2", "uptrain.limit_val_batches=1",
            "logger=csv", "progress_bar=false", "sample_tokens=0", *overrides]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_uptraining_continues_with_the_command_it_prints_on_the_uninterrupted_curve(
        teacher, tmp_path, signum):
    checkpoints = tmp_path / "checkpoints"
    straight = uptrain(uptrain_run(settings(teacher, checkpoints, "run_name=straight")))
    expected = losses_by_step(Path(straight["run_dir"]), 0)
    assert sorted(expected) == list(range(40))

    args = settings(teacher, checkpoints, "run_name=stopped", f"hydra.run.dir={tmp_path / 'hydra'}")
    child = subprocess.Popen([sys.executable, "scripts/uptrain.py", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    last = checkpoints / "stopped" / "last.ckpt"
    wait_for_step(child, last, 6)
    os.kill(child.pid, signum)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 128 + signum, stderr
    stopped_at = read_checkpoint(last)["global_step"]
    assert 6 <= stopped_at < 40
    said = stderr.strip().splitlines()[-1]
    prefix = f"stopped by {signal.Signals(signum).name} at step {stopped_at}; {last} holds it, `"
    assert said.startswith(prefix) and said.endswith("` continues the run"), said
    command = shlex.split(said[len(prefix):-len("` continues the run")])
    assert command[:2] == ["python", "scripts/uptrain.py"] and command[-1] == "resume=true"

    resumed = subprocess.run([sys.executable, *command[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ckpt = read_checkpoint(last)
    assert ckpt["global_step"] == 40
    assert ckpt["lm"]["provenance"]["distill"] == 0.5 and ckpt["lm"]["run_config"]["uptrain"]["temperature"] == 2.0
    after = losses_by_step(last.parent, 1)
    assert min(after) == stopped_at and max(after) == 39  # it went on from the step it stopped at
    for step, loss in after.items():  # the distilled loss, under the same schedule, as if never stopped
        assert abs(loss - expected[step]) < 1e-5, (step, loss, expected[step])
    before = losses_by_step(last.parent, 0)
    assert all(abs(before[s] - expected[s]) < 1e-5 for s in before if s < stopped_at)


def test_resume_without_a_run_or_with_other_settings_is_one_line(teacher, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    short = ["uptrain.steps=2", "logger=none", "run_name=short"]

    def refused(*overrides) -> str:
        with pytest.raises(USER_ERRORS) as error:
            uptrain(uptrain_run(settings(teacher, checkpoints, *short, *overrides)))
        line = f"error: {error.value}"
        assert "\n" not in line
        return line

    assert refused("resume=true") == (f"error: resume=true but run 'short' has no checkpoint at "
                                      f"{checkpoints / 'short' / 'last.ckpt'}")
    assert not checkpoints.exists()  # nothing written
    uptrain(uptrain_run(settings(teacher, checkpoints, *short)))
    last = checkpoints / "short" / "last.ckpt"
    written = last.read_bytes()
    assert refused("resume=true", "uptrain.distill=1.0") == (
        "error: resume=true continues the uptraining as it started; uptrain.distill=1.0 (checkpoint: 0.5); "
        "start afresh (resume=false or another run_name) to change them")
    assert refused("resume=true", "seed=3").startswith("error: resume=true continues the uptraining as it started; "
                                                       "seed=3 (checkpoint: 0)")
    assert refused("resume=maybe").startswith("error: resume=")
    assert refused("resume=true", "uptrain.steps=0", "out=x") == (
        "error: resume=true continues an uptraining run; uptrain.steps=0 converts only, with no run to continue")
    assert last.read_bytes() == written  # the run refused left its checkpoint as it was
    # The same settings: the finished run resumes with no step left to take, and says where it is.
    again = uptrain(uptrain_run(settings(teacher, checkpoints, *short, "resume=true")))
    assert again["steps"] == 2 and again["val_loss_before"] == again["val_history"][0][1]
