"""Hydra 1.3's composition made faster, its results unchanged: five changes, installed by
`faster_compositions()` when lm.config is imported. Each is installed once, and only where the Hydra
functions it wraps take the arguments they were written against (hydra-core 1.3.x): another Hydra
composes as it always did, only slower. One module past 400 lines, not five: each change wraps a step of
the same composition, one installer guards them all, and 3 and 5 share the kept configs (installed
together or not at all).

A composition of conf/train.yaml took about 107 ms (Intel Xeon, family 6 model 207), each script start
made two, and a test run makes about 850, a comparison plan one per attention config:

1. `share_config_store_in_copies`: each composition deep-copies its config repository, and in 1.3 each
   structured source holds the ConfigStore singleton, so every stored schema was copied too (22 ms of
   190). Hydra's main branch no longer holds the store in the source (facebookresearch/hydra#2928: a
   copy must see the live singleton, so a schema registered later is found), which no 1.3 release has
   shipped. A singleton whose deep copy is itself behaves the same on the releases that copy it.
   Nothing a composition writes is shared: ConfigStore.load still deep-copies each node it hands out.
   One thing changes in a process that imports lm.config: Hydra's pytest fixture
   `hydra_restore_singletons` snapshots the singletons by deep copy, so it no longer puts back a
   ConfigStore a test stored into (lm's tests remove what they store).
2. `compose_once_per_start`: before a script runs, `Hydra.get_mode` composes the whole config (as for
   a sweep: sweeps not checked, a defaults entry left ??? skipped) only to read `hydra.mode`, and
   `Hydra.run` composes it again (hydra-ecosystem/hydra#3440, open). The two compositions differ in
   two of Hydra's steps only: its check of the overrides for sweeps, which a single run refuses, and
   a defaults entry left ???, which a single run refuses and a sweep skips. So while get_mode composes,
   Hydra's own sweep check is asked of the overrides and its missing-entry check is watched; if
   neither would refuse, and the mode can be read, the config loader keeps that composition, and its
   next call, if it is run's (same config name and overrides, plus the hydra.mode=RUN that Hydra's
   `_run_app` appends where the configs leave the mode unset), takes it instead of composing again.
   The config is handed out once: the next call takes it or drops it. Everything else composes as
   Hydra does: a sweep (-m, or overrides that sweep, which a single run then refuses as before), a
   missing entry, a failed composition, a mode that fails to resolve, and every composition outside a
   script start (hydra.compose, a sweep's jobs, --cfg).
3. `parse_each_config_file_once`: Hydra reads, parses (PyYAML's pure-Python loader, then OmegaConf)
   and splits out the defaults list of every config file again for each composition (its repository
   caches them within one): about 34 ms of the 107; and ConfigStore.load deep-copies a stored schema
   for each. Each config is kept as Hydra made it, under its source, the name asked for, what it is
   made of (a file's bytes, the ConfigStore's node) and the version_base in force, and handed out
   shared, flagged read-only: Hydra only reads it (its header, defaults list and `hydra.searchpath`)
   until the merge, which takes a copy of its own (5). A changed file is parsed again.
4. `interpolation_map_only_when_used`: for every node of the defaults tree Hydra builds an OmegaConf
   config of the choices known so far, used only to resolve a defaults entry written as an
   interpolation (`- dataset_model: ${dataset}_${model}`); lm's configs have none. Built only where
   the node's defaults list has one, the same map, from the same state: about a fifth of what remained.
5. `merge_each_defaults_list_once`: merging the configs of the defaults list in order took about
   half of what remained (OmegaConf's merge, node by node). The merge depends on the entries (path,
   package, primary or not) and their configs only, so a defaults list merged before, of kept configs,
   is handed out as a deep copy of that merge (a sixth of its cost), what resolvers gave while it ran
   dropped. Merged by Hydra each time: a config not kept, one with a value that is one interpolation
   through a resolver (the merge resolves such a value to see whether it is a container, and a resolver
   may answer from outside the configs), and a file config with a schema of its name in the ConfigStore.
   What a hit does not do: call again the resolvers Hydra's merge called inside longer strings (the
   merge resolves a value a later config replaces, `outputs/${now:%H}`, to see whether it is a
   container, and a string never is); a resolver with side effects, or one that fails in one
   environment and not another within such a string, is not asked again. lm's resolvers (`now`,
   `run_folder_name`, `settings_help`) have none and fail alike everywhere.
   Together 3 and 5 take a composition of conf/train.yaml from about 82 ms to about 35.
"""

