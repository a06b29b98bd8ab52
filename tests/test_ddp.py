"""Two data-parallel CPU processes (gloo) train the same model as one process with the same global batch."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL

from lm.formats.checkpoint import model_state_dict, read_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def run_ddp(cfg, tmp_path, *overrides):
    # float32 as the one-process run (trainer=cpu): auto would pick bf16-mixed on a CPU with bf16 instructions
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), f"optim={cfg.optim.name}", "trainer=ddp",
         "trainer.devices=2",
         "trainer.accelerator=cpu", "trainer.precision=32-true", "data=text", f"data.paths=[{cfg.data.paths[0]}]",
         "data.vocab_size=512",
         "data.batch_size=4", f"data.cache_dir={cfg.data.cache_dir}", f"checkpoint_dir={cfg.checkpoint_dir}",
         *TINY_MODEL, "trainer.max_steps=6", "trainer.val_every_n_steps=3", "trainer.limit_val_batches=2",
         "optim.warmup_steps=2", "logger=none", "trainer.progress_bar=false", "sample.max_new_tokens=0", "run_name=ddp",
         f"hydra.run.dir={tmp_path / 'hydra'}", *overrides],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:]
    # Rank 0 alone speaks: its lines once, Lightning's per-process line only for rank 0.
    lines = [line.removeprefix("INFO: ") for line in result.stdout.splitlines()]  # Lightning prefixes its level
    for start in ("run ddp:", "attention:", "GPU available", "Initializing distributed", "== run ddp finished =="):
        assert sum(line.startswith(start) for line in lines) == 1, start
    return Path(cfg.checkpoint_dir) / "ddp" / "last.ckpt"


def assert_same_weights(a: Path, b: Path) -> None:
    ours, theirs = model_state_dict(read_checkpoint(a)), model_state_dict(read_checkpoint(b))
    for name, tensor in ours.items():
        torch.testing.assert_close(theirs[name], tensor, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_with_the_same_global_batch_and_resumes(train_config, tmp_path):
    from lm.training.run import train

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


@pytest.mark.parametrize("env, main", [
    ({}, True),                                                   # a single process
    ({"LOCAL_RANK": "1"}, False),                                 # Lightning's launcher, second process
    ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, False),               # first process of the second machine
    ({"NODE_RANK": "1"}, False),                                  # ... before it starts the others
    ({"RANK": "0", "LOCAL_RANK": "0", "NODE_RANK": "1"}, True),   # torchrun's global rank decides
    ({"RANK": "3", "LOCAL_RANK": "0"}, False),
    ({"SLURM_PROCID": "2"}, False),                               # srun
    ({"SLURM_PROCID": "0", "LOCAL_RANK": "1"}, False),            # an allocation where Lightning launches
])
def test_rank_zero_is_read_from_what_each_launcher_sets(env, main, monkeypatch):
    from lm.util.distributed import is_main_process

    for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert is_main_process() is main


@pytest.mark.slow
def test_two_process_ddp_with_muon_matches_one_process(train_config, tmp_path):
    """Muon orthogonalises whole matrices: under DDP each process holds them whole and steps on the
    same averaged gradient, so two processes of batch 4 train as one of batch 8."""
    from lm.training.run import train

    # Newton-Schulz in float32: gradients summed in another order differ in their last float32 bits,
    # which a bf16 iteration (auto's choice on a CPU with bf16 instructions) can turn into 2^-8 of an
    # update, more than the bound below at a Muon learning rate of 0.04 (twice the default). A rank
    # stepping on its own half batch would be off by about 1e-2 (measured: 5e-3 to 1.5e-2 per tensor at
    # lr 0.02).
    muon = ("optim=muon", "optim.ns_dtype=float32")
    single = train(train_config(*muon, "data.batch_size=8", "trainer.max_steps=4", "run_name=single"))
    ddp_ckpt = run_ddp(train_config(), tmp_path, *muon, "trainer.max_steps=4")
    assert read_checkpoint(ddp_ckpt)["global_step"] == 4
    ours, theirs = model_state_dict(read_checkpoint(Path(single["last"]))), model_state_dict(read_checkpoint(ddp_ckpt))
    for name, tensor in ours.items():
        torch.testing.assert_close(theirs[name], tensor, atol=5e-4, rtol=0, msg=name)
