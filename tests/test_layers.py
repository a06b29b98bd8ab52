"""The package's layers: each folder imports only from the folders below it, no module imports
itself back through others, and `import lm` stays light (no Lightning, Hydra, wandb or fcntl)."""

import ast
import subprocess
import sys
from pathlib import Path

import lm

PACKAGE = Path(lm.__file__).parent
# From the ground up; a module may import from its own layer and the layers before it.
LAYERS = ["util", "attention", "model", "data", "formats", "generation", "config", "serving", "training", "studies"]


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


def test_import_lm_loads_nothing_heavy_or_posix_only():
    """Measured against what torch and tokenizers load themselves (torch imports fcntl on Linux):
    what `import lm` adds must hold none of these."""
    heavy = ("lightning", "hydra", "omegaconf", "wandb", "datasets", "transformers", "matplotlib", "fcntl")
    code = ("import sys, torch, tokenizers; before = set(sys.modules); import lm; "
            f"print(sorted(m for m in {heavy!r} if m in set(sys.modules) - before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_scripts_settings_and_the_scoring_load_no_lightning():
    """lm.config, which every script imports before it reads its settings (generate, serve, export,
    eval), loads no Lightning: a script that trains nothing starts without it. Nor does scoring a
    batch (the evaluation, the training benchmark) or checking a distillation's settings."""
    code = ("import sys, lm.config, lm.training.scoring, lm.training.distill, lm.studies.evaluate; "
            "print('lightning' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_no_module_imports_fcntl_when_it_is_imported():
    """fcntl exists on POSIX only: lm takes it inside the function that locks a run."""
    at_import = [path.name for path in PACKAGE.rglob("*.py") for node in ast.parse(path.read_text()).body
                 if isinstance(node, ast.Import) and any(a.name == "fcntl" for a in node.names)]
    assert at_import == []
    assert "import fcntl" in (PACKAGE / "util" / "files.py").read_text()  # the lock still takes it
