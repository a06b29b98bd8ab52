"""scripts/train.py's own settings, the keys beside its groups (attn, model, data, trainer, logger,
optim): each one's default, meaning and bound, declared once here.

conf/train.yaml composes them first (`train_settings`), its groups and overrides on top; training
checks them before any data or model work (lm.training.settings.check_run_settings calls
`check_train_settings`). A run config stored before a setting existed takes its default.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from lm.config.settings import boolean, check_settings, group, integer, number, setting, store, training_seed


@dataclass(kw_only=True)
class CheckpointSettings:
    every_n_steps: int | None = setting(100, "last.ckpt every n optimizer steps as well as at each validation "
                                             "(null: only there)", integer(1, nullable=True))


@dataclass(kw_only=True)
class SampleSettings:
    prompt: str = setting("def ", "the text the sample continues")
    max_new_tokens: int = setting(48, "tokens to add (0: no sample)", integer(0))
    temperature: float = setting(0.8, "0 is greedy", number(0))
    top_k: int | None = setting(50, "keep the k likeliest tokens; null: no top-k filter", integer(1, nullable=True))
    seed: int | None = setting(0, "null: a different sample each run", integer(0, nullable=True))


@dataclass(kw_only=True)
class TrainSettings:
    run_name: str = setting("${attn.name}-${model.name}", "checkpoints/<run_name>/; resume=true continues it")
    seed: int | None = setting(0, "of the weights' initialisation and the data's order", training_seed())
    resume: bool = setting(False, "continue checkpoints/<run_name>/last.ckpt", boolean())
    ckpt_path: str | None = setting(None, "or continue from this checkpoint")
    init_from: str | None = setting(None, "start from these weights and their tokenizer (a checkpoint, or a "
                                          "transformers Llama/Mistral folder) with a fresh optimizer; model/attn "
                                          "are then the checkpoint's")
    compile: bool = setting(False, "torch.compile the model (inductor; CPU or GPU; the first step compiles)",
                            boolean())
    loss_chunk: int = setting(512, "positions whose logits the training and validation loss makes at a time: the "
                                   "head, the cross-entropy and their gradients chunk by chunk, never the whole "
                                   "(tokens, vocab) logits (lm.model.linear_cross_entropy); 0: the plain head and "
                                   "F.cross_entropy over every logit", integer(0))
    checkpoint_dir: str = setting("checkpoints", "where checkpoints/<run_name>/ goes")
    checkpoint: CheckpointSettings = group(CheckpointSettings)
    sample: SampleSettings = group(SampleSettings, "a short continuation printed at the end of training")


# The recipe scripts/train.py trained with before model=nano and optim=muon (Muon, wsd) became its
# defaults: the tiny model (6.3M parameters), AdamW with the cosine schedule, 500 steps, and the loss
# made from the whole logits at once (loss_chunk=0). The studies (compare, the frontier) train their
# arms with it, so their committed records hold until a study is rerun on purpose, and `bench.py
# recipe` measures the default against it.
ADAMW_RECIPE = ("model=tiny", "optim=adamw", "trainer.max_steps=500", "loss_chunk=0")


def check_train_settings(cfg: DictConfig) -> None:
    """Every setting of TrainSettings, one line naming the first that is out of its bound."""
    check_settings(cfg, TrainSettings)


store("train_settings", TrainSettings)

__all__ = ["ADAMW_RECIPE", "CheckpointSettings", "SampleSettings", "TrainSettings", "check_train_settings"]
