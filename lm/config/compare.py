"""scripts/compare.py's settings: each one's default, meaning and bound, declared once here.

The defaults are the study's default preset: every cell with a learning-rate sweep and 2 seeds,
about 40-45 hours on a 2-core CPU for its 16 kinds, about 32 of them the cell of 32 pairs in 256
tokens (docs/studies.md, "What the default preset costs"); `frontier` is the recall-memory
frontier's (preset=frontier: its 114 arms took 18.4 CPU-hours, about 9.2 hours at two jobs).
conf/compare.yaml composes them (`compare_settings`) with the `data` group (the language-modelling
corpus) and a preset (conf/preset/: default, quick, zoology, frontier) on top; its --help lists
them. lm.studies.compare_settings checks them before any arm is planned, with what no single
setting's bound can say: the settings of the `data` group, `mqar.seq_len` against `mqar.pairs`,
`speed.contexts` against `speed.new_tokens`, and the MQAR fillers lm.data.mqar writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lm.config.data import DataSettings, data_source
from lm.config.settings import plain, store
from lm.data.recall_task import FILLERS
from lm.util.checks import as_list, require_int
from lm.util.errors import ConfigError
from lm.util.settings import (
    Bound,
    Checked,
    boolean,
    built,
    choice,
    each,
    fraction,
    group,
    integer,
    number,
    positive,
    required_group,
    setting,
)

# recall, language modelling, decoding speed and cache size, then recall against state size, in the study's order
TASKS = ("mqar", "lm", "speed", "frontier")
DEFAULT_TASKS = ("mqar", "lm", "speed")  # the frontier is a study of its own: preset=frontier
BLOCKS = ("based", "transformer")  # frontier.block
KNOB_MODEL_KEYS = ("width", "n_layer", "n_head")  # a knob that is not one of these (or n_kv_head) is an attn option


def learning_rates() -> Bound:
    """One learning rate or a sweep of them, each run as arms of its own: a rate named twice would
    be the same arm twice."""
    each_positive = each(positive())

    def check(name: str, value: Any) -> None:
        each_positive(name, value)
        rates = as_list(name, value)
        if len(set(rates)) < len(rates):
            raise ConfigError(f"{name}={rates} names a learning rate more than once")

    return Bound("a positive number, or a list of different ones", check)


def check_arm(name: str, value: Any) -> None:
    """An index or a name; which arms the plan holds is checked once it is made (lm.studies.jobs.only_arm)."""
    if isinstance(value, str) and value:
        return
    require_int(name, value, minimum=0)


def check_counts(name: str, value: Any) -> None:
    for count in as_list(name, value):
        require_int(f"{name} entry", count)


def recall_cells() -> Bound:
    """A list of [seq_len, pairs]: MQAR tasks, each a sequence length and a number of key-value pairs."""

    def check(name: str, value: Any) -> None:
        cells = as_list(name, value)
        if not cells:
            raise ConfigError(f"{name}=[] is empty: give at least one [seq_len, pairs]")
        for cell in cells:
            if isinstance(cell, (str, int, float, bool)) or len(as_list(name, cell)) != 2 or any(
                    isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in cell):
                raise ConfigError(f"{name} entry {_plain(cell)!r} must be [seq_len, pairs], two integers >= 1")
        if len({tuple(c) for c in cells}) < len(cells):
            raise ConfigError(f"{name}={[_plain(c) for c in cells]} names a [seq_len, pairs] more than once")

    return Bound("a list of [seq_len, pairs]", check)


def knob_table() -> Bound:
    """kind -> a list of state sizes, each {knob: value}: lists, so that an override replaces a kind's
    sizes whole (Hydra merges mappings key by key, which would mix two tables). Which kinds and
    options exist is checked by the study (lm.studies.frontier), which knows the registry."""

    def check(name: str, value: Any) -> None:
        if value is None:
            return
        if not hasattr(value, "items"):
            raise ConfigError(f"{name}={value!r} must be a mapping: {{<kind>: [{{<knob>: <value>}}, ...]}}")
        for kind, points in value.items():
            if isinstance(points, (str, int, float, bool)) or hasattr(points, "items") or not points:
                raise ConfigError(f"{name}.{kind}={_plain(points)!r} must be a list of state sizes, e.g. "
                                  "[{window: 8}, {window: 16}]")
            for point in points:
                if not hasattr(point, "items") or not point:
                    raise ConfigError(f"{name}.{kind} entry {_plain(point)!r} must be a mapping of knobs, e.g. "
                                      "{window: 8}")

    return Bound("a mapping kind -> [{knob: value}, ...]", check)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _plain(value: Any) -> Any:
    """A config node as plain data, for an error message."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value) if hasattr(value, "_is_missing") else value


