"""The attention contract: every registered kind honours it, and a kind written outside lm/ with
nothing but the contract trains, decodes with its cache and round-trips through a checkpoint."""

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import lm
from lm import ModelConfig, Transformer, generate
from lm.attention import (
    AttentionLayer,
    AttentionSpec,
    LayerCache,
    LayerShape,
    available_kinds,
    example_rows,
    layer_specs,
    load_kind_files,
    register,
    spec_class,
    spec_from_dict,
)
from lm.attention import base as attention_base
from lm.attention.base import WeightDeclarations
from lm.attention.rope import RotaryEmbedding
from lm.model.generation_cache import GenerationCache

SHAPE = LayerShape(d_model=128, n_head=4, n_kv_head=2, head_dim=32, layer_idx=0)  # room for every kind's defaults


@pytest.mark.parametrize("kind", available_kinds())
def test_every_kind_builds_its_layer_and_cache_from_sizes_alone(kind):
    spec = spec_class(kind)()
    assert spec_from_dict(spec.to_dict()) == spec  # every option is plain data and comes back
    layer = spec.build(SHAPE)
    assert isinstance(layer, AttentionLayer) and isinstance(layer, torch.nn.Module)
    model = Transformer(ModelConfig(vocab_size=11, n_layer=1, d_model=128, n_head=4, n_kv_head=2, attention=spec))
    context = GenerationCache(model, pad=torch.zeros(2, dtype=torch.long), max_len=8)
    assert isinstance(context.layers[0], LayerCache)
    x = torch.randn(2, 5, 128)
    cos, sin = model.rope(torch.arange(5))
    assert layer(x, cos, sin).shape == (2, 5, 128)


def test_a_spec_must_be_a_frozen_dataclass_registered_once():
    with pytest.raises(ValueError, match="registered twice"):
        register("softmax")(dataclass(frozen=True)(type("Again", (AttentionSpec,), {})))
    with pytest.raises(TypeError, match="must be a frozen dataclass"):
        register("undecorated")(type("Undecorated", (AttentionSpec,), {"__annotations__": {"size": int}}))
    with pytest.raises(TypeError, match="must be a frozen dataclass"):
        register("foreign")(dataclass(frozen=True)(type("Foreign", (), {})))
    assert not {"undecorated", "foreign"} & set(available_kinds())


# ---------------------------------------------------------------- the hooks, declared with their defaults


@pytest.mark.parametrize("row", list(example_rows()))
def test_every_kind_declares_its_hooks_through_the_contract(row):
    """What the code reads from a layer besides its calls comes from AttentionLayer, and each kind's
    answers hold for its weights: fused rows add up to their weight's rows, renamed weights exist
    under their new names, declared AdamW parameters are 2-D, and no loss is left before a forward."""
    spec, example = example_rows()[row]
    layer = spec.build(LayerShape(d_model=32, n_head=4, n_kv_head=example.kv_heads(4, 2), head_dim=8))
    assert isinstance(layer, AttentionLayer) and isinstance(layer, WeightDeclarations)
    assert isinstance(layer.context_limited, bool) and isinstance(layer.uses_rope, bool)
    assert layer.aux_loss is None
    weights = layer.state_dict()
    assert all(sum(rows) == weights[name].shape[0] for name, rows in layer.fused_rows().items())
    assert all(new in weights and old not in weights for old, new in layer.former_names.items())
    assert all(p.dim() == 2 for name, p in layer.named_parameters() if name in layer.adamw_parameters)


@pytest.mark.parametrize("row", list(example_rows()))
def test_uses_rope_says_whether_the_angles_change_the_output(row):
    """Angles of positions three times as far apart change a layer that rotates q and k by them
    and leave one that declares uses_rope=False exactly as it was."""
    spec, example = example_rows()[row]
    torch.manual_seed(0)
    layer = spec.build(LayerShape(d_model=32, n_head=4, n_kv_head=example.kv_heads(4, 2), head_dim=8)).double()
    layer.reset_own_parameters()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    rope = RotaryEmbedding(8, 10000.0)
    with torch.no_grad():
        near, far = (layer(x, *(t.double() for t in rope(positions))) for positions in
                     (torch.arange(12), 3 * torch.arange(12)))
    assert torch.equal(near, far) != layer.uses_rope


