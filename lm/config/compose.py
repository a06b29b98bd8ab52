"""conf/'s configs composed outside a Hydra app: the benchmarks and other argparse commands that read
a group's option (a data source, a model shape) as training would compose it, the schema's defaults
under what the option's YAML states; and compositions kept for the process (`composed`), for the
comparison's plans, which compose the same arms again in each plan (tests, a notebook)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from omegaconf import DictConfig, open_dict

from lm.util.paths import expand_pattern

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_train(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """conf/train.yaml with `overrides` (`["data=pystdlib_tests"]`), as `scripts/train.py` composes it."""
    from hydra import compose, initialize_config_dir

    import lm.config  # noqa: F401  the schemas conf/train.yaml composes

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[*overrides, "logger=none"])


# (search path, config name, overrides) -> (the composition, composition_inputs of its sources then)
KEPT: dict[tuple, tuple[DictConfig, tuple]] = {}


def search_path() -> tuple:
    """The search path of the Hydra initialised now (a config folder, Hydra's own, the schemas)."""
    from hydra.core.global_hydra import GlobalHydra

    return tuple((e.provider, e.path) for e in GlobalHydra.instance().config_loader().get_search_path().get_path())


def composed(config_name: str, overrides: tuple[str, ...]) -> DictConfig:
    """hydra.compose(config_name, overrides) under the search path initialised now, kept for the
    process: the same call returns the same object, which callers copy before they change it.
    forget_changed_compositions() drops each one whose inputs have changed since."""
    from hydra import compose

    key = (search_path(), config_name, tuple(overrides))
    if key not in KEPT:
        cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
        # every source this composition read, those its primary config's hydra.searchpath added included
        sources = tuple((s.provider, s.path) for s in cfg.hydra.runtime.config_sources)
        with open_dict(cfg):
            del cfg["hydra"]  # as hydra.compose leaves it without return_hydra_config
        KEPT[key] = (cfg, composition_inputs(sources))
    return KEPT[key][0]


def forget_changed_compositions() -> None:
    """Drop every kept composition whose YAML files or ConfigStore nodes have changed since it was made."""
    now: dict[tuple, tuple] = {}
    for key, (_, then) in list(KEPT.items()):
        sources = then[0]
        if sources not in now:
            now[sources] = composition_inputs(sources)
        files, nodes = now[sources][1:]
        same_nodes = len(then[2]) == len(nodes) and all(a is b for a, b in zip(then[2], nodes, strict=True))
        if then[1] != files or not same_nodes:
            del KEPT[key]


def composition_inputs(sources: tuple) -> tuple:
    """What a composition from these config sources reads: each YAML file under their folders (its path
    and bytes, a few kB each, where a size and a modification time could miss an edit; Hydra reads no
    other files) and each node of Hydra's ConfigStore (the node itself: a schema stored again is
    another object)."""
    from hydra.core.config_store import ConfigStore

    files = []
    for _, path in sources:
        for folder in source_folders(path):
            files += [(str(f), f.read_bytes()) for f in sorted(expand_pattern(f"{folder}/**/*.yaml"))]

    def nodes(tree: dict):
        for value in tree.values():
            yield from nodes(value) if isinstance(value, dict) else (value,)

    return sources, tuple(files), tuple(nodes(ConfigStore.instance().repo))


def source_folders(path: str) -> list[Path]:
    """The folders a config source reads YAML from: a file:// (or plain) path's folder, a pkg:// package's
    folders (an editable install's are the checkout's), none for structured:// (the ConfigStore)."""
    if path.startswith("structured://"):
        return []
    if path.startswith("pkg://"):
        spec = importlib.util.find_spec(path.removeprefix("pkg://"))
        return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    folder = Path(path.removeprefix("file://")).resolve()
    return [folder] if folder.is_dir() else []


__all__ = ["CONF_DIR", "compose_train", "composed", "forget_changed_compositions"]
