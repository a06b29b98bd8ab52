"""Every command's settings given bad values (wrong types, signs, zeros, huge, NaN, infinity, bare
strings): one line on stderr naming the key as typed, exit code 2, no traceback, nothing written.

The same approach as tests/test_hostile_files.py, for the command line: one table of
(script, arguments, what the line must say), each row run through the script's own `main` in this
process (a fresh process per row would cost seconds each), given the config the arguments compose
(tests/conftest.py's compose_config, held equal to Hydra's in tests/test_config.py). A row whose
arguments are Hydra's own business (a `hydra.` key, a launcher, `+`/`~`, a composition Hydra refuses)
goes through `run_script` and Hydra's whole start, and one row per script goes both ways and must
end the same (`test_a_row_ends_the_same_through_the_whole_command_line`). Outputs of every row point
into one folder, which must stay empty; Hydra's own run folder is put elsewhere.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from pathlib import Path

import pytest
import torch
from conftest import CONF_DIR, compose_config, train_small_run
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from lm.util.cli import run_script

ROOT = Path(__file__).resolve().parents[1]
HUGE = "1000000000000"  # 10**12: no machine holds that many examples, tokens or steps' worth of memory

TRAIN = [
    ("data=mqar", f"data.examples={HUGE}"),
    ("data=mqar", "data.examples=-1"),
    ("data=mqar", "data.pairs=0"),
    ("data=mqar", "data.seq_len=abc"),
    ("data.val_fraction=abc",),
    ("data.val_fraction=nan",),
    ("data.val_fraction=1",),
    ("data=text", "data.paths=[{empty}]"),
    ("optim.lr=nan",),
    ("optim.lr=inf",),
    ("trainer.max_steps=1e3",),
    ("data.batch_size=-1",),
    ("model.short_conv=-2",),
    ("model.short_conv=abc",),
    ("trainer.stop_at_accuracy=1.5",),
    ("data=mqar", "data.filler=zeros"),
    ("data=mqar", "data.query_power=0"),
    ("seed=abc",),
    ("attn=hybrid", "attn.pattern=[]"),
    ("attn=mla", "attn.q_rank=100000"),  # a query bottleneck 1500x the width: 300x the model's weights
    ("attn=mla", "attn.kv_rank=100000"),
    ("attn=mla", "attn.rope_dim=64"),  # the head size of the default model (384 / 6)
    ("model.mlp=gelu",),
    ("model.zero_init_out=maybe",),
    ("optim=muon", "optim.ns_dtype=float16"),
    # finite in Python's float64, zero, subnormal or infinite in float32, where the model computes with them
    ("attn=mha", "attn.softcap=1e-300"),
    ("attn=sliding", "attn.softcap=1e39"),
    ("attn=linear", "attn.eps=1e-40"),
    ("model.rope_theta=1e39",),
    ("model.rope_theta=1000000000000000000000000000000000000000",),  # an int: float32 overflows all the same
    ("model.init_std=1e-300",),
    ("model.norm_eps=1e-45",),
    ("optim.lr=1e-300",),
    ("optim=adamw", "optim.weight_decay=1e-320"),
    ("optim=muon", "optim.adamw_lr=1e-39"),
    ("trainer.gradient_clip_val=1e39",),
]
TRAIN_KEYS = ["data.examples", "data.examples", "data.pairs", "data.seq_len", "data.val_fraction",
              "data.val_fraction", "data.val_fraction", "data.paths", "optim.lr", "optim.lr", "trainer.max_steps",
              "data.batch_size", "short_conv", "short_conv", "trainer.stop_at_accuracy", "data.filler",
              "data.query_power", "seed", "pattern=[]", "attn.q_rank=100000", "kv_rank=100000", "rope_dim=64",
              "mlp='gelu'", "zero_init_out", "optim.ns_dtype", "softcap=1e-300 is zero in float32",
              "softcap=1e+39 overflows float32", "eps=1e-40 is subnormal in float32", "rope_theta=1e+39 overflows",
              "rope_theta=1000000000000000000000000000000000000000 overflows",
              "init_std=1e-300 is zero", "norm_eps=1e-45 is subnormal", "optim.lr=1e-300 is zero",
              "optim.weight_decay=1e-320 is zero", "optim.adamw_lr=1e-39 is subnormal",
              "trainer.gradient_clip_val=1e+39 overflows"]

COMPARE = [
    ("lm.steps=0", "lm.steps"), ("lm.steps=abc", "lm.steps"), ("lm.steps=1.5", "lm.steps"),
    ("lm.batch_size=0", "lm.batch_size"), ("lm.lr=-1", "lm.lr"), ("lm.lr=nan", "lm.lr"), ("lm.lr=inf", "lm.lr"),
    ("lm.val_batches=0", "lm.val_batches"), ("lm.warmup_steps=-3", "lm.warmup_steps"),
    ("mqar.widths=abc", "mqar.widths"), ("mqar.widths=[-32]", "mqar.widths"), ("mqar.pairs=0", "mqar.pairs"),
    ("mqar.steps=nan", "mqar.steps"), (f"mqar.examples={HUGE}", "examples"),
    ("speed.new_tokens=-5", "speed.new_tokens"), ("speed.new_tokens=nan", "speed.new_tokens"),
    ("speed.contexts=abc", "speed.contexts"), ("speed.contexts=[8]", "speed.contexts"),
    ("speed.contexts=[]", "speed.contexts"), ("kinds=[]", "kinds"), ("kinds=nosuch", "kinds"),
    ("extra_kinds=[5]", "extra_kinds"), ("extra_kinds=[{name: a/b, attn: mha}]", "extra_kinds"),
    ("seed=-1", "seed"), ("seed=abc", "seed"), ("data.val_fraction=abc", "data.val_fraction"),
    ("data=mqar", "data=mqar"), (("data=text", "data.paths=[{empty}]"), "data.paths"),
    ("tasks=[]", "tasks"), ("tasks=abc", "tasks"), ("seeds=0", "seeds"), ("seeds=1.5", "seeds"),
    ("mqar.lr=[]", "mqar.lr"), ("mqar.lr=[0.01,nan]", "mqar.lr"), ("mqar.stop_at_accuracy=2", "mqar.stop_at_accuracy"),
    ("mqar.short_conv=-1", "mqar.short_conv"), ("mqar.query_power=nan", "mqar.query_power"),
    ("mqar.filler=abc", "mqar.filler"), ("arm=99", "arm"), ("arm=-1", "arm"), ("arm=abc", "arm"),
    ("speed.new_tokens=2", "speed.new_tokens"), ("speed.max_batch_tokens=-1", "speed.max_batch_tokens"),
    ("speed.compile=abc", "speed.compile"), ("speed.train_contexts=[nan]", "speed.train_contexts"),
    ("speed.train_tokens=0", "speed.train_tokens"), ("speed.train_steps=abc", "speed.train_steps"),
    ("per_kind=5", "per_kind"), ("++per_kind.mha={lm: {steps: 0}}", "per_kind.mha"),
    ("++per_kind.nosuch={lm: {steps: 5}}", "per_kind.nosuch"),  # a misspelt kind, once ignored
    # the mqa arms come first: every arm is checked before any trains
    ("extra_kinds=[{name: wide, attn: mla, kv_rank: 100000}]", "kv_rank=100000"),
    ("extra_kinds=[{name: wide, attn: mla, q_rank: 100000}]", "attn.q_rank=100000"),
    ("frontier.train=abc", "frontier.train"), ("frontier.train=[[64]]", "frontier.train"),
    ("frontier.test=[]", "frontier.test"), ("frontier.knobs=5", "frontier.knobs"),
    ("frontier.knobs.mha=[5]", "frontier.knobs.mha"), ("frontier.still_learning=nan", "frontier.still_learning"),
    ("frontier.test_examples=0", "frontier.test_examples"), ("frontier.lr=[0.01,-1]", "frontier.lr"),
    (("tasks=[frontier]", "frontier.test=[[64,4]]"), "frontier.test"),  # nothing beyond the trained length
    (("tasks=[frontier]", "frontier.train=[[16,8]]"), "frontier.train"),  # 8 pairs do not fit 16 tokens
    (("tasks=[frontier]", "frontier.knobs.mqa=[{window: 8}]"), "frontier.knobs.mqa"),  # not an option of softmax
    ("extra_kinds=[{name: capped, attn: sliding, softcap: 1e-300}]", "softcap=1e-300 is zero in float32"),
    # a key added with + where the study has none: refused, not ignored (an added kind's knobs included)
    ("+frontier.knobs.bogus=[{width: 8}]", "frontier.knobs.bogus names no kind"),
    ("+mqar.bogus=1", "mqar.bogus"), ("+frontier.bogus=1", "frontier.bogus"), ("+speed.bogus=2", "speed.bogus"),
    ("+bogus=1", "bogus"), ("+lm.model.bogus=1", "lm.model.bogus"),
    (("hydra/launcher=joblib", "hydra.launcher.n_jobs=0"), "hydra.launcher.n_jobs=0"),
    (("hydra/launcher=joblib", "hydra.launcher.timeout=-1"), "hydra.launcher.timeout"),
]

EVAL = [
    ("batch_size=0", "batch_size"), ("batch_size=-1", "batch_size"), ("batch_size=abc", "batch_size"),
    ("batch_size=1.5", "batch_size"), ("device=tpu", "device"), ("data.val_fraction=abc", "data.val_fraction"),
    ("data=mqar", "data=mqar"), ("split=bogus", "split"), (("data=text", "data.paths=[{empty}]"), "data.paths"),
]

GENERATE = [
    ("max_new_tokens=-1", "max_new_tokens"), ("max_new_tokens=abc", "max_new_tokens"),
    ("max_new_tokens=1e3", "max_new_tokens"), (f"max_new_tokens={HUGE}", "max_new_tokens"),
    ("temperature=-1", "temperature"), ("temperature=nan", "temperature"), ("temperature=inf", "temperature"),
    ("top_k=0", "top_k"), ("top_k=-1", "top_k"), ("top_k=abc", "top_k"),
    ("top_p=0", "top_p"), ("top_p=1.5", "top_p"), ("top_p=nan", "top_p"), ("min_p=2", "min_p"),
    ("repetition_penalty=0", "repetition_penalty"), ("repetition_penalty=nan", "repetition_penalty"),
    ("stop=['']", "stop"), ("seed=-1", "seed"), ("seed=abc", "seed"), ("device=tpu", "device"),
    ("device=mps", "device"), ("truncate=right", "truncate"), ("quantize=int3", "quantize"),
    ("use_cache=maybe", "use_cache"), ("prompt_file={empty}/none.txt", "prompt_file"),
    ("compile_mode=fast", "compile_mode"), ("compile_mode=max-autotune", "compile_mode"),  # the latter: no compile
    (("compile=true", "compile_mode=max-autotune", "quantize=int8"), "compile_mode=max-autotune tunes float"),
]
UPTRAIN = [
    # the model's own name for the setting, as train.py's model check says it
    ("attn.n_kv_head=3", "n_kv_head"), ("attn.n_kv_head=0", "n_kv_head"), ("attn.n_kv_head=abc", "n_kv_head"),
    ("uptrain.init=bogus", "uptrain.init"),
    ("uptrain.distill=-1", "uptrain.distill"), ("uptrain.distill=nan", "uptrain.distill"),
    ("uptrain.temperature=0", "uptrain.temperature"), ("uptrain.temperature=inf", "uptrain.temperature"),
    ("uptrain.fraction=abc", "uptrain.fraction"), ("uptrain.fraction=-0.5", "uptrain.fraction"),
    ("uptrain.fraction=inf", "uptrain.fraction"), ("uptrain.steps=-1", "uptrain.steps"),
    ("uptrain.calibration_batches=0", "uptrain.calibration_batches"),
    ("uptrain.warmup_fraction=2", "uptrain.warmup_fraction"), ("uptrain.evaluations=0", "uptrain.evaluations"),
    ("uptrain.val_every_n_steps=-1", "uptrain.val_every_n_steps"), ("seed=-1", "seed"),
    (("attn=mla", "attn.kv_rank=-4"), "kv_rank"), (("attn=mla", "attn.rope_dim=3"), "rope_dim"),
    ("resume=maybe", "resume"), ("resume=true", "resume=true"),  # the latter: no interrupted run to continue
    # floats checked in float32, where the loss uses them: 1e308 overflows, 1e-50 rounds to no distillation
    ("uptrain.distill=1e308", "uptrain.distill=1e+308"), ("uptrain.distill=1e-50", "uptrain.distill=1e-50"),
    ("uptrain.temperature=1e-300", "uptrain.temperature"), ("uptrain.temperature=1e300", "uptrain.temperature"),
    ("trainer.skip_nonfinite=maybe", "trainer.skip_nonfinite"),  # the setting a non-finite loss's line advises
    (("attn=mla", "attn.q_rank=100000"), "attn.q_rank=100000"), (("attn=mla", "attn.rope_dim=16"), "rope_dim=16"),
]

SERVE = [  # scripts/serve.py: every setting is checked before the port is bound or the checkpoint read
    ("port=-1", "port"), ("port=65536", "port=65536 must be an integer from 0 to 65535"), ("port=abc", "port"),
    ("max_batch=0", "max_batch=0 must be an integer >= 1"), ("max_batch=1.5", "max_batch"),
    ("max_queue=-1", "max_queue"), ("max_new_tokens=0", "max_new_tokens"),
    (f"max_prompt_tokens={HUGE}.5", "max_prompt_tokens"), ("compile=maybe", "compile"),
    ("quantize=int3", "quantize='int3' is not one of ['int8']"), ("int8_kernel=bogus", "int8_kernel"),
    ("device=tpu", "device"), ("drain_s=-1", "drain_s"),
    ("compile_mode=fast", "compile_mode"), ("compile_mode=max-autotune", "compile_mode"),  # the latter: no compile
    (("compile=true", "compile_mode=max-autotune", "quantize=int8"), "compile_mode=max-autotune tunes float"),
    ("chat_template={empty}/none.jinja", "none.jinja' is not a file"), ("model_name=' '", "model_name"),
    ("ckpt={empty}/none.ckpt", "none.ckpt' does not exist"),
]

if not torch.cuda.is_available():  # this torch has no CUDA: the device check must say so before loading
    EVAL.append(("device=cuda", "device"))
    GENERATE.append(("device=cuda:0", "device"))
    SERVE.append(("device=cuda", "device"))

STUDY = [  # scripts/uptrain.py --config-name uptrain_study: the ablation's grid
    ("study.fractions=[0]", "study.fractions"), ("study.fractions=[1.5]", "study.fractions"),
    ("study.fractions=[]", "study.fractions"), ("study.inits=median", "study.inits"),
    ("study.kv_heads=[0]", "study.kv_heads"), ("study.decode_tokens=-1", "study.decode_tokens"),
    ("study.scratch=maybe", "study.scratch"), ("uptrain.distill=-1", "uptrain.distill"),
    # every arm's conversion is checked against the teacher before the teacher's own arm runs
    ("study.kv_heads=[3]", "study.kv_heads entry 3"), ("study.kv_heads=[8]", "study.kv_heads entry 8"),
    ("study.methods=[{name: m, attn: {name: mla, kind: mla, rope_dim: 16}}]", "rope_dim=16"),
    ("study.methods=[{name: m, attn: {name: mla, kind: mla, q_rank: 100000}}]", "attn.q_rank=100000"),
    ("uptrain.distill=1e308", "uptrain.distill"),
]
METHODS = [  # --config-name uptrain_methods as committed: its MLA arms' rope_dim 16 is the tiny teacher's head size
    ((), "study.methods entry 'mla-r176-svd': attn.rope_dim=16"),
]

CASES = (
    [("train", list(args), key) for args, key in zip(TRAIN, TRAIN_KEYS, strict=True)]
    + [(script, [args] if isinstance(args, str) else list(args), key)
       for script, table in (("compare", COMPARE), ("eval", EVAL), ("generate", GENERATE), ("uptrain", UPTRAIN),
                             ("uptrain_study", STUDY), ("uptrain_methods", METHODS), ("serve", SERVE))
       for args, key in table]
)


def load_script(name: str):
    """scripts/<name>.py as a module; its `if __name__ == "__main__"` part does not run."""
    spec = importlib.util.spec_from_file_location(f"lm_script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # Hydra finds conf/ beside the calling file only for a __main__ module (else it looks for a package).
    module.main.__wrapped__.__module__ = "__main__"
    return module


def run_in_process(name: str, args: list[str], monkeypatch) -> tuple[int, str]:
    """(exit code, stderr) of `python scripts/<name>.py <args>`."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "scripts" / f"{name}.py"), *args])
    GlobalHydra.instance().clear()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = run_script(load_script(name).main)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def run_directly(name: str, args: list[str]) -> tuple[int, str] | None:
    """(exit code, stderr) of scripts/<name>.py's main given the config `args` compose, without
    Hydra's start around it; None for a row that is Hydra's business (see the module's docstring)."""
    config_name, overrides, rest = name, [], list(args)
    while rest:
        arg = rest.pop(0)
        if arg == "--config-name":
            config_name = rest.pop(0)
        elif arg.startswith("hydra.run.dir="):
            continue  # where Hydra's start would write its own folder; no script reads it
        elif arg.startswith(("hydra", "+", "~", "-")):
            return None
        else:
            overrides.append(arg)
    try:
        cfg = compose_config(config_name, overrides)
    except Exception:  # noqa: BLE001  Hydra refuses the composition: its line is run_script's to word
        return None
    err = io.StringIO()
    # Hydra initialised over conf/ as a script's start leaves it: the comparison composes its arms there
    with contextlib.redirect_stderr(err), initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            load_script(name).main.__wrapped__(cfg)
            code = 0
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, small_corpus) -> Path:
    # without the default shape's QK-norm, so that the MLA conversion's own checks are the ones reached
    return train_small_run(tmp_path_factory.mktemp("fuzz-run"), small_corpus, "model.qk_norm=null")


