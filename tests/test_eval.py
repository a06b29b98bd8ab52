"""scripts/eval.py: perplexity and bits per byte, against a plain one-window-at-a-time count."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lm
from lm.config.eval import EvalRun
from lm.config.settings import typed
from lm.data.tokenizer import EOT
from lm.evaluation.perplexity import score, token_stream

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "v1" / "hybrid.ckpt"  # max_seq_len 32, vocab 300


def plain_count(model, tokenizer, texts):
    """Each document after an <|endoftext|>, the stream cut every max_seq_len tokens, one window at a time."""
    stream = []
    for text in texts:
        stream += [(tokenizer.token_to_id(EOT), False)] + [(t, True) for t in tokenizer.encode(text).ids]
    T, nll, tokens = model.config.max_seq_len, 0.0, 0
    for s in range(0, len(stream) - 1, T):
        window = stream[s:s + T + 1]
        ids = torch.tensor([[t for t, _ in window]])
        with torch.no_grad():
            logp = F.log_softmax(model(ids[:, :-1])[0].double(), -1)
        for i, (target, counts) in enumerate(window[1:]):
            if counts:
                nll, tokens = nll - logp[i, target].item(), tokens + 1
    return nll, tokens


def test_score_equals_a_plain_window_by_window_count():
    model, tokenizer = lm.load(FIXTURE)
    texts = ["def f(x):\n    return x * 2\n" * 7, "héllo wörld ✓ " * 5, "import os\n"]
    result = score(model, *token_stream(iter(texts), tokenizer), batch_size=3, progress=False)
    nll, tokens = plain_count(model, tokenizer, texts)
    assert result.tokens == tokens and result.documents == 3
    assert result.bytes == sum(len(t.encode()) for t in texts)  # UTF-8 bytes, not characters
    assert result.nll_nats == pytest.approx(nll, rel=1e-5)
    assert result.bits_per_byte == pytest.approx(nll / math.log(2) / result.bytes, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nll / tokens), rel=1e-5)


@pytest.mark.slow
def test_eval_script_writes_one_line_and_a_record(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    out = tmp_path / "eval.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval.py"), f"ckpt={FIXTURE}", "data=text",
                          f"data.paths=[{corpus}]", "split=all", f"out={out}", "progress_bar=false"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().startswith("text all: ") and "bits per byte" in run.stdout
    record = json.loads(out.read_text())
    assert record["documents"] == 6 and record["bytes"] == sum(p.stat().st_size for p in corpus.iterdir())
    assert record["loss"] == pytest.approx(record["nll_nats"] / record["tokens"])
    assert record["perplexity"] == pytest.approx(math.exp(record["loss"]))
    assert record["bits_per_byte"] == pytest.approx(record["nll_nats"] / math.log(2) / record["bytes"])
    # the same figures as scoring in this process, on the same stream
    model, tokenizer = lm.load(FIXTURE)
    texts = [p.read_text() for p in sorted(corpus.iterdir())]
    here = score(model, *token_stream(iter(texts), tokenizer), progress=False)
    assert record["tokens"] == here.tokens and record["nll_nats"] == pytest.approx(here.nll_nats, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["split=test"], "error: split='test' is not one of ['all', 'train', 'val']"),
    ([f"ckpt={ROOT / 'nope.ckpt'}"], "does not exist"),
])
def test_eval_script_bad_input_is_one_line(args, message, tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval.py"), f"ckpt={FIXTURE}", *args,
                          f"out={tmp_path / 'x.json'}"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and message in run.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("override, message", [
    ("batch_size=-1", "batch_size=-1 must be an integer >= 1"),  # once scored nothing and wrote loss 0
    ("batch_size=0", "batch_size=0 must be an integer >= 1"),
    ("batch_size=1.5", "batch_size=1.5 must be an integer >= 1"),
    ("batch_size=abc", "batch_size='abc' must be an integer >= 1"),
    ("data.val_fraction=abc", "data.val_fraction='abc' must be a number between 0 and 1"),
    ("data.val_fraction=1.5", "data.val_fraction=1.5 must be a number between 0 and 1"),
    ("device=tpu", "device='tpu' is not cpu, cuda or mps"),
])
def test_eval_settings_are_refused_before_the_checkpoint_loads(override, message, tmp_path):
    from hydra import compose, initialize_config_dir

    from lm.evaluation.perplexity import evaluate
    from lm.util.errors import ConfigError

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=[f"ckpt={tmp_path / 'none.ckpt'}", override])
    with pytest.raises(ConfigError) as error:  # the checkpoint does not exist: the check came first
        evaluate(typed(EvalRun, cfg))
    assert str(error.value) == message


def test_weights_too_large_for_float32_are_refused_at_load(tmp_path):
    """Finite weights of 1e30 once loaded, gave all-zero logits and a loss of exactly ln(vocab)."""
    from lm.formats.checkpoint import save_checkpoint
    from lm.util.errors import CheckpointError

    model, tokenizer = lm.load(FIXTURE)
    state = {name: t * 1e30 if t.dim() == 2 else t for name, t in model.state_dict().items()}
    ckpt = save_checkpoint(tmp_path / "run" / "last.ckpt", state, model.config, tokenizer.to_str())
    with pytest.raises(CheckpointError, match=r"with a weight of magnitude .*e\+29, beyond 1e\+06"):
        lm.load(ckpt)


def test_a_non_finite_loss_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    import lm.evaluation.perplexity as evaluation
    from lm.util.errors import DataError

    overflowing = evaluation.Score(tokens=10, bytes=40, nll_nats=float("inf"), documents=1)
    monkeypatch.setattr(evaluation, "score", lambda *args, **kwargs: overflowing)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def f(x):\n    return x + 1\n" * 20)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=[f"ckpt={FIXTURE}", "data=text", f"data.paths=[{corpus}]",
                                                     "split=all", f"out={tmp_path / 'x.json'}", "progress_bar=false"])
    with pytest.raises(DataError, match="is inf: the model's outputs overflow"):
        evaluation.evaluate(typed(EvalRun, cfg))
    assert not (tmp_path / "x.json").exists()


def eval_config(*overrides: str) -> EvalRun:
    """scripts/eval.py's settings, as the script builds them from its command line."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return typed(EvalRun, compose(config_name="eval", overrides=list(overrides)))


