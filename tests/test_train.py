"""End-to-end runs through the same config composition and `train` the script uses."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lm
from lm.attention import LinearSpec, SlidingSpec, SoftmaxSpec
from lm.data.corpora import text_corpus
from lm.data.modules import TokenDataModule
from lm.formats.checkpoint import read_checkpoint
from lm.training.module import warmup_cosine
from lm.training.run import train
from lm.training.summary import format_seconds


def test_gqa_run_leaves_checkpoint_tokenizer_and_offline_wandb_run(train_config, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = train_config("attn=gqa", "logger=wandb")
    result = train(cfg)
    run_dir = Path(result["run_dir"])
    assert run_dir.name == "gqa-nano" and result["steps"] == 6
    assert (run_dir / "last.ckpt").is_file() and (run_dir / "best.ckpt").is_file()
    assert (run_dir / "tokenizer.json").is_file()
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1

    assert read_checkpoint(run_dir / "last.ckpt")["global_step"] == 6

    model, tokenizer = lm.load(run_dir / "last.ckpt")
    assert (model.config.n_head, model.config.n_kv_head) == (4, 2)
    assert tokenizer.get_vocab_size() == 512
    # The loaded weights reproduce the val loss the run reported.
    dm = TokenDataModule(text_corpus(list(cfg.data.paths)), Path(cfg.data.cache_dir), seq_len=32,
                         batch_size=4, vocab_size=512, val_fraction=cfg.data.val_fraction)
    dm.setup()
    losses, counts = [], []
    with torch.no_grad():
        for i, batch in enumerate(dm.val_dataloader()):
            if i == 2:  # trainer.limit_val_batches=2
                break
            logits = model(batch[:, :-1])
            targets = batch[:, 1:]
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()) * targets.numel())
            counts.append(targets.numel())
    assert abs(float(sum(losses) / sum(counts)) - result["val_loss"]) < 1e-4


def test_checkpoint_holds_config_and_tokenizer_as_plain_data(train_config):
    result = train(train_config("attn=mqa"))
    ckpt = read_checkpoint(result["last"])  # weights_only=True inside
    assert ckpt["lm"]["model_config"]["n_kv_head"] == 1
    assert ckpt["lm"]["run_config"]["attn"]["name"] == "mqa"
    assert isinstance(ckpt["lm"]["tokenizer"], str)


def test_loss_falls_on_repeated_text(train_config, tmp_path):
    text = tmp_path / "repeat.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    cfg = train_config(f"data.paths=[{text}]", "trainer.max_steps=50", "trainer.val_every_n_steps=50",
                       "optim.lr=3e-3", "optim.warmup_steps=5")
    result = train(cfg)
    assert result["val_loss"] < 1.0  # from ln(vocab) ~ 6.2 at initialisation


def test_resume_continues_the_run_of_that_name(train_config):
    first = train(train_config("trainer.max_steps=4", "trainer.val_every_n_steps=2"))
    assert first["steps"] == 4
    resumed = train(train_config("resume=true", "trainer.max_steps=7", "trainer.val_every_n_steps=2"))
    assert resumed["steps"] == 7
    assert read_checkpoint(resumed["last"])["global_step"] == 7


def test_warmup_then_cosine_schedule():
    values = [warmup_cosine(s, warmup_steps=10, total_steps=110, min_ratio=0.1) for s in range(120)]
    assert values[0] == 0.1 and values[9] == 1.0
    assert abs(values[60] - 0.55) < 1e-9  # halfway through the decay
    assert abs(values[110] - 0.1) < 1e-9 and values[119] == values[110]


def test_hybrid_sliding_and_linear_models_train_end_to_end(train_config):
    runs = {
        # model=nano's QK-norm reaches the kinds that have it (sliding, softmax), not linear attention
        ("attn=hybrid", "attn.pattern=[linear,sliding]", "attn.window=8"):
            [LinearSpec(), SlidingSpec(window=8, qk_norm=True)],
        ("attn=sliding", "attn.window=[4,8]", "attn.dilation=[1,2]", "attn.n_kv_head=2"):
            [SlidingSpec(window=4, qk_norm=True), SlidingSpec(window=8, dilation=2, qk_norm=True)],
        ("attn=sliding", "attn.global_every=2"): [SlidingSpec(qk_norm=True), SoftmaxSpec(qk_norm=True)],
        ("attn=linear", "attn.feature_map=taylor", "attn.n_kv_head=1"): [LinearSpec(feature_map="taylor")] * 2,
    }
    for overrides, layers in runs.items():
        result = train(train_config(*overrides, "trainer.max_steps=4", "trainer.val_every_n_steps=4"))
        assert result["steps"] == 4 and result["val_loss"] < 6.3  # ln 512 = 6.24 at initialisation
        model, _ = lm.load(result["last"])
        assert model.config.attention == layers


def test_lightning_adverts_are_dropped_and_its_other_lines_kept():
    import logging

    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    from lm.util.cli import quiet_known_warnings

    quiet_known_warnings()  # what a script's, the server's and a training run's start call; importing does not
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        rank_zero_info("💡 Tip: For seamless cloud logging, try installing something")
        rank_zero_info("GPU available: False, used: False")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["GPU available: False, used: False"]


@pytest.mark.slow
def test_a_run_says_each_line_once_and_ends_with_its_summary(train_config, tmp_path):
    """The script's whole output (stdout and stderr as a terminal shows them), wandb logging offline:
    no deprecation warning, no advert, Lightning's lines once, and the summary block last."""
    cfg = train_config()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    args = ["data=text", f"data.paths=[{cfg.data.paths[0]}]", "data.vocab_size=512", "data.batch_size=4",
            f"data.cache_dir={cfg.data.cache_dir}", f"checkpoint_dir={cfg.checkpoint_dir}",
            "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.d_ff=128", "model.max_seq_len=32",
            "trainer.max_steps=4", "trainer.val_every_n_steps=3", "trainer.limit_val_batches=1",
            "trainer.progress_bar=false", "logger=wandb", "sample.max_new_tokens=6", "run_name=talk",
            f"hydra.run.dir={tmp_path / 'hydra'}"]
    result = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "scripts" / "train.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:]
    lines = result.stdout.splitlines()
    assert sum("GPU available" in line for line in lines) == 1
    assert sum(line.startswith("run talk:") for line in lines) == 1
    assert not [line for line in lines if "anonymous" in line or "Tip" in line or "deprecat" in line.lower()]
    assert any(line.startswith("wandb:") for line in lines)  # wandb did log, offline
    block = lines[lines.index("== run talk finished =="):]
    assert [line.split()[0] for line in block[:6]] == ["==", "final", "best", "last", "throughput", "wall"]
    assert block[1].startswith("final val loss ") and "(ppl " in block[1] and block[1].endswith("after 4 steps")
    run_dir = Path(cfg.checkpoint_dir) / "talk"
    assert block[2].startswith(f"best checkpoint  {run_dir / 'best.ckpt'} (val loss ")
    assert block[3] == f"last checkpoint  {run_dir / 'last.ckpt'}"
    assert block[6] == "sample:" and len(block) >= 8  # the sample ends the output
    assert not any(line.startswith("wandb:") for line in block)


