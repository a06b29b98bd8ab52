"""Every command the README and docs/ show is one the project accepts as written.

Each `python scripts/<name>.py ...` line in a code block or inline code span is composed with the
script's own Hydra config and overrides (an unknown option, group choice or key fails here) and then
put through the checks the script runs before any work: the run settings and the model config for
training, the generation settings, the comparison's settings (its plan, every arm composed and
checked, in the slow tier). `scripts/bench.py` lines go through its argument parser, `make` lines
must name a Makefile target. Placeholders the docs use on purpose
(`ckpt=...`, `<tasks>`, `[a|b]`) are filled in first. The commands themselves run end to end in the
slow tier's script tests (train, generate, eval, export, import, compare, uptrain, bench, harness).
"""

from __future__ import annotations

import ast
import functools
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import compose_config
from hydra import initialize_config_dir

from lm.config.compare import CompareRun

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


PLANNED: set[str] = set()  # the comparison configs planned in this process: a plan of the default study takes seconds
RUN_ONLY = ("report_only", "records_from", "arm")


def check_composed(script: str, cfg, plan: bool = False) -> None:
    """The checks each script makes before it does any work; a comparison's plan (every arm composed
    and checked, seconds to tens of seconds for the default study) only with `plan`."""
    if script == "train":
        from lm.config.train import TrainRun
        from lm.training.run import check_run_settings, model_config_from

        run = TrainRun.from_config(cfg)
        check_run_settings(run)
        model_config_from(run.model, run.attn, vocab_size=256)
    elif script == "generate":
        from lm.generation.text import check_run_settings

        check_run_settings(cfg)
    elif script == "compare":
        from unittest import mock

        from omegaconf import OmegaConf, open_dict

        from lm.studies import compare

        # Which arms run and what is reported (report_only, records_from, arm) are compare.run's to read,
        # not the plan's: their values are checked here, and planned without them, a plan that read one
        # fails here rather than passing.
        compare.check_study_settings(cfg)
        if not plan:
            return
        planned = cfg.copy()
        with open_dict(planned):
            for key in RUN_ONLY:
                planned.pop(key)
        settings = OmegaConf.to_yaml(planned)
        if settings in PLANNED:  # another command's plan exactly (only Hydra's own, a comment or RUN_ONLY differ)
            return
        # The pages' corpora (my/texts/) are examples: reading the corpus is test_compare's to check.
        with mock.patch.object(compare, "corpus_key", lambda cfg: "a corpus"):
            assert compare.plan(CompareRun.from_config(planned)), "the comparison plans no arm"
        PLANNED.add(settings)


@pytest.mark.parametrize("where,argv,error", COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_a_documented_command_is_accepted_as_written(where, argv, error, tmp_path, monkeypatch):
    """Accepted, or refused with exactly the line the page says it prints (a comparison: its settings;
    its whole plan in the slow tier, below)."""
    check_documented_command(where, argv, error, tmp_path, monkeypatch)


COMPARISONS = [(where, argv, error) for where, argv, error in COMMANDS if argv[0] == "scripts/compare.py"]


@pytest.mark.slow  # the default study's plan alone composes and checks over 600 arms: 10-25 s a command
@pytest.mark.parametrize("where,argv,error", COMPARISONS, ids=[w for w, _, _ in COMPARISONS])
def test_a_documented_comparison_plans_every_arm_as_written(where, argv, error, tmp_path, monkeypatch):
    """Each documented comparison's every arm composed and checked, as compare.py does before training."""
    check_documented_command(where, argv, error, tmp_path, monkeypatch, plan=True)


# the (argv, error, plan) already checked in this process: a command shown on several pages is composed once
CHECKED: set[tuple] = set()


def check_documented_command(where, argv, error, tmp_path, monkeypatch, plan: bool = False) -> None:
    if (tuple(argv), error, plan) in CHECKED:
        return
    monkeypatch.chdir(tmp_path)  # nothing may land in the checkout
    if argv[0] == "make":
        makefile = (ROOT / "Makefile").read_text()
        targets = set(re.findall(r"^([a-z-]+):", makefile, flags=re.M))
        settings = set(re.findall(r"^([A-Z_]+) \??=", makefile, flags=re.M))  # what `make test WORKERS=1` may set
        assert {w for w in argv[1:] if "=" not in w} <= targets, f"{where}: no such make target"
        assert {w.split("=")[0] for w in argv[1:] if "=" in w} <= settings, f"{where}: no such make variable"
        return
    script = ROOT / argv[0]
    assert script.is_file(), f"{where}: {argv[0]} does not exist"
    name = script.stem
    if name == "bench":
        from benchmarks.bench import build_parser

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
    for overrides in runs:
        cfg = compose_config(config_name or config.group(1), overrides)  # as Hydra composes it (conftest)
        # Hydra initialised over conf/ as at a script's start: a comparison's plan composes its arms there
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            if error is None:
                check_composed(name, cfg, plan)
                continue
            with pytest.raises(Exception) as refused:
                check_composed(name, cfg, plan)
            assert str(refused.value) == error, f"{where}: the page says it prints 'error: {error}'"
    CHECKED.add((tuple(argv), error, plan))


# ---------------------------------------------------------------------------- cited tests and their tiers

# A page that says this holds every test it cites without a slow mark to the fast tier (`make test`).
FAST_UNLESS_MARKED = "A cited test runs in `make test` unless marked (slow)"
SLOW_MARK = re.compile(r"\s*[(,]\s*(marked )?slow\b")  # `test_x` (slow) / `test_x`, slow / `x.py`, marked slow
FILE_CITATION = re.compile(r"(?:tests/)?(test_\w+\.py)(?:::(test_\w*?)(\.\.\.)?)?")  # a file, or a test in it
TEST_CITATION = re.compile(r"(test_\w*?)(\.\.\.)?")  # a test function alone; `...` ends a name cut short


@functools.cache  # read once per process: every page's check reads every test file's tree
def tiers_of_tests() -> dict[str, dict[str, bool]]:
    """{file name: {test function: whether it is in the slow tier}} of tests/test_*.py: marked
    `slow` by a decorator of the function or by the module's `pytestmark`."""
    tiers = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_slow = any("mark.slow" in ast.unparse(node.value) for node in tree.body
                          if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark"
                                                                  for t in node.targets))
        tests = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
        tiers[path.name] = {test.name: module_slow or any("mark.slow" in ast.unparse(d) for d in test.decorator_list)
                            for test in tests}
    return tiers


