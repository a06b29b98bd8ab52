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
`scripts/train.py` would do. Each finished arm leaves a record (with every setting it ran under)
in <out>/records/; a repeated command reuses the records whose settings still match, so an
interrupted study continues where it stopped. Outputs: results.json, results.md, mqar_accuracy.png,
lm_loss.png under `out`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from lm.attention import available_kinds
from lm.data.corpora import build_corpus
from lm.data.mqar import RecallTask
from lm.formats.checkpoint import load
from lm.generation.decode import stream
from lm.model.config import ConfigError
from lm.model.transformer import Transformer
from lm.studies.evaluate import score, split_documents, token_stream
from lm.training.run import model_config_from, train
from lm.util.files import make_folder, write_atomically
from lm.util.paths import resolve_path

PEERS = ["mha", "mqa", "gqa"]  # the softmax kind at three K/V head counts


@dataclass
class Entry:
    """One kind of the study: a name for the tables, the attn config it starts from, options on top."""

    name: str
    attn: str | None  # conf/attn/<attn>.yaml, or None for a registered kind without one
    kind: str | None  # the registered kind when attn is None
    options: dict


@dataclass
class Arm:
    """One training run of the study and everything that defines it."""

    task: str  # "mqar" or "lm"
    entry: Entry
    width: int | None
    pairs: int | None
    cfg: DictConfig  # the composed training config

    @property
    def name(self) -> str:
        if self.task == "mqar":
            return f"mqar-{self.entry.name}-d{self.width}-p{self.pairs}"
        return f"lm-{self.entry.name}"

    def settings(self) -> dict:
        return OmegaConf.to_container(self.cfg, resolve=True)


# ---------------------------------------------------------------------------- the plan


def attn_configs() -> list[str]:
    return sorted(GlobalHydra.instance().config_loader().get_group_options("attn"))


def study_entries(cfg: DictConfig) -> list[Entry]:
    """The kinds to compare: `kinds` (null: MHA, MQA, GQA, then every other registered kind at its
    defaults) followed by `extra_kinds`. A kind registered later joins without an edit here."""
    configs = attn_configs()
    names = list(cfg.kinds) if cfg.kinds is not None else PEERS + [k for k in available_kinds() if k != "softmax"]
    entries = [_entry(name, {}, configs) for name in names]
    for extra in cfg.get("extra_kinds") or []:
        extra = OmegaConf.to_container(extra, resolve=True) if not isinstance(extra, str) else {"attn": extra}
        base = extra.pop("attn", None)
        name = extra.pop("name", None) or base
        if base is None:
            raise ConfigError(f"extra_kinds entry {extra!r} needs attn: <an attn config or a kind>")
        entries.append(_entry(base, extra, configs, name=name))
    seen = [e.name for e in entries]
    duplicates = sorted({n for n in seen if seen.count(n) > 1})
    if duplicates:
        raise ConfigError(f"kinds names {duplicates} more than once")
    return entries


def _entry(base: str, options: dict, configs: list[str], name: str | None = None) -> Entry:
    if not isinstance(base, str):
        raise ConfigError(f"kinds entry {base!r} must be the name of an attn config or a registered kind")
    if base in configs:
        return Entry(name or base, base, None, options)
    if base in available_kinds():
        return Entry(name or base, None, base, options)
    raise ConfigError(f"kinds entry {base!r} is neither an attn config ({', '.join(configs)}) "
                      f"nor a registered kind ({', '.join(available_kinds())})")


def training_config(entry: Entry, task_overrides: list[str], values: dict, data: dict | None = None) -> DictConfig:
    """conf/train.yaml with this entry's attention and the study's settings (`data` replaces the
    data group whole)."""
    attn = f"attn={entry.attn}" if entry.attn else "attn=mha"
    cfg = compose(config_name="train", overrides=[attn, "logger=none", *task_overrides])
    if entry.attn is None:  # a registered kind without a YAML: its spec's defaults, every head its own K/V
        cfg.attn = OmegaConf.create({"name": entry.kind, "kind": entry.kind, "n_kv_head": None})
    if data is not None:
        cfg.data = OmegaConf.create(data)
    return OmegaConf.merge(cfg, values, {"attn": entry.options})


