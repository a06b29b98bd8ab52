"""Every setting declared once: the `attn` group's keys come from the attention registry (the
kinds' specs), the YAMLs hold only what they change, and kinds from outside lm/ register through
the `lm.attention_kinds` entry point group."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import compose_config, train_small_run
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from lm.attention import available_kinds, option_names, spec_class
from lm.config.attn import PER_LAYER, attn_schema
from lm.config.compare import CompareSettings
from lm.config.data import CorpusSettings, HubSettings, RecallSettings
from lm.config.eval import EvalSettings
from lm.config.export import ExportSettings
from lm.config.import_hf import ImportHFSettings
from lm.config.model import ModelSettings
from lm.config.settings import SCHEMAS
from lm.config.train import CheckpointSettings, TrainRun, TrainSettings
from lm.config.trainer import TrainerSettings
from lm.config.uptrain import UptrainSettings, UptrainStudySettings
from lm.generation.settings import GenerateSettings
from lm.util.cli import run_script
from lm.util.errors import ConfigError
from lm.util.settings import built, check_settings, defaults, described, each, integer, is_group

ROOT = Path(__file__).resolve().parents[1]
ATTN_CONFIGS = sorted((ROOT / "conf" / "attn").glob("*.yaml"))
COMMON = {"name", "n_kv_head", "global_every", "last_kind"}  # keys every attn config has beside its kind's options


def schema_defaults(kind: str) -> dict:
    return {f.name: f.default for f in dataclasses.fields(attn_schema(kind))}


def declared_kind(path: Path) -> str:
    """The kind a conf/attn YAML names in its defaults list: `- /attn/kind@_here_: <kind>`."""
    (entry,) = yaml.safe_load(path.read_text())["defaults"]
    ((key, kind),) = entry.items()
    assert key == "/attn/kind@_here_", f"{path.name}: {entry}"
    return kind


@pytest.mark.parametrize("path", ATTN_CONFIGS, ids=[p.stem for p in ATTN_CONFIGS])
def test_an_attn_yaml_holds_its_kind_and_only_what_it_changes(path):
    kind = declared_kind(path)
    assert kind in [*available_kinds(), PER_LAYER]
    values = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "defaults"}
    defaults = schema_defaults(kind)
    specs = [spec_class(k) for k in available_kinds()] if kind == PER_LAYER else [spec_class(kind)]
    spec_defaults = {f.name: f.default for spec in specs for f in dataclasses.fields(spec)}
    for key, value in values.items():
        assert key in defaults, f"{path.name}: {key} is not a key of attn/kind/{kind}"
        assert value != defaults[key], f"{path.name}: {key}={value!r} is the schema's own default"
        assert key not in spec_defaults or value != spec_defaults[key], \
            f"{path.name}: {key}={value!r} restates the spec's default"
    assert "name" in values or path.stem == kind  # the run's name (run_name: ${attn.name}-...)


@pytest.mark.parametrize("kind", [*available_kinds(), PER_LAYER])
def test_a_kinds_schema_is_its_specs_options_and_the_common_keys(kind):
    fields = list(schema_defaults(kind))
    kinds = available_kinds() if kind == PER_LAYER else [kind]
    options = list(dict.fromkeys(name for k in kinds for name in option_names(k)))
    head = ["name", "pattern"] if kind == PER_LAYER else ["name", "kind"]
    assert fields == [*head, "n_kv_head", *options, "global_every", "last_kind"]
    # every option at null, the spec's default; K/V heads one per query head, as the model's config says
    assert all(v is None for k, v in schema_defaults(kind).items() if k not in ("name", "kind", "n_kv_head"))
    assert schema_defaults(kind)["n_kv_head"] == "${model.n_head}"


@pytest.mark.parametrize("path", ATTN_CONFIGS, ids=[p.stem for p in ATTN_CONFIGS])
def test_every_option_of_the_kind_is_set_from_the_command_line(path):
    kind = declared_kind(path)
    keys = [k for k in schema_defaults(kind) if k not in ("name", "kind", "pattern")]
    values = {key: [i, i + 1] if i % 2 else i for i, key in enumerate(keys, start=3)}  # one, or one per layer
    cfg = compose_config("train", [f"attn={path.stem}", *(f"attn.{k}={v}" for k, v in values.items())])
    assert {k: cfg.attn[k] for k in keys} == values
    assert cfg.attn.name == yaml.safe_load(path.read_text()).get("name", path.stem)


def test_the_uptraining_target_takes_the_kinds_options():
    cfg = compose_config("uptrain", ["ckpt=x", "attn=mla", "attn.kv_rank=24", "attn.rope_dim=4"])
    assert OmegaConf.to_container(cfg.attn) == {"name": "mla", "kind": "mla", "n_kv_head": None, "kv_rank": 24,
                                                "rope_dim": 4, "q_rank": None, "rope_pairs": None,
                                                "rope": None, "latent_norm": None, "global_every": None,
                                                "last_kind": None}


def run_train(args: list[str], monkeypatch) -> tuple[int, str]:
    """(exit code, stderr) of scripts/train.py's main as `python scripts/train.py <args>` runs it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lm_script_train", ROOT / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main.__wrapped__.__module__ = "__main__"  # Hydra finds conf/ beside a __main__ module only
    monkeypatch.setattr(sys, "argv", [str(ROOT / "scripts" / "train.py"), *args])
    GlobalHydra.instance().clear()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run_script(script.main)
    return code, err.getvalue()


