"""Fuzzing every loader with damaged files: a real checkpoint, a real export folder and a real
transformers folder, each corrupted in many ways (types, shapes, sizes, truncation, bytes,
configs). Every case must end in one CheckpointError line naming the file, never a traceback,
a hang or an allocation the file does not justify."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import train_small_run

from lm.formats.checkpoint import export_safetensors, load
from lm.util.errors import CheckpointError, ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def originals(tmp_path_factory, small_corpus) -> dict[str, Path]:
    """A trained checkpoint, its safetensors export and (with transformers) its Llama folder."""
    folder = tmp_path_factory.mktemp("originals")
    # the Llama shape (SwiGLU, no QK-norm), which export_hf writes as a Llama folder
    ckpt = train_small_run(folder, small_corpus, "run_name=good", "model.mlp=swiglu", "model.qk_norm=null")
    model, tokenizer = load(ckpt)
    found = {"ckpt": ckpt, "export": export_safetensors(model, tokenizer, folder / "export")}
    try:
        from lm.formats.hf import export_hf

        found["hf"] = export_hf(model, tokenizer, folder / "hf")
    except ImportError:  # no transformers: the Llama cases are skipped
        pass
    except ConfigError as e:  # ... as export_hf says it; any other refusal is a fault of the test
        if "needs transformers" not in str(e):
            raise
    return found


# ------------------------------------------------------------------ checkpoint mutations


def edit_checkpoint(edit):
    def make(original: Path, out: Path) -> Path:
        ckpt = torch.load(original, weights_only=True)
        edit(ckpt)
        path = out / "bad.ckpt"
        torch.save(ckpt, path)
        return path
    return make


def config_edit(**changes):
    return edit_checkpoint(lambda c: c["lm"]["model_config"].update(changes))


def weight_edit(name: str, new):
    def edit(ckpt):
        ckpt["state_dict"][f"model.{name}"] = new(ckpt["state_dict"][f"model.{name}"])
    return edit_checkpoint(edit)


def drop_weight(name: str):
    return edit_checkpoint(lambda c: c["state_dict"].pop(f"model.{name}"))


def shrink_vocabulary(ckpt):
    """A model of 10 tokens carrying the 512-token tokenizer."""
    ckpt["lm"]["model_config"]["vocab_size"] = 10
    for name in ("model.embed.weight", "model.head.weight"):
        ckpt["state_dict"][name] = ckpt["state_dict"][name][:10].clone()


def byte_edit(edit):
    def make(original: Path, out: Path) -> Path:
        path = out / "bad.ckpt"
        path.write_bytes(edit(bytearray(original.read_bytes())))
        return path
    return make


def flip_bytes(data: bytearray) -> bytes:
    rng = random.Random(0)
    for i in rng.sample(range(len(data) // 4, len(data)), 64):
        data[i] ^= 0xFF
    return bytes(data)


CHECKPOINT_CASES = {
    "n_layer of 10^9": config_edit(n_layer=10**9),
    "d_model of 10^6": config_edit(d_model=10**6),
    "vocab_size of 10^9": config_edit(vocab_size=10**9),
    "d_ff of 10^7": config_edit(d_ff=10**7),
    "max_seq_len of 0": config_edit(max_seq_len=0),
    "n_head of 0": config_edit(n_head=0),
    "n_head as a string": config_edit(n_head="four"),
    "d_model as a string": config_edit(d_model="64"),
    "n_layer negative": config_edit(n_layer=-1),
    "unknown config field": config_edit(n_experts=8),
    "attention not a list": config_edit(attention="everything"),
    "attention of an unknown kind": edit_checkpoint(
        lambda c: c["lm"]["model_config"].update(attention=[{"kind": "nope"}] * 2)),
    "model_config a string": edit_checkpoint(lambda c: c["lm"].update(model_config="big")),
    "lm entry a list": edit_checkpoint(lambda c: c.update(lm=[1, 2])),
    "state_dict a list": edit_checkpoint(lambda c: c.update(state_dict=[1, 2])),
    "format_version 99": edit_checkpoint(lambda c: c["lm"].update(format_version=99)),
    "format_version a string": edit_checkpoint(lambda c: c["lm"].update(format_version="2")),
    "NaN weights": weight_edit("blocks.1.mlp_norm.weight", lambda t: torch.full_like(t, float("nan"))),
    "infinite weights": weight_edit("norm.weight", lambda t: torch.full_like(t, float("inf"))),
    "a weight of the wrong shape": weight_edit("blocks.0.mlp_norm.weight", lambda t: torch.ones(3)),
    "a weight of integers": weight_edit("norm.weight", lambda t: torch.ones_like(t, dtype=torch.int64)),
    "a weight missing": drop_weight("blocks.1.mlp_norm.weight"),
    "an extra weight": edit_checkpoint(lambda c: c["state_dict"].update({"model.blocks.0.extra": torch.ones(2)})),
    "a layer missing": edit_checkpoint(lambda c: [c["state_dict"].pop(k) for k in list(c["state_dict"])
                                                  if k.startswith("model.blocks.1.")]),
    "tokenizer a number": edit_checkpoint(lambda c: c["lm"].update(tokenizer=42)),
    "tokenizer not JSON": edit_checkpoint(lambda c: c["lm"].update(tokenizer="{not json")),
    "tokenizer missing": edit_checkpoint(lambda c: c["lm"].pop("tokenizer")),
    "vocabulary smaller than the tokenizer": edit_checkpoint(shrink_vocabulary),
    "truncated to 10%": byte_edit(lambda d: bytes(d[: len(d) // 10])),
    "truncated to 90%": byte_edit(lambda d: bytes(d[: len(d) * 9 // 10])),
    "empty file": byte_edit(lambda d: b""),
    "flipped bytes": byte_edit(flip_bytes),
    "random bytes": byte_edit(lambda d: random.Random(1).randbytes(len(d))),
}


# ------------------------------------------------------------------ export folder mutations


def folder_edit(edit):
    def make(original: Path, out: Path) -> Path:
        folder = out / "bad"
        shutil.copytree(original, folder)
        edit(folder)
        return folder
    return make


def json_edit(name: str, edit):
    def change(folder: Path):
        values = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps(edit(values)))
    return folder_edit(change)


def model_config_edit(**changes):
    return json_edit("config.json", lambda v: {**v, "model_config": {**v["model_config"], **changes}})


def safetensors_edit(edit):
    def change(folder: Path):
        from safetensors.torch import load_file, save_file

        files = sorted(folder.glob("*.safetensors"))
        state = load_file(str(files[0]))
        edit(state)
        save_file(state, str(files[0]))
    return folder_edit(change)


def first_key_reshaped(state: dict) -> None:
    key = sorted(state)[0]
    state[key] = torch.ones(3, 3)


EXPORT_CASES = {
    "config.json not JSON": folder_edit(lambda f: (f / "config.json").write_text("{oops")),
    "config.json a list": folder_edit(lambda f: (f / "config.json").write_text("[1, 2]")),
    "config.json without model_config": json_edit("config.json", lambda v: {"lm_format_version": 2}),
    "n_layer of 10^9": model_config_edit(n_layer=10**9),
    "d_model as a string": model_config_edit(d_model="64"),
    "n_layer missing": json_edit("config.json", lambda v: {**v, "model_config": {
        k: x for k, x in v["model_config"].items() if k != "n_layer"}}),
    "vocab_size of 10^9": model_config_edit(vocab_size=10**9),
    "n_head of 0": model_config_edit(n_head=0),
    "format_version 99": json_edit("config.json", lambda v: {**v, "lm_format_version": 99}),
    "safetensors truncated": folder_edit(lambda f: (f / "model.safetensors").write_bytes(
        (f / "model.safetensors").read_bytes()[:1000])),
    "safetensors random bytes": folder_edit(lambda f: (f / "model.safetensors").write_bytes(
        random.Random(2).randbytes(5000))),
    "safetensors missing": folder_edit(lambda f: (f / "model.safetensors").unlink()),
    "a weight missing": safetensors_edit(lambda s: s.pop("blocks.1.mlp_norm.weight")),
    "a weight of the wrong shape": safetensors_edit(first_key_reshaped),
    "NaN weights": safetensors_edit(lambda s: s["norm.weight"].fill_(float("nan"))),
    "tokenizer.json missing": folder_edit(lambda f: (f / "tokenizer.json").unlink()),
    "tokenizer.json garbage": folder_edit(lambda f: (f / "tokenizer.json").write_text("][")),
}


HF_CASES = {
    "config.json not JSON": folder_edit(lambda f: (f / "config.json").write_text("not json")),
    "config.json a list": folder_edit(lambda f: (f / "config.json").write_text("[]")),
    "hidden_size missing": json_edit("config.json", lambda v: {k: x for k, x in v.items() if k != "hidden_size"}),
    "hidden_size a string": json_edit("config.json", lambda v: {**v, "hidden_size": "64"}),
    "0 attention heads": json_edit("config.json", lambda v: {**v, "num_attention_heads": 0}),
    "num_hidden_layers of 10^9": json_edit("config.json", lambda v: {**v, "num_hidden_layers": 10**9}),
    "more layers than weights": json_edit("config.json", lambda v: {**v, "num_hidden_layers": 3}),
    "intermediate_size disagrees": json_edit("config.json", lambda v: {**v, "intermediate_size": 999}),
    "num_key_value_heads disagrees": json_edit("config.json", lambda v: {**v, "num_key_value_heads": 1}),
    "weights random bytes": folder_edit(lambda f: (f / "model.safetensors").write_bytes(b"\x00" * 100)),
    "index naming a file outside": folder_edit(lambda f: (f / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "../../../etc/passwd"}}))),
    "index not JSON": folder_edit(lambda f: (f / "model.safetensors.index.json").write_text("{")),
    "tokenizer.json garbage": folder_edit(lambda f: (f / "tokenizer.json").write_text("{\"model\": 5}")),
}

ALL_CASES = [("ckpt", name, make) for name, make in CHECKPOINT_CASES.items()]
ALL_CASES += [("export", name, make) for name, make in EXPORT_CASES.items()]
ALL_CASES += [("hf", name, make) for name, make in HF_CASES.items()]


def assert_one_line_refusal(path: Path) -> str:
    with pytest.raises(CheckpointError) as err:
        load(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message, message
    return message


def test_a_missing_setting_is_named_as_missing(originals, tmp_path):
    message = assert_one_line_refusal(EXPORT_CASES["n_layer missing"](originals["export"], tmp_path))
    assert message.endswith("has no n_layer in its config"), message


@pytest.mark.parametrize("source, make", [(c[0], c[2]) for c in ALL_CASES], ids=[f"{c[0]}: {c[1]}" for c in ALL_CASES])
def test_a_damaged_file_is_one_line_naming_it(originals, tmp_path, source, make):
    if source not in originals:
        pytest.skip("transformers is not installed")
    assert_one_line_refusal(make(originals[source], tmp_path))


HUGE = ["ckpt: n_layer of 10^9", "ckpt: d_model of 10^6", "ckpt: vocab_size of 10^9", "ckpt: d_ff of 10^7",
        "export: n_layer of 10^9", "export: vocab_size of 10^9", "hf: num_hidden_layers of 10^9"]


def test_huge_claims_allocate_nothing(originals, tmp_path):
    """The files claiming huge models, loaded in a fresh process: its peak memory must stay near
    what loading the good checkpoint takes (a 10^9-layer model would need terabytes)."""
    paths = []
    for source, name, make in ALL_CASES:
        if f"{source}: {name}" in HUGE and source in originals:
            out = tmp_path / str(len(paths))
            out.mkdir()
            paths.append(str(make(originals[source], out)))
    script = (
        "import resource, sys\n"
        "from lm.formats.checkpoint import load\n"
        "from lm.util.errors import CheckpointError, ConfigError\n"
        "load(sys.argv[1])\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "for path in sys.argv[2:]:\n"
        "    try:\n"
        "        load(path)\n"
        "    except CheckpointError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit(f'{path} loaded')\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(originals["ckpt"]), *paths], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    grown_kib = int(done.stdout.strip())
    assert grown_kib < 100 * 1024, f"peak memory grew by {grown_kib} KiB"


@pytest.mark.slow
def test_a_damaged_checkpoint_is_one_line_and_exit_2_from_the_script(originals, tmp_path):
    bad = CHECKPOINT_CASES["n_layer of 10^9"](originals["ckpt"], tmp_path)
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), f"ckpt={bad}", "prompt=x"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: checkpoint {str(bad)!r} says n_layer=1000000000 but its "
                                                "weights hold 2 layers"]


def test_a_run_folder_stands_for_its_last_checkpoint(originals):
    model, _ = load(originals["ckpt"].parent)
    assert model.config.n_layer == 2
