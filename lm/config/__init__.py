"""The scripts' settings as schemas Hydra composes against, derived from where each setting is
declared: the `attn` group's keys from the attention registry (lm.config.attn), and each script's
run-side settings from a dataclass of them (lm.config.settings; one module per script).

Importing this package registers the schemas in Hydra's ConfigStore. The scripts import it; the
primary configs that compose them (conf/train.yaml, uptrain.yaml, generate.yaml, ...) name it in
`hydra.searchpath` as pkg://lm.config, so Hydra imports it before it reads any group, for every
other composition too (tests, notebooks: hydra.compose).
"""

from lm.config import (  # noqa: F401  store them
    compare,
    data,
    eval,
    export,
    generate,
    import_hf,
    model,
    optim,
    serve,
    train,
    trainer,
    uptrain,
)
from lm.config.attn import register_attn_schemas

register_attn_schemas()

__all__ = ["register_attn_schemas"]
