"""What the package declares: a torch range that resolvers can combine with other packages (the
exact pin lives in constraints.txt, which `make install` applies), its licence, and one set of
optimiser defaults shared by the code and the Hydra config."""

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_config
from omegaconf import OmegaConf
from packaging.requirements import Requirement
from packaging.version import Version

from lm.config.optim import MuonConfig
from lm.training.module import OptimConfig

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def dependencies() -> dict[str, Requirement]:
    return {r.name: r for r in map(Requirement, pyproject()["project"]["dependencies"])}


def constraints() -> dict[str, Requirement]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return {r.name: r for r in (Requirement(line.split("#")[0]) for line in lines if line.split("#")[0].strip())}


def test_torch_is_a_lower_bound_at_or_below_the_version_constraints_txt_pins():
    """A machine's own torch (a GPU image's, say) stays: the bound is the lowest version the test
    suite has passed on (2.11, docs/gpu.md), the pin the one `make install` uses."""
    (torch_spec,) = dependencies()["torch"].specifier
    (pin,) = constraints()["torch"].specifier
    assert (torch_spec.operator, pin.operator) == (">=", "==")
    assert Version(torch_spec.version) <= Version(pin.version)


def test_no_dependency_of_the_package_is_pinned_exactly():
    project = pyproject()["project"]
    requirements = [*project["dependencies"], *sum(project["optional-dependencies"].values(), [])]
    pinned = [r for r in requirements if any(s.operator in ("==", "===") for s in Requirement(r).specifier)]
    assert pinned == []


def test_every_pip_install_of_the_makefile_applies_constraints_txt():
    installs = [line for line in (ROOT / "Makefile").read_text().splitlines() if "pip install" in line]
    assert len(installs) == 3  # the venv, and llama-cpp-python for test-all and for llama-server
    assert [line for line in installs if "-c constraints.txt" not in line] == []


def test_the_licence_is_mit_and_the_package_says_so():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n")
    assert "Copyright (c) 2026 the lm authors" in text
    project = pyproject()["project"]
    assert (project["license"], project["license-files"]) == ("MIT", ["LICENSE"])


def build_from_a_copy(folder: Path, hook: str) -> Path:
    """What setuptools' `hook` (a PEP 517 build_meta function) builds, offline with the setuptools this
    environment has, from a copy of the sources in `folder` (a build writes lm.egg-info beside
    pyproject.toml): the path of the metadata folder or wheel."""
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, folder / name)
    for package in ("lm", "benchmarks"):  # benchmarks/: beside lm/ in the repository, so the wheel could take it
        shutil.copytree(ROOT / package, folder / package, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "out").mkdir()
    build = f"from setuptools import build_meta; print(build_meta.{hook}('out'))"
    done = subprocess.run([sys.executable, "-c", build], cwd=folder, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return folder / "out" / done.stdout.strip().splitlines()[-1]


def test_the_installed_setuptools_builds_metadata_with_the_licence_and_the_torch_range(tmp_path):
    """The wheel's metadata, built offline with the setuptools this environment has, from a copy of
    the sources (a build writes lm.egg-info beside pyproject.toml)."""
    metadata = (build_from_a_copy(tmp_path, "prepare_metadata_for_build_wheel") / "METADATA").read_text()
    headers = {tuple(line.split(": ", 1)) for line in metadata.split("\n\n")[0].splitlines()}  # before the readme
    assert ("License-Expression", "MIT") in headers and ("License-File", "LICENSE") in headers
    assert ("Requires-Dist", "torch>=2.11") in headers


@pytest.mark.slow  # builds a whole wheel: ~15 s
def test_the_wheel_carries_the_c_source_the_native_int8_kernel_is_built_from(tmp_path):
    """int8_kernel=native compiles lm/generation/int8_matmul.c on the user's machine: an installed
    wheel must hold it beside the Python modules."""
    import zipfile

    names = zipfile.ZipFile(build_from_a_copy(tmp_path, "build_wheel")).namelist()
    assert "lm/generation/int8_matmul.c" in names and "lm/generation/int8_native.py" in names
    # evaluation, which users call, ships; the benchmarks, which only the repository runs, do not
    assert "lm/evaluation/perplexity.py" in names and "lm/evaluation/harness.py" in names
    assert [name for name in names if name.startswith("benchmarks/")] == []


def test_the_package_discovery_takes_lm_and_its_evaluation_but_not_the_benchmarks():
    """What pyproject.toml's `packages.find` finds in this checkout: every folder of lm/ (evaluation and
    studies among them) and nothing of benchmarks/, which imports lm but is no part of it."""
    from setuptools import find_namespace_packages

    found = find_namespace_packages(where=str(ROOT), **pyproject()["tool"]["setuptools"]["packages"]["find"])
    assert {"lm", "lm.evaluation", "lm.studies", "lm.generation"} <= set(found)
    assert [name for name in found if not (name == "lm" or name.startswith("lm."))] == []
    assert (ROOT / "benchmarks" / "__init__.py").is_file()  # there to be found, and left out


# ------------------------------------------------------------------ optimiser defaults

def test_the_optim_yaml_composes_the_dataclass_and_states_no_value():
    """OptimConfig (lm/config/optim.py) holds the defaults; conf/optim/adamw.yaml composes them and
    restates none, so a run and a LitLM built in code train alike."""
    stated = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "optim" / "adamw.yaml"))
    assert stated == {"defaults": [{"/optim/settings@_here_": "adamw"}]}
    assert OmegaConf.to_container(compose_config("train", ["optim=adamw"]).optim) == dataclasses.asdict(OptimConfig())


def test_the_composed_training_config_trains_with_the_dataclass_defaults():
    # No other config file (a preset, the experiment default) overrides the optimiser quietly: the
    # default is optim=muon, and each option composes its dataclass's defaults
    assert MuonConfig(**compose_config("train", []).optim) == MuonConfig()
    assert OptimConfig(**compose_config("train", ["optim=adamw"]).optim) == OptimConfig()
