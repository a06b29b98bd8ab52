"""Shared fixtures: Hydra configs composed as the scripts compose them, shrunk to test size."""

from __future__ import annotations

import copy
import functools
import os
import sysconfig
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from omegaconf import DictConfig, OmegaConf, open_dict

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
# Small models that still have several heads, so GQA/MQA groupings are real.
TINY_MODEL = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.d_ff=128", "model.max_seq_len=32"]


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs `-n 2`), each worker gets its share of the cores for
    torch's intra-op threads, so two workers do not run four threads on two cores; the scripts the
    tests start inherit it through OMP_NUM_THREADS. Without xdist, or where the caller set
    OMP_NUM_THREADS, torch keeps its own choice. A run held to a CPU capability (ATEN_CPU_CAPABILITY, as
    docs/reliability.md times `make test` held to AVX2) compiles into inductor's cache for that capability."""
    from lm.attention import load_outside_kinds
    from lm.util.hardware import inductor_cache_per_capability

    inductor_cache_per_capability()
    # the session's start, as a script's: a kind outside lm/ (an installed distribution's entry point,
    # LM_ATTENTION_KINDS) joins the shared tables (docs/adding-a-kind.md)
    load_outside_kinds()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    threads = max(1, available_cores() // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def available_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def hydra_compose(config_name: str, overrides: list[str] | tuple[str, ...]) -> DictConfig:
    """conf/<config_name>.yaml with `overrides`, composed by Hydra as the scripts compose it."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


@functools.cache
def composed_choices(config_name: str, choices: tuple[str, ...]) -> DictConfig:
    """One Hydra composition per set of group choices (`attn=sliding`, `data=text`) in this process."""
    return hydra_compose(config_name, choices)


def is_group(key: str) -> bool:
    """Whether an override's key chooses a config group (a folder of conf/ or a ConfigStore group)."""
    return "/" in key or (CONF_DIR / key).is_dir() or isinstance(ConfigStore.instance().repo.get(key), dict)


def compose_config(config_name: str, overrides: list[str]) -> DictConfig:
    """What hydra_compose(config_name, overrides) gives, composing little: the group choices are
    composed once per process, then the plain `key=value` overrides are applied to a copy as Hydra
    applies them after its merge (OmegaConf.update with merge=True, parsed by Hydra's own override
    parser). Anything else (`+key`, `~key`, a sweep, a `hydra.` key, an override the copy refuses)
    goes to Hydra whole, so its errors are Hydra's. tests/test_config.py holds the two equal."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    if any(o.type is not OverrideType.CHANGE or o.is_sweep_override() or o.package is not None
           or o.key_or_group.split(".")[0] == "hydra" for o in parsed):
        return hydra_compose(config_name, overrides)
    choices = tuple(o.input_line for o in parsed if is_group(o.key_or_group))
    cfg = copy.deepcopy(composed_choices(config_name, choices))
    try:
        for o in parsed:
            if not is_group(o.key_or_group):
                OmegaConf.update(cfg, o.key_or_group, o.value(), merge=True)
    except Exception:  # noqa: BLE001  Hydra then says what is wrong, in its own words
        return hydra_compose(config_name, overrides)
    return cfg


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """About 40 real standard-library modules copied into a folder: a quick `data=text` corpus."""
    folder = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in sorted(p.name for p in stdlib.glob("*.py"))[:40]:
        (folder / name).write_bytes((stdlib / name).read_bytes())
    return folder


def int8_kernels_here(kernels) -> list[str]:
    """Those of `kernels` that generate and serve run on this CPU: dynamic is refused where its int8
    matmul does not return exact sums (lm.generation.quantize.dynamic_refusal), native where the machine
    has no C compiler to build it with (native_refusal)."""
    import torch

    from lm.generation.quantize import dynamic_refusal, native_refusal

    refusals = {"dynamic": dynamic_refusal, "native": native_refusal}
    return [k for k in kernels if k not in refusals or refusals[k](torch.device("cpu")) is None]


def shared_token_cache(corpus: Path) -> Path:
    """Where this worker's runs over `corpus` keep its tokenizer and tokens: beside the corpus, so the first
    run builds them and the others reuse them, as a user's runs do (a cache's own behaviour, built, reused,
    damaged, is tested in test_data.py and test_reliability.py with caches of their own)."""
    return corpus.parent / f"{corpus.name}-token-cache"


def train_small_run(folder: Path, corpus: Path, *overrides: str) -> Path:
    """Train a few steps on the small corpus, writing under `folder`; the path of its last.ckpt."""
    from lm.config.train import TrainRun
    from lm.training.run import train

    cfg = compose_config("train", [
        "data=text", f"data.paths=[{corpus}]", "data.vocab_size=512", "data.batch_size=4", *TINY_MODEL,
        "trainer=cpu", "trainer.max_steps=3", "trainer.val_every_n_steps=3", "trainer.limit_val_batches=1",
        "trainer.progress_bar=false", "logger=none", "sample.max_new_tokens=0", *overrides,
    ])
    with open_dict(cfg):
        cfg.checkpoint_dir = str(folder / "checkpoints")
        cfg.data.cache_dir = str(shared_token_cache(corpus))
    return Path(train(TrainRun.from_config(cfg))["last"])


@pytest.fixture
def train_config(tmp_path, small_corpus):
    """A factory: the training run (a TrainRun) over the small corpus, writing only under tmp_path (and the
    corpus's shared token cache)."""

    from lm.config.train import TrainRun

    def make(*overrides: str) -> TrainRun:
        cfg = compose_config("train", [
            "data=text", f"data.paths=[{small_corpus}]", "data.vocab_size=512", "data.batch_size=4",
            # AdamW: the learning rates and bounds of the tests that use this were set for it; the
            # default optim=muon has its own (test_optim.py, test_recipe_bench.py, the slow train.py runs)
            *TINY_MODEL, "optim=adamw", "trainer=cpu", "trainer.max_steps=6", "trainer.val_every_n_steps=3",
            "trainer.limit_val_batches=2", "trainer.progress_bar=false", "logger=csv", "optim.warmup_steps=2",
            "sample.max_new_tokens=4", *overrides,
        ])
        with open_dict(cfg):
            cfg.checkpoint_dir = str(tmp_path / "checkpoints")
            cfg.data.cache_dir = str(shared_token_cache(small_corpus))
        return TrainRun.from_config(cfg)

    return make


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu run only where torch sees a CUDA device, or where LM_GPU_TIER_DEVICE names
    another device for the tier's device-independent checks (tests/test_gpu.py)."""
    import torch

    if torch.cuda.is_available() or os.environ.get("LM_GPU_TIER_DEVICE"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def uptrain_teacher(tmp_path_factory, small_corpus) -> Path:
    """A 4-head MHA run of 6 steps on the small corpus: the parent the uptraining tests convert. Without
    the default shape's QK-norm, which MLA and aligned pooling cannot carry (they refuse it in one line)."""
    return train_small_run(tmp_path_factory.mktemp("teacher"), small_corpus, "attn=mha", "trainer.max_steps=6",
                           "trainer.val_every_n_steps=6", "trainer.limit_val_batches=2", "run_name=teacher",
                           "model.qk_norm=null")
