"""Which attention should I use? Every kind on recall, language modelling, speed and memory.

For each kind (an attn config such as `gqa`, a registered kind at its defaults, or an entry with
options), at equal steps and equal model size:

- MQAR (lm/data/mqar.py) accuracy on held-out examples for each model width x number of pairs;
- language modelling on the `data` corpus: validation loss against training time, then loss and
  bits per byte over the whole validation split (lm/studies/evaluate.py);
- training tokens/s of that run, and greedy decoding tokens/s and cache bytes at each context of
  `speed.contexts`, on a freshly initialised model of the same shape (speed does not depend on the
  weights, and the trained model's context may be shorter).

Every arm is an ordinary training run composed from conf/train.yaml, so the study measures what
`scripts/train.py` would do; lm/studies/engine.py runs the arms, keeps their records in
<out>/records/ and reuses those whose settings still match. Outputs: results.json, results.md,
mqar_accuracy.png, lm_loss.png under `out` (lm/studies/report.py).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from lm.attention import available_kinds
from lm.data.corpora import build_corpus
from lm.data.mqar import FILLERS, RecallTask
from lm.formats.checkpoint import load
from lm.model.config import ConfigError
from lm.model.transformer import Transformer
from lm.studies.bench import train_step_fn
from lm.studies.decode_speed import decode_speed
from lm.studies.engine import Arm, finished_records, import_records, machine, recorded_settings, run_arms
from lm.studies.evaluate import score, split_documents, token_stream
from lm.studies.jobs import chosen_launcher, only_arm, run_as_jobs
from lm.studies.report import comparison_table, lm_loss_plot, mqar_plot, write_results
from lm.training.run import model_config_from, train
from lm.util.checks import (
    as_list,
    require_bool,
    require_choice,
    require_fraction,
    require_in_interval,
    require_int,
    require_positive,
)
from lm.util.errors import DataError, TrainingError
from lm.util.paths import resolve_path

PEERS = ["mha", "mqa", "gqa"]  # the softmax kind at three K/V head counts


@dataclass
class Entry:
    """One kind of the study: a name for the tables, the attn config it starts from, options on top."""

    name: str
    attn: str | None  # conf/attn/<attn>.yaml, or None for a registered kind without one
    kind: str | None  # the registered kind when attn is None
    options: dict


# ---------------------------------------------------------------------------- the kinds


def attn_configs() -> list[str]:
    return sorted(GlobalHydra.instance().config_loader().get_group_options("attn"))


def study_entries(cfg: DictConfig) -> list[Entry]:
    """The kinds to compare: `kinds` (null: MHA, MQA, GQA, then every other registered kind at its
    defaults) followed by `extra_kinds`. A kind registered later joins without an edit here."""
    configs = attn_configs()
    default = PEERS + [k for k in available_kinds() if k != "softmax"]
    names = as_list("kinds", cfg.kinds) if cfg.kinds is not None else default
    entries = [_entry(name, {}, configs) for name in names]
    for extra in as_list("extra_kinds", cfg.get("extra_kinds")):
        if not isinstance(extra, (str, DictConfig)):
            raise ConfigError(f"extra_kinds entry {extra!r} must be a kind's name or "
                              "{name: ..., attn: ..., option: ...}")
        extra = OmegaConf.to_container(extra, resolve=True) if not isinstance(extra, str) else {"attn": extra}
        base = extra.pop("attn", None)
        name = extra.pop("name", None) or base
        if base is None:
            raise ConfigError(f"extra_kinds entry {extra!r} needs attn: <an attn config or a kind>")
        entries.append(_entry(base, extra, configs, name=name))
    if not entries:
        raise ConfigError("kinds=[] and extra_kinds=[] leave nothing to compare: name at least one kind, "
                          "or kinds=null for every registered one")
    seen = [e.name for e in entries]
    duplicates = sorted({n for n in seen if seen.count(n) > 1})
    if duplicates:
        raise ConfigError(f"kinds names {duplicates} more than once")
    return entries


def _entry(base: str, options: dict, configs: list[str], name: str | None = None) -> Entry:
    if not isinstance(base, str):
        raise ConfigError(f"kinds entry {base!r} must be the name of an attn config or a registered kind")
    if name is not None and (not isinstance(name, str) or not name or any(c in name for c in '/\\:') or
                             name.startswith(".")):
        # The name becomes file names (records/lm-<name>.json, runs/lm-<name>/): one plain file name.
        raise ConfigError(f"extra_kinds name {name!r} must be a plain file name: no '/', '\\' or ':', "
                          "not starting with '.'")
    if base in configs:
        return Entry(name or base, base, None, options)
    if base in available_kinds():
        return Entry(name or base, None, base, options)
    raise ConfigError(f"kinds entry {base!r} is neither an attn config ({', '.join(configs)}) "
                      f"nor a registered kind ({', '.join(available_kinds())})")


COMPOSED: dict[tuple, DictConfig] = {}  # (attn config, overrides) -> conf/train.yaml composed; one plan's


def training_config(entry: Entry, task_overrides: list[str], values: dict, data: dict | None = None) -> DictConfig:
    """conf/train.yaml with this entry's attention and the study's settings (`data` replaces the
    data group whole). Hydra composes it once per attention config and task within a plan (a
    grid has hundreds of arms); each arm gets its own copy."""
    overrides = (f"attn={entry.attn}" if entry.attn else "attn=mha", "logger=none", *task_overrides)
    if overrides not in COMPOSED:
        COMPOSED[overrides] = compose(config_name="train", overrides=list(overrides))
    cfg = OmegaConf.merge(COMPOSED[overrides])  # a copy: the changes below stay this arm's
    if entry.attn is None:  # a registered kind without a YAML: its spec's defaults, every head its own K/V
        cfg.attn = OmegaConf.create({"name": entry.kind, "kind": entry.kind, "n_kv_head": None})
    if data is not None:
        cfg.data = OmegaConf.create(data)
    return OmegaConf.merge(cfg, values, {"attn": entry.options})


# ---------------------------------------------------------------------------- the arms


TASKS = ("mqar", "lm", "speed")


def study_tasks(cfg: DictConfig) -> list[str]:
    """`tasks`, in the study's order: mqar (recall), lm (language modelling), speed (decoding)."""
    tasks = as_list("tasks", cfg.get("tasks", list(TASKS)))
    if not tasks:
        raise ConfigError(f"tasks=[] is empty: give one or more of {', '.join(TASKS)}")
    for task in tasks:
        if task not in TASKS:
            raise ConfigError(f"tasks entry {task!r} is not one of {', '.join(TASKS)}")
    return [task for task in TASKS if task in tasks]