def plan(cfg: DictConfig) -> list[Arm]:
    """Every arm of the study, each checked before any training starts."""
    if cfg.data.get("source") == "mqar":
        raise ConfigError("data=mqar: the study's `data` is the language-modelling corpus (pystdlib, text or hf); "
                          "the recall runs are set under mqar.*")
    for context in cfg.speed.contexts:
        if not isinstance(context, int) or context <= cfg.speed.new_tokens:
            raise ConfigError(f"speed.contexts entry {context!r} must be an integer above "
                              f"speed.new_tokens={cfg.speed.new_tokens}")
    entries = study_entries(cfg)
    out = resolve_path(cfg.out)
    m, lm = cfg.mqar, cfg.lm
    common = {"seed": cfg.seed, "checkpoint_dir": str(out / "runs"), "resume": False,
              "checkpoint": {"every_n_steps": None}, "sample": {"max_new_tokens": 0}}
    arms = []
    for entry in entries:
        for width in m.widths:
            for pairs in m.pairs:
                values = {**common, "run_name": None,
                          "model": {"name": f"mqar-d{width}", "n_layer": m.n_layer, "d_model": width,
                                    "n_head": m.n_head, "d_ff": m.ff_mult * width, "max_seq_len": m.seq_len},
                          "data": {"vocab_size": m.vocab_size, "seq_len": m.seq_len, "pairs": pairs,
                                   "examples": m.examples, "val_examples": m.val_examples, "seed": cfg.seed,
                                   "batch_size": m.batch_size},
                          "optim": {"lr": m.lr, "warmup_steps": m.warmup_steps},
                          "trainer": _trainer(m.steps, m.val_every, None)}
                arms.append(Arm("mqar", entry, width, pairs, training_config(entry, ["data=mqar"], values)))
        values = {**common, "run_name": None, "model": {"name": "compare", **lm.model},
                  "data": {"batch_size": lm.batch_size},
                  "optim": {"lr": lm.lr, "warmup_steps": lm.warmup_steps},
                  "trainer": _trainer(lm.steps, lm.val_every, lm.val_batches)}
        data = OmegaConf.to_container(cfg.data, resolve=True)
        arms.append(Arm("lm", entry, None, None, training_config(entry, [], values, data)))
    for arm in arms:
        arm.cfg.run_name = arm.name
        check_arm(arm)
    return arms


def _trainer(steps: int, val_every: int, val_batches: int | None) -> dict:
    return {"max_steps": steps, "val_every_n_steps": val_every, "progress_bar": False,
            **({"limit_val_batches": val_batches} if val_batches else {})}


def check_arm(arm: Arm) -> None:
    """The errors training would meet, raised now, naming the arm."""
    try:
        vocab = arm.cfg.data.vocab_size
        model_config_from(arm.cfg, vocab)
        if arm.task == "mqar":
            d = arm.cfg.data
            RecallTask(vocab_size=d.vocab_size, seq_len=d.seq_len, pairs=d.pairs, examples=d.examples,
                       val_examples=d.val_examples, seed=d.seed)
    except ValueError as e:
        raise ConfigError(f"{arm.name}: {e}") from None


# ---------------------------------------------------------------------------- running


def run_study(cfg: DictConfig) -> dict:
    started = time.perf_counter()
    arms = plan(cfg)
    out = resolve_path(cfg.out)
    make_folder(out / "records")
    records = []
    quiet_lightning()
    for i, arm in enumerate(arms, 1):
        path = out / "records" / f"{arm.name}.json"
        record, reused = reuse(path, arm), True
        if record is None:
            reused = False
            record = run_arm(arm, cfg)
            write_atomically(path, lambda tmp, r=record: tmp.write_text(json.dumps(r, indent=1) + "\n"))
        records.append(record)
        print(f"[{i:>{len(str(len(arms)))}}/{len(arms)}] {progress_line(record)}"
              + ("  (done before)" if reused else f"  ({record['seconds']:.0f} s)"), flush=True)
    results = {"machine": machine(), "seconds": round(time.perf_counter() - started, 1),
               "settings": OmegaConf.to_container(cfg, resolve=True), "records": records}
    write_outputs(out, results)
    return results


