"""Each script composes once and builds its typed settings at its edge: what the command line builds equals
what Python builds directly, and a value out of its bound is refused as the settings are built, in one line
naming it as typed (the group's prefix from the command line, the bare name in Python)."""

import dataclasses

import pytest
from conftest import compose_config
from omegaconf.errors import MissingMandatoryValue

from lm.config.attn import AttnSettings
from lm.config.compare import CompareRun
from lm.config.compare import RecallSettings as RecallStudySettings
from lm.config.data import CorpusSettings, RecallSettings, data_settings
from lm.config.eval import EvalRun
from lm.config.export import ExportSettings
from lm.config.import_hf import ImportHFSettings
from lm.config.logger import LoggerSettings
from lm.config.model import ModelSettings
from lm.config.optim import MuonConfig, OptimConfig
from lm.config.serve import ServeSettings
from lm.config.settings import typed
from lm.config.train import SampleSettings, TrainRun
from lm.config.trainer import TrainerSettings
from lm.config.uptrain import UptrainOptions, UptrainRun
from lm.generation.settings import GenerateSettings
from lm.model.config import ModelConfig
from lm.training.settings import model_config_from
from lm.util.errors import ConfigError, DataError


def test_a_training_run_from_the_command_line_is_the_run_built_in_python():
    composed = TrainRun.from_config(compose_config("train", [
        "attn=gqa", "model=tiny", "optim=adamw", "optim.lr=0.003", "data=text", "data.paths=[a.txt]", "trainer=cpu",
        "trainer.max_steps=7", "logger=csv", "seed=3", "sample.max_new_tokens=0",
    ]))
    direct = TrainRun(
        attn=AttnSettings(name="gqa", kind="softmax", n_kv_head=2),
        model=ModelSettings(name="tiny", n_layer=4, d_model=288, n_head=6, d_ff=768),
        optim=OptimConfig(lr=0.003), data=CorpusSettings(source="text", paths=["a.txt"]),
        trainer=TrainerSettings(accelerator="cpu", precision="32-true", max_steps=7), logger=LoggerSettings(kind="csv"),
        seed=3, sample=SampleSettings(max_new_tokens=0),
    )
    options = composed.attn.options  # the softmax kind's options, each at null: the spec's own default
    assert set(options) == {"gate", "qk_norm", "learned_sink", "softcap"} and set(options.values()) == {None}
    assert dataclasses.replace(composed, attn=direct.attn) == direct
    assert composed.run_name == direct.run_name == "gqa-tiny"  # ${attn.name}-${model.name}, either way
    assert model_config_from(composed.model, composed.attn, 512) == model_config_from(direct.model, direct.attn, 512)


def test_a_run_built_in_python_takes_the_defaults_the_command_line_takes():
    composed = TrainRun.from_config(compose_config("train", ["model=nano", "data=mqar"]))
    assert composed.optim == MuonConfig() and composed.trainer == TrainerSettings()
    assert composed.data == RecallSettings(source="mqar")
    # every field of ModelConfig that the shape owns is a setting of the model group, with ModelConfig's default
    shape = {f.name for f in dataclasses.fields(ModelConfig)} - {"vocab_size", "n_kv_head", "attention"}
    assert shape | {"name", "qk_norm"} == {f.name for f in dataclasses.fields(ModelSettings)}
    assert {name: getattr(ModelSettings(), name) for name in shape} == {
        name: getattr(ModelConfig(), name) for name in shape}


@pytest.mark.parametrize("script, cls, overrides, direct", [
    ("generate", GenerateSettings, ["ckpt=a.ckpt", "max_new_tokens=5", "temperature=0"],
     dict(ckpt="a.ckpt", max_new_tokens=5, temperature=0)),
    ("serve", ServeSettings, ["ckpt=a.ckpt", "port=0", "max_batch=2"], dict(ckpt="a.ckpt", port=0, max_batch=2)),
    ("export", ExportSettings, ["ckpt=a.ckpt", "out=o", "format=gguf"], dict(ckpt="a.ckpt", out="o", format="gguf")),
    ("import_hf", ImportHFSettings, ["src=s", "out=o"], dict(src="s", out="o")),
])
def test_each_scripts_settings_from_its_command_line_are_its_settings_built_in_python(script, cls, overrides,
                                                                                        direct):
    assert typed(cls, compose_config(script, overrides)) == cls(**direct)


