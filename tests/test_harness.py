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

    import lm.evaluation.harness  # noqa: F401  (registers --model lm)

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
    from lm.evaluation.harness import HarnessModel

    ckpt, model = checkpoint(tmp_path, tokenizer, [SlidingSpec(window=8), LinearSpec(chunk_size=8)])
    harness = HarnessModel(str(ckpt))
    context = "def forward(self, x):\n"
    ids = tokenizer.encode(context).ids
    full = tokenizer.decode(generate(model, [ids], 20)[0][len(ids):])
    stop = full[5:7]  # a stop string that occurs in the greedy continuation
    request = SimpleNamespace(args=(context, {"until": [stop], "max_gen_toks": 20}))
    assert harness.generate_until([request]) == [full[:full.index(stop)]]


# ------------------------------------------------------------------ mistakes: one line, exit code 2

def nan_checkpoint(folder: Path, tokenizer) -> Path:
    ckpt, model = checkpoint(folder, tokenizer, SoftmaxSpec())
    state = {name: torch.full_like(t, float("nan")) if name.endswith("weight") else t
             for name, t in model.state_dict().items()}
    return save_checkpoint(folder / "nan.ckpt", state, model.config, tokenizer.to_str())


def harness_command(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """scripts/harness.py as a user runs it offline, with the harness's INFO lines (its progress) silenced
    through its own LMEVAL_LOG_LEVEL, so that stderr holds only what went wrong."""
    import os

    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "LMEVAL_LOG_LEVEL": "WARNING"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "harness.py"), *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env=env)