def learning_rates(name: str, value) -> list[float]:
    """The swept learning rates of `mqar.lr` or `lm.lr`: one value, or a list."""
    lrs = as_list(name, value)
    if not lrs:
        raise ConfigError(f"{name}=[] is empty: give at least one learning rate")
    for lr in lrs:
        require_positive(name if len(lrs) == 1 else f"{name} entry", lr)
    if len(set(lrs)) < len(lrs):
        raise ConfigError(f"{name}={lrs} names a learning rate more than once")
    return lrs


def study_seeds(cfg: DictConfig) -> list[int]:
    """seed, seed + 1, ...: `seeds` of them, so `seed=<n>` reruns every cell with other seeds."""
    count = cfg.get("seeds", 1)
    require_int("seed", cfg.seed, minimum=0)
    require_int("seeds", count)
    return list(range(cfg.seed, cfg.seed + count))


def check_study_settings(cfg: DictConfig) -> None:
    """Every number of the study, named as the user types it, before any arm is planned: an arm's
    own check would name its internal key (trainer.max_steps for lm.steps) after others trained."""
    if cfg.data.get("source") == "mqar":
        raise ConfigError("data=mqar: the study's `data` is the language-modelling corpus (pystdlib, text or hf); "
                          "the recall runs are set under mqar.*")
    study_tasks(cfg)
    study_seeds(cfg)
    require_bool("report_only", cfg.get("report_only", False))
    require_fraction("data.val_fraction", cfg.data.get("val_fraction"))
    m, lm, speed = cfg.mqar, cfg.lm, cfg.speed
    for key in ("widths", "pairs"):
        values = as_list(f"mqar.{key}", m[key])
        if not values:
            raise ConfigError(f"mqar.{key}=[] is empty: give at least one value, or tasks without mqar")
        for value in values:
            require_int(f"mqar.{key} entry", value)
    recall_lengths(m)
    for group, name, keys in (("mqar", m, ("vocab_size", "n_layer", "n_head", "ff_mult", "steps",
                                           "val_every", "batch_size", "val_examples")),
                              ("lm", lm, ("steps", "val_every", "batch_size"))):
        for key in keys:
            require_int(f"{group}.{key}", name[key])
    if m.get("examples") is not None:
        require_int("mqar.examples", m.examples)
    require_int("mqar.short_conv", m.get("short_conv", 0), minimum=0)
    require_choice("mqar.filler", m.get("filler", "pad"), FILLERS)
    require_in_interval("mqar.query_power", m.get("query_power", 0.01), 0, 1, open_low=True)
    if m.get("stop_at_accuracy") is not None:
        require_fraction("mqar.stop_at_accuracy", m.stop_at_accuracy)
    if lm.get("val_batches") is not None:
        require_int("lm.val_batches", lm.val_batches)
    for group, name in (("mqar", m), ("lm", lm)):
        learning_rates(f"{group}.lr", name.lr)
        require_int(f"{group}.warmup_steps", name.warmup_steps, minimum=0)
    require_int("speed.new_tokens", speed.new_tokens, minimum=3)  # the first step is not timed (decode_speed)
    batches = as_list("speed.batches", speed.get("batches", 1))
    if not batches:
        raise ConfigError("speed.batches=[] is empty: give at least one batch size to decode at")
    for batch in batches:
        require_int("speed.batches entry", batch)
    contexts = as_list("speed.contexts", speed.contexts)
    if not contexts:
        raise ConfigError("speed.contexts=[] is empty: give at least one context length to decode at")
    for context in contexts:
        if not isinstance(context, int) or isinstance(context, bool) or context <= speed.new_tokens:
            raise ConfigError(f"speed.contexts entry {context!r} must be an integer above "
                              f"speed.new_tokens={speed.new_tokens}")
    if speed.get("max_batch_tokens") is not None:
        require_int("speed.max_batch_tokens", speed.max_batch_tokens)
    require_bool("speed.compile", speed.get("compile", False))
    train_contexts = as_list("speed.train_contexts", speed.get("train_contexts", []))
    for context in train_contexts:
        require_int("speed.train_contexts entry", context)
    if train_contexts:
        require_int("speed.train_tokens", speed.get("train_tokens"))
        require_int("speed.train_steps", speed.get("train_steps", 3))