@dataclass(kw_only=True)
class RecallSettings(Checked):
    """Zoology's recall task (lm/data/mqar.py) with the recipe that learns on a CPU budget."""

    # Zoology: recurrent kinds need a wider model (a bigger state) to recall as well.
    widths: list[int] = setting(help="model widths, one cell each", bound=each(integer()), factory=lambda: [64, 128])
    # 32 pairs in 256 tokens: where Zoology's designs separate (every kind recalls 4 and 8 pairs in 64 tokens).
    pairs: list[int] = setting(help="key-value pairs per example, one cell each", bound=each(integer()),
                               factory=lambda: [4, 8, 32])
    seq_len: int | list[int] = setting(help="one sequence length, or one per entry of pairs (Zoology's Figure 2 "
                                            "grows the sequence with the pairs)", bound=each(integer()),
                                       factory=lambda: [64, 64, 256])
    vocab_size: int = setting(256, "keys 1..127, values 128..255 at 256 (Zoology: 8192; preset=zoology)", integer())
    filler: str = setting("pad", "the query region between the queries: pad (token 0, Zoology's Figure 2) or "
                                 "random tokens")
    query_power: float = setting(0.01, "a of the power law placing the queries, most of them close to the pairs; "
                                       "1: uniform", number(0, 1, open_low=True))
    n_layer: int = setting(2, "layers", integer())
    n_head: int = setting(4, "heads", integer())
    ff_mult: int = setting(3, "d_ff = ff_mult x width", integer())
    # Without the convolution softmax attention stays on the 1/pairs plateau at this budget (docs/studies.md).
    short_conv: int = setting(4, "taps of the causal convolution before every attention layer, every kind alike "
                                 "(0: none)", integer(0))
    steps: int = setting(1000, "training steps at most: a cell stops once it passes stop_at_accuracy", integer())
    stop_at_accuracy: float | None = setting(0.99, "a cell stops once its held-out accuracy passes it; null: "
                                                          "every cell runs all its steps", fraction(nullable=True))
    val_every: int = setting(100, "steps between held-out accuracies", integer())
    batch_size: int = setting(64, "examples per step", integer())
    # A model memorises a small set and stays on the plateau: fresh examples until it could have solved the task.
    examples: int | None = setting(None, "training examples; null: steps x batch_size fresh ones, none seen twice",
                                   integer(nullable=True))
    val_examples: int = setting(1000, "held-out examples", integer())
    # 1e-3 was never the best for softmax and ran every step of its cells (docs/studies.md).
    lr: float | list[float] = setting(help="swept per cell: every rate recorded, the best reported",
                                      bound=learning_rates(), factory=lambda: [0.003, 0.01, 0.03])
    warmup_steps: int = setting(50, "linear warm-up steps", integer(0))


@dataclass(kw_only=True)
class ModelShape(Checked):
    """The language-modelling model, the same for every kind (ModelConfig checks it)."""

    n_layer: int = setting(2, "layers")
    d_model: int = setting(128, "width")
    n_head: int = setting(4, "heads")
    d_ff: int = setting(384, "the MLP's hidden width")
    max_seq_len: int = setting(256, "the training context")


@dataclass(kw_only=True)
class LanguageSettings(Checked):
    """Language modelling on the `data` corpus: 1250 x 16 x 256 = 5.12M training tokens per kind and seed."""

    model: ModelShape = group(ModelShape, "the model's shape, every kind alike")
    steps: int = setting(1250, "training steps", integer())
    val_every: int = setting(125, "steps between validations", integer())
    val_batches: int | None = setting(10, "batches per validation; null: the whole split", integer(nullable=True))
    batch_size: int = setting(16, "sequences per step", integer())
    lr: float | list[float] = setting(0.002, "one rate, or a list swept as mqar.lr is", learning_rates())
    warmup_steps: int = setting(100, "linear warm-up steps", integer(0))


