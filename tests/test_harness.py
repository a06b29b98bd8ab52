"""lm-evaluation-harness: `--model lm` scores any kind offline, and agrees with the harness's own `hf`
model on the same weights exported as a Llama folder."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lm import ModelConfig, Transformer
from lm.attention import LinearSpec, SlidingSpec, SoftmaxSpec
from lm.data.tokenizer import train_tokenizer
from lm.formats.checkpoint import save_checkpoint

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra (pip install -e .[eval]) is not installed")
pytest.importorskip("transformers", reason="the hf extra is not installed")
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "fixtures" / "harness"
TASKS = ["lm_local_choice", "lm_local_texts"]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """Two local tasks over the JSON-lines files in tests/fixtures/harness/: multiple choice, perplexity."""
    folder = tmp_path_factory.mktemp("tasks")
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "choice.yaml").write_text(
        f"task: lm_local_choice\n{common}dataset_kwargs:\n  data_files:\n    test: {DATA / 'choices.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (folder / "texts.yaml").write_text(
        f"task: lm_local_texts\n{common}dataset_kwargs:\n  data_files:\n    test: {DATA / 'texts.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    return folder


@pytest.fixture(scope="module")
def tokenizer():
    text = (ROOT / "lm" / "model" / "transformer.py").read_text() * 3 + "import os\nimport sys\n"
    return train_tokenizer(iter([text]), 300)


def checkpoint(folder: Path, tokenizer, attention) -> tuple[Path, Transformer]:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=300, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=48,
                                    max_seq_len=64, init_std=0.2, attention=attention)).eval()
    return save_checkpoint(folder / "last.ckpt", model.state_dict(), model.config, tokenizer.to_str()), model


def evaluate(task_dir: Path, model: str, model_args: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import lm.studies.harness  # noqa: F401  (registers --model lm)

    out = simple_evaluate(model=model, model_args=model_args, tasks=TASKS, device="cpu", batch_size=4,
                          task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    return out


@pytest.mark.slow
def test_lm_model_agrees_with_the_harness_hf_model_on_the_exported_llama(task_dir, tokenizer, tmp_path):
    from lm.formats.hf import export_hf

    ckpt, model = checkpoint(tmp_path, tokenizer, SoftmaxSpec())
    export_hf(model, tokenizer, tmp_path / "hf")
    ours = evaluate(task_dir, "lm", f"ckpt={ckpt}")
    theirs = evaluate(task_dir, "hf", f"pretrained={tmp_path / 'hf'},dtype=float32")
    for task in TASKS:
        mine = [s["resps"] for s in ours["samples"][task]]
        other = [s["resps"] for s in theirs["samples"][task]]
        for a, b in zip(mine, other, strict=True):  # every request's log-likelihood, choice by choice
            flat_a, flat_b = _numbers(a), _numbers(b)
            assert len(flat_a) == len(flat_b) and max(abs(x - y) for x, y in zip(flat_a, flat_b, strict=True)) < 1e-3
    assert ours["results"]["lm_local_choice"]["acc,none"] == theirs["results"]["lm_local_choice"]["acc,none"]


def _numbers(responses) -> list[float]:
    flat = []
    for r in responses:
        for x in (r if isinstance(r, (list, tuple)) else [r]):
            flat += _numbers(x) if isinstance(x, (list, tuple)) else ([float(x)] if not isinstance(x, bool) else [])
    return flat


@pytest.mark.slow
@pytest.mark.parametrize("attention", [SlidingSpec(window=8), LinearSpec(chunk_size=8)], ids=["sliding", "linear"])
def test_harness_command_scores_kinds_transformers_cannot_load(attention, task_dir, tokenizer, tmp_path):
    ckpt, _ = checkpoint(tmp_path, tokenizer, attention)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "harness.py"), "run", "--model", "lm",
                          "--model_args", f"ckpt={ckpt}", "--device", "cpu", "--tasks", ",".join(TASKS),
                          "--include_path", str(task_dir), "--output_path", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    assert 0 <= results["lm_local_choice"]["acc,none"] <= 1
    assert results["lm_local_texts"]["bits_per_byte,none"] > 0


def test_generate_until_is_lm_greedy_decoding_cut_at_the_stop(tokenizer, tmp_path):
    from types import SimpleNamespace

    from lm import generate
    from lm.studies.harness import HarnessModel

    ckpt, model = checkpoint(tmp_path, tokenizer, [SlidingSpec(window=8), LinearSpec(chunk_size=8)])
    harness = HarnessModel(str(ckpt))
    context = "def forward(self, x):\n"
    ids = tokenizer.encode(context).ids
    full = tokenizer.decode(generate(model, [ids], 20)[0][len(ids):])
    stop = full[5:7]  # a stop string that occurs in the greedy continuation
    request = SimpleNamespace(args=(context, {"until": [stop], "max_gen_toks": 20}))
    assert harness.generate_until([request]) == [full[:full.index(stop)]]