def citation_problems(text: str, tiers: dict[str, dict[str, bool]]) -> list[str]:
    """What is wrong with the tests a page cites in inline code (`tests/test_x.py`,
    `test_x.py::test_y`, `test_y`, `test_y_...`): a file or test that does not exist, or a tier other
    than the page says: slow where a slow mark follows the citation; `make test` where the page says
    FAST_UNLESS_MARKED and none does (a file: at least one of its tests in that tier)."""
    text = " ".join(re.sub(r"```.*?```", "", text, flags=re.S).split())  # prose only, one line
    fast_unless_marked = FAST_UNLESS_MARKED in text
    problems = []
    for span in re.finditer(r"`([^`\s]+)`", text):
        cited = span.group(1)
        if match := FILE_CITATION.fullmatch(cited):
            file, test, cut = match.groups()
        elif match := TEST_CITATION.fullmatch(cited):
            file, (test, cut) = None, match.groups()
        else:
            continue
        if file is not None and file not in tiers:
            problems.append(f"`{cited}`: no tests/{file}")
            continue
        files = [file] if file else list(tiers)
        found = {name: slow for f in files for name, slow in tiers[f].items()
                 if (name.startswith(test) if cut else name == test)} if test else tiers[file]
        if not found:
            problems.append(f"`{cited}`: no such test")
            continue
        if SLOW_MARK.match(text, span.end()):
            slow = True
        elif fast_unless_marked:
            slow = False
        else:  # the page says no tier
            continue
        tier = "the slow tier" if slow else "`make test`"
        if test and set(found.values()) != {slow}:
            wrong = sorted(name for name, s in found.items() if s != slow)
            problems.append(f"`{cited}` is said to be in {tier}, but {', '.join(wrong)} is not")
        elif not test and slow not in found.values():
            problems.append(f"`{cited}` is said to have tests in {tier}, but has none there")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_every_test_a_page_cites_exists_in_the_tier_the_page_says(page):
    assert citation_problems(page.read_text(), tiers_of_tests()) == []