from __future__ import annotations

import copy
import inspect
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from importlib import resources
from typing import Any

from hydra import version
from hydra._internal import defaults_list
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.config_repository import ConfigRepository
from hydra._internal.hydra import Hydra
from hydra.core.config_store import ConfigNode, ConfigStore
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.plugins.config_source import ConfigResult, ConfigSource
from hydra.types import RunMode
from omegaconf import Container, DictConfig, OmegaConf
from omegaconf.errors import GrammarParseError
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser
from omegaconf.grammar_parser import parse


def faster_compositions() -> None:
    """Install the five; each replacement keeps the function it wraps as its `hydras` attribute, which
    also tells that it is installed already."""
    share_config_store_in_copies()
    if takes(Hydra.get_mode, "self", "config_name", "overrides") and takes(
            ConfigLoaderImpl.load_configuration, "self", "config_name", "overrides", "run_mode", "from_shell",
            "validate_sweep_overrides") and takes(defaults_list._check_not_missing, "repo", "default", "skip_missing"):
        compose_once_per_start()
    # together or neither: the kept configs are shared read-only until the merge takes copies of its own
    if takes(ConfigRepository.load_config, "self", "config_path") and takes(
            ConfigLoaderImpl._compose_config_from_defaults_list, "self", "defaults", "repo"):
        parse_each_config_file_once()
        merge_each_defaults_list_once()
    if takes(defaults_list._create_interpolation_map, "overrides", "defaults_list", "self_added"):
        interpolation_map_only_when_used()


def takes(function: Any, *names: str) -> bool:
    """Whether `function` (or the Hydra function a change of ours wraps) has exactly these parameters."""
    return list(inspect.signature(getattr(function, "hydras", function)).parameters) == list(names)


# ------------------------------------------------------------------ 1. the ConfigStore shared by copies

def share_config_store_in_copies() -> None:
    if "__deepcopy__" not in vars(ConfigStore):
        ConfigStore.__deepcopy__ = lambda self, memo: self


# ------------------------------------------------------------------ 2. one composition per script start

READING_MODE = "_lm_reading_mode"  # set on the config loader while get_mode composes
KEPT_FOR_RUN = "_lm_kept_for_run"  # (config name, overrides, config, its hydra.mode) on the loader, for run
MODE_OVERRIDE = "hydra.mode=RUN"


class Composing(threading.local):
    skipped_missing = False  # whether a defaults entry left ??? was skipped since get_mode began


COMPOSING = Composing()


def compose_once_per_start() -> None:
    if hasattr(Hydra.get_mode, "hydras"):
        return  # installed already
    hydras_get_mode = Hydra.get_mode
    hydras_load_configuration = ConfigLoaderImpl.load_configuration
    hydras_check_not_missing = defaults_list._check_not_missing

    def get_mode(self: Hydra, config_name: str | None, overrides: list[str]) -> Any:
        setattr(self.config_loader, READING_MODE, True)
        COMPOSING.skipped_missing = False
        try:
            return hydras_get_mode(self, config_name, overrides)
        finally:
            vars(self.config_loader).pop(READING_MODE, None)

    def load_configuration(self: ConfigLoaderImpl, config_name: str | None, overrides: list[str],
                           run_mode: RunMode, from_shell: bool = True,
                           validate_sweep_overrides: bool = True) -> DictConfig:
        kept = vars(self).pop(KEPT_FOR_RUN, None)
        if kept is not None and validate_sweep_overrides and run_mode == RunMode.RUN:
            cfg = taken_for_run(kept, config_name, overrides)
            if cfg is not None:
                return cfg
        cfg = hydras_load_configuration(self, config_name, overrides, run_mode, from_shell=from_shell,
                                        validate_sweep_overrides=validate_sweep_overrides)
        if vars(self).get(READING_MODE):
            kept = kept_for_run(cfg, config_name, overrides)
            if kept is not None:
                setattr(self, KEPT_FOR_RUN, kept)
        return cfg

    def check_not_missing(repo: Any, default: Any, skip_missing: bool) -> bool:
        skipped = hydras_check_not_missing(repo=repo, default=default, skip_missing=skip_missing)
        COMPOSING.skipped_missing |= skipped
        return skipped

    get_mode.hydras, load_configuration.hydras = hydras_get_mode, hydras_load_configuration
    check_not_missing.hydras = hydras_check_not_missing
    Hydra.get_mode = get_mode
    ConfigLoaderImpl.load_configuration = load_configuration
    defaults_list._check_not_missing = check_not_missing


