"""Two data-parallel CPU processes (gloo) train the same model as one process with the same global batch."""

import subprocess
import sys
from pathlib import Path

import torch

from lm.checkpoint import model_state_dict, read_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def test_two_process_ddp_matches_one_process_with_the_same_global_batch(train_config, tmp_path):
    from lm.training import train

    single = train(train_config("data.batch_size=8", "trainer.max_steps=4", "trainer.val_every_n_steps=4",
                                "run_name=single"))
    cfg = train_config()
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "trainer=ddp", "trainer.devices=2",
         "trainer.accelerator=cpu", "data=text", f"data.paths=[{cfg.data.paths[0]}]", "data.vocab_size=512",
         "data.batch_size=4", f"data.cache_dir={cfg.data.cache_dir}", f"checkpoint_dir={cfg.checkpoint_dir}",
         "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.d_ff=128", "model.max_seq_len=32",
         "trainer.max_steps=4", "trainer.val_every_n_steps=4", "trainer.limit_val_batches=2", "optim.warmup_steps=2",
         "logger=none", "trainer.progress_bar=false", "sample.max_new_tokens=0", "run_name=ddp",
         f"hydra.run.dir={tmp_path / 'hydra'}"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    ddp_ckpt = Path(cfg.checkpoint_dir) / "ddp" / "last.ckpt"
    assert read_checkpoint(ddp_ckpt)["global_step"] == 4
    ours, theirs = model_state_dict(read_checkpoint(single["last"])), model_state_dict(read_checkpoint(ddp_ckpt))
    for name, tensor in ours.items():
        torch.testing.assert_close(theirs[name], tensor, atol=1e-5, rtol=1e-4)
    assert len(list((Path(cfg.checkpoint_dir) / "ddp").glob("*.ckpt"))) == 2  # rank 0 alone wrote last + best