@pytest.mark.parametrize("data, message", [
    (["data=mqar"], "data=mqar has no text to score: eval.py scores a text corpus (data=pystdlib, text or hf); "
                    "recall on data=mqar is measured by training (train.py data=mqar reports val/accuracy) and by "
                    "compare.py"),
    (["data=text", "data.paths=[{empty}]"], "data.paths entry '{empty}' is a folder with no files in it"),
])
def test_a_corpus_eval_cannot_score_is_refused_before_the_checkpoint_loads(data, message, tmp_path):
    from lm.evaluation.perplexity import evaluate
    from lm.util.errors import DataError

    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = eval_config(f"ckpt={tmp_path / 'none.ckpt'}", *(d.format(empty=empty) for d in data))
    with pytest.raises(DataError) as error:  # the checkpoint does not exist: the corpus came first
        evaluate(cfg)
    assert str(error.value) == message.format(empty=empty)


@pytest.mark.slow
def test_eval_script_on_an_empty_folder_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval.py"), f"ckpt={FIXTURE}", "data=text",
                          f"data.paths=[{tmp_path / 'empty'}]"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.splitlines() == [f"error: data.paths entry '{tmp_path / 'empty'}' is a folder with no files "
                                       "in it"]


def test_the_record_of_an_exported_folder_goes_beside_it_not_into_it(tmp_path, monkeypatch):
    """An export folder is copied or uploaded whole; a run folder, or its checkpoint, keeps its records inside."""
    import lm.evaluation.perplexity as evaluation
    from lm.formats.checkpoint import export_safetensors, save_checkpoint

    monkeypatch.setattr(evaluation, "score", lambda *args, **kwargs: evaluation.Score(10, 40, 20.0, 1))
    model, tokenizer = lm.load(FIXTURE)
    export = export_safetensors(model, tokenizer, tmp_path / "export")
    exported = sorted(p.name for p in export.iterdir())
    run = save_checkpoint(tmp_path / "run" / "last.ckpt", model.state_dict(), model.config, tokenizer.to_str()).parent
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def f(x):\n    return x + 1\n" * 20)
    for ckpt, record in [(export, tmp_path / "export.eval-text-all.json"), (run, run / "eval-text-all.json"),
                         (run / "last.ckpt", run / "eval-text-all.json")]:
        evaluation.evaluate(eval_config(f"ckpt={ckpt}", "data=text", f"data.paths=[{corpus}]", "split=all",
                                        "progress_bar=false"))
        assert json.loads(record.read_text())["checkpoint"] == str(ckpt)
        record.unlink()
    assert sorted(p.name for p in export.iterdir()) == exported


def test_a_folder_of_empty_files_is_a_split_with_no_text(tmp_path):
    """Training refuses it as an empty corpus (test_bad_input.py); eval, as nothing to score."""
    from lm.evaluation.perplexity import evaluate
    from lm.util.errors import DataError

    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("")
    with pytest.raises(DataError, match="^the chosen split holds no text to score$"):
        evaluate(eval_config(f"ckpt={FIXTURE}", "data=text", f"data.paths=[{tmp_path}]", "split=all",
                             f"out={tmp_path / 'x.json'}", "progress_bar=false"))
