"""`scripts/bench.py recipe`: training recipes side by side, measured as time to a held-out score.

    python scripts/bench.py recipe                        # the AdamW recipe (lm.config.train.ADAMW_RECIPE) vs today's
    python scripts/bench.py recipe --a "optim=adamw" --b ""                    # one change against today's default
    python scripts/bench.py recipe --recipe "muon=" --recipe "adamw=optim=adamw" --recipe "relu2=model.mlp=relu2"

Each contender is a training run composed from conf/train.yaml with its own overrides (any Hydra
overrides: optimizer, schedule, model shape, batch, vocabulary ...), built from the pieces `train(run)`
uses: the data module, the model config, LitLM's optimizer and schedule, gradient clipping and the
precision `trainer.precision` resolves to. They take turns, one optimizer step each, so load from
elsewhere on the machine slows all alike. Every `--eval-every` training tokens a contender's model
is scored on held-out text, the validation split of data=pystdlib_tests (the standard library's test
suites, which data=pystdlib never trains on), in **bits per byte**, which does not depend on the
tokenizer, so recipes with different vocabularies compare. Scoring is not counted in a contender's
seconds. The report gives, for each target bits per byte (by default the first contender's scores
at half, three quarters and all of its run), the tokens and seconds each contender took to reach it
(the first evaluation at or below it) and the first contender's seconds over each other's, with a
plot of bits per byte against tokens and against seconds.
"""

from __future__ import annotations

import itertools
import math
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lm.config.train import ADAMW_RECIPE

BASELINE = " ".join(ADAMW_RECIPE)  # the recipe before today's defaults: tiny model, AdamW, cosine
CANDIDATE = ""  # today's default recipe: conf/train.yaml as it is
REPORT_KEYS = ("target", "seconds_ratio")  # a target's row holds these beside each recipe's name


def compose(name: str, overrides: list[str]):
    """conf/train.yaml with the overrides; one that does not compose is one line naming the recipe."""
    from hydra.errors import HydraException

    from lm.config.compose import compose_train
    from lm.util.errors import ConfigError

    try:
        return compose_train(overrides)
    except HydraException as e:
        raise ConfigError(f"--{name} {' '.join(overrides)!r}: {str(e).strip().splitlines()[0]}") from None


@dataclass
class Contender:
    """One recipe's run: its model, optimizer and data, and what it has done so far."""

    name: str
    overrides: list[str]
    max_steps: int = 0
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    curve: list[dict] = field(default_factory=list)  # {tokens, seconds, bits_per_byte} per evaluation

    def configure(self) -> Contender:
        """The run's config, composed and checked: both recipes are, before either builds anything."""
        from lm.config.train import TrainRun
        from lm.training.settings import check_run_settings

        self.cfg = TrainRun.from_config(compose(self.name, self.overrides))
        check_run_settings(self.cfg)
        self.max_steps = self.cfg.trainer.max_steps
        return self

    def build(self, held_out: list[str] | int) -> Contender:
        """The data, model, optimizer and schedule; `held_out` is the documents every evaluation scores,
        or a token count choosing them (the first contender's) with this tokenizer."""
        from lm.data.modules import make_data_module
        from lm.evaluation.perplexity import token_stream
        from lm.model.transformer import Transformer
        from lm.training.module import LitLM
        from lm.training.scoring import Scorer
        from lm.training.settings import model_config_from
        from lm.training.setup import pick_precision

        cfg = self.cfg
        data = make_data_module(cfg.data, cfg.model.max_seq_len, cfg.seed)
        data.prepare_data()
        data.setup("fit")
        torch.manual_seed(cfg.seed)
        self.model = Transformer(model_config_from(cfg.model, cfg.attn, data.tokenizer.get_vocab_size())).train()
        self.scorer = Scorer(self.model, cfg.loss_chunk, cfg.compile)
        module = LitLM(self.model, cfg.optim, total_steps=self.max_steps)
        optimizers = module.configure_optimizers()
        self.optimizer, self.schedule = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
        self.clip = cfg.trainer.gradient_clip_val
        self.precision = pick_precision(cfg.trainer)
        self.batches = itertools.chain.from_iterable(iter(data.train_dataloader()) for _ in itertools.count())
        self.documents = held_out if isinstance(held_out, list) else held_out_documents(data.tokenizer, held_out)
        self.held_out = token_stream(iter(self.documents), data.tokenizer)
        return self

    @property
    def done(self) -> bool:
        return self.steps >= self.max_steps

    def autocast(self):
        dtype = torch.bfloat16 if self.precision.startswith("bf16") else None
        return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)

    def step(self) -> None:
        """One optimizer step, as training takes it: the batch, forward and loss, backward, clipping,
        the optimizer and the schedule; its seconds counted."""
        from lm.training.scoring import next_token_loss

        started = time.perf_counter()
        batch = next(self.batches)  # (B, T + 1)
        with self.autocast():
            loss, _ = next_token_loss(self.scorer, batch)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not math.isfinite(float(loss.detach())):
            raise ValueError(f"{self.name}: the loss is {float(loss.detach())} at step {self.steps + 1}")
        self.seconds += time.perf_counter() - started
        self.steps += 1
        self.tokens += batch[:, 1:].numel()

    def evaluate(self) -> float:
        from lm.evaluation.perplexity import score

        self.model.eval()
        with self.autocast():
            bpb = score(self.model, *self.held_out, progress=False).bits_per_byte
        self.model.train()
        self.curve.append({"steps": self.steps, "tokens": self.tokens, "seconds": self.seconds,
                           "bits_per_byte": bpb})
        return bpb

    def reached(self, target: float) -> dict | None:
        """The first evaluation at or below `target` bits per byte."""
        return next((point for point in self.curve if point["bits_per_byte"] <= target), None)