def test_the_citation_check_finds_missing_tests_and_wrong_tiers():
    tiers = {"test_a.py": {"test_fast": False, "test_slow_one": True, "test_slow_two": True},
             "test_b.py": {"test_slow_three": True}}
    page = f"""{FAST_UNLESS_MARKED}: `test_a.py::test_fast`, `test_slow_...` (slow), `tests/test_b.py`, slow;
    `test_fast`, slow; `test_slow_one`; `test_b.py`; `test_c.py`; `test_a.py::test_gone`; `test_sl...`
    ```
    `test_gone` in a code block is not a citation
    ```"""
    assert citation_problems(page, tiers) == [
        "`test_fast` is said to be in the slow tier, but test_fast is not",
        "`test_slow_one` is said to be in `make test`, but test_slow_one is not",
        "`test_b.py` is said to have tests in `make test`, but has none there",
        "`test_c.py`: no tests/test_c.py", "`test_a.py::test_gone`: no such test",
        "`test_sl...` is said to be in `make test`, but test_slow_one, test_slow_three, test_slow_two is not"]
    # without the page's statement, unmarked citations claim no tier: only existence and slow marks are held
    assert citation_problems(page.replace(FAST_UNLESS_MARKED, ""), tiers) == [
        "`test_fast` is said to be in the slow tier, but test_fast is not",
        "`test_c.py`: no tests/test_c.py", "`test_a.py::test_gone`: no such test"]


def layout_entries() -> dict[str, dict[str, str]]:
    """docs/layout.md's tree: each top-level entry (lm/attention/, conf/, scripts/, ...) -> its entries
    (the names at two spaces' indent -> their text, continuation lines joined); the top line's own text
    under ''."""
    block = (ROOT / "docs" / "layout.md").read_text().split("```")[1]
    tree: dict[str, dict[str, str]] = {}
    top = entry = ""
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            top, entry = line.split()[0], ""
            tree[top] = {"": line}
        elif line.startswith("  ") and not line[2].isspace():
            entry = line.split()[0]
            tree[top][entry] = line
        else:
            tree[top][entry] += " " + line.strip()
    return tree


def names(word: str, text: str) -> bool:
    """text names word whole: train.py is not found inside uptrain.py, nor mha inside mha-nano."""
    return re.search(rf"(?<![\w.-]){re.escape(word)}(?![\w-])", text) is not None


def layout_omissions(tree: dict[str, dict[str, str]]) -> list[str]:
    """What the repository tracks and docs/layout.md does not name where it belongs."""
    tracked = [Path(p) for p in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                               check=True).stdout.splitlines()]
    everything = {top: " ".join(entries.values()) for top, entries in tree.items()}
    missing = [str(p) for p in tracked if p.suffix == ".py" and len(p.parts) == 3 and p.parts[0] == "lm"
               and p.name != "__init__.py" and p.name not in tree.get(f"lm/{p.parts[1]}/", {})]
    missing += [str(p) for p in tracked if p.suffix == ".py" and len(p.parts) == 2 and p.parts[0] == "tests"
                and not p.name.startswith("test_") and not names(p.name, everything.get("tests/", ""))]
    conf = tree.get("conf/", {})
    for p in (p for p in tracked if p.suffix == ".yaml" and p.parts[0] == "conf"):
        if len(p.parts) == 2 and not names(p.name, everything.get("conf/", "")):
            missing.append(str(p))
        elif len(p.parts) == 3:
            group = p.parts[1]  # its entry, or the entry that says where its folder is (preset/ under compare.yaml)
            text = conf.get(f"{group}/") or next((t for t in conf.values() if f"{group}/" in t), "")
            if not names(p.stem, text):
                missing.append(str(p))
    missing += [str(p) for p in tracked if p.suffix == ".py" and len(p.parts) == 2 and p.parts[0] == "scripts"
                and not names(p.name, everything.get("scripts/", ""))]
    folders = sorted({p.parts[1] for p in tracked if len(p.parts) > 2 and p.parts[0] == "docs"})
    missing += [f"docs/{f}/" for f in folders if not names(f"{f}/", everything.get("docs/", ""))]
    return missing


def test_the_layout_page_names_every_module_config_script_and_output_folder():
    assert layout_omissions(layout_entries()) == []


def test_the_layout_check_finds_what_the_page_leaves_out():
    tree = layout_entries()
    del tree["lm/attention/"]["mla.py"]
    tree["conf/"]["attn/"] = tree["conf/"]["attn/"].replace("mamba2,", "")
    tree["conf/"]["compare.yaml"] = tree["conf/"]["compare.yaml"].replace("frontier", "")
    tree["conf/"]["train.yaml"] = tree["conf/"]["train.yaml"].replace("train.yaml", "")  # uptrain.yaml stays
    tree["scripts/"][""] = tree["scripts/"][""].replace("serve.py", "").replace(" train.py", "")
    tree["docs/"][""] = tree["docs/"][""].replace("compare-mla/", "")
    del tree["tests/"]["serving.py"]
    assert sorted(layout_omissions(tree)) == sorted([
        "lm/attention/mla.py", "tests/serving.py", "conf/train.yaml", "conf/attn/mamba2.yaml",
        "conf/preset/frontier.yaml", "scripts/serve.py", "scripts/train.py", "docs/compare-mla/"])