@dataclass(kw_only=True)
class SpeedSettings(Checked):
    """Decoding and training speed of the language-modelling shape, freshly initialised."""

    contexts: list[int] = setting(help="decode tokens/s and cache bytes at these context lengths (each above "
                                       "new_tokens)", bound=each(integer()), factory=lambda: [1024, 8192, 32768])
    batches: list[int] = setting(help="and at these batch sizes (the same prompt in every row)",
                                 bound=each(integer()), factory=lambda: [1, 16])
    max_batch_tokens: int | None = setting(131072, "rows of batch x context above it are left out (16 x 32k: 16 "
                                                   "prefills of 32k); null: none", integer(nullable=True))
    new_tokens: int = setting(64, "tokens decoded per row (the first step is not timed)", integer(3))
    # It won or tied eager at every row measured on the 2-core CPU (docs/studies.md).
    compile: bool = setting(True, "the decoding step through torch.compile", boolean())
    train_contexts: list[int] = setting(help="training tokens/s at these sequence lengths ([]: none)",
                                        bound=each(integer(), at_least_one=False), factory=lambda: [256, 4096])
    train_tokens: int = setting(16384, "tokens per timed training step: batch = train_tokens / context", integer())
    train_steps: int = setting(3, "timed training steps (the median), after one untimed", integer())


def based_train_mix() -> list[list[int]]:
    return [[64, 4], [128, 8], [256, 16], [256, 32], [256, 64]]


def along(knob: str, values: list, **fixed: Any) -> list[dict]:
    """State sizes along one knob, other knobs fixed: along("window", [8, 16]) -> [{window: 8}, {window: 16}]."""
    return [{**fixed, knob: value} for value in values]


def default_knobs() -> dict:
    """Each registered kind's knob along which its decoding state grows (a kind named nowhere here
    sweeps the model width, frontier.widths; a preset adds the knobs of its extra_kinds). n_head at
    a fixed width sets the head size: linear attention's features (elu: hs; Taylor: 1 + hs + hs^2),
    the delta rule's hs x hs state per head."""
    return {"mha": along("width", [64, 128, 256]), "mqa": along("width", [64, 128, 256]),
            # its 2 K/V heads of 4 at each width: 1 and 4 would be MQA and MHA again
            "gqa": along("width", [64, 128, 256]),
            "sliding": along("window", [8, 16, 32, 64, 128]),
            "linear": along("n_head", [16, 8, 4]),
            "lowrank": along("rank", [2, 4, 8, 16]),
            # head size 8, 16, 32 at width 64; 16 heads of 4 cost a training step 4-7x MHA's on a CPU
            "gated_delta": along("n_head", [8, 4, 2]), "kda": along("n_head", [8, 4, 2]),
            "mamba2": along("d_state", [8, 16, 32, 64]), "mla": along("kv_rank", [8, 16, 32, 64]),
            # DSA caches every position (MLA's latent plus the indexer's key) whatever top_k: its points
            # share their state bytes and differ in the positions each query reads
            "dsa": along("top_k", [4, 8, 16, 32])}


FRONTIER_SCHEDULES = ("constant", "cosine")
RATES_AT = ("grid", "every", "middle")