def quiet_lightning() -> None:
    """One progress line per arm: each arm's own messages go to its train.log instead."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)


def reuse(path: Path, arm: Arm) -> dict | None:
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return record if record.get("settings") == arm.settings() else None


def run_arm(arm: Arm, cfg: DictConfig) -> dict:
    started = time.perf_counter()
    run_dir = resolve_path(arm.cfg.checkpoint_dir) / arm.name
    make_folder(run_dir)
    with open(run_dir / "train.log", "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        result = train(arm.cfg)
    record = {"arm": arm.name, "task": arm.task, "kind": arm.entry.name, "width": arm.width, "pairs": arm.pairs,
              "steps": result["steps"], "val_loss": result["val_loss"], "val_accuracy": result["val_accuracy"],
              "train_seconds": result["train_seconds"], "train_tokens_per_s": result["train_tokens_per_s"],
              "history": result["val_history"]}
    if arm.task == "lm":
        record.update(language_figures(result["last"], arm.cfg, cfg))
    record["seconds"] = time.perf_counter() - started
    record["settings"] = arm.settings()
    return record


def language_figures(checkpoint: str, arm_cfg: DictConfig, cfg: DictConfig) -> dict:
    """Loss and bits per byte over the whole validation split, the parameter count, and the speed
    and cache figures of the same shape at each context."""
    model, tokenizer = load(checkpoint)
    texts = split_documents(build_corpus(arm_cfg.data), "val", float(arm_cfg.data.val_fraction))
    result = score(model, *token_stream(texts, tokenizer), progress=False)
    figures = {"params": model.num_params(), "eval_loss": result.loss, "bits_per_byte": result.bits_per_byte,
               "eval_tokens": result.tokens, "decode": []}
    for context in cfg.speed.contexts:
        figures["decode"].append(decode_speed(arm_cfg, model.config.vocab_size, context, cfg.speed.new_tokens))
    return figures


@torch.no_grad()
def decode_speed(arm_cfg: DictConfig, vocab_size: int, context: int, new_tokens: int) -> dict:
    """Greedy decoding of the last `new_tokens` of a `context`-token sequence (batch 1): tokens/s of
    those steps and the cache bytes once all `context` tokens are in."""
    long = OmegaConf.merge(arm_cfg, {"model": {"max_seq_len": context}})
    torch.manual_seed(0)
    model = Transformer(model_config_from(long, vocab_size)).eval()
    prompt = torch.randint(0, vocab_size, (context - new_tokens,)).tolist()
    list(stream(model, [prompt[-64:]], 8))  # warm-up
    run = stream(model, [prompt], new_tokens)
    for _ in run:
        pass
    return {"context": context, "tokens_per_s": run.stats["new_tokens"] / run.stats["decode_s"],
            "prefill_s": run.stats["prefill_s"], "cache_bytes": run.stats["cache_bytes"]}


def progress_line(r: dict) -> str:
    if r["task"] == "mqar":
        return f"mqar {r['kind']:<14} d={r['width']:<4} pairs={r['pairs']:<3} accuracy {r['val_accuracy']:.3f}"
    speeds = ", ".join(f"{d['tokens_per_s']:.0f} tok/s at {d['context']}" for d in r["decode"])
    return (f"lm   {r['kind']:<14} val loss {r['eval_loss']:.3f}, {r['bits_per_byte']:.3f} bits/byte, "
            f"train {r['train_tokens_per_s']:.0f} tok/s, decode {speeds}")


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu, "threads": torch.get_num_threads(), "gpu": gpu, "torch": torch.__version__}


# ---------------------------------------------------------------------------- outputs


def write_outputs(out: Path, results: dict) -> None:
    from lm.studies.report import markdown, plot_lm_loss, plot_mqar

    json_text = json.dumps(results, indent=1) + "\n"
    write_atomically(out / "results.json", lambda tmp: tmp.write_text(json_text))
    table = markdown(results)
    write_atomically(out / "results.md", lambda tmp: tmp.write_text(table))
    plot_mqar(results["records"], out / "mqar_accuracy.png")
    plot_lm_loss(results["records"], out / "lm_loss.png")
    print(table)
    print(f"this command took {results['seconds'] / 60:.1f} min; wrote results.json, results.md, mqar_accuracy.png, "
          f"lm_loss.png under {out}")