def corpus_key(cfg: DictConfig) -> str:
    """The corpus's content fingerprint (file sizes and modification times, or the dataset's
    identity), checked to leave the evaluation some text: the language-modelling records are keyed
    by it, so rewritten files rerun the arms they feed."""
    corpus = build_corpus(cfg.data)
    val_fraction = cfg.data.get("val_fraction")
    if not any(text.strip() for text in split_documents(corpus, "val", float(val_fraction))):
        raise DataError(f"data.val_fraction={val_fraction} leaves no document of the corpus for validation and "
                        "evaluation: give more documents or a larger fraction")
    return corpus.fingerprint


def plan(cfg: DictConfig) -> list[Arm]:
    """Every arm of the study, each checked before any training starts: per kind, the recall
    cells (width x pairs) at each swept learning rate and seed, the language-modelling runs at each
    learning rate and seed, and one speed arm."""
    check_study_settings(cfg)
    COMPOSED.clear()  # the config files may have changed since the last plan of this process
    entries = study_entries(cfg)
    check_per_kind(cfg)
    tasks = study_tasks(cfg)
    runs = resolve_path(cfg.out) / "runs"
    common = {"checkpoint_dir": str(runs), "resume": False, "checkpoint": {"every_n_steps": None},
              "sample": {"max_new_tokens": 0}}
    fingerprint = corpus_key(cfg) if "lm" in tasks else None
    arms = []
    for entry in entries:
        own = for_kind(cfg, entry.name)
        seeds = study_seeds(own)
        if "mqar" in tasks:
            arms += recall_arms(own, entry, seeds, common, runs)
        if "lm" in tasks:
            arms += language_arms(own, entry, seeds, common, runs, fingerprint)
        if "speed" in tasks:
            arms.append(speed_arm(own, entry, common))
    return arms


