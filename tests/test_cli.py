"""Mistakes at the command line: Hydra's own (unknown setting, unknown group option) and ours, each
one line and exit code 2 before any work; a -m sweep runs every arm and lists the failed ones."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_config
from test_command_fuzz import run_in_process

from lm.config.settings import typed
from lm.generation.settings import GenerateSettings
from lm.generation.text import generate_text, read_stop_strings
from lm.util.cli import quote_text_overrides
from lm.util.errors import ConfigError, GenerationError

ROOT = Path(__file__).resolve().parents[1]
ATTN_OPTIONS = sorted(p.stem for p in (ROOT / "conf" / "attn").glob("*.yaml"))  # the attn group's options


@pytest.fixture(autouse=True, params=[None, "0"], ids=["HYDRA_FULL_ERROR-unset", "HYDRA_FULL_ERROR=0"])
def hydra_full_error(request, monkeypatch):
    """Every test here twice: in a clean environment and with HYDRA_FULL_ERROR=0 (a common setting, which
    makes Hydra print its own short form of an error); the scripts' one line must not depend on it."""
    if request.param is None:
        monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    else:
        monkeypatch.setenv("HYDRA_FULL_ERROR", request.param)
    yield
    assert os.environ.get("HYDRA_FULL_ERROR") == request.param  # run_script puts the user's value back


def run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("script, args, line", [
    ("train.py", ["attn=gqaa"], "error: attn=gqaa is not an option of attn; did you mean gqa? (options: "),
    ("train.py", ["trainer.max_stepz=5"], "error: trainer.max_stepz is not a setting; did you mean trainer.max_steps? "
                                          "(+trainer.max_stepz=... adds a new one)"),
    ("train.py", ["max_steps=5"], "error: max_steps is not a setting; did you mean trainer.max_steps?"),
    ("generate.py", ["ckpt=x", "max_new_tokenz=5"], "error: max_new_tokenz is not a setting; did you mean "
                                                    "max_new_tokens?"),
    ("train.py", ["trainer.max_steps=[1"], "error: cannot read an override on the command line"),
])
def test_hydra_mistakes_are_one_line_and_exit_2(tmp_path, script, args, line):
    done = run(script, *args, cwd=tmp_path)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith(line), done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_sweep_runs_every_arm_and_lists_the_failed_ones(tmp_path):
    done = run("generate.py", "-m", "ckpt=none.ckpt", "prompt=x", "temperature=-1,nan", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: [ckpt=none.ckpt prompt='x' temperature=-1] temperature=-1 must be a finite number >= 0",
        "error: [ckpt=none.ckpt prompt='x' temperature=nan] temperature=nan must be a finite number >= 0",
        "error: 2 arm(s) of the sweep failed: ckpt=none.ckpt prompt='x' temperature=-1; "
        "ckpt=none.ckpt prompt='x' temperature=nan",
    ]


@pytest.mark.slow
def test_a_sweep_arm_that_cannot_be_composed_refuses_the_sweep_before_any_arm_runs(tmp_path):
    # Hydra composes every arm before launching the first: a typo in the list costs no training.
    done = run("train.py", "-m", "attn=mha,gqaa", "logger=none", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: attn=gqaa is not an option of attn; did you mean gqa? (options: {', '.join(ATTN_OPTIONS)})"]
    written = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert written == ["multirun.yaml"]  # Hydra's record of the sweep; no arm started, no checkpoint


@pytest.mark.slow
def test_a_hub_dataset_unreachable_offline_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # what a machine without network sees, at once
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "data=hf",
                           "data.name=someone/no-such-dataset", "logger=none", f"data.cache_dir={tmp_path / 'c'}",
                           f"checkpoint_dir={tmp_path / 'ck'}", f"hydra.run.dir={tmp_path / 'h'}"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: data.name='someone/no-such-dataset' is not a local folder and the Hugging Face Hub cannot be "
        "reached (Couldn't reach 'someone/no-such-dataset' on the Hub (OfflineModeIsEnabled)); offline, only "
        "datasets already in the datasets cache load"], done.stderr
    assert not (tmp_path / "ck" / "mha-nano").exists()  # no run folder left behind


def test_hydras_console_does_not_repeat_what_a_library_printed_itself(capsys):
    """Hydra puts a console handler on the root logger; libraries such as huggingface_hub print
    their records with their own handler as well, so without the filter each shows twice."""
    import logging

    from lm.util.cli import show_each_log_record_once

    hydra_console = logging.StreamHandler(sys.stderr)
    library = logging.getLogger("some_library")
    library_console = logging.StreamHandler(sys.stderr)
    library.addHandler(library_console)
    polite = logging.getLogger("polite_library")  # the logging HOWTO's advice: a NullHandler, printing nothing
    polite_null = logging.NullHandler()
    polite.addHandler(polite_null)
    logging.root.addHandler(hydra_console)
    try:
        show_each_log_record_once()
        show_each_log_record_once()  # a second script main in one process adds nothing
        logging.getLogger("some_library.http").warning("retrying in 1s")
        logging.getLogger("plain_library").warning("no handler of its own")
        polite.warning("only a NullHandler")
    finally:
        logging.root.removeHandler(hydra_console)
        library.removeHandler(library_console)
        polite.removeHandler(polite_null)
    assert capsys.readouterr().err.splitlines() == ["retrying in 1s", "no handler of its own", "only a NullHandler"]
    assert len(hydra_console.filters) == 1


