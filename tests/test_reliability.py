"""A run survives SIGKILL exactly, checkpoints are never torn, and no file can run code on load."""

import csv
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL

import lm
from lm.formats.checkpoint import read_checkpoint
from lm.training.module import AtomicCheckpointIO, warmup_cosine
from lm.training.run import train
from lm.util.errors import CheckpointError, ConfigError, DataError
from lm.util.files import RunLock, write_atomically

ROOT = Path(__file__).resolve().parents[1]


def losses_by_step(run_dir: Path, version: int) -> dict[int, float]:
    rows = csv.DictReader(open(run_dir / "csv" / f"version_{version}" / "metrics.csv"))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


COMMON = ["trainer.val_every_n_steps=1000", "checkpoint.every_n_steps=5", "trainer.log_every_n_steps=1", "logger=csv"]


def start_training_child(train_config, tmp_path, *overrides) -> tuple[subprocess.Popen, Path]:
    """scripts/train.py in a child process with train_config's settings; (process, its last.ckpt)."""
    cfg = train_config(*overrides)
    paths = [f"data.paths=[{cfg.data.paths[0]}]", f"data.cache_dir={cfg.data.cache_dir}",
             f"checkpoint_dir={cfg.checkpoint_dir}", f"hydra.run.dir={tmp_path / 'hydra'}"]
    args = [f"optim={cfg.optim.name}",  # the optimizer train_config chose (AdamW unless overridden)
            "data=text", "data.vocab_size=512", "data.batch_size=4", "trainer=cpu", "trainer.limit_val_batches=2",
            "trainer.progress_bar=false", "optim.warmup_steps=2", "sample.max_new_tokens=0",
            *TINY_MODEL, *overrides, *paths]
    child = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return child, Path(cfg.checkpoint_dir) / cfg.run_name / "last.ckpt"


def wait_for_step(child: subprocess.Popen, last: Path, step: int) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and child.poll() is None:
        if last.is_file() and read_checkpoint(last)["global_step"] >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"the child finished or stalled before step {step}")


def assert_resumes_on_curve(train_config, run_name: str, stopped_at: int, expected: dict, max_steps: int) -> None:
    resumed = train(train_config(*COMMON, f"trainer.max_steps={max_steps}", f"run_name={run_name}", "resume=true"))
    assert resumed["steps"] == max_steps
    after = losses_by_step(Path(resumed["run_dir"]), 1)
    assert min(after) == stopped_at and max(after) == max_steps - 1
    for step, loss in after.items():
        assert abs(loss - expected[step]) < 1e-5, (step, loss, expected[step])


@pytest.mark.slow
def test_killed_run_resumes_on_the_uninterrupted_loss_curve(train_config, tmp_path):
    straight = train(train_config(*COMMON, "trainer.max_steps=120", "run_name=straight"))
    expected = losses_by_step(Path(straight["run_dir"]), 0)

    child, last = start_training_child(train_config, tmp_path, *COMMON, "trainer.max_steps=120", "run_name=killed")
    wait_for_step(child, last, 20)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    killed_at = read_checkpoint(last)["global_step"]  # last.ckpt is whole even if the kill hit a save
    assert 20 <= killed_at < 120
    assert_resumes_on_curve(train_config, "killed", killed_at, expected, 120)


@pytest.mark.slow
def test_ctrl_c_and_sigterm_save_the_current_step_and_resume_exactly(train_config, tmp_path):
    straight = train(train_config(*COMMON, "trainer.max_steps=80", "run_name=straight"))
    expected = losses_by_step(Path(straight["run_dir"]), 0)
    for signum in (signal.SIGINT, signal.SIGTERM):
        name = signal.Signals(signum).name.lower()
        child, last = start_training_child(train_config, tmp_path, *COMMON, "trainer.max_steps=80",
                                           f"run_name={name}")
        wait_for_step(child, last, 10)  # the periodic save (every 5 steps) shows the run is under way
        os.kill(child.pid, signum)
        _, stderr = child.communicate(timeout=120)
        assert child.returncode == 128 + signum, stderr
        stopped_at = read_checkpoint(last)["global_step"]
        assert 10 <= stopped_at < 80
        assert stderr.strip().splitlines()[-1] == (f"stopped by {signal.Signals(signum).name} at step {stopped_at}; "
                                                   f"{last} holds it, resume=true continues the run")
        assert not list(last.parent.glob(".*tmp*"))
        assert_resumes_on_curve(train_config, name, stopped_at, expected, 80)