@pytest.mark.parametrize("args, line", [
    (["attn=linear", "attn.window=8"],
     "error: attn.window is not a setting; attn takes name, kind, n_kv_head, feature_map, chunk_size, eps, "
     "global_every, last_kind"),
    (["attn=sliding", "attn.windw=8"], "error: attn.windw is not a setting; did you mean attn.window?"),
    (["attn=mha", "attn.kv_rank=8"], "error: attn.kv_rank is not a setting; attn takes name, kind, n_kv_head, "
                                     "gate, qk_norm, learned_sink, softcap, global_every, last_kind"),
])
def test_a_key_the_kind_does_not_take_is_one_line_naming_it(args, line, tmp_path, monkeypatch):
    code, err = run_train([*args, f"hydra.run.dir={tmp_path}/hydra", f"checkpoint_dir={tmp_path}"], monkeypatch)
    assert (code, err.strip().splitlines()) == (2, [line])
    assert not any(tmp_path.rglob("*"))


def test_a_composition_elsewhere_finds_the_schemas_through_hydra_searchpath(tmp_path):
    """conf/train.yaml names pkg://lm.config, so hydra.compose works without importing it first."""
    code = textwrap.dedent(f"""
        import sys
        from hydra import compose, initialize_config_dir
        with initialize_config_dir(config_dir={str(ROOT / "conf")!r}, version_base="1.3"):
            cfg = compose(config_name="train", overrides=["attn=sliding", "attn.window=8"])
        print(cfg.attn.window, "lm.config" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.stdout.split() == ["8", "True"], done.stderr[-2000:]


KIND_MODULE = """
from dataclasses import dataclass
from lm.attention import AttentionSpec, register

@register({name!r})
@dataclass(frozen=True)
class Spec(AttentionSpec):
    scale: float = 1.0
"""


def distribution(folder: Path, name: str, module: str, source: str) -> Path:
    """An installed distribution as importlib.metadata sees one: a .dist-info folder whose
    entry_points.txt names `module` in the group lm.attention_kinds, and the module beside it."""
    info = folder / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[lm.attention_kinds]\n{name} = {module}\n")
    (folder / f"{module}.py").write_text(source)
    return folder


def test_an_installed_distributions_entry_point_registers_its_kind_and_a_broken_one_is_one_line(tmp_path):
    good = distribution(tmp_path / "good", "outside_kinds", "outside_kinds_mod", KIND_MODULE.format(name="ep_kind"))
    broken = distribution(tmp_path / "broken", "broken_kinds", "broken_kinds_mod", "import no_such_module_here\n")
    old_style = tmp_path / "old_kind.py"
    old_style.write_text(KIND_MODULE.format(name="env_kind"))
    code = textwrap.dedent("""
        import sys, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import lm.attention
            lm.attention.load_outside_kinds()  # what a script's start calls
        print(sorted(k for k in lm.attention.available_kinds() if k.endswith("_kind")))
        print([str(w.message) for w in caught if w.category is DeprecationWarning])
        print([str(w.message) for w in caught if w.category is RuntimeWarning])
        try:
            lm.attention.load_entry_points()
        except lm.attention.base.ConfigError as error:
            print(str(error))
    """)
    # The broken plug-in is installed beside the good one: loading the kinds warns in one line and goes on.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(good), str(broken), os.environ.get("PYTHONPATH", "")]),
           "LM_ATTENTION_KINDS": str(old_style)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    kinds, warned, broken_warning, error = done.stdout.strip().splitlines()
    assert kinds == "['env_kind', 'ep_kind']", done.stderr[-2000:]
    assert "LM_ATTENTION_KINDS is deprecated" in warned and "'lm.attention_kinds'" in warned
    said = ("entry point broken_kinds = broken_kinds_mod of broken_kinds (group lm.attention_kinds) "
            "cannot be loaded: ModuleNotFoundError: No module named 'no_such_module_here'")
    assert broken_warning == repr([f"{said}; its kinds are not available"])
    assert error == said  # asked for directly, the same line is an error



def test_training_prints_every_layers_resolved_options(tmp_path, small_corpus, capsys):
    train_small_run(tmp_path, small_corpus, "attn=sliding", "attn.window=[3,5]", "attn.global_every=2")
    out = capsys.readouterr().out
    # model=nano's qk_norm turns QK-norm on in both kinds, which have it
    assert ("attention: 1 x sliding(gate=none, qk_norm=True, window=3, dilation=1, sink_tokens=0, learned_sink=False, "
            "softcap=None), 1 x softmax(gate=none, qk_norm=True, learned_sink=False, softcap=None)") in out


# ------------------------------------------------------------------ the scripts' run-side settings

def test_every_settings_schema_documents_each_setting_and_its_defaults_pass_its_bounds():
    assert SCHEMAS  # lm.config stores them on import
    for name, cls in SCHEMAS.items():
        for f in dataclasses.fields(cls):
            assert is_group(f) or f.metadata["help"], f"{name}.{f.name} has no help"
        check_settings({}, cls)  # every default within its bound


SCRIPT_SETTINGS = [("generate", GenerateSettings), ("export", ExportSettings), ("eval", EvalSettings),
                   ("import_hf", ImportHFSettings), ("compare", CompareSettings), ("uptrain", UptrainSettings)]
GROUPS = ("data", "logger", "attn")  # a script's groups, composed beside its settings


@pytest.mark.parametrize("config, cls", SCRIPT_SETTINGS, ids=[config for config, _ in SCRIPT_SETTINGS])
def test_a_scripts_settings_come_from_its_dataclass_and_its_help_lists_them(config, cls):
    assert set(yaml.safe_load((ROOT / "conf" / f"{config}.yaml").read_text())) == {"defaults", "hydra"}
    composed = OmegaConf.to_container(compose_config(config, []))
    assert {key: value for key, value in composed.items() if key not in GROUPS} == defaults(cls)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        template = compose(config_name=config, return_hydra_config=True).hydra.help.template
    for name, words in described(cls):  # what it means, its bound and its default, groups' settings dotted
        line = next(line for line in template.splitlines() if line.split()[:1] == [name])
        assert line.split(maxsplit=1)[1] == words


PRESETS = sorted((ROOT / "conf" / "preset").glob("*.yaml"))


MAPPINGS = ("per_kind", "frontier.knobs")  # settings whose value is a mapping of the user's keys


def leaves(values: dict, prefix: str = "") -> dict:
    found = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        found.update(leaves(value, f"{name}.") if isinstance(value, dict) and name not in MAPPINGS else {name: value})
    return found


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_a_comparison_preset_holds_only_what_it_changes(path):
    values = leaves(yaml.safe_load(path.read_text()) or {})
    declared = leaves(defaults(CompareSettings))
    for key, value in values.items():
        assert key in declared, f"{path.name}: {key} is not a setting of CompareSettings"
        assert value != declared[key], f"{path.name}: {key}={value!r} is CompareSettings's own default"


@pytest.mark.parametrize("value, line", [
    ([], "mqar.widths=[] is empty: give at least one value"),
    (0, "mqar.widths=0 must be an integer >= 1"),  # typed bare: named as the setting
    ([4, 0], "mqar.widths entry=0 must be an integer >= 1"),
    ({"a": 1}, "mqar.widths={'a': 1} must be a list, e.g. mqar.widths=[a,b]"),
])
def test_a_list_settings_bound_checks_every_entry(value, line):
    with pytest.raises(ConfigError) as refused:
        each(integer())("mqar.widths", value)
    assert str(refused.value) == line
    each(integer(), at_least_one=False)("speed.train_contexts", [])


UPTRAIN_STUDIES = [("uptrain_study_base", "uptrain"), ("uptrain_methods", "uptrain_study")]


@pytest.mark.parametrize("config, parent", UPTRAIN_STUDIES, ids=[config for config, _ in UPTRAIN_STUDIES])
def test_an_uptraining_study_holds_only_what_it_changes(config, parent):
    """Its keys are settings (UptrainSettings, UptrainStudySettings) or the attn target, and none
    restates what the config it builds on composes."""
    stated = yaml.safe_load((ROOT / "conf" / f"{config}.yaml").read_text())
    values = leaves({key: value for key, value in stated.items() if key not in ("defaults", "hydra")})
    base = OmegaConf.to_container(compose_config(parent, []))
    if parent == "uptrain":
        base.update(defaults(UptrainStudySettings))
    declared = leaves(base)
    for key, value in values.items():
        assert key in declared, f"{config}.yaml: {key} is not a setting"
        assert value != declared[key], f"{config}.yaml: {key}={value!r} restates {parent}'s"
    assert leaves(OmegaConf.to_container(compose_config(config, [])))["study.out"].startswith("checkpoints/")


GROUP_SCHEMAS = {"trainer": {"trainer": TrainerSettings}, "model": {"model": ModelSettings},
                 "data": {"corpus": CorpusSettings, "hf": HubSettings, "mqar": RecallSettings}}
GROUP_OPTIONS = [path for group in GROUP_SCHEMAS for path in sorted((ROOT / "conf" / group).glob("*.yaml"))]
SHAPE = ("n_layer", "d_model", "n_head", "d_ff")  # each model option names its shape in full


@pytest.mark.parametrize("path", GROUP_OPTIONS, ids=[f"{p.parent.name}/{p.stem}" for p in GROUP_OPTIONS])
def test_a_groups_option_holds_only_what_it_changes(path):
    """trainer, model and data options compose their schema (or an option that does) and state only
    keys it declares, none at the value it already has; the composed option is the schema's
    defaults under the option's own values."""
    group = path.parent.name
    stated = yaml.safe_load(path.read_text())
    (entry,) = [e for e in stated.pop("defaults") if e != "_self_"]
    ((key, parent),) = entry.items() if isinstance(entry, dict) else [(None, entry)]
    if key is None:  # another option of the group (trainer=cpu composes base)
        base = OmegaConf.to_container(compose_config("train", [f"{group}={parent}"])[group])
    else:
        assert key == f"/{group}/settings@_here_", f"{path.name}: {entry}"
        base = defaults(GROUP_SCHEMAS[group][parent])
    for name, value in stated.items():
        assert name in base, f"{group}/{path.name}: {name} is not a setting of its schema"
        assert name in SHAPE or value != base[name], f"{group}/{path.name}: {name}={value!r} restates the default"
    composed = OmegaConf.to_container(compose_config("train", [f"{group}={path.stem}"])[group])
    assert composed == {**base, **stated}


@pytest.mark.parametrize("override, line", [
    ("trainer.precision=16", "trainer.precision='16' is not one of"),
    ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1 must be"),
    ("trainer.num_nodes=0", "trainer.num_nodes=0 must be an integer >= 1"),
    ("data.num_workers=-1", "data.num_workers=-1 must be an integer >= 0"),
    ("data.vocab_size=0", "data.vocab_size=0 must be an integer >= 1"),
])
def test_a_group_setting_out_of_its_bound_is_one_line_naming_it_as_typed(override, line):
    with pytest.raises(ConfigError) as refused:
        TrainRun.from_config(compose_config("train", [override]))
    assert str(refused.value).startswith(line)


def test_export_refuses_a_format_it_does_not_write_before_reading_the_checkpoint():
    with pytest.raises(ConfigError, match=r"^format='onnx' is not one of \['gguf', 'hf', 'safetensors'\]$"):
        check_settings(compose_config("export", ["ckpt=none.ckpt", "out=x", "format=onnx"]), ExportSettings)


def test_train_composes_its_own_keys_from_the_dataclass():
    assert set(yaml.safe_load((ROOT / "conf" / "train.yaml").read_text())) == {"defaults", "hydra"}
    cfg = OmegaConf.to_container(compose_config("train", []), resolve=True)
    assert {k: cfg[k] for k in defaults(TrainSettings)} == {**defaults(TrainSettings), "run_name": "mha-nano"}


@pytest.mark.parametrize("override, line", [
    ("seed=abc", "seed='abc' must be an integer from 0 to 4294967295"),
    ("seed=4294967296", "seed=4294967296 must be an integer from 0 to 4294967295"),  # past Lightning's seed_everything
    ("resume=maybe", "resume='maybe' must be true or false"),
    ("compile=1", "compile=1 must be true or false"),
    ("checkpoint.every_n_steps=0", "checkpoint.every_n_steps=0 must be an integer >= 1"),
    ("sample.max_new_tokens=-1", "sample.max_new_tokens=-1 must be an integer >= 0"),
    ("sample.temperature=nan", "sample.temperature=nan must be a finite number >= 0"),
    ("sample.top_k=0", "sample.top_k=0 must be an integer >= 1"),
    ("sample.seed=-2", "sample.seed=-2 must be an integer >= 0"),
])
def test_a_train_setting_out_of_its_bound_is_one_line_naming_it_as_typed(override, line):
    with pytest.raises(ConfigError) as refused:
        TrainRun.from_config(compose_config("train", [override]))
    assert str(refused.value) == line


def test_a_run_config_written_before_a_setting_existed_takes_its_default():
    old = built(TrainSettings, {"run_name": "old", "seed": 0})  # no checkpoint, sample, compile ...
    assert old.checkpoint == CheckpointSettings() and old.loss_chunk == TrainSettings().loss_chunk
    with pytest.raises(ConfigError, match=r"^checkpoint.every_n_steps=0 "):
        built(TrainSettings, {"checkpoint": {"every_n_steps": 0}})
