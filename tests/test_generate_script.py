"""scripts/generate.py on a real checkpoint: streaming output, batches, stats, and bad input."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import compose_config, train_small_run

from lm import GenerationError, ModelConfig, Transformer, generate
from lm.config.settings import typed
from lm.generation.quantize import choose_kernel
from lm.generation.settings import GenerateSettings
from lm.generation.text import generate_text
from lm.util.cli import exit_on_user_error, quote_text_overrides

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, small_corpus) -> Path:
    return train_small_run(tmp_path_factory.mktemp("gen"), small_corpus, "attn=gqa")


def run_script(*args, cwd):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.slow
def test_script_streams_a_continuation_and_prints_stats(checkpoint, tmp_path):
    result = run_script(f"ckpt={checkpoint}", "prompt=def fibonacci(n):", "max_new_tokens=12", "stats=true",
                        "temperature=0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def fibonacci(n):") and len(result.stdout) > len("def fibonacci(n):\n")
    assert "prompt tokens" in result.stderr and "tokens/s" in result.stderr and "bytes" in result.stderr
    assert list(tmp_path.iterdir()) == []  # generation writes nothing


def test_int8_script_run_reports_a_quarter_of_the_matmul_bytes(checkpoint, capsys):
    texts = generate_text(compose_generate(f"ckpt={checkpoint}", "prompt=import os", "max_new_tokens=6",
                                           "temperature=0", "quantize=int8", "stats=true"))
    assert texts[0].startswith("import os")
    err = capsys.readouterr().err
    fp32 = generate_text(compose_generate(f"ckpt={checkpoint}", "prompt=import os", "max_new_tokens=6",
                                          "temperature=0", "stats=true"))
    fp32_err = capsys.readouterr().err
    assert fp32[0].startswith("import os")
    weights = [int(re.search(r"weights ([\d,]+) bytes", e).group(1).replace(",", "")) for e in (err, fp32_err)]
    assert weights[0] < weights[1]  # the float embedding stays; every matmul weight shrinks to a quarter
    auto, _ = choose_kernel(torch.device("cpu"))  # dynamic with VNNI, else native where it builds
    assert f"(int8, kernel {auto})" in err and "int8" not in fp32_err  # the kernel that ran is named
    assert err.startswith(f"int8_kernel=auto: {auto}")  # ... and at the start, why auto chose it


@pytest.mark.slow
def test_script_rejects_bad_input_in_one_line(checkpoint, tmp_path):
    result = run_script(f"ckpt={tmp_path / 'missing.ckpt'}", "prompt=hello", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: checkpoint '{tmp_path / 'missing.ckpt'}' does not exist"]
    assert list(tmp_path.iterdir()) == []


def compose_generate(*overrides) -> GenerateSettings:
    """scripts/generate.py's settings, as the script builds them from its command line."""
    quoted = quote_text_overrides(list(overrides), keys=("prompt", "prompt_file"))
    return typed(GenerateSettings, compose_config("generate", list(quoted)))


def test_prompt_file_decodes_a_batch(checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\n\ndef main():\nclass A(object):\n")
    texts = generate_text(compose_generate(f"ckpt={checkpoint}", f"prompt_file={prompts}", "max_new_tokens=5",
                                           "temperature=0"))
    assert [t.split("\n")[0][:9] for t in texts] == ["import os", "def main(", "class A(o"]
    assert capsys.readouterr().out.count("=== ") == 3


# A prompt with a byte that is no UTF-8 (0xff): refused alike however it arrives, never replaced by U+FFFD.
UNDECODABLE = b"def f():\n    return '\xff'\n"


@pytest.mark.parametrize("source", ["prompt", "prompt_file", "stdin"])
def test_undecodable_prompt_bytes_are_refused_alike_from_every_source(source, tmp_path):
    from lm.generation.text import read_prompts

    stdin = None
    if source == "prompt":  # what the shell hands Python for bytes it cannot decode: lone surrogates
        settings = GenerateSettings(ckpt="x", prompt=UNDECODABLE.decode("utf-8", "surrogateescape"))
    elif source == "prompt_file":
        (tmp_path / "p.txt").write_bytes(UNDECODABLE)
        settings = GenerateSettings(ckpt="x", prompt_file=str(tmp_path / "p.txt"))
    else:
        import io

        settings, stdin = GenerateSettings(ckpt="x", prompt_file="-"), io.BytesIO(UNDECODABLE)
    with pytest.raises(GenerationError, match=r"not valid UTF-8 text"):
        read_prompts(settings, stdin)


def test_prompts_read_from_standard_input_and_refused_in_one_line_there(checkpoint, tmp_path, monkeypatch, capsys):
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"import os\n\nclass A:\n")))
    texts = generate_text(compose_generate(f"ckpt={checkpoint}", "prompt_file=-", "max_new_tokens=3",
                                           "temperature=0"))
    assert [t[:8] for t in texts] == ["import o", "class A:"]  # two prompts, the blank line skipped
    assert capsys.readouterr().out.count("=== ") == 2
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), f"ckpt={checkpoint}",
                          "prompt_file=-"], input=UNDECODABLE, capture_output=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == b""
    assert bad.stderr.decode().strip().splitlines() == [
        f"error: prompt_file=- is not valid UTF-8 text: byte 0xff at offset {UNDECODABLE.index(0xff)}"]