def test_resumed_wandb_run_keeps_its_id(train_config, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    first = train(train_config("logger=wandb", "trainer.max_steps=3"))
    run_id = read_checkpoint(first["last"])["lm"]["wandb_run_id"]
    assert run_id
    train(train_config("logger=wandb", "trainer.max_steps=5", "resume=true"))
    runs = sorted(p.name for p in (Path(first["run_dir"]) / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(run_id) for name in runs)


class RunsCode:
    """Unpickling this calls os.system: what a malicious checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused_everywhere(train_config, tmp_path):
    marker = tmp_path / "pwned"
    crafted = tmp_path / "crafted.ckpt"
    torch.save({"state_dict": {}, "lm": RunsCode(marker)}, crafted)
    with pytest.raises(CheckpointError, match=r"refused by the safe loader: .* \(posix.system\), which could run code"):
        lm.load(crafted)
    with pytest.raises(CheckpointError, match="refused by the safe loader"):
        train(train_config(f"ckpt_path={crafted}"))
    assert not marker.exists()


def test_a_failed_save_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(3)}, path)

    def disk_full(obj, f):
        Path(f).write_bytes(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError) as err:
        io.save_checkpoint({"step": 2, "w": torch.zeros(3)}, path)
    assert "No space left on device" in str(err.value) and "previous file is untouched" in str(err.value)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_resume_without_a_checkpoint_is_one_clear_error(train_config):
    with pytest.raises(ConfigError, match="resume=true but run 'mha-nano' has no checkpoint"):
        train(train_config("resume=true"))


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_safetensors_export_is_plain_data_that_load_reads(tmp_path, tied):
    from tokenizers import Tokenizer, models

    from lm import ModelConfig, Transformer
    from lm.formats.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=48,
                                    tie_embeddings=tied)).eval()
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    ckpt = save_checkpoint(tmp_path / "run" / "last.ckpt", model.state_dict(), model.config, tokenizer.to_str())
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), f"ckpt={ckpt}",
                             f"out={tmp_path / 'export'}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["config.json", "model.safetensors",
                                                                        "tokenizer.json"]
    loaded, _ = lm.load(tmp_path / "export")
    idx = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))
    assert (loaded.head.weight is loaded.embed.weight) == tied


def test_a_real_full_disk_during_torch_save_is_one_line_and_leaves_nothing_behind(tmp_path):
    """/dev/full refuses every write with ENOSPC, as a full disk does; torch.save turns that into
    a RuntimeError of its zip writer, which must still read as a failed write."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    path = tmp_path / "last.ckpt"
    torch.save({"step": 1}, path)

    def write(tmp: Path) -> None:
        tmp.write_bytes(b"half a checkpoint")
        torch.save({"w": torch.ones(100_000)}, "/dev/full")

    with pytest.raises(CheckpointError, match=r"could not write .*last.ckpt.*the previous file is untouched"):
        write_atomically(path, write)
    assert torch.load(path, weights_only=True)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temporaries_of_dead_runs_are_removed_and_live_ones_kept(train_config, tmp_path):
    cfg = train_config("trainer.max_steps=2")
    cfg.data.cache_dir = str(tmp_path / "cache")  # a cache of its own, its temporaries this test's
    run_dir, cache = Path(cfg.checkpoint_dir) / cfg.run_name, Path(cfg.data.cache_dir)
    run_dir.mkdir(parents=True)
    cache.mkdir(parents=True)
    pid = dead_pid()
    stale = [run_dir / f".last.ckpt.tmp-{pid}", cache / f"text-0123.tmp-{pid}"]
    stale[0].write_bytes(b"half")
    stale[1].mkdir()
    live = run_dir / f".notes.txt.tmp-{os.getpid()}"  # this process is alive: kept
    live.write_bytes(b"being written")
    train(cfg)
    assert not any(p.exists() for p in stale) and live.exists()


def test_a_second_run_of_the_same_name_is_refused_and_a_killed_one_leaves_no_lock(train_config):
    cfg = train_config("trainer.max_steps=2")
    run_dir = Path(cfg.checkpoint_dir) / cfg.run_name
    with RunLock(run_dir, cfg.run_name):
        with pytest.raises(ConfigError, match=f"run 'mha-nano' is being trained by process {os.getpid()} right now"):
            train(cfg)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from lm.util.files import RunLock\nwith RunLock(Path(sys.argv[1]), 'x'):\n"
                               "    print('locked', flush=True); time.sleep(600)", str(run_dir)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(ConfigError, match="is being trained by process"):
        train(cfg)
    holder.kill()
    holder.wait()
    assert train(cfg)["steps"] == 2


def test_a_run_stopped_by_bad_input_leaves_no_run_folder(train_config):
    cfg = train_config("data.batch_size=100000")  # refused once the data is read, inside the lock
    with pytest.raises(DataError, match="larger than the"):
        train(cfg)
    assert not (Path(cfg.checkpoint_dir) / cfg.run_name).exists()


@pytest.mark.parametrize("where, error, message", [
    ("checkpoint_dir", CheckpointError, "cannot create the folder '{blocked}/checkpoints/mha-nano': "
                                        "'{blocked}' is a file, not a folder"),
    ("cache_dir", DataError, "could not write the token cache in '{blocked}/cache': "
                             "'{blocked}' is a file, not a folder"),
])
def test_a_folder_that_cannot_be_written_is_one_line_before_training(train_config, tmp_path, where, error, message):
    # Tests run as root, whom permissions do not stop; a file where a folder must be created
    # stops everyone.
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a folder")
    cfg = train_config()
    if where == "checkpoint_dir":
        cfg.checkpoint_dir = str(blocked / "checkpoints")
    else:
        cfg.data.cache_dir = str(blocked / "cache")
    with pytest.raises(error, match=re.escape(message.format(blocked=blocked))):
        train(cfg)
    assert blocked.read_text() == "a file, not a folder"
    assert not (Path(train_config().checkpoint_dir) / "mha-nano").exists()


@pytest.mark.parametrize("exporter", ["safetensors", "hf", "gguf"])
def test_an_export_into_a_file_where_its_folder_should_be_is_one_line(tmp_path, exporter):
    from lm.data.tokenizer import train_tokenizer
    from lm.formats.checkpoint import export_safetensors
    from lm.formats.gguf import export_gguf
    from lm.formats.hf import export_hf
    from lm.model.transformer import Transformer

    model = Transformer(lm.ModelConfig(vocab_size=300, n_layer=1, d_model=32, n_head=2, d_ff=64, max_seq_len=16))
    tokenizer = train_tokenizer(iter(["def f(x):\n    return x\n"] * 20), 300)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file")
    write = {"safetensors": export_safetensors, "hf": export_hf,
             "gguf": lambda m, t, out: export_gguf(m, t, out / "model.gguf", "f32")}[exporter]
    with pytest.raises(CheckpointError, match=re.escape(f"'{blocked}' is a file, not a folder")):
        write(model, tokenizer, blocked / "out")
    assert blocked.read_text() == "a file"


def test_a_folder_export_into_a_link_to_another_disk_moves_nothing_across_disks(tmp_path):
    """`out` a link to (or a mount of) another filesystem: a rename across filesystems fails, so
    the temporary folder lives inside `out`."""
    from lm.util.files import write_folder_atomically

    other_disk = Path("/dev/shm")
    if not other_disk.is_dir() or other_disk.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs a second filesystem at /dev/shm")
    target = other_disk / f"lm-test-{os.getpid()}"
    target.mkdir()
    (tmp_path / "out").symlink_to(target, target_is_directory=True)
    try:
        write_folder_atomically(tmp_path / "out", lambda folder: (folder / "a.json").write_text("{}"))
        assert [p.name for p in target.iterdir()] == ["a.json"]  # and no temporary folder left
    finally:
        shutil.rmtree(target, ignore_errors=True)


def test_the_summary_survives_a_diverged_run_and_a_missing_best_score():
    from lm.training.summary import summary_lines

    result = {"val_loss": float("inf"), "val_accuracy": 0.0, "steps": 3, "best": "/x/best.ckpt",
              "best_val_loss": None, "last": "/x/last.ckpt", "train_tokens_per_s": None, "train_seconds": 0.0,
              "wall_seconds": 59.96}
    lines = summary_lines("r", result)
    assert lines[1].startswith("final val loss   inf (ppl inf)")
    assert not any(line.startswith("best checkpoint") for line in lines)
    assert lines[-1] == "wall time        1 min 00 s"


def test_a_nan_loss_stops_the_run_in_one_line_at_the_next_check_with_the_last_good_checkpoint(
        train_config, tmp_path, monkeypatch, capsys):
    """A weight poisoned with NaN before step 4: the loss is watched on the device and read every
    trainer.log_every_n_steps batches and before each save, so the run stops at step 6's save, in
    one line, exit code 2, and last.ckpt stays step 3's."""
    from lm.training.module import LitLM
    from lm.util.cli import exit_on_user_error

    real_start, started = LitLM.on_train_batch_start, []

    def poisoning(self, batch, batch_idx):
        started.append(self.global_step)
        if self.global_step == 4:
            with torch.no_grad():
                next(p for p in self.model.blocks.parameters() if p.dim() == 2)[0, 0] = float("nan")
        real_start(self, batch, batch_idx)

    monkeypatch.setattr(LitLM, "on_train_batch_start", poisoning)
    cfg = train_config("trainer.max_steps=30", "trainer.val_every_n_steps=30", "trainer.log_every_n_steps=4",
                       "checkpoint.every_n_steps=3", "logger=none")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
        train(cfg)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: loss is nan at step 4; stopping with the last good "
                                                   "checkpoint kept"), err
    assert err.count("error: ") == 1 and "Traceback" not in err
    assert started == [0, 1, 2, 3, 4, 5]  # the save after step 5 read the watch
    last = read_checkpoint(Path(cfg.checkpoint_dir) / cfg.run_name / "last.ckpt")
    assert last["global_step"] == 3 and all(torch.isfinite(v).all() for v in last["state_dict"].values())


def test_a_training_step_reads_no_value_back_from_the_device(train_config, monkeypatch):
    """On an accelerator a read of a tensor's value (`if`, .item(), float()) waits for every queued
    step; the training step makes none, so non-finite losses are caught without one."""
    from lm.training.module import LitLM

    reads, inside = [], []

    def counting(name: str):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            if inside:
                reads.append(name)
            return real(self, *args, **kwargs)

        return counted

    for name in ("__bool__", "__float__", "__int__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    real_step = LitLM.training_step

    def watched_step(self, batch, batch_idx):
        inside.append(batch_idx)
        try:
            return real_step(self, batch, batch_idx)
        finally:
            inside.pop()

    monkeypatch.setattr(LitLM, "training_step", watched_step)
    assert train(train_config("trainer.max_steps=3", "logger=none", "sample.max_new_tokens=0"))["steps"] == 3
    assert reads == []


def test_the_lock_is_taken_on_the_file_at_its_path_when_the_holder_removed_it_meanwhile(tmp_path, monkeypatch):
    """The race the folder clean-up opens: we open `.lock`, its holder finishes and removes it,
    then our flock succeeds on a file no one else can see. The lock must be on the new file."""
    import fcntl


    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").write_text("process 1")
    real_flock, calls = fcntl.flock, []

    def flock_after_the_holder_left(file, operation):
        if not calls:  # the first attempt: the file we opened is replaced before we lock it
            (run_dir / ".lock").unlink()
            (run_dir / ".lock").write_text("")
        calls.append(file.fileno())
        return real_flock(file, operation)

    monkeypatch.setattr(fcntl, "flock", flock_after_the_holder_left)
    with RunLock(run_dir, "x") as lock:
        assert len(calls) == 2
        assert os.fstat(lock._file.fileno()).st_ino == os.stat(run_dir / ".lock").st_ino
        (run_dir / "last.ckpt").write_bytes(b"kept")
    assert (run_dir / ".lock").exists()  # a folder with a checkpoint keeps its lock file


def test_a_damaged_token_cache_is_rebuilt_with_a_note(train_config, tmp_path, capsys):
    cfg = train_config("trainer.max_steps=2")
    cfg.data.cache_dir = str(tmp_path / "cache")  # a cache of its own to damage
    train(cfg)
    (cached,) = [p for p in Path(cfg.data.cache_dir).iterdir() if p.is_dir()]
    size = (cached / "train.bin").stat().st_size
    with open(cached / "train.bin", "r+b") as f:
        f.truncate(size // 2)
    capsys.readouterr()
    train(cfg)
    assert f"note: token cache {cached} is damaged (train.bin has {size // 2} bytes, not {size}); rebuilding it" \
        in capsys.readouterr().out
    assert (cached / "train.bin").stat().st_size == size
    with open(cached / "val.bin", "r+b") as f:  # same size, other bytes
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    train(cfg)
    assert "val.bin does not match its checksum" in capsys.readouterr().out


def test_resume_keeps_its_tokenizer_on_a_changed_corpus_and_applies_a_new_learning_rate(train_config, tmp_path,
                                                                                        small_corpus, capsys):
    corpus = tmp_path / "corpus"
    shutil.copytree(small_corpus, corpus)
    first = train(train_config(f"data.paths=[{corpus}]", "trainer.max_steps=4", "trainer.log_every_n_steps=1"))
    tokenizer = read_checkpoint(first["last"])["lm"]["tokenizer"]
    (corpus / "added.py").write_text("def added():\n    return 'a file that changes the tokenizer'\n" * 50)
    capsys.readouterr()
    resumed = train(train_config(f"data.paths=[{corpus}]", "trainer.max_steps=8", "trainer.log_every_n_steps=1",
                                 "optim.lr=0.0005", "resume=true"))
    assert "note: the corpus has changed since the checkpoint" in capsys.readouterr().out
    ckpt = read_checkpoint(resumed["last"])
    assert ckpt["lm"]["tokenizer"] == tokenizer
    assert ckpt["lm"]["run_config"]["optim"]["lr"] == 0.0005
    rows = csv.DictReader(open(Path(resumed["run_dir"]) / "csv" / "version_1" / "metrics.csv"))
    lrs = {int(r["step"]): float(r["train/lr"]) for r in rows if r.get("train/lr")}
    assert sorted(lrs) == [4, 5, 6, 7]
    for step, lr in lrs.items():  # the new base rate on the old schedule (warm-up 2, cosine to 0.1 at step 8)
        assert lr == pytest.approx(0.0005 * warmup_cosine(step, 2, 8, 0.1), rel=1e-6), step


def test_exported_files_have_the_usual_mode(tmp_path):
    from tokenizers import Tokenizer, models

    from lm import ModelConfig, Transformer
    from lm.formats.checkpoint import export_safetensors
    from lm.formats.hf import export_hf
    from lm.util.files import FILE_MODE

    model = Transformer(ModelConfig(vocab_size=20, n_layer=1, d_model=16, n_head=2, d_ff=32))
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    folder = export_safetensors(model, tokenizer, tmp_path / "export")
    modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
    assert modes == dict.fromkeys(["model.safetensors", "config.json", "tokenizer.json"], FILE_MODE)
    # The transformers folder: written by save_pretrained and safetensors (0600) into a
    # temporary folder, each file moved into place with the usual mode.
    folder = export_hf(model, tokenizer, tmp_path / "hf")
    modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= set(modes)
    assert set(modes.values()) == {FILE_MODE}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "hf"]  # no temporary folder left