PER_KIND_KEYS = ("mqar", "lm", "speed", "seeds")


def for_kind(cfg: DictConfig, name: str) -> DictConfig:
    """The study's settings for one kind: `per_kind.<name>` on top of the rest. A kind too slow
    for the whole grid (additive's pairwise scores) runs fewer cells or shorter contexts, and the
    report names what it left out."""
    own = (cfg.get("per_kind") or {}).get(name)
    if own is None:
        return cfg
    return OmegaConf.merge(cfg, own)


def check_per_kind(cfg: DictConfig) -> None:
    """`per_kind` gives only the keys a kind may change, each checked as the study's own settings are."""
    per_kind = cfg.get("per_kind")
    if per_kind is None:
        return
    if not isinstance(per_kind, DictConfig):
        raise ConfigError(f"per_kind={per_kind!r} must be a mapping: {{<kind>: {{mqar: {{widths: [64]}}}}}}")
    for name, own in per_kind.items():
        if not isinstance(own, DictConfig):
            raise ConfigError(f"per_kind.{name}={own!r} must be a mapping of {', '.join(PER_KIND_KEYS)}")
        unknown = sorted(set(own) - set(PER_KIND_KEYS))
        if unknown:
            raise ConfigError(f"per_kind.{name}.{unknown[0]} is not a setting a kind may change: "
                              f"give {', '.join(PER_KIND_KEYS)}")
        try:  # also for a kind this study leaves out (kinds=[mha]): its entry stays for the full study
            check_study_settings(for_kind(cfg, name))
        except ConfigError as e:
            raise ConfigError(f"per_kind.{name}: {e}") from None


def recall_lengths(m: DictConfig) -> dict[int, int]:
    """pairs -> sequence length: `mqar.seq_len` is one length for every number of pairs, or a list
    with one per entry of `mqar.pairs` (Zoology's Figure 2 grows the sequence with the pairs)."""
    pairs = as_list("mqar.pairs", m.pairs)
    if isinstance(m.seq_len, int) and not isinstance(m.seq_len, bool):
        require_int("mqar.seq_len", m.seq_len)
        return dict.fromkeys(pairs, m.seq_len)
    lengths = as_list("mqar.seq_len", m.seq_len)
    if len(lengths) != len(pairs):
        raise ConfigError(f"mqar.seq_len={lengths} must be one length, or one per entry of mqar.pairs={pairs}")
    for length in lengths:
        require_int("mqar.seq_len entry", length)
    return dict(zip(pairs, lengths, strict=True))


def lr_tag(lr: float) -> str:
    return f"lr{lr:g}"


