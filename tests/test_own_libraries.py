"""Importing lm, and what a script's start does, leave every library its own: no function of Hydra,
OmegaConf or torch is replaced, no attribute of theirs is set, and lm's source names no
`hydra._internal` module. A user's process that imports lm runs the Hydra, OmegaConf and torch
they installed."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
    # and what a script's and the server's start do (lm.util.cli.run_script), and compiled decoding's
    from lm.config.attn import load_attention_kinds
    from lm.generation.compiled import declare_constants
    from lm.util.cli import quiet_known_warnings
    from lm.util.hardware import inductor_cache_per_capability
    inductor_cache_per_capability(); quiet_known_warnings(); load_attention_kinds(); declare_constants()
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

    # The check can fail: a replaced Hydra function is seen (printed after the line above, for the second test)
    import hydra._internal.hydra as h
    h.Hydra.get_mode = lambda *a, **k: None
    print(*(f"control replaced {k[0]} {k[1]}" for k, v in snapshot().items() if before.get(k, v) is not v))
""")


@pytest.fixture(scope="module")
def imported_lm() -> tuple[list[str], list[str]]:
    """(what importing lm changed, what the control's replacement changed), from one fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", SNAPSHOT_THEN_IMPORT_LM], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    checked = next(i for i, line in enumerate(lines) if line.startswith("checked "))
    assert int(lines[checked].split()[1]) > 1000, done.stdout[-2000:]
    return lines[:checked], lines[checked + 1:]


def test_importing_every_module_of_lm_replaces_and_sets_nothing_in_hydra_omegaconf_or_torch(imported_lm):
    changed, _ = imported_lm
    assert changed == [], "\n".join(changed)


def test_the_snapshot_sees_a_replaced_hydra_function(imported_lm):
    """The check above can fail: replacing one of Hydra's private functions is reported."""
    _, control = imported_lm
    assert control == ["control replaced hydra._internal.hydra Hydra.get_mode"]


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
