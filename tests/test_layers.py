"""The package's layers: each folder imports only from the folders below it, no module imports
itself back through others, and `import lm` stays light (no Lightning, Hydra, wandb or fcntl)."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lm

PACKAGE = Path(lm.__file__).parent
# From the ground up; a module may import from its own layer and the layers before it.
LAYERS = ["util", "attention", "model", "data", "formats", "generation", "config", "serving", "training", "evaluation",
          "studies"]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """Every lm module `path` imports, at the top or inside a function: `from lm.a import b`
    counts as lm.a.b when that is a module, else as lm.a."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lm":
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "lm"}
    return found


def imported_names(path: Path) -> set[str]:
    """Every module name `path` imports, of any package, at the top or inside a function."""
    tree = ast.parse(path.read_text())
    return ({node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
            | {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names})


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path, set(paths)) - {name} for name, path in paths.items()}


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_lives_in_a_layer():
    stray = [m for m in import_graph() if m != "lm" and layer_of(m) is None]
    assert stray == []


def test_no_layer_imports_a_layer_above_it():
    upward = sorted(f"{m} -> {i}" for m, imports in import_graph().items() if m != "lm"
                    for i in imports if i != "lm" and layer_of(i) > layer_of(m))
    assert upward == []


def test_no_import_cycle():
    graph = import_graph()
    graph = {m: {i for i in imports if i in graph} for m, imports in graph.items()}
    # A package's __init__ importing its own modules is how a package exposes them, not a cycle.
    edges = {m: {i for i in imports if not m.startswith(i + ".") and not i.startswith(m + ".")}
             for m, imports in graph.items()}
    cycles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_walk_sees_the_imports_it_judges():
    """The checks above could pass on a graph with no edges; this one cannot."""
    graph = import_graph()
    assert "lm.attention.base" in graph["lm.attention.softmax"]
    assert "lm.model.config" in graph["lm.formats.checkpoint"]
    assert layer_of("lm.studies.compare") > layer_of("lm.training.run") > layer_of("lm.model.transformer")
    assert "lm.evaluation.perplexity" in graph["lm.studies.compare_runs"]


def test_the_package_never_imports_the_benchmarks():
    """benchmarks/ is a folder of the repository, not of the wheel: what is installed cannot import it."""
    importers = sorted(m for m, path in {module_name(p): p for p in PACKAGE.rglob("*.py")}.items()
                       if any(name.split(".")[0] == "benchmarks" for name in imported_names(path)))
    assert importers == []


# What each import may not load, in an interpreter that has only torch and tokenizers (which `import lm`
# loads itself: torch imports fcntl on Linux). A statement's modules: those it adds to sys.modules.
# torch._dynamo: what compiles imports it, 1.3-2 s a process; nothing that only imports lm or starts a script does.
IMPORT_CHECKS = {
    # `import lm` stays light, and holds nothing POSIX-only
    "import lm": ("lightning", "hydra", "omegaconf", "wandb", "datasets", "transformers", "matplotlib", "fcntl",
                  "torch._dynamo"),
    # model code trains and decodes without the training stack
    "import lm.model, lm.attention": ("lightning", "wandb", "hydra", "torch._dynamo"),
    # lm.config, which every script imports before it reads its settings (generate, serve, export, eval): a
    # script that trains nothing starts without Lightning; nor does scoring a batch (the evaluation, the
    # training benchmark) or checking a distillation's settings
    "import lm.config, lm.training.scoring, lm.training.distill, lm.evaluation.perplexity": ("lightning",
                                                                                             "torch._dynamo"),
    # what every script does first (lm.util.cli.run_script), where no CPU capability is held back
    "import os; os.environ.pop('ATEN_CPU_CAPABILITY', None); from lm.util.hardware import "
    "inductor_cache_per_capability; inductor_cache_per_capability()": ("torch._dynamo", "torch._inductor"),
    # a study's report renders from its records alone: its tables and plots load no training layer
    "import lm.studies.report": ("lightning", "pytorch_lightning", "lm.training"),
}
FRESH_IMPORTS = """
import json, os, sys, torch, tokenizers
base = set(sys.modules)
for statement in json.loads(sys.argv[1]):
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # a fresh copy of this interpreter, torch and tokenizers loaded: the statement alone
        try:
            os.close(read)
            exec(statement)
            os.write(write, json.dumps(sorted(set(sys.modules) - base)).encode())
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(0)  # never back into the loop
    os.close(write)
    with os.fdopen(read) as out:
        added = json.loads(out.read() or "null")
    os.waitpid(child, 0)
    print(json.dumps([statement, added]))
"""