def held_out_documents(tokenizer, tokens: int) -> list[str]:
    """The first whole documents of data=pystdlib_tests' validation split that hold at least `tokens`
    tokens of `tokenizer`: chosen once, with the first recipe's tokenizer, so that every recipe is
    scored on the same bytes whatever its vocabulary."""
    from lm.config.compose import compose_train
    from lm.data.corpora import build_corpus
    from lm.evaluation.perplexity import split_documents

    data_cfg = compose_train(["data=pystdlib_tests"]).data
    texts, count = [], 0
    for text in split_documents(build_corpus(data_cfg), "val", float(data_cfg.val_fraction)):
        texts.append(text)
        count += len(tokenizer.encode(text).ids)
        if count >= tokens:
            break
    return texts


def named_recipes(args) -> list[tuple[str, str]]:
    """(name, overrides) of each contender: the --recipe NAME=OVERRIDES given, or a and b."""
    from lm.util.errors import ConfigError

    if not args.recipe:
        return [("a", BASELINE if args.a is None else args.a), ("b", CANDIDATE if args.b is None else args.b)]
    if args.a is not None or args.b is not None:
        raise ConfigError("give --recipe NAME=OVERRIDES for every recipe, or --a and --b, not both")
    recipes = []
    for given in args.recipe:
        name, equals, overrides = given.partition("=")
        if not equals or not name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"--recipe {given!r} is not NAME=OVERRIDES (a name of letters, digits, - and _)")
        if name in REPORT_KEYS:
            raise ConfigError(f"--recipe {given!r}: {name} names a column of the report; choose another name")
        recipes.append((name, overrides))
    names = [name for name, _ in recipes]
    if len(recipes) < 2 or len(set(names)) < len(names):
        raise ConfigError(f"--recipe names {names}: give two or more, each name once")
    return recipes


