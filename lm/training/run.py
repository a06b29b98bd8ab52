"""`train(run)`: one training run from its typed settings (lm.config.train.TrainRun, which a script
builds once from its composed config). Scripts, studies and tests call it.

It reads as the run goes: check what depends on two groups, decide what the run starts from, take the run's
folder, set up the data, the model and the Lightning trainer, fit, validate the final weights and
say what the run reached. The steps live beside it: settings (checks, the model's config), start
(weights to start from, the checkpoint to continue), setup (data, module, trainer), summary.
"""

from __future__ import annotations

import contextlib
import time

import lightning as L

from lm.config.train import TrainRun
from lm.model.config import ModelConfig
from lm.model.transformer import Transformer
from lm.training.settings import check_run_settings, distillation_settings, model_config_from, model_config_of
from lm.training.setup import lightning_module, make_trainer, pick_precision, prepared_data
from lm.training.start import continued, starting_point
from lm.training.summary import announce, finish, run_result, sample_text, sampling_model
from lm.util.cli import quiet_known_warnings
from lm.util.distributed import is_main_process, quiet_other_ranks
from lm.util.files import RunLock, remove_stale_temporaries, run_folder
from lm.util.memory import keep_freed_memory
from lm.util.paths import resolve_path

__all__ = ["train", "check_run_settings", "distillation_settings", "model_config_from", "model_config_of"]


def train(run: TrainRun, model_config: ModelConfig | None = None, init_state: dict | None = None,
          tokenizer_json: str | None = None, provenance: dict | None = None, validate_first: bool = False,
          teacher: Transformer | None = None) -> dict:
    """Fit the configured model; returns the final val loss and where the checkpoints are.

    Uptraining passes the converted `model_config` and its weights (`init_state`), the source
    run's tokenizer and the conversion's `provenance`; `validate_first` measures the starting
    weights (`val_loss_before`); `teacher`, the frozen parent, is distilled from with the weight
    and temperature of `uptrain.distill` and `uptrain.temperature` (lm.training.module.LitLM).
    """
    if not isinstance(run, TrainRun):
        raise TypeError(f"train() takes a TrainRun (lm.config.train), not {type(run).__name__}: build one from a "
                        "composed config with TrainRun.from_config(cfg)")
    started = time.perf_counter()
    quiet_known_warnings()  # Lightning's warnings that a run of ours answers itself, and its advert
    quiet_other_ranks()
    check_run_settings(run)
    keep_freed_memory()
    distill, temperature = distillation_settings(run.uptrain, teacher)
    start = starting_point(run, model_config, init_state, tokenizer_json, provenance)
    L.seed_everything(run.seed, workers=True, verbose=False)
    run_dir = run_folder(resolve_path(run.checkpoint_dir), run.run_name)
    # Under DDP every rank runs train(); rank 0, which writes the checkpoints, holds the run's lock.
    with RunLock(run_dir, run.run_name) if is_main_process() else contextlib.nullcontext():
        remove_stale_temporaries(run_dir)
        start = continued(run, run_dir, start)
        data = prepared_data(run, start, run_dir)
        model = start.model(data.tokenizer.get_vocab_size())
        lit = lightning_module(run, model, data, start, dict(teacher=teacher, distill=distill, temperature=temperature))
        precision = pick_precision(run.trainer)
        announce(run.run_name, model, precision, run_dir, start.checkpoint)
        trainer, saves = make_trainer(run, run_dir, precision, start.entry.get("wandb_run_id"))
        if validate_first:
            trainer.validate(lit, datamodule=data, verbose=False)
        saves.stop.fit(trainer, lit, data, start.checkpoint)
        if lit.last_val_step != trainer.global_step:
            # max_steps is not a multiple of the validation interval: measure the final weights
            # and make `last.ckpt` hold them.
            trainer.validate(lit, datamodule=data, verbose=False)
            trainer.save_checkpoint(run_dir / "last.ckpt")
        result = run_result(trainer, lit, saves.best, run_dir)
        if validate_first:
            result["val_loss_before"] = lit.val_history[0][1]
        if trainer.is_global_zero and run.sample.max_new_tokens > 0 and data.is_text:
            result["sample"] = sample_text(sampling_model(trainer, model, result["last"]), data.tokenizer, run.sample)
        return finish(trainer, run.run_name, result, started)
