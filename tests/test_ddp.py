"""Two data-parallel CPU processes (gloo) train the same model as one process with the same global batch."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL

from lm.checkpoint import model_state_dict, read_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def run_ddp(cfg, tmp_path, *overrides):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "trainer=ddp", "trainer.devices=2",
         "trainer.accelerator=cpu", "data=text", f"data.paths=[{cfg.data.paths[0]}]", "data.vocab_size=512",
         "data.batch_size=4", f"data.cache_dir={cfg.data.cache_dir}", f"checkpoint_dir={cfg.checkpoint_dir}",
         *TINY_MODEL, "trainer.max_steps=6", "trainer.val_every_n_steps=3", "trainer.limit_val_batches=2",
         "optim.warmup_steps=2", "logger=none", "trainer.progress_bar=false", "sample.max_new_tokens=0", "run_name=ddp",
         f"hydra.run.dir={tmp_path / 'hydra'}", *overrides],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return Path(cfg.checkpoint_dir) / "ddp" / "last.ckpt"


def assert_same_weights(a: Path, b: Path) -> None:
    ours, theirs = model_state_dict(read_checkpoint(a)), model_state_dict(read_checkpoint(b))
    for name, tensor in ours.items():
        torch.testing.assert_close(theirs[name], tensor, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_with_the_same_global_batch_and_resumes(train_config, tmp_path):
    from lm.training import train

    # One process, batch 8: 4 steps, then resumed to 6. Two processes, batch 4 each: the same.
    single = ("data.batch_size=8", "trainer.val_every_n_steps=3", "run_name=single")
    train(train_config(*single, "trainer.max_steps=4"))
    single = train(train_config(*single, "trainer.max_steps=6", "resume=true"))
    cfg = train_config()
    ddp_ckpt = run_ddp(cfg, tmp_path, "trainer.max_steps=4")
    assert read_checkpoint(ddp_ckpt)["global_step"] == 4
    assert len(list(ddp_ckpt.parent.glob("*.ckpt"))) == 2  # rank 0 alone wrote last + best
    ddp_ckpt = run_ddp(cfg, tmp_path, "resume=true")
    assert read_checkpoint(ddp_ckpt)["global_step"] == 6
    assert_same_weights(Path(single["last"]), ddp_ckpt)