def bench_recipe(args) -> dict:
    """Trains the contenders in turns; prints the time to each target and returns every figure (--json)."""
    contenders = [Contender(name, shlex.split(overrides)).configure() for name, overrides in named_recipes(args)]
    held_out = args.held_out_tokens
    for c in contenders:
        print(f"{c.name}: {' '.join(c.overrides) or '(the default recipe)'}")
        held_out = c.build(held_out).documents
    print(f"held-out: {contenders[0].held_out[2]:,} bytes of data=pystdlib_tests' validation split; "
          f"an evaluation every {args.eval_every:,} training tokens; precision {contenders[0].precision}")
    marks = {c.name: args.eval_every for c in contenders}
    for c in contenders:
        c.evaluate()
    while not all(c.done for c in contenders):
        for c in contenders:  # one step each, in turn
            if c.done:
                continue
            c.step()
            if c.tokens >= marks[c.name] or c.done:
                bpb = c.evaluate()
                marks[c.name] = (c.tokens // args.eval_every + 1) * args.eval_every
                print(f"{c.name} step {c.steps:>5}/{c.max_steps}  {c.tokens:>11,} tokens  {c.seconds:8.1f} s  "
                      f"held-out {bpb:.4f} bits per byte", flush=True)
    targets = args.targets or default_targets(contenders[0])
    rows = [time_to(target, contenders) for target in targets]
    print_report(contenders, rows)
    if args.out:
        plot(contenders, Path(args.out))
    return {"contenders": {c.name: {"overrides": c.overrides, "steps": c.steps, "tokens": c.tokens,
                                    "seconds": c.seconds, "held_out_bytes": c.held_out[2], "curve": c.curve}
                           for c in contenders},
            "targets": rows}


def default_targets(baseline: Contender) -> list[float]:
    """The baseline's scores at half, three quarters and all of its run."""
    curve = baseline.curve[1:]  # after step 0
    picks = {curve[max(0, math.ceil(len(curve) * f) - 1)]["bits_per_byte"] for f in (0.5, 0.75, 1.0)}
    return sorted(picks, reverse=True)


def time_to(target: float, contenders: list[Contender]) -> dict:
    """Each contender's tokens and seconds to `target` (None: not reached) and, for every contender
    after the first, the first's seconds over its own (`seconds_ratio`; None where either did not
    reach it or took no time)."""
    row = {"target": target}
    for c in contenders:
        point = c.reached(target)
        row[c.name] = None if point is None else {"tokens": point["tokens"], "seconds": point["seconds"]}
    first = row[contenders[0].name]
    row["seconds_ratio"] = {c.name: first["seconds"] / row[c.name]["seconds"]
                            if first and row[c.name] and row[c.name]["seconds"] > 0 else None
                            for c in contenders[1:]}
    return row


def print_report(contenders: list[Contender], rows: list[dict]) -> None:
    first = contenders[0].name
    print(f"\n{'recipe':<16} {'final bpb':>9} {'tokens':>11} {'seconds':>8} {'s/step':>7}  overrides")
    for c in contenders:
        print(f"{c.name:<16} {c.curve[-1]['bits_per_byte']:>9.4f} {c.tokens:>11,} {c.seconds:>8.1f} "
              f"{c.seconds / max(c.steps, 1):>7.3f}  {' '.join(c.overrides) or '(the default recipe)'}")
    for r in rows:
        print(f"\nto {r['target']:.4f} bits per byte:  {'tokens':>11} {'seconds':>8} {first + '/it time':>14}")
        for c in contenders:
            reached, ratio = r[c.name], r["seconds_ratio"].get(c.name)
            tokens, seconds = ((f"{reached['tokens']:,}", f"{reached['seconds']:.1f}") if reached
                               else ("not reached", ""))
            print(f"  {c.name:<28} {tokens:>11} {seconds:>8} {f'{ratio:.2f}x' if ratio else '-':>14}")


def plot(contenders: list[Contender], folder: Path) -> None:
    """recipe.png: held-out bits per byte against training tokens and against training seconds."""
    from lm.studies.plotting import line_style, pyplot, save_figure
    from lm.util.files import make_folder

    make_folder(folder)
    plt = pyplot()
    figure, (by_tokens, by_seconds) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, c in enumerate(contenders):
        label = c.name  # its overrides are in the printed report and the JSON: too long for a legend
        curve = c.curve[1:]  # step 0's score (the vocabulary's size, in bits) would flatten the rest
        by_tokens.plot([p["tokens"] for p in curve], [p["bits_per_byte"] for p in curve], label=label,
                       **line_style(i))
        by_seconds.plot([p["seconds"] for p in curve], [p["bits_per_byte"] for p in curve], label=label,
                        **line_style(i))
    by_tokens.set_xlabel("training tokens")
    by_seconds.set_xlabel("training seconds (scoring excluded)")
    for axis in (by_tokens, by_seconds):
        axis.set_ylabel("held-out bits per byte (pystdlib_tests val)")
    by_seconds.legend()
    save_figure(figure, folder / "recipe.png")
    print(f"wrote {folder / 'recipe.png'}")


__all__ = ["BASELINE", "CANDIDATE", "bench_recipe"]
