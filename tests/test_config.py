import json
import subprocess
import sys
from pathlib import Path

import pytest

from lm import ConfigError, ModelConfig
from lm.attention import LinearSpec, SlidingSpec, SoftmaxSpec, layer_specs
from lm.attention.mla import LatentSpec

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("fields, message", [
    (dict(n_head=6, n_kv_head=4, d_model=384), "n_head=6 is not divisible by n_kv_head=4"),
    (dict(n_head=5, d_model=384), "d_model=384 is not divisible by n_head=5"),
    (dict(n_head=4, n_kv_head=8, d_model=256), "n_kv_head=8 must not exceed n_head=4"),
    (dict(n_layer=0), "n_layer=0 must be an integer >= 1"),
    (dict(d_model="big"), "d_model='big' must be an integer"),
    (dict(norm_eps=-1.0), "norm_eps=-1.0 must be a positive number"),
    (dict(d_model=12, n_head=4), "head_dim=3 (d_model/n_head) must be even for RoPE"),
    (dict(attention="banana"), "attention kind 'banana' is not known"),
    (dict(attention={"kind": "softmax", "window": 4}), "attention kind 'softmax' does not take option(s) ['window']"),
    (dict(attention={"window": 4}), "must be a mapping with a 'kind'"),
    (dict(attention=42), "attention=42 must be a kind's name, a spec, or one per layer"),
    (dict(n_layer=2, attention=["linear"]), "attention has 1 layers but n_layer=2"),
    (dict(attention_options={"window": 4}), "attention_options is gone"),
    (dict(attention={"kind": "sliding", "window": 0}), "window=0 must be an integer >= 1"),
    (dict(attention={"kind": "sliding", "dilation": 0}), "dilation=0 must be an integer >= 1"),
    (dict(attention={"kind": "linear", "feature_map": "cosine"}), "feature_map='cosine' is not one of"),
    (dict(attention={"kind": "linear", "eps": 0}), "eps=0 must be a positive number"),
    (dict(attention={"kind": "lowrank", "rank": 8, "block": 8}), "rank=8 must be less than block=8"),
    (dict(attention={"kind": "lowrank", "block": 0}), "block=0 must be an integer >= 1"),
    (dict(attention={"kind": "lowrank", "rank": -1}), "rank=-1 must be an integer >= 1"),
    (dict(attention={"kind": "additive", "block": 0}), "block=0 must be an integer >= 1"),
    (dict(attention={"kind": "efficient", "chunk_size": 0}), "chunk_size=0 must be an integer >= 1"),
])
def test_bad_model_config_names_the_field(fields, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**fields)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind, options, every, message", [
    ("sliding", {"window": [4, 8, 16]}, None, "window=[4, 8, 16] has 3 entries but n_layer=2"),
    ([], {}, None, "pattern=[] names no kind: give the first layers' kinds, which repeat over the layers"),
    (["linear", "lstm"], {}, None, "attention kind 'lstm' is not known"),
    ("softmax", {"window": 4}, None, "option(s) ['window'] are taken by no layer's kind (softmax)"),
    (["linear", "softmax"], {"window": 4}, None, "are taken by no layer's kind (linear, softmax)"),
    ("sliding", {"window": [4, 0]}, None, "window=0 must be an integer >= 1"),
    ("sliding", {}, 0, "global_every=0 must be an integer >= 1"),
])
def test_bad_layer_layout_names_the_option(kind, options, every, message):
    with pytest.raises(ConfigError) as err:
        layer_specs(kind, 2, options, every)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_every_way_of_writing_the_attention_gives_one_spec_per_layer():
    sliding = SlidingSpec(window=8)
    assert ModelConfig(n_layer=3, attention=sliding).attention == [sliding] * 3
    assert ModelConfig(n_layer=3, attention="sliding").attention == [SlidingSpec()] * 3
    assert ModelConfig(n_layer=2, attention={"kind": "sliding", "window": 8}).attention == [sliding] * 2
    mixed = ModelConfig(n_layer=2, attention=["linear", {"kind": "sliding", "window": 8}]).attention
    assert mixed == [LinearSpec(), sliding]
    # options apply to the layers whose kind takes them; global_every makes softmax layers
    layers = layer_specs(["linear", "sliding", "sliding", "sliding"], 4, {"window": [1, 2, 3, 4], "chunk_size": 8},
                         global_every=2)
    assert layers == [LinearSpec(chunk_size=8), SoftmaxSpec(), SlidingSpec(window=3), SoftmaxSpec()]