def offline_task(folder: Path) -> Path:
    """A task whose dataset lives on the Hugging Face Hub, which an offline machine cannot reach."""
    folder.mkdir()
    (folder / "hub.yaml").write_text(
        "task: lm_hub_task\ndataset_path: lm-tests/no-such-dataset\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return folder


# (id, function of (tmp_path, tokenizer, task_dir) -> the command's arguments, the error line's beginning)
SCRIPT_MISTAKES = [
    ("missing checkpoint", lambda t, k, d: ["--model_args", f"ckpt={t / 'nope.ckpt'}"],
     "error: checkpoint '{t}/nope.ckpt' does not exist"),
    ("NaN weights", lambda t, k, d: ["--model_args", f"ckpt={nan_checkpoint(t, k)}"],
     "error: checkpoint '{t}/nan.ckpt' holds NaN or infinite values in "),
    ("no ckpt", lambda t, k, d: ["--model_args", "max_gen_toks=16"], "error: --model_args has no ckpt: "),
    ("batch_size 0", lambda t, k, d: ["--model_args", f"ckpt={t / 'x.ckpt'},batch_size=0"],
     "error: batch_size=0 must be an integer >= 1"),
    ("batch_size -1", lambda t, k, d: ["--model_args", f"ckpt={t / 'x.ckpt'},batch_size=-1"],
     "error: batch_size=-1"),  # the harness reads -1 as the float -1.0
    ("batch_size abc", lambda t, k, d: ["--model_args", f"ckpt={t / 'x.ckpt'},batch_size=abc"],
     "error: batch_size='abc' must be an integer >= 1"),
    ("batch_size 1.5", lambda t, k, d: ["--model_args", f"ckpt={t / 'x.ckpt'},batch_size=1.5"],
     "error: batch_size=1.5 must be an integer >= 1"),
    ("--batch_size 0", lambda t, k, d: ["--model_args", f"ckpt={t / 'x.ckpt'}", "--batch_size", "0"],
     "error: --batch_size 0: batch_size=0 must be an integer >= 1"),
    ("max_gen_toks 0", lambda t, k, d: ["--model_args", f"ckpt={t / 'x.ckpt'},max_gen_toks=0"],
     "error: max_gen_toks=0 must be an integer >= 1"),
    ("device tpu", lambda t, k, d: ["--model_args", f"ckpt={t / 'x.ckpt'},device=tpu"],
     "error: device='tpu' is not cpu, cuda or mps"),
    ("unknown argument", lambda t, k, d: ["--model_args", f"pretrained={t},ckpt={t / 'x.ckpt'}"],
     "error: --model_args pretrained="),
    ("unknown task", lambda t, k, d: ["--model_args", f"ckpt={t / 'x.ckpt'}", "--tasks", "nosuchtask"],
     "error: --tasks: Tasks not found: nosuchtask"),
    ("offline hub task", lambda t, k, d: ["--model_args", f"ckpt={checkpoint(t, k, SoftmaxSpec())[0]}",
                                          "--tasks", "lm_hub_task", "--include_path", str(offline_task(t / "hub"))],
     "error: the data of task 'lm_hub_task' could not be loaded (Couldn't reach 'lm-tests/no-such-dataset' on "
     "the Hub (OfflineModeIsEnabled)); offline, only datasets already in the datasets cache load"),
]


@pytest.mark.slow
@pytest.mark.parametrize("make_args, line", [c[1:] for c in SCRIPT_MISTAKES], ids=[c[0] for c in SCRIPT_MISTAKES])
def test_a_mistake_is_one_line_and_exit_2(make_args, line, task_dir, tokenizer, tmp_path):
    args = make_args(tmp_path, tokenizer, task_dir)
    if "--tasks" not in args:
        args += ["--tasks", ",".join(TASKS), "--include_path", str(task_dir)]
    done = harness_command("--model", "lm", "--device", "cpu", *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(line.format(t=tmp_path)), done.stderr
    assert "Traceback" not in done.stderr and not list(tmp_path.rglob("results_*.json"))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the harness's default device works here")
def test_the_harness_default_device_on_a_machine_without_cuda_is_named_as_its_flag(task_dir, tokenizer, tmp_path):
    ckpt, _ = checkpoint(tmp_path, tokenizer, SoftmaxSpec())
    done = harness_command("--model", "lm", "--model_args", f"ckpt={ckpt}", "--tasks", ",".join(TASKS),
                           "--include_path", str(task_dir), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: --device cuda:0 (the harness's default): device='cuda:0': this "
                                        "torch has no CUDA device; use device=cpu"]


@pytest.mark.parametrize("typed, harness, message", [
    ("batch_size=0", {}, "batch_size=0 must be an integer >= 1"),
    ("batch_size=-1", {}, "batch_size=-1.0 must be an integer >= 1"),
    ("batch_size=abc", {}, "batch_size='abc' must be an integer >= 1"),
    ("batch_size=1.5", {}, "batch_size=1.5 must be an integer >= 1"),
    ("max_gen_toks=0", {}, "max_gen_toks=0 must be an integer >= 1"),
    ("max_gen_toks=many", {}, "max_gen_toks='many' must be an integer >= 1"),
    ("device=tpu", {}, "device='tpu' is not cpu, cuda or mps"),
    ("ckpt_path=x", {}, "--model_args ckpt_path='x' is not an argument of --model lm (it takes ckpt, device, "
                        "batch_size, max_gen_toks)"),
    ("", {"batch_size": "abc"}, "--batch_size abc: batch_size='abc' must be an integer >= 1"),
    ("", {"device": "tpu"}, "--device tpu: device='tpu' is not cpu, cuda or mps"),
])
def test_model_arguments_are_refused_before_the_checkpoint_loads(typed, harness, message, tmp_path):
    """As the command line hands them over: --model_args parsed by the harness's own parser, its --device
    and --batch_size beside them. The checkpoint does not exist, so the check came first."""
    from lm_eval._cli.utils import key_val_to_dict

    from lm.evaluation.harness import HarnessModel
    from lm.util.errors import ConfigError

    typed = f"ckpt={tmp_path / 'none.ckpt'}" + (f",{typed}" if typed else "")
    with pytest.raises(ConfigError) as error:
        HarnessModel.create_from_arg_obj(key_val_to_dict(typed), {"device": "cpu", "batch_size": "1", **harness})
    assert str(error.value) == message


def test_model_arguments_win_over_the_harness_flags_and_auto_is_a_fixed_batch(tokenizer, tmp_path):
    """The harness passes --device and --batch_size even when not typed (cuda:0 and 1); the same names in
    --model_args used to fail as keywords given twice."""
    from lm.evaluation.harness import AUTO_BATCH, HarnessModel

    ckpt, _ = checkpoint(tmp_path, tokenizer, SoftmaxSpec())
    model = HarnessModel.create_from_arg_obj({"ckpt": str(ckpt), "device": "cpu", "batch_size": 3},
                                             {"device": "cuda:0", "batch_size": "1", "max_batch_size": None})
    assert model.batch_size == 3 and model.device == torch.device("cpu")
    assert HarnessModel.create_from_arg_string(f"ckpt={ckpt}", {"device": "cpu", "batch_size": "auto:4"}
                                               ).batch_size == AUTO_BATCH