def fill(arg: str, empty: Path) -> str:
    return arg.replace("{empty}", str(empty))


def row_arguments(script: str, args: list[str], checkpoint: Path, small_corpus: Path, tmp_path: Path) -> list[str]:
    """The whole command line of a row: where the script reads and writes, then the row's own arguments."""
    empty, written = tmp_path / "empty", tmp_path / "written"
    empty.mkdir()
    outputs = {
        "train": [f"checkpoint_dir={written}", "trainer.max_steps=2", "logger=none", f"hydra.run.dir={tmp_path}/hydra"],
        "uptrain_study": ["--config-name", "uptrain_study", f"ckpt={checkpoint}", f"study.out={written}",
                          f"hydra.run.dir={tmp_path}/hydra"],
        "uptrain_methods": ["--config-name", "uptrain_methods", f"ckpt={checkpoint}", f"study.out={written}",
                            f"hydra.run.dir={tmp_path}/hydra"],
        "uptrain": [f"ckpt={checkpoint}", "attn.n_kv_head=2", f"checkpoint_dir={written}", "logger=none",
                    "uptrain.steps=2",
                    f"hydra.run.dir={tmp_path}/hydra"],
        "compare": ["preset=quick", "kinds=[mqa]", f"out={written}", f"hydra.run.dir={tmp_path}/hydra"],
        "eval": [f"ckpt={checkpoint}", f"out={written}/eval.json"],
        "generate": [f"ckpt={checkpoint}", "prompt=def", "max_new_tokens=4"],
        "serve": [f"ckpt={checkpoint}", "port=0"],  # 0: were a row to pass its checks, no port is taken from others
    }[script]
    if script in ("train", "compare", "eval") and not any(a.startswith("data=") for a in args):
        outputs += ["data=text", f"data.paths=[{small_corpus}]", "data.vocab_size=512",
                    f"data.cache_dir={written}/cache"]
    elif script in ("train", "compare", "eval") and "data=mqar" not in args:
        outputs.append(f"data.cache_dir={written}/cache")
    return [*outputs, *(fill(a, empty) for a in args)]