class Bare(AttentionLayer):
    """A layer that overrides none of the hooks: one projection of x."""

    def __init__(self, shape: LayerShape):
        super().__init__()
        self.proj = torch.nn.Linear(shape.d_model, shape.d_model, bias=False)

    def forward(self, x, cos, sin, cache=None, pos=None):
        return self.proj(x)


@dataclass(frozen=True)
class BareSpec(AttentionSpec):
    kind = "bare"  # built directly, never registered

    def build(self, shape: LayerShape) -> Bare:
        return Bare(shape)


def test_a_layer_that_overrides_no_hook_reads_as_their_defaults():
    from lm.formats.checked import with_current_names
    from lm.training.optim import declarations, placement

    model = Transformer(ModelConfig(vocab_size=11, n_layer=2, d_model=32, n_head=4, attention=BareSpec()))
    layer = model.blocks[0].attn
    assert (layer.context_limited, layer.uses_rope, layer.aux_loss, dict(layer.former_names)) == (True, True, None, {})
    assert declarations(layer) == ((), {}) and model.context_limited and model.aux_loss() is None
    assert "blocks.0.attn.proj.weight" in placement(model).muon  # an nn.Linear weight, one matrix
    state = model.state_dict()
    assert with_current_names(model, state) == state


def test_hooks_are_read_from_the_contract_not_from_whatever_a_module_holds():
    """A module outside WeightDeclarations that happens to hold an attribute of a hook's name declares
    nothing; a layer that is not an AttentionLayer is refused where the model builds it, in one line."""
    from lm.training.optim import declarations

    class Stray(torch.nn.Module):
        adamw_parameters = ("weight",)
        former_names = {"old": "weight"}

        def fused_rows(self):
            return {"weight": (1, 1)}

    assert declarations(Stray()) == ((), {})

    @dataclass(frozen=True)
    class LinearOnly(AttentionSpec):
        kind = "linear_only"

        def build(self, shape: LayerShape) -> torch.nn.Module:
            return torch.nn.Linear(shape.d_model, shape.d_model)

    with pytest.raises(lm.ConfigError, match=r"^attention kind 'linear_only' built a Linear; a kind's layer must "
                                        r"subclass lm.attention.AttentionLayer$"):
        Transformer(ModelConfig(vocab_size=11, n_layer=1, d_model=32, n_head=4, attention=LinearOnly()))


def test_a_former_name_loads_under_todays_name():
    """WeightDeclarations.former_names: load_state_dict (through the module's own pre-hook, at any
    depth) takes a weight saved under the old name."""

    class Renamed(WeightDeclarations):
        former_names = {"gate.weight": "output_gate.weight"}

        def __init__(self):
            super().__init__()
            self.output_gate = torch.nn.Linear(3, 2, bias=False)

    saved = torch.randn(2, 3)
    outer = torch.nn.Sequential(Renamed())
    outer.load_state_dict({"0.gate.weight": saved})
    assert torch.equal(outer[0].output_gate.weight, saved)


# ---------------------------------------------------------------- a kind from outside, on the contract alone

OUTSIDE = Path(__file__).parent / "fixtures" / "outside_kind"


@pytest.fixture(scope="module")
def outside_kind(tmp_path_factory):
    """The kind of tests/fixtures/outside_kind copied to a temporary folder and registered from there,
    for this module's tests only: a test elsewhere that lists every kind (the benchmarks' rows against
    a subprocess's) would otherwise see one more kind whenever it ran after these."""
    folder = tmp_path_factory.mktemp("outside")
    shutil.copytree(OUTSIDE, folder, dirs_exist_ok=True)
    kinds = available_kinds()  # the built-in kinds loaded before the snapshot, so teardown keeps them
    registered = dict(attention_base._SPECS)
    if "prefix_mean" not in kinds:
        assert load_kind_files(str(folder / "prefix_mean.py")) == ["prefix_mean"]
    yield folder
    attention_base._SPECS.clear()
    attention_base._SPECS.update(registered)


