"""Importing lm leaves every library its own: no function of Hydra, OmegaConf or torch is replaced,
no attribute of theirs is set, and lm's source names no `hydra._internal` module. A user's process
that imports lm runs the Hydra, OmegaConf and torch they installed."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter: snapshot every attribute of the libraries' modules and of the classes
# they define, import every module of lm, and print what differs. Hydra's private modules are
# imported first so that a replacement of one of their functions is seen too, and so are the
# libraries lm's modules bring in (dynamo rewraps torch.manual_seed and torch.compile as it loads,
# Lightning imports dynamo): what they do to each other is theirs, not lm's.
SNAPSHOT_THEN_IMPORT_LM = textwrap.dedent("""
    import importlib, inspect, pkgutil, sys, types
    import hydra, omegaconf, torch, torch.compiler, torch.nn.functional
    for name in ("hydra._internal.hydra", "hydra._internal.config_loader_impl",
                 "hydra._internal.config_repository", "hydra._internal.defaults_list",
                 "hydra.core.config_store", "hydra.core.global_hydra", "hydra.compose", "hydra.main",
                 "omegaconf.omegaconf", "omegaconf.base", "omegaconf.dictconfig", "omegaconf.listconfig",
                 "torch._dynamo", "torch._inductor.config", "lightning.pytorch", "datasets", "tokenizers",
                 "fastapi", "transformers"):
        importlib.import_module(name)

    WATCHED = ("hydra", "omegaconf", "torch", "torch.compiler", "torch.nn.functional")

    def watched(name):
        return any(name == w or (w != "torch" and name.startswith(w + ".")) for w in WATCHED)

    def attributes(module):
        found = {}
        for attr, value in list(vars(module).items()):
            found[(module.__name__, attr)] = value
            if isinstance(value, type) and getattr(value, "__module__", None) == module.__name__:
                for cls_attr, cls_value in list(vars(value).items()):
                    found[(module.__name__, f"{attr}.{cls_attr}")] = cls_value
        return found

    def snapshot():
        found = {}
        for name, module in list(sys.modules.items()):
            if watched(name) and isinstance(module, types.ModuleType):
                found.update(attributes(module))
        return found

    before = snapshot()
    import lm
    for info in pkgutil.walk_packages(lm.__path__, "lm."):
        importlib.import_module(info.name)
    after = snapshot()

    for key, value in before.items():
        now = after.get(key, value)
        if now is not value:
            print("replaced", *key)
    for key, value in after.items():
        # a submodule imported later becomes its parent's attribute; that is the import system's doing
        if key not in before and key[0] in {k[0] for k in before} and not isinstance(value, types.ModuleType):
            print("added", *key)
    print("checked", len(before))
""")


def test_importing_every_module_of_lm_replaces_and_sets_nothing_in_hydra_omegaconf_or_torch():
    done = subprocess.run([sys.executable, "-c", SNAPSHOT_THEN_IMPORT_LM], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("checked ") and int(lines[-1].split()[1]) > 1000, done.stdout[-2000:]
    assert lines[:-1] == [], "\n".join(lines[:-1])


def test_the_snapshot_sees_a_replaced_hydra_function():
    """The check above can fail: a module that replaces one of Hydra's private functions is reported."""
    patching = SNAPSHOT_THEN_IMPORT_LM.replace(
        "after = snapshot()",
        "import hydra._internal.hydra as h; h.Hydra.get_mode = lambda *a, **k: None\nafter = snapshot()")
    done = subprocess.run([sys.executable, "-c", patching], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert "replaced hydra._internal.hydra Hydra.get_mode" in done.stdout.splitlines(), done.stdout[-2000:]


def test_lm_names_no_private_hydra_module_and_sets_no_library_attribute():
    """What a reader greps for: `hydra._internal`, and an assignment to an attribute of hydra,
    omegaconf, OmegaConf or torch (`torch.x.y = ...`, `inductor_config.freezing = ...`)."""
    private = re.compile(r"hydra\._internal")
    assignment = re.compile(r"^\s*(hydra|omegaconf|OmegaConf|torch|inductor_config)(\.\w+)+\s*=[^=]", re.M)
    found = []
    for path in sorted((ROOT / "lm").rglob("*.py")):
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}: {m.group(0).strip()}" for m in private.finditer(text)]
        found += [f"{path.relative_to(ROOT)}: {m.group(0).strip()}" for m in assignment.finditer(text)]
    assert found == []