def kept_for_run(cfg: DictConfig, config_name: str | None, overrides: list[str]) -> tuple | None:
    """(config name, overrides, config, its hydra.mode) when composing for a single run would give
    `cfg`, composed as for a sweep; else None. The two differ only in two of Hydra's own steps, asked
    here: its check of the overrides for sweeps (a single run refuses them) and a defaults entry left
    ??? (a single run refuses it; a sweep skips it, which check_not_missing saw or not). A mode that
    cannot be read (an interpolation that fails) is left for Hydra to read in its own composition."""
    if COMPOSING.skipped_missing:
        return None
    try:
        mode = cfg.hydra.mode
        parsed = OverridesParser.create().parse_overrides(overrides=overrides)
        ConfigLoaderImpl.validate_sweep_overrides_legal(overrides=parsed, run_mode=RunMode.RUN, from_shell=True)
    except Exception:
        return None
    return config_name, list(overrides), cfg, mode


def taken_for_run(kept: tuple, config_name: str | None, overrides: list[str]) -> DictConfig | None:
    """The kept config, if it is the one `run` asks for. Where the configs leave `hydra.mode` unset,
    Hydra's `_run_app` adds the override hydra.mode=RUN to the list get_mode was given; applying it
    to the kept config sets that key and records the override, as composing with it does."""
    kept_name, kept_overrides, cfg, mode = kept
    if kept_name != config_name:
        return None
    if overrides == kept_overrides:
        return cfg
    if overrides == [*kept_overrides, MODE_OVERRIDE] and mode is None:
        cfg.hydra.mode = RunMode.RUN
        cfg.hydra.overrides.hydra.append(MODE_OVERRIDE)
        return cfg
    return None


# ------------------------------------------------------------------ 3. each config read once, shared until merged

MAX_KEPT_CONFIGS = 1024  # the least recently loaded go first past this: a long test run writes many small configs
KEPT_CONFIGS: OrderedDict[tuple, Kept] = OrderedDict()
# Deep-copying an OmegaConf tree writes to it for a moment (each child's parent), so copies of what is kept
# are taken under these locks. Hydra's reads of a shared config are not: Hydra's own state (GlobalHydra) is
# one per process, and compositions on several threads at once are not something it supports either.
KEPT_LOCK = threading.Lock()
KEPT = "_lm_kept"  # the attribute of a handed-out ConfigResult that names the Kept config it shares


@dataclass(frozen=True)
class Kept:
    """One config as Hydra's repository loaded it, flagged read-only while it is shared."""

    key: tuple  # config_key's: where it came from and what it was made of
    result: ConfigResult  # Hydra's own, its config read-only
    readonly: bool | None  # the config's own read-only flag, given back to each copy a merge takes
    resolves_outside: bool  # whether a value is one interpolation through a resolver (see outside_resolvers)