def test_stop_string_cuts_the_streamed_text(checkpoint, capsys):
    free = generate_text(compose_generate(f"ckpt={checkpoint}", "prompt=def f(x):", "max_new_tokens=20",
                                          "temperature=0"))[0]
    continuation = free[len("def f(x):"):]
    stop = continuation[4:6]
    capsys.readouterr()
    cut = generate_text(compose_generate(f"ckpt={checkpoint}", "prompt=def f(x):", "max_new_tokens=20",
                                         "temperature=0", f"stop=[{stop!r}]"))[0]
    assert cut == free[: len("def f(x):") + continuation.find(stop)]
    assert capsys.readouterr().out == cut + "\n"


def incompatible_copy(checkpoint: Path, folder: Path) -> Path:
    ckpt = torch.load(checkpoint, weights_only=True)
    ckpt["lm"]["format_version"] = 99
    path = folder / "old.ckpt"
    torch.save(ckpt, path)
    return path


@pytest.mark.parametrize("override, message", [
    ("prompt=", "the prompt is empty"),
    ("top_p=1.5", "top_p=1.5 must be in (0, 1]"),
    ("top_p=0", "top_p=0 must be in (0, 1]"),
    ("temperature=-1", "temperature=-1 must be a finite number >= 0"),
    ("max_new_tokens=-1", "max_new_tokens=-1 must be an integer >= 0"),
    ("quantize=int4", "quantize='int4' must be null or int8"),
    ("int8_kernel=fast", "int8_kernel='fast' must be one of ['auto', 'dynamic', 'native', 'dequant', 'int8pack']"),
    ("compile=sometimes", "compile='sometimes' must be true or false"),
    ("CORRUPT", "is not a readable torch file"),
    ("INCOMPATIBLE", "has format_version=99; this lm reads versions 1, 2; a newer lm wrote it: upgrade lm"),
])
def test_bad_input_exits_2_with_one_line(checkpoint, tmp_path, capsys, override, message):
    ckpt = checkpoint
    if override == "CORRUPT":
        ckpt = tmp_path / "corrupt.ckpt"
        ckpt.write_bytes(checkpoint.read_bytes()[:5000])
    elif override == "INCOMPATIBLE":
        ckpt = incompatible_copy(checkpoint, tmp_path)
    overrides = [f"ckpt={ckpt}", "prompt=hello", "max_new_tokens=4"]
    if "=" in override:
        overrides.append(override)
    with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
        generate_text(compose_generate(*overrides))
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_free_text_overrides_are_quoted_for_hydra():
    raw = "x = f(a, b) + '${y}' \\"
    cfg = compose_generate("ckpt=c", f"prompt={raw}")
    assert cfg.prompt == raw


@pytest.mark.parametrize("key, typed, value", [
    ("seed", "-1", -1), ("seed", "1.5", 1.5), ("top_p", "1.5", 1.5), ("top_p", "true", True), ("top_k", "0", 0),
    ("top_k", "2.5", 2.5), ("min_p", "2", 2), ("temperature", "-1", -1), ("temperature", "inf", float("inf")),
    ("repetition_penalty", "0", 0), ("max_new_tokens", "-1", -1), ("use_cache", "maybe", "maybe"),
    ("compile", "sometimes", "sometimes"), ("truncate", "right", "right"), ("stop", "['']", [""]),
    ("stop", "['a','']", ["a", ""]),
])
def test_the_script_and_the_api_refuse_a_value_with_the_same_line(tmp_path, key, typed, value):
    """scripts/generate.py checks its settings with lm.generate's own checks, before it loads anything."""
    model = Transformer(ModelConfig(vocab_size=32, n_layer=1, d_model=16, n_head=2, d_ff=32, max_seq_len=16))
    with pytest.raises(GenerationError) as api:
        generate(model, [[1, 2]], **{"max_new_tokens": 3, key: value})
    with pytest.raises(GenerationError) as script:
        generate_text(compose_generate(f"ckpt={tmp_path / 'none.ckpt'}", "prompt=x", f"{key}={typed}"))
    assert str(script.value) == str(api.value) and "\n" not in str(api.value)


def test_extreme_accepted_values_give_their_limit_through_the_script(checkpoint, capsys):
    def text(*overrides):
        return generate_text(compose_generate(f"ckpt={checkpoint}", "prompt=def f(x):", "max_new_tokens=8", "seed=0",
                                              *overrides))[0]

    greedy = text("temperature=0")
    assert text("temperature=1e-300") == text("temperature=1e-45") == greedy
    assert text("temperature=1", "top_p=1e-320") == greedy
    for extreme in (("temperature=1e300",), ("temperature=1", "repetition_penalty=1e-300"),
                    ("temperature=1", "repetition_penalty=1e300"), ("temperature=1", "top_k=1000000000000")):
        assert text(*extreme).startswith("def f(x):")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has an MPS device")
def test_a_device_this_torch_lacks_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
        generate_text(compose_generate(f"ckpt={tmp_path / 'none.ckpt'}", "prompt=x", "device=mps"))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: device='mps': this torch has no MPS device; use device=cpu\n"
