"""The attention contract: every registered kind honours it, and a kind written outside lm/ with
nothing but the contract trains, decodes with its cache and round-trips through a checkpoint."""

import dataclasses
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
    layer_specs,
    register,
    spec_class,
    spec_from_dict,
)
from lm.attention.cache import CacheSpec, GenerationCache, tensor_bytes
from lm.attention.projections import GroupedQKV
from lm.util.checks import require_positive

SHAPE = LayerShape(d_model=32, n_head=4, n_kv_head=2, head_dim=8, layer_idx=0)


@pytest.mark.parametrize("kind", available_kinds())
def test_every_kind_builds_its_layer_and_cache_from_sizes_alone(kind):
    spec = spec_class(kind)()
    assert spec_from_dict(spec.to_dict()) == spec  # every option is plain data and comes back
    layer = spec.build(SHAPE)
    assert isinstance(layer, AttentionLayer) and isinstance(layer, torch.nn.Module)
    model = Transformer(ModelConfig(vocab_size=11, n_layer=1, d_model=32, n_head=4, n_kv_head=2, attention=spec))
    context = GenerationCache(model, pad=torch.zeros(2, dtype=torch.long), max_len=8)
    assert isinstance(context.layers[0], LayerCache)
    x = torch.randn(2, 5, 32)
    cos, sin = model.rope(torch.arange(5))
    assert layer(x, cos, sin).shape == (2, 5, 32)


def test_a_spec_must_be_a_frozen_dataclass_registered_once():
    with pytest.raises(ValueError, match="registered twice"):
        register("softmax")(dataclass(frozen=True)(type("Again", (AttentionSpec,), {})))
    with pytest.raises(TypeError, match="must be a frozen dataclass"):
        register("undecorated")(type("Undecorated", (AttentionSpec,), {"__annotations__": {"size": int}}))
    with pytest.raises(TypeError, match="must be a frozen dataclass"):
        register("foreign")(dataclass(frozen=True)(type("Foreign", (), {})))
    assert not {"undecorated", "foreign"} & set(available_kinds())


# ---------------------------------------------------------------- a kind from outside, on the contract alone


@register("prefix_mean")
@dataclass(frozen=True)
class PrefixMeanSpec(AttentionSpec):
    """Every query takes `scale` x the mean of the values at and before it: attention with equal scores."""

    scale: float = 1.0

    def check(self) -> None:
        require_positive("scale", self.scale)

    def build(self, shape: LayerShape) -> "PrefixMean":
        return PrefixMean(self, shape)


class PrefixMean(GroupedQKV):
    context_limited = False

    def __init__(self, spec: PrefixMeanSpec, shape: LayerShape):
        super().__init__(shape)
        self.scale = spec.scale

    def attend(self, q, k, v):
        g = self.n_head // self.n_kv_head
        counts = torch.arange(1, v.shape[2] + 1, dtype=v.dtype)[:, None]
        means = v.cumsum(2) / counts  # (B, nkv, T, hs)
        return self.scale * means.repeat_interleave(g, dim=1)  # (B, nh, T, hs)

    def generation_state(self) -> CacheSpec:
        return CacheSpec("recurrent", self.n_kv_head, self.head_dim, state_numel=self.head_dim + 1)

    def build_cache(self, context, max_len):
        return PrefixMeanCache(self, context)


class PrefixMeanCache:
    def __init__(self, layer: PrefixMean, context: GenerationCache):
        self.layer = layer
        self.total = torch.zeros(context.batch_size, layer.n_kv_head, 1, layer.head_dim)
        self.count = torch.zeros(())

    def attend(self, q, k, v):
        g = self.layer.n_head // self.layer.n_kv_head
        sums = self.total + v.cumsum(2)  # (B, nkv, T, hs)
        counts = self.count + torch.arange(1, v.shape[2] + 1, dtype=v.dtype)[:, None]
        self.total, self.count = sums[:, :, -1:], counts[-1, 0]
        return self.layer.scale * (sums / counts).repeat_interleave(g, dim=1)

    def nbytes(self) -> int:
        return tensor_bytes(self.total, self.count)


def test_a_kind_written_on_the_contract_alone_trains_decodes_and_saves(tmp_path):
    attention = layer_specs(["prefix_mean", "softmax"], 2, {"scale": 2.0})
    assert attention == [PrefixMeanSpec(scale=2.0), spec_class("softmax")()]
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


def test_bad_option_of_a_new_kind_is_one_line():
    with pytest.raises(lm.ConfigError, match=r"^scale=0 must be a positive number$"):
        PrefixMeanSpec(scale=0)
    assert dataclasses.fields(PrefixMeanSpec)[0].default == 1.0


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