def parse_each_config_file_once() -> None:
    if hasattr(ConfigRepository.load_config, "hydras"):
        return  # installed already
    hydras_load_config = ConfigRepository.load_config

    def load_config(self: ConfigRepository, config_path: str) -> ConfigResult | None:
        source = self._find_object_source(config_path=config_path, object_type=ObjectType.CONFIG)
        key = config_key(source, config_path) if source is not None else None
        if key is None:
            return hydras_load_config(self, config_path)
        with KEPT_LOCK:
            kept = KEPT_CONFIGS.get(key)
            if kept is not None:
                KEPT_CONFIGS.move_to_end(key)
        if kept is None:
            loaded = hydras_load_config(self, config_path)
            if loaded is None or config_key(source, config_path) != key:  # changed while Hydra read it
                return loaded
            kept = Kept(key, loaded, loaded.config._get_node_flag("readonly"), outside_resolvers(loaded.config))
            OmegaConf.set_readonly(loaded.config, True)
            with KEPT_LOCK:
                KEPT_CONFIGS[key] = kept
                while len(KEPT_CONFIGS) > MAX_KEPT_CONFIGS:
                    KEPT_CONFIGS.popitem(last=False)
        # Hydra deep-copies the defaults list before it changes it, and reads the config only, until
        # _compose_config_from_defaults_list, which takes a copy of its own first (merge_each_defaults_list_once)
        shared = copy.copy(kept.result)
        shared.header = dict(shared.header)
        setattr(shared, KEPT, kept)
        return shared

    load_config.hydras = hydras_load_config
    ConfigRepository.load_config = load_config


def config_key(source: ConfigSource, config_path: str) -> tuple | None:
    """(source kind, its path and provider, the name asked for, what it is made of, the version_base it is
    read under: how Hydra splits out a defaults list depends on it). What it is made of: a file's bytes
    (file:// and pkg://), the ConfigStore's node itself (structured://; a node stored again is another
    object, one changed in place is not seen). None for another source or a file that cannot be read
    (Hydra then says so). By scheme, not class: Hydra's plugin scan imports its sources' modules a second
    time, so the class a repository holds is not the one `import` gives."""
    name = source._normalize_file_name(config_path)  # config_path with .yaml, as the source opens it
    try:
        if source.scheme() == "file":
            with open(os.path.realpath(os.path.join(source.path, name)), "rb") as f:
                content: Any = f.read()
        elif source.scheme() == "pkg":
            content = resources.files(source.path).joinpath(name).read_bytes()
        elif source.scheme() == "structured":
            node = stored_node(name)
            if node is None:
                return None
            content = Same(node)
        else:
            return None
    except (OSError, ValueError, ModuleNotFoundError, TypeError):
        return None
    return source.scheme(), source.path, source.provider, config_path, content, str(version.getbase())


class Same:
    """An object compared by identity, not value, and held: while a key holds it, no other object takes its id."""

    def __init__(self, thing: Any) -> None:
        self.thing = thing

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.thing is self.thing

    def __hash__(self) -> int:
        return id(self.thing)


def stored_node(name: str) -> Any:
    """The ConfigStore's node at `name` (`group/option.yaml`), or None: the object itself, not a copy."""
    found: Any = ConfigStore.instance().repo
    for part in filter(None, name.split("/")):  # as ConfigStore walks it: empty parts skipped
        if not isinstance(found, dict) or part not in found:
            return None
        found = found[part]
    return found if isinstance(found, ConfigNode) else None


def outside_resolvers(cfg: Container) -> bool:
    """Whether a value of `cfg` is one interpolation that calls a resolver (`${oc.env:X}`, or a node path
    built by one). Merging configs resolves interpolations to learn whether they stand for a container or
    None; only such a value can answer from outside the configs (the environment, the clock, a resolver of
    the user's). A string around interpolations (`outputs/${now:%H}`) is a string whatever they give."""
    def values(node: Any) -> Any:
        if isinstance(node, dict):
            for value in node.values():
                yield from values(value)
        elif isinstance(node, list):
            for value in node:
                yield from values(value)
        else:
            yield node

    for value in values(OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)):
        if isinstance(value, str) and "${" in value and ":" in value:
            try:
                text = parse(value).text()
            except GrammarParseError:  # a string OmegaConf takes but its grammar does not (`${:x}`): count it
                return True
            if text.getChildCount() == 1 and isinstance(text.getChild(0), OmegaConfGrammarParser.InterpolationContext):
                return True
    return False


# ------------------------------------------------------------------ 4. the interpolation map when used