def recall_arms(cfg: DictConfig, entry: Entry, seeds: list[int], common: dict, runs: Path) -> list[Arm]:
    m = cfg.mqar
    # Fresh examples at every step unless a count is given: no run sees an example twice before
    # it could have solved the task (a model memorises a small set and stays on the plateau).
    examples = m.get("examples") or m.steps * m.batch_size
    lengths = recall_lengths(m)
    arms = []
    for width, pairs, lr, seed in itertools.product(as_list("mqar.widths", m.widths), as_list("mqar.pairs", m.pairs),
                                                    learning_rates("mqar.lr", m.lr), seeds):
        name = f"mqar-{entry.name}-d{width}-p{pairs}-{lr_tag(lr)}-s{seed}"
        values = {**common, "seed": seed, "run_name": name,
                  "model": {"name": f"mqar-d{width}", "n_layer": m.n_layer, "d_model": width, "n_head": m.n_head,
                            "d_ff": m.ff_mult * width, "max_seq_len": lengths[pairs],
                            "short_conv": m.get("short_conv", 0)},
                  "data": {"vocab_size": m.vocab_size, "seq_len": lengths[pairs], "pairs": pairs, "examples": examples,
                           "val_examples": m.val_examples, "seed": seed, "batch_size": m.batch_size,
                           "filler": m.get("filler", "pad"), "query_power": m.get("query_power", 0.01)},
                  "optim": {"lr": lr, "warmup_steps": m.warmup_steps},
                  "trainer": {**_trainer(m.steps, m.val_every, None), "stop_at_accuracy": m.get("stop_at_accuracy")}}
        run_cfg = training_config(entry, ["data=mqar"], values)
        check_run(name, run_cfg, recall=True)
        arms.append(Arm(name, recorded_settings(run_cfg),
                        lambda resume=False, c=run_cfg: unless_diverged(recall_run, resumed(c, resume)),
                        labels={"task": "mqar", "kind": entry.name, "width": width, "pairs": pairs, "lr": lr,
                                "seed": seed},
                        log=runs / name / "train.log", checkpoint=runs / name / "last.ckpt"))
    return arms


def language_config(cfg: DictConfig, entry: Entry, lr: float, seed: int, common: dict, name: str) -> DictConfig:
    lm = cfg.lm
    values = {**common, "seed": seed, "run_name": name, "model": {"name": "compare", **lm.model},
              "data": {"batch_size": lm.batch_size}, "optim": {"lr": lr, "warmup_steps": lm.warmup_steps},
              "trainer": _trainer(lm.steps, lm.val_every, lm.val_batches)}
    return training_config(entry, [], values, OmegaConf.to_container(cfg.data, resolve=True))


def language_arms(cfg: DictConfig, entry: Entry, seeds: list[int], common: dict, runs: Path,
                  fingerprint: str) -> list[Arm]:
    arms = []
    for lr, seed in itertools.product(learning_rates("lm.lr", cfg.lm.lr), seeds):
        name = f"lm-{entry.name}-{lr_tag(lr)}-s{seed}"
        run_cfg = language_config(cfg, entry, lr, seed, common, name)
        check_run(name, run_cfg, recall=False)
        # The figures depend on the corpus's text too.
        arms.append(Arm(name, {**recorded_settings(run_cfg), "corpus_fingerprint": fingerprint},
                        lambda resume=False, c=run_cfg: unless_diverged(language_run, resumed(c, resume)),
                        labels={"task": "lm", "kind": entry.name, "lr": lr, "seed": seed},
                        log=runs / name / "train.log", checkpoint=runs / name / "last.ckpt"))
    return arms


def speed_settings(speed: DictConfig) -> dict:
    """`speed` as the speed arm records it, every list a list and every default filled in."""
    return {"contexts": as_list("speed.contexts", speed.contexts), "new_tokens": speed.new_tokens,
            "batches": as_list("speed.batches", speed.get("batches", 1)),
            "max_batch_tokens": speed.get("max_batch_tokens"), "compile": bool(speed.get("compile", False)),
            "train_contexts": as_list("speed.train_contexts", speed.get("train_contexts", [])),
            "train_tokens": speed.get("train_tokens"), "train_steps": speed.get("train_steps", 3)}