@dataclass(kw_only=True)
class FrontierSettings(Checked):
    """Recall against decoding-state size (Based's Figure 2, Arora et al. 2024, arXiv 2402.18668;
    HazyResearch/zoology experiments/arxiv24_based_figure2): every arm trains on the whole mix, is
    tested at each test cell, and records its state bytes at each test length from its own
    generation cache. The defaults are the paper's; preset=frontier sizes them for a CPU."""

    train: list[list[int]] = setting(help="[seq_len, pairs] trained together in every arm (Based's mix)",
                                     bound=recall_cells(), factory=based_train_mix)
    test: list[list[int]] = setting(help="[seq_len, pairs] each tested after training, one panel each",
                                    bound=recall_cells(),
                                    factory=lambda: [*based_train_mix(), [512, 128], [1024, 256]])
    vocab_size: int = setting(8192, "keys in the lower half, values in the upper", integer())
    filler: str = setting("random", "the query region between the queries: random tokens 1..vocab_size-1, keys and "
                                    "values among them as decoys (Based's Figure 2: zoology's random_non_queries), "
                                    "or pad (token 0)", choice(FILLERS))
    knobs: dict[str, Any] | None = setting(help="kind -> [{knob: value}, ...]: its state sizes; a knob is width, "
                                                "n_layer, n_head, n_kv_head or an attn option",
                                           bound=knob_table(), factory=default_knobs)
    widths: list[int] = setting(help="the state sizes of a kind frontier.knobs does not name: model widths",
                                bound=each(integer()), factory=lambda: [64, 128, 256])
    width: int = setting(128, "the model width where a kind's knob is not the width", integer())
    n_layer: int = setting(2, "layers, where a kind's knob does not set them", integer())
    n_head: int = setting(4, "heads, where a kind's knob does not set them (Based: 1; MQA and GQA need several)",
                          integer())
    block: str = setting("based", "based: Based's block, each mixer layer after a gated short convolution layer "
                                  "(attn=baseconv, frontier.short_conv taps) and no MLP; transformer: each layer "
                                  "the mixer and an MLP of ff_mult x width, after model.short_conv",
                         choice(BLOCKS))
    ff_mult: int = setting(3, "d_ff = ff_mult x width, with frontier.block=transformer", integer())
    short_conv: int = setting(3, "taps of the short convolution before every mixer layer (Based: 3); 0: none, "
                                 "with frontier.block=transformer", integer(0))
    steps: int = setting(22500, "each arm's cap of training steps (Based: 32 epochs of its 180k examples at batch "
                                "256); raised under schedule=constant, the arms that ran to the old cap continue",
                         integer())
    stop_at_accuracy: float | None = setting(0.99, "an arm stops once its held-out accuracy on the mix passes it; "
                                                   "null: every arm runs all its steps", fraction(nullable=True))
    val_every: int = setting(500, "steps between held-out accuracies on the mix", integer())
    still_learning: float = setting(0.01, "an arm that ran every step and whose last held-out accuracy rose by "
                                          "more than this over the one before is marked stopped by the budget, "
                                          "not converged", number(0))
    plateau: float = setting(0.05, "an arm that ran every step and ended at most this accuracy on the mix is marked "
                                   "still on MQAR's plateau (it is learnt in a jump), not a measured limit",
                             fraction())
    batch_size: int = setting(256, "examples per step, the mix shuffled together", integer())
    train_examples: list[int] | None = setting(help="training examples of each frontier.train cell, in its order "
                                                    "(Based: 100k at 64 / 4 pairs, 20k at each other); null: "
                                                    "frontier.examples shared equally",
                                               bound=Bound("null or a list of integers >= 1", check_counts,
                                                           nullable=True),
                                               factory=lambda: [100000, 20000, 20000, 20000, 20000])
    examples: int | None = setting(180000, "training examples shared equally by the mix's cells, where "
                                           "frontier.train_examples is null; null: steps x batch_size fresh ones",
                                   integer(nullable=True))
    val_examples: int = setting(1000, "held-out examples of the mix, validated during training", integer())
    test_examples: int = setting(1000, "examples per test cell", integer())
    lr: float | list[float] = setting(help="swept per point: every rate recorded, the best on the mix reported "
                                           "(Based: logspace(-3, -1.5, 4))", bound=learning_rates(),
                                      factory=lambda: [0.001, 0.00316, 0.01, 0.0316])
    warmup_steps: int = setting(500, "linear warm-up steps", integer(0))
    schedule: str = setting("constant", "the rate after warm-up: constant (held to the last step, so a higher "
                                        "frontier.steps continues each arm that ran to the old one from its "
                                        "checkpoint, the same run made longer) or cosine (to optim.min_lr_ratio at "
                                        "frontier.steps; zoology anneals with cosine to 0 over its epochs)",
                            choice(FRONTIER_SCHEDULES))
    rates_at: str = setting("grid", "grid: every frontier.lr rate at every state size on every seed (Based's sweep); "
                                    "or a search on the first seed, the other seeds then at its best rate: every "
                                    "(the grid at each state size) or middle (the grid at each kind's middle state "
                                    "size, and at its others the best rate there with its grid neighbours, once "
                                    "that has finished); a search's best rate at an edge of the rates it ran adds "
                                    "one step past it", choice(RATES_AT))