def test_a_kind_written_on_the_contract_alone_trains_decodes_and_saves(outside_kind, tmp_path):
    attention = layer_specs(["prefix_mean", "softmax"], 2, {"scale": 2.0})
    assert attention[0].to_dict() == {"kind": "prefix_mean", "scale": 2.0}
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=300, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=48,
                                    max_seq_len=64, attention=attention, init_std=0.2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, 40, (4, 17))
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    prompt = batch[:1, :6]
    assert generate(model, prompt, 12) == generate(model, prompt, 12, use_cache=False)

    from lm.data.tokenizer import train_tokenizer
    from lm.formats.checkpoint import read_checkpoint, save_checkpoint

    tokenizer = train_tokenizer(iter(["abc def " * 50]), 300)
    path = save_checkpoint(tmp_path / "last.ckpt", model.state_dict(), model.config, tokenizer.to_str())
    assert read_checkpoint(path)["lm"]["model_config"]["attention"][0] == {"kind": "prefix_mean", "scale": 2.0}
    loaded, _ = lm.load(path)
    with torch.no_grad():
        assert torch.equal(loaded(batch), model(batch))


def test_bad_option_of_a_new_kind_is_one_line(outside_kind):
    with pytest.raises(lm.ConfigError, match=r"^scale=0 must be a positive number$"):
        spec_class("prefix_mean")(scale=0)


def test_a_missing_kind_file_is_one_line(tmp_path):
    with pytest.raises(lm.ConfigError, match=r"^LM_ATTENTION_KINDS entry '.*nowhere.py' is not a .py file"):
        load_kind_files(str(tmp_path / "nowhere.py"))


def run_with_outside_kind(folder: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "LM_ATTENTION_KINDS": str(folder / "prefix_mean.py"), "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_kind_from_a_temporary_folder_runs_every_shared_test_row_and_benchmark_row(outside_kind, tmp_path):
    """The promise of the contract: a file and a YAML outside lm/, nothing else edited."""
    tests = run_with_outside_kind(outside_kind, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "prefix_mean",
                                  "tests/test_attention.py", "tests/test_generation.py", "tests/test_fast_paths.py",
                                  "tests/test_contract.py::test_every_kind_builds_its_layer_and_cache_from_sizes_alone")
    assert tests.returncode == 0, tests.stdout[-3000:]
    passed = int(tests.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert passed >= 20  # equivalence, causality, cache, ragged batches, host reads, compile, checkpoint ...
    for table in ("attention", "generate"):
        extra = (["--lengths", "64", "128", "--d-model", "64", "--heads", "4", "--repeats", "1", "--out", str(tmp_path),
                  "--no-single-head"] if table == "attention" else
                 ["--prompt", "4", "--new-tokens", "6", "--positions", "8", "24", "--repeats", "1", "--no-compare"])
        bench = run_with_outside_kind(outside_kind, "scripts/bench.py", table, "--kinds", "prefix_mean",
                                      "softmax-mha", *extra)
        assert bench.returncode == 0, bench.stderr[-2000:]
        assert any(line.startswith("prefix_mean") for line in bench.stdout.splitlines())
    train = run_with_outside_kind(outside_kind, "scripts/train.py", "attn=prefix_mean", f"hydra.searchpath=[file://{outside_kind}]",
                                  "model=tiny", "trainer.max_steps=2", "trainer.val_every_n_steps=2", "logger=none",
                                  f"checkpoint_dir={tmp_path / 'ckpt'}", "run_name=outside", "sample.max_new_tokens=4")
    assert train.returncode == 0, train.stderr[-2000:]
    assert "prefix_mean" in train.stdout + train.stderr


@pytest.mark.slow
def test_installed_package_works_from_another_folder(tmp_path):
    """`pip install .` (not editable) carries every module, and relative paths then resolve against
    the folder the user is in, not where the package was installed."""
    root, source = Path(__file__).resolve().parents[1], tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):  # a copy, so the build leaves nothing in the clone
        shutil.copy(root / name, source / name)
    shutil.copytree(root / "lm", source / "lm", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-cache-dir", "--target", str(target), str(source)], check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("import lm, lm.attention, lm.training.run; from lm.util.paths import resolve_path; "
            "m = lm.Transformer(lm.ModelConfig(n_layer=2, attention=['linear', 'sliding'])); "
            "print(lm.__file__, lm.attention.available_kinds(), resolve_path('checkpoints'))")
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == str(target / "lm" / "__init__.py")
    assert "'softmax']" in out and out[-1] == str(elsewhere / "checkpoints")