def interpolation_map_only_when_used() -> None:
    if hasattr(defaults_list._create_interpolation_map, "hydras"):
        return  # installed already
    hydras_map = defaults_list._create_interpolation_map

    def interpolation_map(overrides: Any, defaults: list, self_added: bool) -> DictConfig | None:
        # Hydra resolves with the map only the entries of `defaults` that are interpolations
        if not any(d.is_interpolation() for d in defaults):
            return None
        return interpolation_map.hydras(overrides, defaults, self_added)

    interpolation_map.hydras = hydras_map
    defaults_list._create_interpolation_map = interpolation_map


# ------------------------------------------------------------------ 5. each defaults list merged once

MAX_MERGED = 256  # merged configs of a few hundred kB each
MERGED: OrderedDict[tuple, DictConfig] = OrderedDict()
MERGED_LOCK = threading.Lock()


def merge_each_defaults_list_once() -> None:
    if hasattr(ConfigLoaderImpl._compose_config_from_defaults_list, "hydras"):
        return  # installed already
    hydras_merge = ConfigLoaderImpl._compose_config_from_defaults_list

    def compose_config_from_defaults_list(self: ConfigLoaderImpl, defaults: list, repo: Any) -> DictConfig:
        # the composition's caching repository hands back what create_defaults_list loaded
        loaded = [repo.load_config(config_path=d.config_path) if d.config_path is not None else None
                  for d in defaults]
        key = merge_key(defaults, loaded)
        if key is not None:
            with MERGED_LOCK:
                merged = MERGED.get(key)
                if merged is not None:
                    MERGED.move_to_end(key)
                    return copy.deepcopy(merged)
        cfg = compose_config_from_defaults_list.hydras(self, defaults, OwnCopies(repo))
        if key is not None:
            merged = copy.deepcopy(cfg)
            # what resolvers gave while this merge ran (`${now:...}` among them) is this composition's: the
            # next composition's resolve again, as its own merge would
            OmegaConf.clear_cache(merged)
            with MERGED_LOCK:
                MERGED[key] = merged
                while len(MERGED) > MAX_MERGED:
                    MERGED.popitem(last=False)
        return cfg

    compose_config_from_defaults_list.hydras = hydras_merge
    ConfigLoaderImpl._compose_config_from_defaults_list = compose_config_from_defaults_list


class OwnCopies:
    """The repository Hydra's merge reads: each config a copy of its own, made once per path as a
    composition's caching repository keeps one result per path. Hydra's merge moves nodes out of what
    it merges, so it must never see a kept config."""

    def __init__(self, repo: Any) -> None:
        self.repo, self.results = repo, {}

    def copied(self, result: ConfigResult | None) -> ConfigResult | None:
        kept = getattr(result, KEPT, None)
        if kept is None:
            return result
        result = copy.copy(result)
        del result.__dict__[KEPT]
        with KEPT_LOCK:
            result.config = copy.deepcopy(kept.result.config)
        OmegaConf.set_readonly(result.config, kept.readonly)
        return result

    def load_config(self, config_path: str) -> ConfigResult | None:
        if config_path not in self.results:
            self.results[config_path] = self.copied(self.repo.load_config(config_path=config_path))
        return self.results[config_path]

    def __getattr__(self, name: str) -> Any:  # the schema source, and anything else the merge asks for
        return getattr(self.repo, name)


def merge_key(defaults: list, loaded: list) -> tuple | None:
    """What Hydra's merge of `defaults` reads: each entry's path, package and whether it is the primary
    config, and the kept config it loads; or None where the merge may read more. That is a config not
    kept, a value resolved from outside the configs (outside_resolvers), and a file config with a schema
    of its name in the ConfigStore (Hydra 1.1's automatic schema matching, which warns each time)."""
    key = []
    for default, result in zip(defaults, loaded, strict=True):
        kept = getattr(result, KEPT, None)
        if kept is None or kept.resolves_outside:
            return None
        if not result.is_schema_source and stored_node(ConfigSource._normalize_file_name(default.config_path)):
            return None
        key.append((default.config_path, default.package, default.primary, kept.key))
    return tuple(key)


__all__ = ["compose_once_per_start", "faster_compositions", "interpolation_map_only_when_used", "kept_for_run",
           "merge_each_defaults_list_once", "parse_each_config_file_once", "share_config_store_in_copies",
           "taken_for_run", "takes"]
