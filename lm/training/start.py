"""Where a run starts from: the model it trains (built from the config, or given with its weights by
uptraining, or read from `init_from`), and the checkpoint it continues (`resume`, `ckpt_path`),
checked against that model and the run's data settings before Lightning opens it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from lm.config.train import TrainRun
from lm.formats.checkpoint import load, model_state_dict, read_checkpoint, stored_model_config
from lm.model.config import ModelConfig
from lm.model.transformer import Transformer
from lm.training.settings import model_config_from
from lm.util.distributed import say
from lm.util.errors import ConfigError
from lm.util.paths import resolve_path

# Data settings a resumed run may change: they decide neither which text nor which batches.
DATA_SETTINGS_FREE_ON_RESUME = ("num_workers", "cache_dir")


@dataclass
class Start:
    """What a run starts from. `vocab_from_tokenizer`: the config was built from the `model` and
    `attn` groups, and the run's tokenizer fixes its vocabulary; otherwise the config is the given
    weights' own. `checkpoint` and `entry` (its "lm" entry) name the checkpoint a resumed run
    continues; None and {} for a fresh run."""

    model_config: ModelConfig
    vocab_from_tokenizer: bool
    weights: dict | None = None
    tokenizer_json: str | None = None
    provenance: dict | None = None
    checkpoint: str | None = None
    entry: dict = field(default_factory=dict)

    def config_with_vocabulary(self, vocab_size: int) -> ModelConfig:
        if not self.vocab_from_tokenizer:
            return self.model_config
        return dataclasses.replace(self.model_config, vocab_size=vocab_size)

    def model(self, vocab_size: int) -> Transformer:
        """The network to train, its first weights loaded when the run starts from given ones."""
        model = Transformer(self.config_with_vocabulary(vocab_size))
        if self.weights is not None:
            model.load_state_dict(self.weights)
        return model


def starting_point(run: TrainRun, model_config: ModelConfig | None, weights: dict | None,
                   tokenizer_json: str | None, provenance: dict | None) -> Start:
    """The given model (uptraining's conversion), else `init_from`'s weights and tokenizer, else the
    config's model, built now so that a bad setting stops the run before any time goes on data
    (its vocabulary is `data.vocab_size` until the tokenizer fixes it)."""
    if model_config is not None:
        return Start(model_config, vocab_from_tokenizer=False, weights=weights, tokenizer_json=tokenizer_json,
                     provenance=provenance)
    if run.init_from:
        return weights_from(run.init_from, provenance)
    return Start(model_config_from(run.model, run.attn, run.data.vocab_size), vocab_from_tokenizer=True,
                 provenance=provenance)


def weights_from(path: str, provenance: dict | None = None) -> Start:
    """A start from the weights and tokenizer of a checkpoint or transformers folder."""
    model, tokenizer = load(resolve_path(path))
    return Start(model.config, vocab_from_tokenizer=False, weights=model.state_dict(),
                 tokenizer_json=tokenizer.to_str(), provenance=provenance)


def continued(run: TrainRun, run_dir: Path, start: Start) -> Start:
    """`start` with the checkpoint the run continues, checked by the safe loader before Lightning
    opens it; a resumed run keeps the tokenizer its weights were trained with, whatever the corpus
    is now. A fresh run says when it is about to replace an earlier run's checkpoints."""
    path = checkpoint_to_continue(run, run_dir)
    if path is None:
        if (run_dir / "last.ckpt").exists():
            say(f"note: starting run {run.run_name!r} afresh; its checkpoints will be replaced "
                "(resume=true continues it)")
        return start
    ckpt = read_checkpoint(path)  # weights_only: refuses code, names corruption
    entry = ckpt["lm"]
    saved = stored_model_config(entry, model_state_dict(ckpt), f"checkpoint {str(path)!r}").to_dict()
    requested = start.config_with_vocabulary(saved["vocab_size"]).to_dict()
    differences = [f"{k}={saved.get(k)!r} (config: {v!r})" for k, v in requested.items() if saved.get(k) != v]
    if differences:
        raise ConfigError(f"checkpoint {str(path)!r} does not match the configured model: {', '.join(differences)}")
    changed = changed_data_settings(entry.get("run_config") or {}, run)
    if changed:
        raise ConfigError(f"a resumed run cannot change {', '.join(changed)}: the checkpoint was trained on "
                          "other data settings; start afresh (resume=false or another run_name) to change them")
    return dataclasses.replace(start, checkpoint=str(path), entry=entry,
                               tokenizer_json=start.tokenizer_json or entry.get("tokenizer"))


def checkpoint_to_continue(run: TrainRun, run_dir: Path) -> Path | None:
    """`ckpt_path`, or with `resume=true` the run's last.ckpt; None for a fresh run."""
    if run.ckpt_path:
        path = resolve_path(run.ckpt_path)
        if not path.is_file():
            raise ConfigError(f"ckpt_path={str(run.ckpt_path)!r} does not exist")
        return path
    if run.resume:
        path = run_dir / "last.ckpt"
        if not path.is_file():
            raise ConfigError(f"resume=true but run {run.run_name!r} has no checkpoint at {path}")
        return path
    return None


def changed_data_settings(stored_run_config: dict, run: TrainRun) -> list[str]:
    """`data.<key> (checkpoint: a, now: b)` for each data setting that differs from the stored run's."""
    stored = stored_run_config.get("data")
    if not isinstance(stored, dict):
        return []  # an uptrained or hand-made checkpoint records no data settings
    now = dataclasses.asdict(run.data)
    keys = sorted((set(stored) | set(now)) - set(DATA_SETTINGS_FREE_ON_RESUME))
    return [f"data.{k} (checkpoint: {stored.get(k)!r}, now: {now.get(k)!r})"
            for k in keys if stored.get(k) != now.get(k)]