def test_a_pattern_repeats_over_the_layers_and_last_kind_sets_the_last_one():
    """The open models' rules over the layer index: a pattern tiled and cut where the layers end
    (nanochat's window_pattern, Gemma 3's sliding_window_pattern), the last layer forced to a kind."""
    nanochat = layer_specs(["sliding", "sliding", "sliding", "softmax"], 6, {"window": 4}, last_kind="softmax")
    assert nanochat == [SlidingSpec(window=4)] * 3 + [SoftmaxSpec(), SlidingSpec(window=4), SoftmaxSpec()]
    assert layer_specs(["sliding", "softmax"], 3) == [SlidingSpec(), SoftmaxSpec(), SlidingSpec()]
    assert layer_specs(["linear", "linear", "softmax"], 2) == [LinearSpec(), LinearSpec()]  # cut at the last layer
    # Kimi Linear's 27 layers: MLA at layers 4, 8, ..., 24 and 27 (its config counts from 1), the
    # option reaching the MLA layers only; the last layer's kind takes its options like any other.
    kimi = layer_specs(["kda", "kda", "kda", "mla"], 27, {"rope": False, "kv_rank": 16}, last_kind="mla")
    assert [i + 1 for i, spec in enumerate(kimi) if spec.kind == "mla"] == [4, 8, 12, 16, 20, 24, 27]
    assert {spec for spec in kimi if spec.kind == "mla"} == {LatentSpec(rope=False, kv_rank=16)}
    # last_kind after global_every: OLMo-core's sliding pattern with full attention on the last layer
    olmo = layer_specs("sliding", 6, global_every=4, last_kind="softmax")
    assert [spec.kind for spec in olmo] == ["sliding"] * 3 + ["softmax", "sliding", "softmax"]
    # an option only the last layer's kind takes is used, not refused
    assert layer_specs("linear", 2, {"qk_norm": True}, last_kind="softmax")[1] == SoftmaxSpec(qk_norm=True)
    with pytest.raises(ConfigError, match=r"^last_kind=3 must name one attention kind$"):
        layer_specs("linear", 2, last_kind=3)


def test_stored_config_holds_every_option_of_every_layer():
    stored = ModelConfig(n_layer=2, attention=["linear", "sliding"]).to_dict()["attention"]
    assert stored == [{"kind": "linear", "feature_map": "elu", "chunk_size": 64, "eps": 1e-6},
                      {"kind": "sliding", "gate": "none", "qk_norm": False, "window": 128, "dilation": 1,
                       "sink_tokens": 0, "learned_sink": False, "softcap": None}]
    assert json.loads(json.dumps(stored)) == stored  # plain data


def test_format_1_config_upgrades_to_the_same_layers():
    v1 = {**ModelConfig(n_layer=4).to_dict(), "attention": "hybrid",
          "attention_options": {"pattern": ["linear", "sliding", "sliding", "softmax"], "window": [2, 3, 5, 8],
                                "dilation": 2, "global_every": 3, "feature_map": "relu"}}
    config = ModelConfig.from_dict(v1, format_version=1)
    assert config.attention == [LinearSpec(feature_map="relu"), SlidingSpec(window=3, dilation=2), SoftmaxSpec(),
                                SoftmaxSpec()]


def test_n_kv_head_defaults_to_multi_head():
    cfg = ModelConfig(n_head=6, d_model=384)
    assert cfg.n_kv_head == 6 and cfg.kv_groups == 1


def test_config_round_trips_through_a_plain_dict():
    cfg = ModelConfig(n_head=6, n_kv_head=2, d_model=384, tie_embeddings=False)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown model config field"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_heads": 3})