@pytest.fixture(scope="module")
def loaded_by():
    """(statement -> the modules it loads, in a fresh interpreter that has imported torch and tokenizers;
    what the children wrote to stderr): one interpreter imports them (seconds), then each statement runs
    in a fork of it."""
    run = subprocess.run([sys.executable, "-c", FRESH_IMPORTS, json.dumps(list(IMPORT_CHECKS))], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return dict(json.loads(line) for line in run.stdout.splitlines()), run.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks one interpreter per statement")
@pytest.mark.parametrize("statement", IMPORT_CHECKS)
def test_each_import_loads_none_of_what_its_layer_must_not(statement, loaded_by):
    added = loaded_by[0][statement]
    assert added is not None, f"{statement!r} failed in the fresh interpreter: {loaded_by[1][-2000:]}"
    assert any(m == "lm" or m.startswith("lm.") for m in added)  # the statement ran: lm was not loaded before it
    forbidden = [m for m in added if any(m == f or m.startswith(f + ".") for f in IMPORT_CHECKS[statement])]
    assert forbidden == [], f"{statement!r} loads {forbidden[:8]}"


def test_no_module_imports_fcntl_when_it_is_imported():
    """fcntl exists on POSIX only: lm takes it inside the function that locks a run."""
    at_import = [path.name for path in PACKAGE.rglob("*.py") for node in ast.parse(path.read_text()).body
                 if isinstance(node, ast.Import) and any(a.name == "fcntl" for a in node.names)]
    assert at_import == []
    assert "import fcntl" in (PACKAGE / "util" / "files.py").read_text()  # the lock still takes it


# ---------------------------------------------------------------- importing defines, nothing more

# What may run at a module's top level only inside a function that a start calls: a warning or logging
# filter, a level, the kinds from outside lm/ (entry points, LM_ATTENTION_KINDS), an import by name. (A
# module's own logger, logging.getLogger(__name__), is a definition.)
STARTS_ONLY = re.compile(r"^(warnings\.\w+|logging\.(?!getLogger$)\w+|\w+\.(addFilter|setLevel)|"
                         r"load_outside_kinds|load_entry_points|load_kind_files|load_builtin_kinds|"
                         r"load_attention_kinds|quiet_known_warnings|importlib\.import_module)$")


def top_level_calls(path: Path) -> list[str]:
    """The calls a module makes as it is imported: those of its top level and of its top-level
    blocks (for, with, if, try), not those inside its functions and classes."""
    found, body = [], list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, (ast.For, ast.While, ast.With, ast.If, ast.Try)):
            body += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
            continue
        found += [ast.unparse(call.func) for call in ast.walk(node) if isinstance(call, ast.Call)]
    return found


def test_no_module_installs_a_filter_or_loads_kinds_when_it_is_imported():
    at_import = sorted(f"{path.relative_to(PACKAGE.parent)}: {name}" for path in PACKAGE.rglob("*.py")
                       for name in top_level_calls(path) if STARTS_ONLY.match(name))
    assert at_import == []


