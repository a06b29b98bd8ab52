"""What the attention comparison's arms run and measure: training (a diverged run is a result of
the sweep), loss and bits per byte over the validation split, and decoding and training speed on a
freshly initialised model of the language-modelling shape."""

from __future__ import annotations

import statistics
import time

import torch
from omegaconf import DictConfig, OmegaConf

from lm.config.train import TrainRun
from lm.data.corpora import build_corpus
from lm.evaluation.perplexity import score, split_documents, token_stream
from lm.formats.checkpoint import load
from lm.model.transformer import Transformer
from lm.studies.decode_speed import decode_speed
from lm.studies.train_step import train_step_fn
from lm.training.run import train
from lm.training.settings import model_config_of
from lm.util.errors import TrainingError


def unless_diverged(run, run_cfg: DictConfig) -> dict:
    """The run's figures, or {"diverged": why} when its loss stopped being finite: in a sweep a
    learning rate too high for a kind is a result of the sweep (the report shows it and picks the
    best of the others), not an error that stops the study."""
    try:
        return run(run_cfg)
    except TrainingError as e:
        print(f"  diverged: {e}", flush=True)
        return {"diverged": str(e)}


def recall_run(run_cfg: DictConfig) -> dict:
    return training_figures(train(TrainRun.from_config(run_cfg)))


def training_figures(result: dict) -> dict:
    return {"steps": result["steps"], "val_loss": result["val_loss"], "val_accuracy": result["val_accuracy"],
            "train_seconds": result["train_seconds"], "train_tokens_per_s": result["train_tokens_per_s"],
            "history": result["val_history"]}


def language_run(run_cfg: DictConfig) -> dict:
    """Train, then loss and bits per byte over the whole validation split and the parameter count."""
    result = train(TrainRun.from_config(run_cfg))
    model, tokenizer = load(result["last"])
    texts = split_documents(build_corpus(run_cfg.data), "val", float(run_cfg.data.val_fraction))
    scored = score(model, *token_stream(texts, tokenizer), progress=False)
    return {**training_figures(result), "params": model.num_params(), "eval_loss": scored.loss,
            "bits_per_byte": scored.bits_per_byte, "eval_tokens": scored.tokens, "eval_bytes": scored.bytes}


def decoding_rows(speed: dict) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(batch, context) rows to decode, and those left out for holding more than
    `speed.max_batch_tokens` tokens (a 32k context 16 times over is 16 prefills of 32k)."""
    rows = [(batch, context) for batch in speed["batches"] for context in speed["contexts"]]
    cap = speed["max_batch_tokens"]
    return ([r for r in rows if cap is None or r[0] * r[1] <= cap],
            [r for r in rows if cap is not None and r[0] * r[1] > cap])


def speed_figures(run_cfg: DictConfig, speed: dict) -> dict:
    """Every figure of a speed arm; `speed` as speed_settings fills it in."""
    vocab_size = run_cfg.data.vocab_size
    measured, left_out = decoding_rows(speed)
    decode = [fresh_model_decoding(run_cfg, vocab_size, context, speed["new_tokens"], batch, speed["compile"])
              for batch, context in measured]
    training = [fresh_model_training(run_cfg, vocab_size, context, speed["train_tokens"], speed["train_steps"])
                for context in speed["train_contexts"]]
    params = Transformer(model_config_of(run_cfg, vocab_size)).num_params()
    return {"params": params, "decode": decode, "decode_left_out": [list(r) for r in left_out], "train": training}


def fresh_model(run_cfg: DictConfig, vocab_size: int, context: int) -> Transformer:
    """The run's shape, its context stretched to `context`, freshly initialised with seed 0."""
    long = OmegaConf.merge(run_cfg, {"model": {"max_seq_len": context}})
    torch.manual_seed(0)
    return Transformer(model_config_of(long, vocab_size))


def fresh_model_decoding(run_cfg: DictConfig, vocab_size: int, context: int, new_tokens: int, batch: int = 1,
                         compile: bool = False) -> dict:
    """Decoding figures of the last `new_tokens` of a `context`-token sequence in `batch` rows on a
    freshly initialised model of the run's shape."""
    model = fresh_model(run_cfg, vocab_size, context).eval()
    prompt = torch.randint(0, vocab_size, (context - new_tokens,)).tolist()
    if compile:  # compiled graphs of earlier models would count against torch's recompile limit
        torch._dynamo.reset()
    measured = decode_speed(model, prompt, new_tokens, batch, compile=compile)
    return {"batch": batch, "context": context, "tokens_per_s": measured.tokens_per_s, "prefill_s": measured.prefill_s,
            "cache_bytes": measured.cache_bytes}


def fresh_model_training(run_cfg: DictConfig, vocab_size: int, context: int, tokens: int, steps: int) -> dict:
    """Training tokens/s at sequence length `context`: forward, loss, backward and AdamW on
    batches of max(1, tokens // context) sequences, the median of `steps` timed steps after one
    untimed (eager, fp32, as scripts/train.py trains on a CPU)."""
    model = fresh_model(run_cfg, vocab_size, context).train()
    batch = max(1, tokens // context)
    data = torch.randint(0, vocab_size, (batch, context + 1))
    step = train_step_fn(model, lambda m, x: m(x))
    step(data)
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        step(data)
        seconds.append(time.perf_counter() - started)
    step_s = statistics.median(seconds)
    return {"context": context, "batch": batch, "step_s": step_s, "tokens_per_s": batch * context / step_s}