@pytest.mark.parametrize(("script", "args", "key"), CASES,
                         ids=[f"{script} {' '.join(args)}" for script, args, _ in CASES])
def test_a_bad_setting_is_one_line_naming_it_exit_2_and_nothing_written(script, args, key, checkpoint, small_corpus,
                                                                         tmp_path, monkeypatch):
    written = tmp_path / "written"
    line = row_arguments(script, args, checkpoint, small_corpus, tmp_path)
    ended = run_directly(script.split("_")[0], line) or run_in_process(script.split("_")[0], line, monkeypatch)
    code, err = ended
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert key in lines[0], lines[0]
    assert "Traceback" not in err
    assert not written.exists() or not any(written.rglob("*")), sorted(written.rglob("*"))


FIRST_ROWS = [next(case for case in CASES if case[0] == script) for script in dict.fromkeys(s for s, _, _ in CASES)]


@pytest.mark.parametrize(("script", "args", "key"), FIRST_ROWS, ids=[script for script, _, _ in FIRST_ROWS])
def test_a_row_ends_the_same_through_the_whole_command_line(script, args, key, checkpoint, small_corpus, tmp_path,
                                                            monkeypatch):
    """The table's first row of each script, run both ways: the same exit code and the same line."""
    line = row_arguments(script, args, checkpoint, small_corpus, tmp_path)
    direct = run_directly(script.split("_")[0], line)
    assert direct is not None and direct[0] == 2
    assert direct == run_in_process(script.split("_")[0], line, monkeypatch)