def test_eval_and_uptrain_settings_from_the_command_line_are_those_built_in_python():
    assert typed(EvalRun, compose_config("eval", ["ckpt=a.ckpt", "data=text", "data.paths=[d]", "batch_size=2"])) \
        == EvalRun(ckpt="a.ckpt", batch_size=2, data=CorpusSettings(source="text", paths=["d"]))
    uptrain = UptrainRun.from_config(compose_config("uptrain", ["ckpt=a.ckpt", "attn.n_kv_head=2", "logger=none",
                                                                "uptrain.fraction=0.1"]))
    assert uptrain == UptrainRun(ckpt="a.ckpt", attn={"n_kv_head": 2}, logger=LoggerSettings(kind="none"),
                                 uptrain=UptrainOptions(fraction=0.1))


def test_the_comparisons_settings_from_the_command_line_are_those_built_in_python():
    composed = CompareRun.from_config(compose_config("compare", ["kinds=[mha]", "seeds=1", "data=text",
                                                                 "data.paths=[d]", "mqar.widths=[32]"]))
    assert composed == CompareRun(kinds=["mha"], seeds=1, data=CorpusSettings(source="text", paths=["d"]),
                                  mqar=RecallStudySettings(widths=[32]))
    with pytest.raises(ConfigError, match=r"^mqar.bogus is not a setting here; mqar takes mqar.widths, "):
        CompareRun.from_config({**compose_config("compare", []), "mqar": {"bogus": 1}})


@pytest.mark.parametrize("build, message", [
    (lambda: OptimConfig(lr=1e-300), "lr=1e-300 is zero in float32"),
    (lambda: TrainRun.from_config(compose_config("train", ["trainer.gradient_clip_val=1e39"])),
     "trainer.gradient_clip_val=1e+39 overflows float32"),
    (lambda: TrainerSettings(max_steps=0), "max_steps=0 must be an integer >= 1"),
    (lambda: TrainRun.from_config(compose_config("train", ["trainer.max_steps=0"])),
     "trainer.max_steps=0 must be an integer >= 1"),
    (lambda: ModelSettings(qk_norm=3), "qk_norm=3 must be true or false"),
    (lambda: data_settings({"source": "mqar", "batch_size": 0}), "data.batch_size=0 must be an integer >= 1"),
    (lambda: typed(ServeSettings, compose_config("serve", ["ckpt=a", "port=70000"])),
     "port=70000 must be an integer from 0 to 65535"),
    (lambda: UptrainRun.from_config(compose_config("uptrain", ["ckpt=a", "uptrain.temperature=0"])),
     "uptrain.temperature=0 must be a positive number"),
    (lambda: TrainRun.from_config({**compose_config("train", []), "attn": {"name": "x"}}),
     "give attn.kind (one kind for every layer) or attn.pattern (kinds, repeated over the layers), not neither"),
])
def test_a_value_out_of_its_bound_is_refused_as_the_settings_are_built(build, message):
    with pytest.raises(ConfigError) as refused:
        build()
    assert str(refused.value).startswith(message)


def test_a_required_setting_left_out_on_the_command_line_is_omegaconfs_one_line_naming_it():
    """What reading it from the composed config said before the settings were typed (the scripts print it as
    `error: ckpt: Missing mandatory value: ckpt`), not a checkpoint or an output folder named `???`."""
    for script, cls, overrides in [("export", ExportSettings, ["out=x"]), ("import_hf", ImportHFSettings, ["src=s"]),
                                   ("serve", ServeSettings, [])]:
        with pytest.raises(MissingMandatoryValue) as missing:
            typed(cls, compose_config(script, overrides))
        assert missing.value.full_key in ("ckpt", "out")


def test_a_stored_config_with_a_key_the_settings_lack_is_one_line_naming_it():
    with pytest.raises(ConfigError, match=r"^trainer\.epochs is not a setting here; trainer takes trainer\.accel"):
        TrainRun.from_config({**compose_config("train", []), "trainer": {"epochs": 3}})
    with pytest.raises(DataError, match=r"^data\.source='tape' is not one of"):
        data_settings({"source": "tape"})
    with pytest.raises(ConfigError, match=r"^data\.source is required: give data\.source=\.\.\.$"):
        TrainRun.from_config({**compose_config("train", []), "data": {"batch_size": 4}})
    with pytest.raises(ConfigError, match=r"^checkpoint=5 must be a mapping of its settings$"):
        TrainRun.from_config({**compose_config("train", []), "checkpoint": 5})
    assert TrainRun.from_config({**compose_config("train", []), "checkpoint": None}).checkpoint.every_n_steps == 100