def test_the_walk_sees_a_filter_installed_at_import(tmp_path):
    """The check above could pass by seeing nothing; it sees what runs on import, and only that."""
    sample = tmp_path / "sample.py"
    sample.write_text("import logging, warnings\nlog = logging.getLogger(__name__)\nif True:\n"
                      "    warnings.filterwarnings('ignore')\nlog.addFilter(None)\n"
                      "def start():\n    warnings.simplefilter('ignore')\n")
    assert sorted(name for name in top_level_calls(sample) if STARTS_ONLY.match(name)) == ["log.addFilter",
                                                                                      "warnings.filterwarnings"]


OUTSIDE_KIND = """
from dataclasses import dataclass
from lm.attention import AttentionSpec, register

@register("{name}")
@dataclass(frozen=True)
class Spec(AttentionSpec):
    width: int = 1
"""

# Runs in a fresh interpreter whose environment names a kind file in LM_ATTENTION_KINDS and an installed
# distribution with an entry point: imports the modules a script or the server imports and asks for the
# built-in kinds, then makes the calls a start makes. Torch first: what it does to the warning filters as
# it loads is its own. (Not lm.training.run, which takes Lightning's seconds to import: the walk above
# holds every module.)
IMPORT_THEN_START = """
import json, logging, os, sys, warnings
import torch

adverts = logging.getLogger("lightning.pytorch.utilities.rank_zero")
seen = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    filters, advert_filters = list(warnings.filters), list(adverts.filters)
    import lm, lm.attention, lm.config, lm.generation.compiled, lm.serving.run, lm.training.scoring, lm.util.cli
    seen["kinds"] = lm.attention.available_kinds()  # the built-in ones, on first use
    seen["filters unchanged"] = warnings.filters == filters and adverts.filters == advert_filters
    seen["entry point module loaded"] = "outside_kinds_mod" in sys.modules
    seen["warned on import"] = [str(w.message) for w in caught if "kind" in str(w.message)]

    from lm.config.attn import load_attention_kinds
    from lm.util.cli import quiet_known_warnings

    os.environ["LM_ATTENTION_KINDS"] = sys.argv[1]  # read by the call, not before
    seen["loaded"] = load_attention_kinds()
    seen["loaded again"] = load_attention_kinds()
    seen["warned on loading"] = [w.category.__name__ for w in caught if "LM_ATTENTION_KINDS" in str(w.message)]
    from hydra.core.config_store import ConfigStore
    seen["schema"] = "ep_kind.yaml" in ConfigStore.instance().repo["attn"]["kind"]
    quiet_known_warnings()
    seen["quieted"] = len(warnings.filters) - len(filters) == len(lm.util.cli.KNOWN_WARNINGS)
    seen["adverts filtered"] = len(adverts.filters) == len(advert_filters) + 1
print(json.dumps(seen))
"""


def test_importing_lm_installs_no_filter_and_loads_no_outside_kind_until_a_start_asks(tmp_path):
    installed = tmp_path / "site"
    info = installed / "outside_kinds-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: outside_kinds\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lm.attention_kinds]\noutside_kinds = outside_kinds_mod\n")
    (installed / "outside_kinds_mod.py").write_text(OUTSIDE_KIND.format(name="ep_kind"))
    kind_file = tmp_path / "env_kind.py"
    kind_file.write_text(OUTSIDE_KIND.format(name="env_kind"))
    # a path that is no kind file: read on import, it would be an error
    env = {**os.environ, "LM_ATTENTION_KINDS": str(tmp_path / "nowhere.py"),
           "PYTHONPATH": os.pathsep.join([str(installed), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", IMPORT_THEN_START, str(kind_file)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "softmax" in seen["kinds"] and not {"ep_kind", "env_kind"} & set(seen["kinds"])
    assert seen["filters unchanged"] and not seen["entry point module loaded"] and seen["warned on import"] == []
    assert seen["loaded"] == ["env_kind", "ep_kind"] and seen["loaded again"] == []
    assert seen["warned on loading"] == ["DeprecationWarning"] and seen["schema"]
    assert seen["quieted"] and seen["adverts filtered"]
