"""conf/'s configs composed outside a Hydra app: the benchmarks and other argparse commands that read
a group's option (a data source, a model shape) as training would compose it, the schema's defaults
under what the option's YAML states; and compositions kept for the process (`composed`), for the
comparison's plans, which compose the same arms again in each plan (tests, a notebook)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

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
    forget_changed_compositions() drops each one whose inputs have changed since.

    Hydra composes each set of group choices once (`attn=sliding`, `data=text`): the plain `key=value`
    overrides are then applied to a copy of that as Hydra applies them after its merge
    (OmegaConf.update with merge=True, each value parsed by Hydra's own override parser), so the arms of
    a comparison, which differ in their values, cost one composition per attention config and task
    rather than one each. Anything else (`+key`, `~key`, a sweep, a `hydra.` key, a value the copy
    refuses) is Hydra's whole composition, and its errors are Hydra's."""
    key = (search_path(), config_name, tuple(overrides))
    if key not in KEPT:
        split = choices_and_values(overrides)
        if split is None or not split[1]:
            KEPT[key] = hydra_composition(config_name, overrides)
        else:
            choices, values = split
            base = composed(config_name, choices)
            cfg = copy.deepcopy(base)
            try:
                for value in values:
                    OmegaConf.update(cfg, value.key_or_group, value.value(), merge=True)
            except Exception:  # noqa: BLE001  Hydra then says what is wrong, in its own words
                KEPT[key] = hydra_composition(config_name, overrides)
            else:
                KEPT[key] = (cfg, KEPT[(key[0], config_name, choices)][1])
    return KEPT[key][0]


def hydra_composition(config_name: str, overrides: tuple[str, ...]) -> tuple[DictConfig, tuple]:
    """(Hydra's composition, composition_inputs of the sources it read)."""
    from hydra import compose

    cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    # every source this composition read, those its primary config's hydra.searchpath added included
    sources = tuple((s.provider, s.path) for s in cfg.hydra.runtime.config_sources)
    with open_dict(cfg):
        del cfg["hydra"]  # as hydra.compose leaves it without return_hydra_config
    return cfg, composition_inputs(sources)


def choices_and_values(overrides: tuple[str, ...]) -> tuple[tuple[str, ...], list] | None:
    """(the group choices as typed, the plain `key=value` overrides parsed) of `overrides`, or None
    where one is more than a plain change of a value or a choice."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    if any(o.type is not OverrideType.CHANGE or o.is_sweep_override() or o.package is not None
           or o.key_or_group.split(".")[0] == "hydra" for o in parsed):
        return None
    groups = config_groups()
    choices = tuple(o.input_line for o in parsed if is_group(o.key_or_group, groups))
    return choices, [o for o in parsed if not is_group(o.key_or_group, groups)]


def config_groups() -> set[str]:
    """The top-level config groups under the search path initialised now: the folders of its sources'
    YAML and the groups of Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    folders = {f.name for _, path in search_path() for root in source_folders(path) for f in root.iterdir()
               if f.is_dir()}
    return folders | {k for k, v in ConfigStore.instance().repo.items() if isinstance(v, dict)}


def is_group(key: str, groups: set[str]) -> bool:
    """Whether an override's key chooses a config group (`attn`, `hydra/launcher`) rather than a value."""
    return "/" in key or key in groups


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
