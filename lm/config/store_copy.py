"""Hydra's ConfigStore shared, not copied, by each composition.

Every `compose` (and every script start: see lm.config.compose_once) deep-copies
its config repository so that re-initialising the copy's sources leaves the original alone. In
hydra-core 1.3.x each structured-config source holds the ConfigStore singleton, so that copy also
deep-copies every schema stored: lm's schemas and Hydra's own, 22 ms of a 190 ms composition of
conf/train.yaml (Intel Xeon, family 6 model 207). Hydra's main branch no longer holds the store in the
source (facebookresearch/hydra#2928: the copy must see the live singleton, so that a schema registered
later is found), which no 1.3 release has shipped. A singleton whose deep copy is itself gives the same
behaviour on the releases that copy it. Nothing is shared that a composition writes: ConfigStore.load
still deep-copies each node it hands out. One thing does change in a process that imports lm.config:
Hydra's pytest fixture `hydra_restore_singletons` snapshots the singletons by deep copy, so it no
longer puts back a ConfigStore that a test stored into (lm's tests remove what they store).
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore


def share_config_store_in_copies() -> None:
    if "__deepcopy__" not in vars(ConfigStore):
        ConfigStore.__deepcopy__ = lambda self, memo: self


__all__ = ["share_config_store_in_copies"]
