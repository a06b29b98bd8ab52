"""`train(cfg)`: one training run from a resolved Hydra config. Scripts and tests call it.

It builds the data module, the model and the Lightning trainer from the config, fits,
validates once more at the end and prints a short sample from the trained model.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from lm.attention import layer_specs
from lm.checkpoint import read_checkpoint, stored_model_config
from lm.config import ConfigError, ModelConfig
from lm.data import make_data_module
from lm.generation import generate
from lm.lit import AtomicCheckpointIO, LitLM, OptimConfig
from lm.model import Transformer
from lm.paths import resolve_path

# Lightning's own use of a deprecated torch API; nothing a user can act on.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
# The run folder always holds tokenizer.json before the first checkpoint; train() says
# itself when an earlier run's checkpoints are about to be replaced.
warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
# Resuming mid-epoch is exact here: the data module restarts its shuffle at the checkpoint's batch.
warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended")


def model_config_from(cfg: DictConfig, vocab_size: int) -> ModelConfig:
    """ModelConfig from the `model` and `attn` groups; the vocabulary comes from the tokenizer."""
    model = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k != "name"}
    attn = OmegaConf.to_container(cfg.attn, resolve=True)
    attn.pop("name", None)
    n_kv_head = attn.pop("n_kv_head", None)
    kind, pattern, every = attn.pop("kind", None), attn.pop("pattern", None), attn.pop("global_every", None)
    if (kind is None) == (pattern is None):
        raise ConfigError(f"give attn.kind (one kind for every layer) or attn.pattern (one per layer), "
                          f"not {'both' if kind else 'neither'}")
    specs = layer_specs(pattern or kind, model["n_layer"], attn, every)
    return ModelConfig(vocab_size=vocab_size, attention=specs, n_kv_head=n_kv_head, **model)


def pick_precision(trainer_cfg: DictConfig) -> str:
    """`precision: auto` is bf16-mixed on a GPU and 32-true on the CPU, where bf16 matmuls are
    about 100x slower than fp32."""
    if trainer_cfg.precision != "auto":
        return str(trainer_cfg.precision)
    accelerator = trainer_cfg.accelerator
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return "bf16-mixed" if on_gpu else "32-true"


def make_logger(cfg: DictConfig, run_dir: Path, wandb_run_id: str | None = None):
    kind = cfg.logger.kind
    if kind == "none":
        return False
    if kind == "csv":
        return L.pytorch.loggers.CSVLogger(save_dir=str(run_dir), name="csv")
    if kind == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        # Offline unless the environment asks for online: `wandb sync` uploads later.
        if "WANDB_MODE" not in os.environ and "WANDB_API_KEY" not in os.environ:
            os.environ["WANDB_MODE"] = "offline"
        # A resumed run continues its wandb run (same id) instead of starting a second one.
        return WandbLogger(project=cfg.logger.project, name=cfg.run_name, save_dir=str(run_dir),
                           config=OmegaConf.to_container(cfg, resolve=True), id=wandb_run_id,
                           resume="allow" if wandb_run_id else None)
    raise ConfigError(f"logger.kind={kind!r} is not one of 'wandb', 'csv', 'none'")


def resume_path(cfg: DictConfig, run_dir: Path) -> tuple[str | None, dict]:
    """The checkpoint to continue from and its "lm" entry, checked by the safe loader before
    Lightning opens it; (None, {}) for a fresh run."""
    path = None
    if cfg.get("ckpt_path"):
        path = resolve_path(cfg.ckpt_path)
        if not path.is_file():
            raise ConfigError(f"ckpt_path={str(cfg.ckpt_path)!r} does not exist")
    elif cfg.resume:
        path = run_dir / "last.ckpt"
        if not path.is_file():
            raise ConfigError(f"resume=true but run {cfg.run_name!r} has no checkpoint at {path}")
    if path is None:
        return None, {}
    entry = read_checkpoint(path)["lm"]  # weights_only: refuses code, names corruption
    saved = stored_model_config(entry).to_dict()
    requested = model_config_from(cfg, saved["vocab_size"]).to_dict() if not cfg.get("init_from") else saved
    differences = [f"{k}={saved.get(k)!r} (config: {v!r})" for k, v in requested.items() if saved.get(k) != v]
    if differences:
        raise ConfigError(f"checkpoint {str(path)!r} does not match the configured model: {', '.join(differences)}")
    return str(path), entry


def check_trainer(cfg: DictConfig) -> None:
    t = cfg.trainer
    if not isinstance(t.max_steps, int) or t.max_steps < 1:
        raise ConfigError(f"trainer.max_steps={t.max_steps!r} must be a positive integer")
    if not isinstance(t.accumulate_grad_batches, int) or t.accumulate_grad_batches < 1:
        raise ConfigError(f"trainer.accumulate_grad_batches={t.accumulate_grad_batches!r} must be a positive integer")


def weights_from(path: str) -> tuple[ModelConfig, dict, str]:
    """(config, weights, tokenizer JSON) of a checkpoint or transformers folder to start from."""
    from lm.checkpoint import load

    model, tokenizer = load(resolve_path(path))
    return model.config, model.state_dict(), tokenizer.to_str()


def make_strategy(trainer_cfg: DictConfig):
    """`fsdp` shards each transformer Block as one unit; other names go to Lightning as they are."""
    if trainer_cfg.strategy == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from lm.model import Block

        return FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full")
    return trainer_cfg.strategy


def progress_bar(trainer_cfg: DictConfig) -> list:
    if not trainer_cfg.progress_bar:
        return []
    return [L.pytorch.callbacks.TQDMProgressBar(refresh_rate=trainer_cfg.progress_refresh_steps)]


def train(cfg: DictConfig, model_config: ModelConfig | None = None, init_state: dict | None = None,
          tokenizer_json: str | None = None, provenance: dict | None = None, validate_first: bool = False) -> dict:
    """Fit the configured model; returns the final val loss and where the checkpoints are.

    Uptraining passes the converted `model_config` and its weights (`init_state`), the source
    run's tokenizer and the conversion's `provenance`; `validate_first` measures step 0.
    """
    check_trainer(cfg)
    if cfg.get("init_from") and model_config is None:
        model_config, init_state, tokenizer_json = weights_from(cfg.init_from)
    # Validate the model settings before spending time on data; the tokenizer fixes the
    # final vocabulary size later.
    if model_config is None:
        model_config_from(cfg, cfg.data.vocab_size)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    run_dir = resolve_path(cfg.checkpoint_dir) / cfg.run_name
    ckpt_path, resumed = resume_path(cfg, run_dir)

    data = make_data_module(cfg.data, cfg.model.max_seq_len, cfg.seed, tokenizer_json)
    data.prepare_data()
    data.setup("fit")
    model = Transformer(model_config or model_config_from(cfg, data.tokenizer.get_vocab_size()))
    if init_state is not None:
        model.load_state_dict(init_state)

    if ckpt_path is None and (run_dir / "last.ckpt").exists():
        print(f"note: starting run {cfg.run_name!r} afresh; its checkpoints will be replaced "
              "(resume=true continues it)")
    run_dir.mkdir(parents=True, exist_ok=True)
    data.tokenizer.save(str(run_dir / "tokenizer.json"))
    run_config = OmegaConf.to_container(cfg, resolve=True)
    lit = LitLM(model, OptimConfig(**cfg.optim), total_steps=cfg.trainer.max_steps,
                tokenizer_json=data.tokenizer.to_str(), run_config=run_config, compile=cfg.compile,
                provenance=provenance, skip_nonfinite=bool(cfg.trainer.get("skip_nonfinite", False)))

    precision = pick_precision(cfg.trainer)
    print(f"run {cfg.run_name}: {model.num_params() / 1e6:.2f}M parameters, n_head={model.config.n_head} "
          f"n_kv_head={model.config.n_kv_head}, precision={precision}, checkpoints in {run_dir}"
          + (f", resuming {ckpt_path}" if ckpt_path else ""))
    print(f"attention: {model.config.describe_attention()}")
    # Two callbacks: Lightning's `save_last` only refreshes last.ckpt when the best one changes.
    best = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=run_dir, filename="best", monitor="val/loss", mode="min", save_top_k=1, enable_version_counter=False
    )
    last = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=run_dir, filename="last", monitor=None, save_top_k=1, enable_version_counter=False
    )
    checkpoint_callbacks = [best, last]
    every = (cfg.get("checkpoint") or {}).get("every_n_steps")
    if every:  # a third writer of last.ckpt: Lightning saves either per n steps or per validation, not both
        checkpoint_callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=run_dir, filename="last", monitor=None, save_top_k=1, enable_version_counter=False,
            every_n_train_steps=every))
    t = cfg.trainer
    trainer = L.Trainer(
        accelerator=t.accelerator, devices=t.devices, strategy=make_strategy(t), num_nodes=t.num_nodes,
        precision=precision, max_steps=t.max_steps, val_check_interval=min(t.val_every_n_steps, t.max_steps),
        check_val_every_n_epoch=None, limit_val_batches=t.limit_val_batches,
        gradient_clip_val=t.gradient_clip_val, accumulate_grad_batches=t.accumulate_grad_batches,
        log_every_n_steps=t.log_every_n_steps, num_sanity_val_steps=0,
        logger=make_logger(cfg, run_dir, resumed.get("wandb_run_id")),
        plugins=[AtomicCheckpointIO()],
        callbacks=[*checkpoint_callbacks, *progress_bar(t)], enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
        use_distributed_sampler=False,  # the data module shards by rank itself (lm.data.EpochShuffle)
    )
    if validate_first:
        trainer.validate(lit, datamodule=data, verbose=False)
    trainer.fit(lit, datamodule=data, ckpt_path=ckpt_path)
    if lit.last_val_step != trainer.global_step:
        # max_steps is not a multiple of the validation interval: measure the final weights
        # and make `last.ckpt` hold them.
        trainer.validate(lit, datamodule=data, verbose=False)
        trainer.save_checkpoint(run_dir / "last.ckpt")
    val_loss = float(trainer.callback_metrics["val/loss"])
    val_accuracy = float(trainer.callback_metrics["val/accuracy"])
    result = {"val_loss": val_loss, "val_accuracy": val_accuracy, "run_dir": str(run_dir),
              "last": str(run_dir / "last.ckpt"), "best": best.best_model_path, "steps": trainer.global_step,
              "val_history": lit.val_history, "train_seconds": lit.train_seconds,
              "train_tokens_per_s": lit.train_tokens / lit.train_seconds if lit.train_seconds else None}
    if trainer.is_global_zero:
        ppl = torch.tensor(val_loss).exp()
        print(f"final val loss {val_loss:.4f} (ppl {ppl:.1f}), accuracy {val_accuracy:.4f}, "
              f"after {trainer.global_step} steps")
        if cfg.sample.max_new_tokens > 0 and data.is_text:
            result["sample"] = sample_text(model, data.tokenizer, cfg.sample)
            print(f"sample:\n{result['sample']}")
    if isinstance(trainer.logger, L.pytorch.loggers.WandbLogger):
        trainer.logger.experiment.finish()
    return result


def sample_text(model: Transformer, tokenizer, sample_cfg: DictConfig) -> str:
    model.eval()
    prompt_ids = tokenizer.encode(sample_cfg.prompt).ids
    max_new = sample_cfg.max_new_tokens
    if model.context_limited:
        max_new = min(max_new, model.config.max_seq_len - len(prompt_ids))
    out = generate(model, [prompt_ids], max_new, temperature=sample_cfg.temperature, top_k=sample_cfg.top_k,
                   seed=sample_cfg.seed)
    return tokenizer.decode(out[0])