@pytest.mark.slow
@pytest.mark.parametrize("override, message", [
    ("attn.n_kv_head=3", "error: n_head=4 is not divisible by n_kv_head=3"),
    ("trainer.max_steps=0", "error: trainer.max_steps=0 must be an integer >= 1"),
    ("model.d_model=abc", "error: d_model='abc' must be an integer >= 1"),
    ("attn=sliding attn.window=0", "error: window=0 must be an integer >= 1"),
    ("attn=hybrid attn.pattern=[]", "error: pattern=[] names no kind: give the first layers' kinds, which repeat "
                                    "over the layers"),
    ("attn=sliding attn.last_kind=3", "error: last_kind=3 must name one attention kind"),
    ("attn=hybrid attn.window=8",
     "error: option(s) ['window'] are taken by no layer's kind (linear, softmax); "
     "they take ['chunk_size', 'eps', 'feature_map', 'gate', 'learned_sink', 'qk_norm', 'softcap']"),
])
def test_train_script_rejects_bad_config_in_one_line(override, message, tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), *override.split(), "logger=none",
         f"checkpoint_dir={tmp_path}", f"hydra.run.dir={tmp_path}/hydra"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [message]
    assert not any(tmp_path.glob("*/*.ckpt"))


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], [True] * 4),  # model=nano turns it on
    (["model=tiny"], [False] * 4),  # the studies' shape leaves each kind's own
    (["attn.qk_norm=false"], [False] * 4),  # attn.qk_norm, when given, decides
    (["model.qk_norm=false", "attn.qk_norm=true"], [True] * 4),
    (["attn=linear"], [None] * 4),  # a kind without QK-norm is left as it is
    (["attn=qwen3_next"], [None, None, None, True]),  # a hybrid: only its softmax layer has it
])
def test_the_model_shapes_qk_norm_reaches_every_layer_whose_kind_has_it(overrides, expected):
    from lm.config.compose import compose_train
    from lm.training.settings import model_config_of

    config = model_config_of(compose_train(overrides), vocab_size=64)
    assert [getattr(spec, "qk_norm", None) for spec in config.attention] == expected


def test_model_qk_norm_is_refused_in_one_line_when_not_a_boolean():
    from lm.config.compose import compose_train
    from lm.config.train import TrainRun

    cfg = compose_train(["model.qk_norm=3"])
    with pytest.raises(ConfigError, match="model.qk_norm=3 must be true or false"):
        TrainRun.from_config(cfg)


@pytest.mark.parametrize("config_name, overrides", [
    ("train", ["data=text", "data.paths=[/a/b.py, /c]", "data.vocab_size=512", "model.n_layer=2",
               "model.d_model=64", "trainer=cpu", "trainer.max_steps=3", "logger=none", "sample.max_new_tokens=0"]),
    ("train", ["model.d_model=64", "attn=sliding", "attn.window=8", "optim=adamw", "optim.lr=1e-3",
               "model.qk_norm=null", "run_name=teacher", "sample.prompt='def '"]),
    ("train", ["attn=hybrid", "model=small", "trainer.val_every_n_steps=3", "seed=null"]),
    ("uptrain", ["attn=gqa", "attn.n_kv_head=2"]),
    ("train", ["+extra=1"]),  # not a plain change: Hydra's whole
])
def test_composing_group_choices_once_then_the_values_equals_hydras_composition(config_name, overrides):
    """tests/conftest.py's compose_config composes each set of group choices once and applies the plain
    `key=value` overrides itself; what it returns must be what Hydra composes, value for value."""
    from conftest import compose_config, hydra_compose
    from omegaconf import OmegaConf

    ours, hydras = compose_config(config_name, overrides), hydra_compose(config_name, overrides)
    assert OmegaConf.to_container(ours) == OmegaConf.to_container(hydras)
    assert OmegaConf.to_container(ours, resolve=True) == OmegaConf.to_container(hydras, resolve=True)
    assert OmegaConf.is_struct(ours) == OmegaConf.is_struct(hydras)


def test_an_override_of_a_key_the_config_lacks_gets_hydras_own_error():
    from conftest import compose_config
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="Could not override 'model.no_such_key'"):
        compose_config("train", ["attn=mha", "model.no_such_key=1"])