BENCH = [  # scripts/bench.py (argparse): a size that cannot be measured, named as typed
    (["attention", "--lengths", "0"], "--lengths: 0 must be at least 1"),
    (["attention", "--repeats", "0"], "--repeats: 0 must be at least 1"),
    (["attention", "--d-model", "30", "--heads", "4"], "--d-model 30"),
    (["attention", "--d-model", "36", "--heads", "4"], "--d-model 36"),
    (["generate", "--prompt", "-5"], "--prompt: -5 must be at least 1"),
    (["generate", "--new-tokens", "8", "0"], "--new-tokens: 0 must be at least 1"),
    (["train", "--steps", "0"], "--steps: 0 must be at least 1"), (["train", "--warmup", "-1"], "--warmup: -1 must"),
    (["decode", "--batches", "-2"], "--batches: -2 must"), (["kernels", "--rows", "0"], "--rows: 0 must"),
    (["kernels", "--rounds", "0"], "--rounds: 0 must be at least 1"), (["decode", "--rounds", "0"], "--rounds: 0"),
    (["recipe", "--targets", "nan"], "--targets: nan must be a finite number above 0"),
    (["frontier", "--steps", "0"], "--steps: 0 must be at least 1"),
    (["int8", "--ckpt", "{empty}/none.ckpt"], "none.ckpt"),
    # argparse's own refusals, one line too
    (["attention", "--lengths", "abc"], "--lengths: invalid integer value: 'abc'"),
    (["nope"], "invalid choice: 'nope'"),
    (["serve", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["serve", "--kinds", "linear"], "--int8 holds ['softmax-gqa']: not among --kinds"),
    # serve's llama.cpp rows: a program that is not there, a kind it is not given or cannot run (/bin/sh stands in)
    (["serve", "--kinds", "softmax-gqa", "--llama-server", "{empty}/llama-server"],
     "llama-server: not an executable file"),
    (["serve", "--kinds", "softmax-gqa", "--llama-kind", "nope"], "--llama-kind nope: not one of --kinds"),
    (["serve", "--llama-server", "/bin/sh", "--kinds", "linear", "--int8", "--llama-kind", "linear"],
     "no GGUF equivalent"),
    # recipe: the overrides compose before anything trains, and the named recipes are checked as a set
    (["recipe", "--b", "optim=nope"], "optim"),
    (["recipe", "--recipe", "a=", "--recipe", "noequals"], "--recipe 'noequals' is not NAME=OVERRIDES"),
    (["recipe", "--recipe", "a b=seed=1", "--recipe", "c="], "--recipe 'a b=seed=1' is not NAME=OVERRIDES"),
    (["recipe", "--recipe", "only="], "give two or more, each name once"),
    (["recipe", "--recipe", "x=", "--recipe", "x=seed=1"], "give two or more, each name once"),
    (["recipe", "--recipe", "target=", "--recipe", "b="], "target names a column of the report"),
    (["recipe", "--recipe", "a=", "--recipe", "b=", "--a", "seed=1"],
     "give --recipe NAME=OVERRIDES for every recipe, or --a and --b, not both"),
]


@pytest.mark.parametrize(("args", "key"), BENCH, ids=[" ".join(args) for args, _ in BENCH])
def test_a_bad_benchmark_option_is_one_line_naming_it_exit_2_and_nothing_written(args, key, tmp_path, capsys):
    out = tmp_path / "written"
    module = importlib.util.module_from_spec(spec := importlib.util.spec_from_file_location(
        "lm_script_bench", ROOT / "scripts" / "bench.py"))
    spec.loader.exec_module(module)
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        module.run([*(fill(a, tmp_path) for a in args), "--json", str(out / "results.json")])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert done.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert key in lines[0] and "Traceback" not in err
    assert not out.exists() or not any(out.rglob("*"))  # at most the --json folder, made before measuring


VERIFY_CACHE = [  # scripts/verify_cache.py over a cache whose meta.json was rewritten: what the line names
    ({}, "does not name tokenizer.json, train.bin, val.bin"),
    ({"tokenizer.json": None, "train.bin": None}, "does not name val.bin"),
    ({"../train.bin": [4, "0" * 64]}, "'../train.bin'"),
]


@pytest.mark.parametrize(("files", "named"), VERIFY_CACHE, ids=[str(files) for files, _ in VERIFY_CACHE])
def test_a_cache_manifest_that_checks_nothing_is_one_line_exit_2(files, named, tmp_path, capsys):
    import json
    import runpy

    cache = tmp_path / "cache"
    cache.mkdir()
    for name in ("tokenizer.json", "train.bin", "val.bin"):
        (cache / name).write_bytes(b"\0" * 4)
    (cache / "meta.json").write_text(json.dumps({"dtype": "uint16", "files": files}))
    main = runpy.run_path(str(ROOT / "scripts" / "verify_cache.py"))["main"]
    with pytest.raises(SystemExit) as done:
        main([str(cache)])
    out, err = capsys.readouterr()
    assert done.value.code == 2 and out == "" and len(err.strip().splitlines()) == 1 and named in err, err


def tiny_model():
    import lm

    torch.manual_seed(0)
    return lm.Transformer(lm.ModelConfig(vocab_size=64, n_layer=1, d_model=32, n_head=4, d_ff=64, max_seq_len=16))


API = [  # the Python API given what a user is likely to pass by mistake: (call, error class, what it says)
    ("quantize_int8(None)", lambda lm, m: lm.quantize_int8(None), "GenerationError", "model is None"),
    ("quantize_int8((model, tokenizer))", lambda lm, m: lm.quantize_int8((m, None)), "GenerationError",
     "lm.load returns (model, tokenizer)"),
    ("quantize_int8(model, 'int3')", lambda lm, m: lm.quantize_int8(m, "int3"), "GenerationError", "'int3'"),
    ("quantize_int8(quantized, 'int3')", lambda lm, m: lm.quantize_int8(lm.quantize_int8(m), "int3"),
     "GenerationError", "'int3'"),
    ("load('/dev/null')", lambda lm, m: lm.load("/dev/null"), "CheckpointError", "'/dev/null' is not a regular file"),
    ("load('<missing>')", lambda lm, m: lm.load("/nonexistent/none.ckpt"), "CheckpointError", "does not exist"),
]


@pytest.mark.parametrize(("call", "error", "named"), [(c, e, n) for c, _, e, n in API], ids=[c for c, *_ in API])
def test_a_mistake_through_the_python_api_is_one_exported_error_naming_it(call, error, named):
    import lm

    run = next(f for c, f, _, _ in API if c == call)
    assert error in lm.__all__  # every error the API raises can be caught as lm.<Error>
    with pytest.raises(getattr(lm, error)) as raised:
        run(lm, tiny_model())
    assert named in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


def test_quantizing_a_quantized_model_takes_the_kernel_asked_for_and_keeps_its_weights():
    import lm
    from lm.generation.quantize import Int8Linear

    model = tiny_model()
    once = lm.quantize_int8(model, "int8pack")
    twice = lm.quantize_int8(once, "dequant")
    layers = [m for m in twice.modules() if isinstance(m, Int8Linear)]
    assert layers and {m.kernel for m in layers} == {"dequant"}
    assert {m.kernel for m in once.modules() if isinstance(m, Int8Linear)} == {"int8pack"}  # the original untouched
    for a, b in zip(once.state_dict().values(), twice.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    idx = torch.randint(0, 64, (2, 8))
    fresh = lm.quantize_int8(model, "dequant")  # what quantizing the float model with that kernel gives
    assert torch.allclose(twice(idx), fresh(idx), atol=1e-5)
