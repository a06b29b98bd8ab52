"""Mistakes at the command line: Hydra's own (unknown setting, unknown group option) and ours, each
one line and exit code 2 before any work; a -m sweep runs every arm and lists the failed ones."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_config

from lm.cli import quote_text_overrides
from lm.errors import GenerationError
from lm.generate_text import generate_text, read_stop_strings

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


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


def test_a_sweep_runs_every_arm_and_lists_the_failed_ones(tmp_path):
    done = run("generate.py", "-m", "ckpt=none.ckpt", "prompt=x", "temperature=-1,nan", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: [ckpt=none.ckpt prompt='x' temperature=-1] temperature=-1 must be a finite number >= 0",
        "error: [ckpt=none.ckpt prompt='x' temperature=nan] temperature=nan must be a finite number >= 0",
        "error: 2 arm(s) of the sweep failed: ckpt=none.ckpt prompt='x' temperature=-1; "
        "ckpt=none.ckpt prompt='x' temperature=nan",
    ]


def test_stop_strings_typed_as_in_the_readme_mean_newlines():
    # The shell hands `stop=["\n\n"]` over as backslash-n; Hydra keeps it so.
    assert read_stop_strings(["\\n\\n", "a\\tb", "c\\\\n"]) == ["\n\n", "a\tb", "c\\n"]
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
    with pytest.raises(GenerationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        generate_text(cfg)


def test_a_prompt_of_invalid_utf8_is_one_line(tmp_path):
    done = run("generate.py", f"ckpt={tmp_path / 'none.ckpt'}", "prompt=caf\udce9", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr == "error: the prompt is not valid UTF-8 text\n", done.stderr
