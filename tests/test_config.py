import subprocess
import sys
from pathlib import Path

import pytest

from lm import ConfigError, ModelConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("fields, message", [
    (dict(n_head=6, n_kv_head=4, d_model=384), "n_head=6 is not divisible by n_kv_head=4"),
    (dict(n_head=5, d_model=384), "d_model=384 is not divisible by n_head=5"),
    (dict(n_head=4, n_kv_head=8, d_model=256), "n_kv_head=8 must not exceed n_head=4"),
    (dict(n_layer=0), "n_layer=0 must be >= 1"),
    (dict(d_model="big"), "d_model='big' must be an integer"),
    (dict(norm_eps=-1.0), "norm_eps=-1.0 must be a positive number"),
    (dict(d_model=12, n_head=4), "head_dim=3 (d_model/n_head) must be even for RoPE"),
    (dict(attention="banana"), "attention='banana' is not a known kind"),
    (dict(attention_options={"window": 4}), "attention=softmax does not take option(s) ['window']"),
    (dict(attention="sliding", attention_options={"window": 0}), "window=0 must be an integer >= 1"),
    (dict(attention="sliding", attention_options={"dilation": 0}), "dilation=0 must be an integer >= 1"),
    (dict(n_layer=2, attention="sliding", attention_options={"window": [4, 8, 16]}),
     "window=[4, 8, 16] has 3 entries but n_layer=2"),
    (dict(attention="linear", attention_options={"feature_map": "cosine"}), "feature_map='cosine' is not one of"),
    (dict(n_layer=2, attention="hybrid", attention_options={"pattern": ["linear"]}),
     "pattern=['linear'] has 1 entries but n_layer=2"),
    (dict(n_layer=2, attention="hybrid", attention_options={"pattern": ["linear", "lstm"]}),
     "attention='lstm' is not a known kind"),
])
def test_bad_model_config_names_the_field(fields, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**fields)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_n_kv_head_defaults_to_multi_head():
    cfg = ModelConfig(n_head=6, d_model=384)
    assert cfg.n_kv_head == 6 and cfg.kv_groups == 1


def test_config_round_trips_through_a_plain_dict():
    cfg = ModelConfig(n_head=6, n_kv_head=2, d_model=384, tie_embeddings=False)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown model config field"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_heads": 3})


@pytest.mark.parametrize("override, message", [
    ("attn.n_kv_head=4", "error: n_head=6 is not divisible by n_kv_head=4"),
    ("trainer.max_steps=0", "error: trainer.max_steps=0 must be a positive integer"),
    ("model.d_model=abc", "error: d_model='abc' must be an integer"),
    ("attn=sliding attn.window=0", "error: window=0 must be an integer >= 1 (or one per layer)"),
    ("attn=hybrid attn.pattern=[linear,softmax]", "error: pattern=['linear', 'softmax'] has 2 entries but n_layer=4"),
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