@pytest.mark.parametrize("seconds, shown", [(3.44, "3.4 s"), (59.94, "59.9 s"), (892.4, "14 min 52 s"),
                                            (3599.6, "1 h 00 min"), (11220, "3 h 07 min")])
def test_wall_times_read_as_people_say_them(seconds, shown):
    assert format_seconds(seconds) == shown


@pytest.mark.parametrize("accelerator, cuda, bf16_cpu, expected", [
    ("auto", False, False, "32-true"),    # a CPU without bf16 instructions: bf16 matmuls ~100x slower
    ("auto", False, True, "bf16-mixed"),  # AVX512-BF16 or AMX: ~3.5x fp32's matmul rate
    ("auto", True, False, "bf16-mixed"),
    ("cpu", False, True, "bf16-mixed"),
    ("gpu", False, False, "bf16-mixed"),
])
def test_precision_auto_follows_what_the_hardware_multiplies_fast(monkeypatch, accelerator, cuda, bf16_cpu, expected):
    from omegaconf import OmegaConf

    from lm.training import setup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(setup, "cpu_multiplies_bf16", lambda: bf16_cpu)
    trainer = OmegaConf.create({"precision": "auto", "accelerator": accelerator})
    assert setup.pick_precision(trainer) == expected
    assert setup.pick_precision(OmegaConf.merge(trainer, {"precision": "32-true"})) == "32-true"  # asked for: kept


