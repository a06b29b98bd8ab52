"""GGUF export, read back by gguf's reader and run by transformers' GGUF loader: same logits, same tokens."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lm import ConfigError, ModelConfig, Transformer, generate
from lm.attention import SlidingSpec, SoftmaxSpec
from lm.attention.mla import LatentSpec
from lm.data.tokenizer import train_tokenizer
from lm.formats.gguf import export_gguf

gguf = pytest.importorskip("gguf", reason="the gguf extra (pip install -e .[gguf]) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate (the hf extra)")
ROOT = Path(__file__).resolve().parents[1]
# odd sizes: 6 heads of 16 (96 wide, a multiple of Q8_0's 32-number blocks), d_ff 160, vocab 301
VARIANTS = {"mha-tied": dict(n_kv_head=6, tie_embeddings=True), "gqa-untied": dict(n_kv_head=2, tie_embeddings=False),
            "mqa-tied": dict(n_kv_head=1, tie_embeddings=True)}
# the largest |logit difference| each file type is held to, on logits of spread ~1
TOLERANCE = {"f32": 1e-4, "f16": 2e-2, "q8_0": 0.25}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(iter([(ROOT / "lm" / "model" / "transformer.py").read_text() * 3]), 301)


def native(variant):
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=301, n_layer=2, d_model=96, n_head=6, d_ff=160, max_seq_len=64,
                                   init_std=0.1, **VARIANTS[variant])).eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_gguf_loads_in_transformers_with_our_logits(variant, dtype, tokenizer, tmp_path):
    model = native(variant)
    path = export_gguf(model, tokenizer, tmp_path / "model.gguf", dtype)
    reader = gguf.GGUFReader(path)
    assert str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8") == "llama"
    assert len(reader.tensors) == 2 + 9 * 2 + (0 if model.config.tie_embeddings else 1)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf").eval()
    assert theirs.config.num_key_value_heads == model.config.n_kv_head
    idx = torch.randint(0, 301, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(idx) - theirs(input_ids=idx).logits).abs().max().item() < TOLERANCE[dtype]
    if dtype == "f32":
        prompt = idx[:1, :6]
        with torch.no_grad():
            their_tokens = theirs.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0].tolist()
        assert generate(model, prompt, 16)[0] == their_tokens


def test_a_trained_checkpoint_runs_with_our_greedy_tokens(tmp_path, small_corpus):
    from conftest import train_small_run

    from lm import load

    # The default training config (train.yaml, as `make train` runs it), shrunk to test size, in the
    # Llama shape the docs train for export: SwiGLU, no QK-norm.
    model, tokenizer = load(train_small_run(tmp_path, small_corpus, "trainer.max_steps=20", "optim.warmup_steps=5",
                                            "model.mlp=swiglu", "model.qk_norm=null"))
    export_gguf(model, tokenizer, tmp_path / "model.gguf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf").eval()
    prompt = torch.tensor([tokenizer.encode("def main(argv):\n    ").ids])
    new = model.config.max_seq_len - prompt.shape[1]
    with torch.no_grad():
        their_tokens = theirs.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)[0].tolist()
    assert generate(model, prompt, new)[0] == their_tokens


def test_gguf_tokenizer_encodes_as_ours(tokenizer, tmp_path):
    export_gguf(native("mha-tied"), tokenizer, tmp_path / "model.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf")
    for text in ["def forward(self, x):\n    return  x", "héllo wörld ✓<|endoftext|>next", "   \t\n"]:
        assert theirs(text)["input_ids"] == tokenizer.encode(text).ids
    assert theirs.eos_token == "<|endoftext|>"


def test_qk_norm_is_refused_naming_the_training_setting_and_the_export_that_takes_it(tokenizer, tmp_path):
    # model=nano, the default shape, turns QK-norm on: llama.cpp's llama architecture has no q/k norms
    model = Transformer(ModelConfig(vocab_size=301, n_layer=2, d_model=32, n_head=4, d_ff=48,
                                    attention=SoftmaxSpec(qk_norm=True)))
    with pytest.raises(ConfigError, match=r"attn.qk_norm=True has no GGUF equivalent.*model.qk_norm=null.*Qwen3"):
        export_gguf(model, tokenizer, tmp_path / "model.gguf")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("attention", ["linear", SlidingSpec(window=8), LatentSpec(kv_rank=12, rope_dim=4)], ids=str)
def test_kinds_llama_cpp_cannot_run_are_refused(attention, tokenizer, tmp_path):
    model = Transformer(ModelConfig(vocab_size=301, n_layer=2, d_model=32, n_head=4, d_ff=48, attention=attention))
    with pytest.raises(ConfigError, match="has no GGUF equivalent"):
        export_gguf(model, tokenizer, tmp_path / "model.gguf")
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_export_script_writes_gguf(tokenizer, tmp_path):
    from lm.formats.checkpoint import save_checkpoint

    model = native("gqa-untied")
    ckpt = save_checkpoint(tmp_path / "run" / "last.ckpt", model.state_dict(), model.config, tokenizer.to_str())
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), f"ckpt={ckpt}", "format=gguf",
                          "gguf_type=q8_0", f"out={tmp_path / 'm.gguf'}"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    types = {t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types == {"Q8_0", "F32"}  # matrices Q8_0 (rows of 96 and 160: whole 32-number blocks), norms F32


def test_q8_0_keeps_rows_that_are_not_whole_blocks_in_f16(tokenizer, tmp_path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=301, n_layer=1, d_model=48, n_head=4, d_ff=64, max_seq_len=32))
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(export_gguf(model, tokenizer, tmp_path / "m.gguf",
                                                                             "q8_0")).tensors}
    assert types["blk.0.ffn_down.weight"] == "Q8_0"  # rows of d_ff = 64
    assert types["blk.0.attn_q.weight"] == "F16"  # rows of d_model = 48