def speed_arm(cfg: DictConfig, entry: Entry, common: dict) -> Arm:
    """Decoding and training figures of the language-modelling shape, freshly initialised: speed
    does not depend on the weights, and the trained model's context may be shorter than the
    contexts measured."""
    name = f"speed-{entry.name}"
    run_cfg = language_config(cfg, entry, as_list("lm.lr", cfg.lm.lr)[0], 0, common, name)
    check_run(name, run_cfg, recall=False)
    speed = speed_settings(cfg.speed)
    shape = OmegaConf.to_container(run_cfg, resolve=True)
    settings = {"model": shape["model"], "attn": shape["attn"], "vocab_size": run_cfg.data.vocab_size, "speed": speed}
    return Arm(name, settings, lambda resume=False, c=run_cfg: speed_figures(c, speed),
               labels={"task": "speed", "kind": entry.name})


def resumed(run_cfg: DictConfig, resume: bool) -> DictConfig:
    """The arm's run, continuing from its last.ckpt when the engine says it was interrupted."""
    return OmegaConf.merge(run_cfg, {"resume": True}) if resume else run_cfg


# Every arm trains in float32: `precision: auto` follows the machine (bf16-mixed on a GPU or on a CPU with
# bf16 instructions), and one study's numbers must not depend on which machine ran which arm.
ARM_PRECISION = "32-true"


def _trainer(steps: int, val_every: int, val_batches: int | None) -> dict:
    return {"max_steps": steps, "val_every_n_steps": val_every, "progress_bar": False, "precision": ARM_PRECISION,
            **({"limit_val_batches": val_batches} if val_batches else {})}


def check_run(name: str, run_cfg: DictConfig, recall: bool) -> None:
    """The errors training would meet, raised now, naming the arm."""
    try:
        model_config_from(run_cfg, run_cfg.data.vocab_size)
        if recall:
            d = run_cfg.data
            RecallTask(vocab_size=d.vocab_size, seq_len=d.seq_len, pairs=d.pairs, examples=d.examples,
                       val_examples=d.val_examples, seed=d.seed, filler=d.filler, query_power=d.query_power)
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from None


# ---------------------------------------------------------------------------- measuring


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
    return training_figures(train(run_cfg))


def training_figures(result: dict) -> dict:
    return {"steps": result["steps"], "val_loss": result["val_loss"], "val_accuracy": result["val_accuracy"],
            "train_seconds": result["train_seconds"], "train_tokens_per_s": result["train_tokens_per_s"],
            "history": result["val_history"]}


def language_run(run_cfg: DictConfig) -> dict:
    """Train, then loss and bits per byte over the whole validation split and the parameter count."""
    result = train(run_cfg)
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
    params = Transformer(model_config_from(run_cfg, vocab_size)).num_params()
    return {"params": params, "decode": decode, "decode_left_out": [list(r) for r in left_out], "train": training}


def fresh_model(run_cfg: DictConfig, vocab_size: int, context: int) -> Transformer:
    """The run's shape, its context stretched to `context`, freshly initialised with seed 0."""
    long = OmegaConf.merge(run_cfg, {"model": {"max_seq_len": context}})
    torch.manual_seed(0)
    return Transformer(model_config_from(long, vocab_size))


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


