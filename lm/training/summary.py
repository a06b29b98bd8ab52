"""What a run says and returns: the lines that open it, its result, a sample from the trained
model, and the block that ends it."""

from __future__ import annotations

import math
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lm.config.train import SampleSettings
from lm.formats.checkpoint import load
from lm.generation.decode import generate
from lm.model.transformer import Transformer
from lm.training.module import LitLM
from lm.util.distributed import say


def announce(run_name: str, model: Transformer, precision: str, run_dir: Path, checkpoint: str | None) -> None:
    say(f"run {run_name}: {model.num_params() / 1e6:.2f}M parameters, n_head={model.config.n_head} "
        f"n_kv_head={model.config.n_kv_head}, precision={precision}, checkpoints in {run_dir}"
        + (f", resuming {checkpoint}" if checkpoint else ""))
    say(f"attention: {model.config.describe_attention()}")


def run_result(trainer: L.Trainer, lit: LitLM, best: ModelCheckpoint, run_dir: Path) -> dict:
    """The final val loss and accuracy, where the checkpoints are, the steps taken and how fast."""
    # The last validation, also when it happened before a resume that had no steps left to take.
    _, val_loss, val_accuracy, _ = lit.val_history[-1]
    return {"val_loss": val_loss, "val_accuracy": val_accuracy, "run_dir": str(run_dir),
            "last": str(run_dir / "last.ckpt"), "best": best.best_model_path, "steps": trainer.global_step,
            "best_val_loss": float(best.best_model_score) if best.best_model_score is not None else None,
            "val_history": lit.val_history, "train_seconds": lit.train_seconds,
            "train_tokens_per_s": lit.train_tokens / lit.train_seconds if lit.train_seconds else None}


def finish(trainer: L.Trainer, run_name: str, result: dict, started: float) -> dict:
    """`result` with the run's wall time; the summary block printed once, last."""
    # wandb prints its own run summary when it finishes: before ours, so ours ends the output.
    if isinstance(trainer.logger, L.pytorch.loggers.WandbLogger):
        trainer.logger.experiment.finish()
    result["wall_seconds"] = time.perf_counter() - started
    if trainer.is_global_zero:
        print("\n".join(summary_lines(run_name, result)))
    return result


def summary_lines(run_name: str, result: dict) -> list[str]:
    """The block that ends a run: what it reached, where it is, how fast it went, what it writes."""
    ppl = math.exp(result["val_loss"]) if result["val_loss"] < 709 else math.inf  # exp(710) overflows a float
    lines = [f"== run {run_name} finished ==",
             f"final val loss   {result['val_loss']:.4f} (ppl {ppl:,.1f}), accuracy {result['val_accuracy']:.4f}, "
             f"after {result['steps']} steps"]
    if "val_loss_before" in result:
        lines.append(f"val loss before  {result['val_loss_before']:.4f} (the starting weights)")
    if result["best"] and result["best_val_loss"] is not None:
        lines.append(f"best checkpoint  {shown_path(result['best'])} (val loss {result['best_val_loss']:.4f})")
    lines.append(f"last checkpoint  {shown_path(result['last'])}")
    if result["train_tokens_per_s"]:
        lines.append(f"throughput       {result['train_tokens_per_s']:,.0f} tokens/s in training steps "
                     f"({format_seconds(result['train_seconds'])} of them)")
    lines.append(f"wall time        {format_seconds(result['wall_seconds'])}")
    if "sample" in result:
        lines.append(f"sample:\n{result['sample']}")
    return lines


def shown_path(path: str) -> str:
    """A path relative to the working folder when it lies inside it, as the user typed it."""
    path = Path(path)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def format_seconds(seconds: float) -> str:
    """`38.2 s`, `14 min 52 s`, `3 h 07 min`."""
    if seconds < 59.95:  # what rounds to 60.0 reads as a minute
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def sampling_model(trainer: L.Trainer, model: Transformer, last_checkpoint: str) -> Transformer:
    """The model the closing sample is drawn from: the trained one, but under FSDP the last
    checkpoint's full weights read back as a plain model. FSDP keeps each Block's weights as
    shards cast to bf16 at each forward: a forward outside training's autocast fails on their
    dtype, and one on rank 0 alone would wait forever for the other ranks' shards."""
    from lightning.pytorch.strategies import FSDPStrategy

    if not isinstance(trainer.strategy, FSDPStrategy):
        return model
    return load(last_checkpoint, device=next(model.parameters()).device)[0]


def sample_text(model: Transformer, tokenizer, sample: SampleSettings) -> str:
    model.eval()
    prompt_ids = tokenizer.encode(sample.prompt).ids
    max_new = sample.max_new_tokens
    if model.context_limited:
        max_new = min(max_new, model.config.max_seq_len - len(prompt_ids))
    out = generate(model, [prompt_ids], max_new, temperature=sample.temperature, top_k=sample.top_k,
                   seed=sample.seed)
    return tokenizer.decode(out[0])