def test_stop_strings_typed_as_in_the_readme_mean_newlines():
    # The shell hands `stop=["\n\n"]` over as backslash-n; Hydra keeps it so.
    assert read_stop_strings(["\\n\\n", "a\\tb", "c\\\\n"]) == ["\n\n", "a\tb", "c\\n"]
    assert read_stop_strings("ef") == ["ef"]  # stop=ef typed without brackets: one string, not 'e' and 'f'
    assert read_stop_strings(None) == []
    with pytest.raises(GenerationError, match="empty string"):
        read_stop_strings(["x", ""])


@pytest.mark.parametrize("override, message", [
    ("temperature=nan", "temperature=nan must be a finite number >= 0"),
    ("temperature=inf", "temperature=inf must be a finite number >= 0"),
    ("seed=100000000000000000000000", "seed=100000000000000000000000 must be null or an integer"),
    ("device=tpu", "device='tpu' is not cpu, cuda or mps"),
    ("stop=['']", "stop=[...] holds an empty string"),
])
def test_generation_settings_are_checked_before_loading(tmp_path, override, message):
    cfg = compose_config("generate", quote_text_overrides([f"ckpt={tmp_path / 'none.ckpt'}", "prompt=x", override],
                                                          keys=("prompt",)))
    with pytest.raises((GenerationError, ConfigError), match=message.replace("[", r"\[").replace("]", r"\]")):
        generate_text(typed(GenerateSettings, cfg))


@pytest.mark.slow
def test_a_prompt_of_invalid_utf8_is_one_line(tmp_path):
    done = run("generate.py", f"ckpt={tmp_path / 'none.ckpt'}", "prompt=caf\udce9", cwd=tmp_path)
    # the shell's undecodable byte reaches Python as a lone surrogate; the line names the byte itself
    assert done.returncode == 2 and done.stderr == "error: prompt is not valid UTF-8 text: byte 0xe9 at offset 3\n", \
        done.stderr


# ------------------------------------------------------------------ run_name and Hydra's run folder

REFUSED_BEFORE_TRAINING = ["trainer.max_steps=0", "logger=none"]  # nothing trains, whatever the run_name
LEAVES_OUTPUTS = "must name a folder inside checkpoint_dir and outputs/ (not empty, no '..', no leading '/')"


def everything_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_run_name_leaving_outputs_is_refused_before_hydra_makes_its_folder(tmp_path, monkeypatch):
    checkout = tmp_path / "above" / "checkout"
    checkout.mkdir(parents=True)
    monkeypatch.chdir(checkout)  # Hydra's folders are made relative to where the command runs
    code, err = run_in_process("train", ["run_name=../../escape", *REFUSED_BEFORE_TRAINING], monkeypatch)
    assert (code, err) == (2, f"error: run_name='../../escape' {LEAVES_OUTPUTS}\n")
    assert everything_under(tmp_path) == ["above", "above/checkout"]
    # A name with a folder in it keeps its Hydra folder, outputs/<run_name>/<time>/, as before.
    code, err = run_in_process("train", ["run_name=group/sub", *REFUSED_BEFORE_TRAINING], monkeypatch)
    assert err == "error: trainer.max_steps=0 must be an integer >= 1\n"
    (hydra_run,) = (checkout / "outputs" / "group" / "sub").iterdir()
    assert (hydra_run / ".hydra" / "config.yaml").is_file()


def test_a_sweep_arm_whose_run_name_leaves_multirun_is_refused_before_hydra_makes_its_folder(tmp_path, monkeypatch):
    checkout = tmp_path / "above" / "checkout"
    checkout.mkdir(parents=True)
    monkeypatch.chdir(checkout)
    # The arm's folder is multirun/<time>/1-<run_name>: four `..` after `1-..` reach above/.
    code, err = run_in_process("train", ["-m", "run_name=fine,../../../../../escape", *REFUSED_BEFORE_TRAINING],
                               monkeypatch)
    assert code == 2
    assert err.splitlines()[-1] == f"error: run_name='../../../../../escape' {LEAVES_OUTPUTS}"
    assert [p for p in everything_under(tmp_path) if not p.startswith("above/checkout/")] == ["above", "above/checkout"]
    # The sweep leaves no state behind: a later user error in this process ends it, not taken for an arm's.
    from lm.util.cli import FAILED_ARMS, exit_on_user_error, sweep_arm

    assert sweep_arm() is None and FAILED_ARMS == []
    with pytest.raises(SystemExit) as done, exit_on_user_error():
        raise ConfigError("after the sweep")
    assert done.value.code == 2


@pytest.mark.parametrize("name, refused", [
    ("mha-tiny", False), ("group/sub", False), ("./here", False),
    ("../escape", True), ("group/../../escape", True), ("group/../sub", True), ("/tmp/elsewhere", True), ("", True),
    ("  ", True), (".", True), (None, True),
])
def test_run_folder_name_keeps_a_name_below_its_folder_and_refuses_the_rest(name, refused):
    from lm.util.files import run_folder_name

    if refused:
        with pytest.raises(ConfigError, match=f"^run_name={re.escape('null' if name is None else repr(name))} "
                                              f"{re.escape(LEAVES_OUTPUTS)}$"):
            run_folder_name(name)
    else:
        assert run_folder_name(name) == name