def describe(r: dict) -> str:
    if "diverged" in r:
        return f"{r['task']:<5} {r['kind']:<14} lr={r['lr']:<7g} seed={r['seed']:<2} diverged"
    if r["task"] == "mqar":
        return (f"mqar  {r['kind']:<14} d={r['width']:<4} pairs={r['pairs']:<3} lr={r['lr']:<7g} seed={r['seed']:<2} "
                f"accuracy {r['val_accuracy']:.3f} after {r['steps']} steps")
    if r["task"] == "lm":
        return (f"lm    {r['kind']:<14} lr={r['lr']:<7g} seed={r['seed']:<2} val loss {r['eval_loss']:.3f}, "
                f"{r['bits_per_byte']:.3f} bits/byte, train {r['train_tokens_per_s']:.0f} tok/s")
    speeds = ", ".join(f"{d['tokens_per_s']:.0f} tok/s at {d['context']} x {d.get('batch', 1)}" for d in r["decode"])
    training = ", ".join(f"{t['tokens_per_s']:.0f} tok/s at {t['context']}" for t in r.get("train", []))
    return f"speed {r['kind']:<14} decode {speeds}" + (f"; train {training}" if training else "")


# ---------------------------------------------------------------------------- the study


def table_entry(labels: dict) -> tuple:
    """The entry of the tables an arm counts towards: a recall cell (every rate and seed of one
    width x pairs), a kind's language modelling (every rate and seed), a kind's speed."""
    return labels["task"], labels["kind"], labels.get("width"), labels.get("pairs")


def reported_records(arms: list[Arm], records: Path) -> tuple[list[dict], list[dict], list[str]]:
    """`report_only=true`: the finished records of the entries whose every arm has finished, those of
    the entries still waiting for an arm, and the names of the arms not finished. An entry with an
    arm missing is left out of the tables whole: a best rate chosen among the rates that happen to
    have run, or a mean over one seed of two, would be a number the finished study might not show."""
    done, unfinished = finished_records(arms, records)
    incomplete = {table_entry(arm.labels) for arm in unfinished}
    shown = [r for r in done if table_entry(r) not in incomplete]
    waiting = [r for r in done if table_entry(r) in incomplete]
    if unfinished:
        print(f"report_only: {len(done)} of {len(arms)} arms have finished; {len(incomplete)} table entries wait for "
              f"the other {len(unfinished)} and are left out (results.json names them)", flush=True)
    else:
        print(f"report_only: all {len(arms)} arms have finished", flush=True)
    return shown, waiting, [arm.name for arm in unfinished]


def run_study(cfg: DictConfig) -> dict | None:
    """What scripts/compare.py runs: every arm (reusing finished ones; as jobs of the chosen Hydra
    launcher, lm.studies.jobs), then the outputs. `arm=<i>` runs that arm alone, as a job does,
    and writes no report (None); `report_only=true` runs no arm and reports the finished ones."""
    started = time.perf_counter()
    arms = plan(cfg)
    out = resolve_path(cfg.out)
    if cfg.get("arm") is not None:
        run_arms(arms, out / "records", describe, only=only_arm(arms, cfg.arm))
        return None
    if cfg.get("records_from") is not None:  # before any job starts: the jobs then find the records done
        print(import_records(arms, out / "records", resolve_path(cfg.records_from),
                             times_this_machine=lambda arm: arm.labels["task"] == "speed"), flush=True)
    unfinished = waiting = None
    if cfg.get("report_only"):
        records, waiting, unfinished = reported_records(arms, out / "records")
    else:
        launcher = chosen_launcher()
        if launcher is not None:
            run_as_jobs(arms, out / "records", launcher)
        records = run_arms(arms, out / "records", describe)
    settings = OmegaConf.to_container(cfg, resolve=True)
    for key, default in (("contexts", 1), ("batches", 1), ("train_contexts", [])):
        settings["speed"][key] = as_list(f"speed.{key}", settings["speed"].get(key, default))
    results = {"machine": machine(), "seconds": round(time.perf_counter() - started, 1),
               "settings": settings, "records": records}
    if unfinished:  # report_only with arms left to run (once all have, the report is the finished study's);
        # the finished arms of waiting entries are kept too, so records_from can continue from this file
        results["unfinished"] = {"planned": len(arms), "arms": unfinished}
        results["waiting"] = waiting
    write_results(out, results, comparison_table(results),
                  {"mqar_accuracy.png": mqar_plot, "lm_loss.png": lm_loss_plot})
    return results
