"""Every command the README and docs/ show is one the project accepts as written.

Each `python scripts/<name>.py ...` line in a code block or inline code span is composed with the
script's own Hydra config and overrides (an unknown option, group choice or key fails here) and then
put through the checks the script runs before any work: the run settings and the model config for
training, the generation settings, the comparison's plan. `scripts/bench.py` lines go through its
argument parser, `make` lines must name a Makefile target. Placeholders the docs use on purpose
(`ckpt=...`, `<tasks>`, `[a|b]`) are filled in first. The commands themselves run end to end in the
slow tier's script tests (train, generate, eval, export, import, compare, uptrain, bench, harness).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HYDRA_SCRIPT = re.compile(r'config_name="(\w+)"')


def code_lines(text: str) -> list[tuple[str, str | None]]:
    """(command, the error the page says it prints or None): lines inside ``` blocks, continuations
    joined, and inline `python ...`/`make ...` spans, with a "`error: ...`" span after one in its paragraph."""
    lines, in_block, pending, prose = [], False, "", []
    for raw in text.splitlines() + [""]:
        if raw.strip().startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            lines.append((pending + raw, None))
            pending = ""
        elif raw.strip():
            prose.append(raw)
        else:  # a paragraph ends: its inline spans, in order
            spans = re.findall(r"`([^`]+)`", " ".join(prose))
            for i, span in enumerate(spans):
                if re.match(r"(python|make) ", span):
                    after = spans[i + 1] if i + 1 < len(spans) else ""
                    lines.append((span, after[len("error: "):] if after.startswith("error: ") else None))
            prose = []
    return lines


def fill_placeholders(line: str) -> str:
    line = re.sub(r"\[(\w[\w.]*=[^\]|\s]+)\|[^\]]*\]", r"\1", line)  # [gguf_type=f32|f16|q8_0] -> the first
    line = re.sub(r"<[^>]*>", "PLACEHOLDER", line)  # <tasks>, <dataset or local folder>
    return line.replace("=...", "=PLACEHOLDER")


def documented_commands() -> list[tuple[str, list[str], str | None]]:
    """(where, argv from the script or make on, the error it should print) for each command of every page."""
    found = []
    for page in PAGES:
        for line, error in code_lines(page.read_text()):
            try:
                words = shlex.split(fill_placeholders(line), comments=True)
            except ValueError:  # prose in a code block, not a command
                continue
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # an environment setting before it
                if words[0].startswith("LM_ATTENTION_KINDS="):  # a kind outside lm/: tests/test_contract.py
                    words = []
                    break
                words = words[1:]
            if words[:1] not in (["python"], ["srun"], ["torchrun"], ["make"]):
                continue
            start = next((i for i, w in enumerate(words) if w.startswith("scripts/") and w.endswith(".py")), None)
            if start is not None:
                found.append((f"{page.name}: {line.strip()}", words[start:], error))
            elif words[:1] == ["make"]:
                found.append((f"{page.name}: {line.strip()}", words, error))
    return found


COMMANDS = documented_commands()


def test_the_pages_show_commands_of_every_script():
    scripts = {argv[0] for _, argv, _ in COMMANDS if argv[0].startswith("scripts/")}
    for name in ("train", "generate", "eval", "export", "import_hf", "uptrain", "compare", "bench", "harness"):
        assert f"scripts/{name}.py" in scripts, f"no command of scripts/{name}.py in README.md or docs/"


def hydra_overrides(argv: list[str]) -> tuple[str | None, list[list[str]]]:
    """(--config-name, override lists): a multirun's comma list becomes one list per value."""
    config_name, overrides, sweep = None, [], None
    words = iter(argv)
    for word in words:
        if word == "--config-name":
            config_name = next(words)
        elif word in ("-m", "--multirun"):
            sweep = True
        elif not word.startswith("-"):
            overrides.append(word)
    if not sweep:
        return config_name, [overrides]
    swept = next(i for i, o in enumerate(overrides) if "," in o and "[" not in o)
    key, values = overrides[swept].split("=", 1)
    return config_name, [overrides[:swept] + [f"{key}={v}"] + overrides[swept + 1:] for v in values.split(",")]


def check_composed(script: str, cfg) -> None:
    """The checks each script makes before it does any work."""
    if script == "train":
        from lm.training.run import check_run_settings, model_config_from

        check_run_settings(cfg)
        model_config_from(cfg, vocab_size=256)
    elif script == "generate":
        from lm.generation.text import check_run_settings

        check_run_settings(cfg)
    elif script == "compare":
        from unittest import mock

        from lm.studies import compare

        # The pages' corpora (my/texts/) are examples: reading the corpus is test_compare's to check.
        with mock.patch.object(compare, "corpus_key", lambda cfg: "a corpus"):
            assert compare.plan(cfg), "the comparison plans no arm"


@pytest.mark.parametrize("where,argv,error", COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_a_documented_command_is_accepted_as_written(where, argv, error, tmp_path, monkeypatch):
    """Accepted, or refused with exactly the line the page says it prints."""
    monkeypatch.chdir(tmp_path)  # nothing may land in the checkout
    if argv[0] == "make":
        targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        assert set(argv[1:]) <= targets, f"{where}: no such make target"
        return
    script = ROOT / argv[0]
    assert script.is_file(), f"{where}: {argv[0]} does not exist"
    name = script.stem
    if name == "bench":
        from lm.studies.bench import build_parser

        if "--help" not in argv and "PLACEHOLDER" not in argv:
            build_parser().parse_args(argv[1:])
        return
    config = HYDRA_SCRIPT.search(script.read_text())
    if config is None:  # harness.py: lm-eval's own command line, run in the slow tier
        return
    config_name, runs = hydra_overrides(argv[1:])
    if name == "generate":  # the script quotes its free-text settings for Hydra before parsing
        from lm.generation.text import PROMPT_KEYS
        from lm.util.cli import quote_text_overrides

        runs = [quote_text_overrides(overrides, keys=PROMPT_KEYS) for overrides in runs]
    if "--help" in argv:
        runs = [[]]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for overrides in runs:
            cfg = compose(config_name=config_name or config.group(1), overrides=overrides)
            if error is None:
                check_composed(name, cfg)
                continue
            with pytest.raises(Exception) as refused:
                check_composed(name, cfg)
            assert str(refused.value) == error, f"{where}: the page says it prints 'error: {error}'"
