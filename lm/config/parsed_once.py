"""Each config file parsed once per process while its bytes are unchanged.

Hydra 1.3 reads, parses (PyYAML's pure-Python loader, then OmegaConf) and splits out the defaults list
of every config file again for each composition: its repository caches them only within one. Loading
conf/train.yaml's 16 files, Hydra's own among them, is about 34 ms of a 107 ms composition (Intel Xeon,
family 6 model 207), and a test run composes about 850 times, a comparison plan once per arm.

So a file read from a folder (file://) or a package (pkg://) is kept, as Hydra made it, under its
source, the name asked for and the file's bytes; a later load that finds the same bytes gets a deep
copy, a tenth of the parse's cost, and a changed file is parsed again. Schemas (the ConfigStore) are
not kept: ConfigStore.load copies its node already. What a load returns is Hydra's own result or a
copy of it, so nothing a composition changes reaches the kept one.
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
from importlib import resources

from hydra._internal.config_repository import ConfigRepository
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigResult, ConfigSource

KEPT_FILES = 1024  # the least recently loaded go first past this: a long test run writes many small configs
KEPT: OrderedDict[tuple, ConfigResult] = OrderedDict()


def parse_each_config_file_once() -> None:
    if getattr(ConfigRepository.load_config, "keeps_parsed_files", False):
        return  # installed already
    hydras_load_config = ConfigRepository.load_config

    def load_config(self: ConfigRepository, config_path: str) -> ConfigResult | None:
        source = self._find_object_source(config_path=config_path, object_type=ObjectType.CONFIG)
        key = file_key(source, config_path) if source is not None else None
        if key is None:
            return hydras_load_config(self, config_path)
        if key in KEPT:
            KEPT.move_to_end(key)
            return copy.deepcopy(KEPT[key])
        loaded = hydras_load_config(self, config_path)
        if loaded is not None and file_key(source, config_path) == key:  # unchanged while Hydra read it
            KEPT[key] = copy.deepcopy(loaded)
            while len(KEPT) > KEPT_FILES:
                KEPT.popitem(last=False)
        return loaded

    load_config.keeps_parsed_files = True
    ConfigRepository.load_config = load_config


def file_key(source: ConfigSource, config_path: str) -> tuple | None:
    """(source kind, its path and provider, the name asked for, the file's bytes), or None for a
    source that is not a file (the ConfigStore's) or a file that cannot be read (Hydra then says so).
    By scheme, not class: Hydra's plugin scan imports its sources' modules a second time, so the
    class a repository holds is not the one `import` gives."""
    name = source._normalize_file_name(config_path)  # config_path with .yaml, as the source opens it
    try:
        if source.scheme() == "file":
            with open(os.path.realpath(os.path.join(source.path, name)), "rb") as f:
                content = f.read()
        elif source.scheme() == "pkg":
            content = resources.files(source.path).joinpath(name).read_bytes()
        else:
            return None
    except (OSError, ValueError, ModuleNotFoundError, TypeError):
        return None
    return type(source).__name__, source.path, source.provider, config_path, content


__all__ = ["parse_each_config_file_once"]