@pytest.mark.parametrize("variables, limit, bf16, int8", [
    ({}, None, True, True),
    ({"DNNL_MAX_CPU_ISA": "AVX2"}, "AVX2", False, False),  # as docs/performance.md emulates an AVX2 CPU
    ({"ONEDNN_MAX_CPU_ISA": "avx512_core"}, "AVX512_CORE", False, False),  # oneDNN takes either case
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, "AVX512_CORE_VNNI", False, True),
    ({"DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "AVX512_CORE_BF16", True, True),
    ({"DNNL_MAX_CPU_ISA": "AVX512_CORE_AMX"}, "AVX512_CORE_AMX", True, True),
    ({"ONEDNN_MAX_CPU_ISA": "ALL", "DNNL_MAX_CPU_ISA": "AVX2"}, None, True, True),  # the newer name is read first
    ({"ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "ALL"}, "AVX2", False, False),
    ({"DNNL_MAX_CPU_ISA": "NO_SUCH_ISA"}, None, True, True),  # a name oneDNN does not know holds nothing
])
def test_auto_choices_take_onednn_held_below_bf16_or_int8_as_a_cpu_without_them(monkeypatch, variables, limit,
                                                                                 bf16, int8):
    """oneDNN runs PyTorch's bf16 and int8 matmuls on a CPU: held below the instructions (its
    DNNL_MAX_CPU_ISA), a bf16 matmul ran ~600x slower than unheld on an AVX-512 Xeon with AMX, so
    precision=auto and optim.ns_dtype=auto take fp32 as on a CPU without them."""
    from omegaconf import OmegaConf

    from lm.training import setup
    from lm.training.optim import ns_dtype
    from lm.util import hardware

    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    for instructions in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_vnni_supported"):
        monkeypatch.setattr(torch.cpu, instructions, lambda: True)  # this CPU's, whatever it has
    assert hardware.onednn_limit() == limit
    assert hardware.cpu_multiplies_bf16() is bf16 and hardware.cpu_multiplies_int8() is int8
    trainer = OmegaConf.create({"precision": "auto", "accelerator": "cpu"})
    assert setup.pick_precision(trainer) == ("bf16-mixed" if bf16 else "32-true")
    assert ns_dtype("auto", torch.device("cpu")) == ("bfloat16" if bf16 else "float32")
    assert hardware.cpu_features().endswith(f" + AMX (oneDNN held to {limit})" if limit else " + AMX")


def test_bf16_mixed_trains_with_the_fused_optimizer_and_clips_its_gradients(train_config):
    """Lightning's mixed-precision plugin refuses gradient clipping with a fused AdamW (it guards
    float16's scaler); bf16-mixed has no scaler, and the run clips and trains."""
    from types import SimpleNamespace

    from lm.training.module import LitLM

    result = train(train_config("trainer.precision=bf16-mixed", "optim.fused=true", "trainer.gradient_clip_val=1.0"))
    assert result["val_loss"] < 6.5  # it trained: ln(512) = 6.24 at initialisation, and it finished

    lit = LitLM(lm.Transformer(lm.ModelConfig(vocab_size=64, n_layer=1, d_model=32, n_head=2, d_ff=64,
                                               max_seq_len=16)), lm.training.module.OptimConfig(), total_steps=1)
    for p in lit.parameters():
        p.grad = torch.full_like(p, 10.0)
    lit._trainer = SimpleNamespace(precision="bf16-mixed")
    lit.configure_gradient_clipping(None, gradient_clip_val=0.5)
    assert torch.nn.utils.get_total_norm([p.grad for p in lit.parameters()]).item() == pytest.approx(0.5, rel=1e-4)


def test_freed_memory_is_kept_for_the_next_allocation():
    """After keep_freed_memory, a 64 MB tensor comes from malloc's heap, not from pages mapped for
    it alone (which the kernel zeroes and faults in anew on every training step)."""
    import ctypes
    import platform

    from lm.util.memory import keep_freed_memory

    if platform.libc_ver()[0] != "glibc":
        assert not keep_freed_memory()
        return

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):  # glibc before 2.33
        pytest.skip("this glibc has no mallinfo2 to read malloc's state with")
    libc.mallinfo2.restype = MallInfo2
    assert keep_freed_memory()
    mapped_before = libc.mallinfo2().hblkhd  # bytes in blocks malloc mapped one by one
    big = torch.empty(64 * 2**20, dtype=torch.uint8)
    big.fill_(1)
    assert libc.mallinfo2().hblkhd == mapped_before
    assert libc.mallinfo2().uordblks >= 64 * 2**20  # it is in the heap instead


def test_muon_trains_in_bf16_with_clipping_and_its_run_is_continued_by_muon_only(train_config):
    """optim=muon through Lightning: one optimizer (Muon and AdamW) under bf16-mixed's plugin and
    gradient clipping, whose checkpoint holds every parameter's state; a resume with optim=adamw is
    one line before any state is restored."""
    from lm.util.errors import ConfigError

    muon = ("optim=muon", "trainer.precision=bf16-mixed", "trainer.gradient_clip_val=1.0", "trainer.max_steps=4",
            "trainer.val_every_n_steps=4", "sample.max_new_tokens=0")
    result = train(train_config(*muon))
    assert result["val_loss"] < 6.5  # ln(512) = 6.24 at initialisation
    ckpt = read_checkpoint(result["last"])
    (state,) = ckpt["optimizer_states"]
    assert [len(g["params"]) for g in state["param_groups"]][0] == 2 * 4  # qkv, out, gate_up, down of 2 layers
    assert len(state["state"]) == sum(len(g["params"]) for g in state["param_groups"])  # every one stepped
    assert ckpt["lm"]["run_config"]["optim"]["name"] == "muon"
    with pytest.raises(ConfigError, match="^the checkpoint was trained with optim=muon; continue it with optim=muon, "
                                          "or start optim=adamw from its weights with init_from$"):
        train(train_config("resume=true", "trainer.max_steps=6", "sample.max_new_tokens=0"))


@pytest.mark.slow
def test_a_muon_run_stopped_by_sigterm_resumes_on_the_uninterrupted_loss_curve(train_config, tmp_path):
    """As tests/test_reliability.py's Ctrl-C and SIGTERM test, with optim=muon and the wsd schedule:
    Muon's momentum, AdamW's moments and the schedule's step all come back from last.ckpt."""
    import signal

    from test_reliability import COMMON, losses_by_step, start_training_child, wait_for_step

    run = (*COMMON, "optim=muon", "optim.schedule=wsd", "trainer.max_steps=40")
    expected = losses_by_step(Path(train(train_config(*run, "run_name=straight"))["run_dir"]), 0)
    child, last = start_training_child(train_config, tmp_path, *run, "run_name=stopped")
    wait_for_step(child, last, 10)
    os.kill(child.pid, signal.SIGTERM)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 128 + signal.SIGTERM, stderr
    stopped_at = read_checkpoint(last)["global_step"]
    assert 10 <= stopped_at < 40
    resumed = train(train_config(*run, "run_name=stopped", "resume=true"))
    after = losses_by_step(Path(resumed["run_dir"]), 1)
    assert resumed["steps"] == 40 and min(after) == stopped_at and max(after) == 39
    for step, loss in after.items():
        assert abs(loss - expected[step]) < 1e-5, (step, loss, expected[step])


def test_an_fsdp_runs_closing_sample_comes_from_its_last_checkpoint_read_back(train_config, monkeypatch):
    """Under FSDP each Block keeps shards of its weights cast to bf16 at each forward: sampling
    through them outside training's autocast failed on an H100 (float activations against bf16
    weights), and on rank 0 alone it would wait for the other ranks' shards. Such a run samples
    from last.ckpt read back as a plain model; any other strategy samples the trained model."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy, SingleDeviceStrategy

    from lm.training import run
    from lm.training.summary import sampling_model

    asked = []
    monkeypatch.setattr(run, "sampling_model", lambda *args: asked.append(args) or sampling_model(*args))
    result = train(train_config())
    assert [args[2] for args in asked] == [result["last"]] and result["sample"]  # train() asks it, once
    model, _ = lm.load(result["last"])
    assert sampling_model(SimpleNamespace(strategy=SingleDeviceStrategy("cpu")), model, result["last"]) is model
    read_back = sampling_model(SimpleNamespace(strategy=FSDPStrategy()), model, result["last"])
    assert read_back is not model and not read_back.training
    pairs = zip(read_back.state_dict().values(), model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_a_checkpoint_whose_weights_the_strategy_already_loaded_still_restores_the_progress():
    """Lightning's FSDP strategy takes "state_dict" out of the checkpoint and loads it into its shards
    before the module's on_load_checkpoint runs (an H100 run of the gpu tier failed there with a
    KeyError): the history, time and tokens must still come back."""
    from lm.training.module import LitLM, OptimConfig

    lit = LitLM(lm.Transformer(lm.ModelConfig(vocab_size=64, n_layer=1, d_model=32, n_head=2, d_ff=64,
                                              max_seq_len=16)), OptimConfig(), total_steps=1)
    progress = {"val_history": [[10, 3.5]], "train_seconds": 12.5, "train_tokens": 4096, "last_val_step": 10}
    lit.on_load_checkpoint({"global_step": 20, "lm": {"progress": progress}})
    assert lit.val_history == [(10, 3.5)]
    assert (lit.train_seconds, lit.train_tokens, lit.last_val_step) == (12.5, 4096, 10)