def default_extra_kinds() -> list[dict]:
    return [{"name": "mha-gated-qk-norm", "attn": "mha", "gate": "elementwise", "qk_norm": True},  # Qwen3-Next's layer
            {"name": "sliding-softcap", "attn": "sliding", "softcap": 30},  # Gemma 2's cap
            {"name": "linear-taylor", "attn": "linear", "feature_map": "taylor"},  # Based's feature map
            {"name": "sliding-w16", "attn": "sliding", "window": 16}]  # shorter than the recall distance


def default_per_kind() -> dict:
    # Bahdanau's pairwise tanh scores: a training step costs 13x MHA's at width 64, and a 32k prefill or
    # a 4k training step would take minutes (O(T^2 hs) tanh evaluations); its 5.12M-token language-modelling
    # run alone takes about an hour (1.5k tokens/s).
    return {"additive": {"seeds": 1, "mqar": {"widths": [64], "pairs": [4], "seq_len": 64},
                         "speed": {"contexts": [1024, 8192], "max_batch_tokens": 16384, "train_contexts": [256]}}}


@dataclass(kw_only=True)
class CompareSettings(Checked):
    kinds: list[str] | None = setting(None, "attn configs (conf/attn/) and registered kinds; null: mha, mqa, gqa, "
                                            "then every other registered kind at its defaults")
    extra_kinds: list[Any] = setting(help="more, with options: [{name: linear-taylor, attn: linear, "
                                          "feature_map: taylor}]", factory=default_extra_kinds)
    out: str = setting("checkpoints/compare", "results.json, results.md, mqar_accuracy.png, lm_loss.png, records/, "
                                              "runs/")
    tasks: list[str] = setting(help="which parts run: mqar (recall), lm (language modelling), speed (decoding "
                                    "speed and cache size), frontier (recall against state size)",
                               bound=each(choice(TASKS)), factory=lambda: list(DEFAULT_TASKS))
    seed: int = setting(0, "the first seed of every cell; seed=<n> reruns the cells with seeds n, n+1, ...",
                        integer(0))
    seeds: int = setting(2, "seeds per cell: the tables show their mean and spread", integer())
    per_kind: dict[str, Any] | None = setting(help="a kind's own mqar, lm, speed or seeds on top (the tables say "
                                                   "so); null: none", factory=default_per_kind)
    arm: int | str | None = setting(None, "an arm's index or name: run it alone and write its record, as a "
                                          "launcher's job does", Bound("an integer >= 0 or an arm's name",
                                                                       check_arm, nullable=True))
    report_only: bool = setting(False, "run no arm, render the finished ones (a cell shows once all its arms have)",
                                boolean())
    records_from: str | None = setting(None, "a study's results.json (docs/compare/results.json): its finished "
                                             "arms of equal settings are taken instead of run again")
    mqar: RecallSettings = group(RecallSettings, "recall")
    lm: LanguageSettings = group(LanguageSettings, "language modelling")
    speed: SpeedSettings = group(SpeedSettings, "decoding and training speed")
    frontier: FrontierSettings = group(FrontierSettings, "recall against decoding-state size (tasks=[frontier])")


@dataclass(kw_only=True)
class CompareRun(CompareSettings):
    """The whole study, every setting typed and checked: CompareSettings with the language-modelling
    corpus conf/compare.yaml composes beside them. scripts/compare.py builds it once from its command
    line (`from_config`); lm.studies.compare plans and runs it."""

    data: DataSettings = required_group(DataSettings, "the language-modelling corpus (data=<option>)",
                                        choose=data_source)

    @classmethod
    def from_config(cls, cfg: DictConfig | Mapping) -> CompareRun:
        """The study a composed config (or one kind's settings merged onto it) describes: a key the
        study has no setting for, added with `+`, is one line naming what it takes, never ignored."""
        return built(cls, plain(cfg))

    def as_config(self) -> DictConfig:
        """The settings as the struct DictConfig the plan merges each kind's per_kind onto (OmegaConf
        merges, as the command line composes), and the records' `settings` are written from."""
        cfg = OmegaConf.create(dataclasses.asdict(self))
        OmegaConf.set_struct(cfg, True)
        return cfg


store("compare_settings", CompareSettings)

__all__ = ["TASKS", "DEFAULT_TASKS", "KNOB_MODEL_KEYS", "CompareRun", "CompareSettings", "FrontierSettings",
           "LanguageSettings", "ModelShape", "RecallSettings", "SpeedSettings", "learning_rates"]
