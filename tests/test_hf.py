"""Export to and import from transformers, proven by identical logits and greedy tokens."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lm import ConfigError, ModelConfig, Transformer, generate, load
from lm.attention import SlidingSpec, SoftmaxSpec, layer_specs
from lm.attention.dsa import SparseLatentSpec
from lm.attention.gated_delta import GatedDeltaSpec
from lm.attention.kda import KimiDeltaSpec
from lm.attention.mla import LatentSpec
from lm.data.tokenizer import train_tokenizer
from lm.formats.hf import export_hf
from lm.formats.qwen3_next import GATED_SOFTMAX

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install -e .[hf]) is not installed")
ROOT = Path(__file__).resolve().parents[1]

KIMI_MLA = LatentSpec(kv_rank=12, rope_dim=2, rope=False, latent_norm=True)  # Kimi Linear's MLA layer

VARIANTS = {
    "mha-tied": dict(n_head=4, n_kv_head=4, tie_embeddings=True, vocab_size=301),
    "gqa-untied": dict(n_head=6, n_kv_head=2, tie_embeddings=False, vocab_size=317),
    "mqa-tied": dict(n_head=4, n_kv_head=1, tie_embeddings=True, vocab_size=263),
    "sliding-gqa": dict(n_head=4, n_kv_head=2, tie_embeddings=False, vocab_size=289, attention=SlidingSpec(window=5)),
    "qk-norm-gqa": dict(n_head=4, n_kv_head=2, tie_embeddings=False, vocab_size=271,
                        attention=SoftmaxSpec(qk_norm=True)),
}
# Export only (import reads Llama, Mistral and Qwen3): Qwen3-Next's two layers and Kimi Linear's, the
# DeltaNet's and KDA's chunks shorter than compare()'s 24 tokens (transformers' own chunks are 64: the chunking
# changes how, not what). rope_theta, the kernel and the tied variant's epsilon away from Qwen3NextConfig's
# defaults, so a setting the export failed to write would show; Kimi Linear's kernel and ranks away from
# KimiLinearConfig's, and tied embeddings, which its class never ties.
EXPORTED = {**VARIANTS,
            "qwen3-next": dict(n_head=4, n_kv_head=4, tie_embeddings=False, vocab_size=293, norm_eps=1e-6,
                               rope_theta=5e5, attention=[GatedDeltaSpec(chunk_size=8, conv_size=3), GATED_SOFTMAX]),
            "qwen3-next-gated-gqa": dict(n_head=4, n_kv_head=2, tie_embeddings=True, vocab_size=281,
                                         attention=GATED_SOFTMAX),
            "kimi-linear": dict(n_head=4, n_kv_head=4, tie_embeddings=True, vocab_size=277, norm_eps=1e-6,
                                attention=[KimiDeltaSpec(chunk_size=8, conv_size=3, gate_bias=False), KIMI_MLA]),
            # KDA without a convolution: Kimi Linear's of one tap of weight 1 (SiLU stays in both)
            "kimi-linear-no-conv": dict(n_head=4, n_kv_head=4, tie_embeddings=False, vocab_size=269, norm_eps=1e-6,
                                        attention=[KimiDeltaSpec(chunk_size=8, conv_size=0, gate_bias=False),
                                                   KIMI_MLA])}
ARCHITECTURES = {"sliding-gqa": "MistralForCausalLM", "qk-norm-gqa": "Qwen3ForCausalLM",
                 "qwen3-next": "Qwen3NextForCausalLM", "qwen3-next-gated-gqa": "Qwen3NextForCausalLM",
                 "kimi-linear": "KimiLinearForCausalLM",
                 "kimi-linear-no-conv": "KimiLinearForCausalLM"}  # others: Llama


def scramble_norm_gains(model: torch.nn.Module) -> None:
    """Norm gains away from their initial ones, so a gain read from the wrong place shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.uniform_(0.5, 1.5)


@pytest.fixture(scope="module")
def tokenizer():
    text = (Path(__file__).read_text() + Path(ROOT / "lm" / "model" / "transformer.py").read_text()) * 2
    return train_tokenizer(iter([text]), 260)


def native_model(variant):
    torch.manual_seed(0)
    fields = {"n_layer": 2, "d_ff": 80, "max_seq_len": 64, "init_std": 0.1, **EXPORTED[variant]}
    fields["d_model"] = 8 * fields["n_head"]
    model = Transformer(ModelConfig(**fields)).eval()
    scramble_norm_gains(model)
    return model


def compare(ours: Transformer, theirs, vocab: int):
    idx = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))  # longer than the window
    with torch.no_grad():
        ours_logits, their_logits = ours(idx), theirs(input_ids=idx).logits
    assert (ours_logits - their_logits).abs().max().item() < 1e-4
    prompt = idx[:1, :7]
    theirs.generation_config.eos_token_id = None  # ours does not stop at EOT; min_new_tokens would forbid it instead
    with torch.no_grad():
        their_tokens = theirs.generate(prompt, max_new_tokens=16, do_sample=False)[0].tolist()
    assert generate(ours, prompt, 16)[0] == their_tokens


@pytest.mark.parametrize("variant", list(EXPORTED))
def test_export_loads_in_transformers_with_the_same_logits_and_tokens(variant, tokenizer, tmp_path):
    model = native_model(variant)
    export_hf(model, tokenizer, tmp_path)
    theirs, loading = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                                         output_loading_info=True)
    theirs.eval()
    assert not any(loading.values()), loading  # every weight of theirs written, none left over
    assert type(theirs).__name__ == ARCHITECTURES.get(variant, "LlamaForCausalLM")
    assert theirs.config.num_key_value_heads == model.config.n_kv_head
    assert theirs.config.num_hidden_layers == model.config.n_layer
    assert theirs.config.max_position_embeddings == model.config.max_seq_len
    compare(model, theirs, model.config.vocab_size)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "def forward(self, x):\n    return x"
    assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text).ids
    assert hf_tokenizer.eos_token == "<|endoftext|>"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_import_of_a_transformers_folder_matches_it(variant, tokenizer, tmp_path):
    fields = VARIANTS[variant]
    n_head = fields["n_head"]
    common = dict(vocab_size=fields["vocab_size"], hidden_size=8 * n_head, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=n_head, num_key_value_heads=fields["n_kv_head"], max_position_embeddings=64,
                  tie_word_embeddings=fields["tie_embeddings"], initializer_range=0.1)
    torch.manual_seed(2)
    if variant == "sliding-gqa":
        theirs = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=5, **common))
    elif variant == "qk-norm-gqa":
        theirs = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, rms_norm_eps=1e-5, **common))
    else:
        theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    scramble_norm_gains(theirs)
    theirs.eval().save_pretrained(tmp_path)
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    hf_tokenizer.save_pretrained(tmp_path)
    ours, _ = load(tmp_path)
    assert ours.config.attention == [fields.get("attention", SoftmaxSpec())] * 2
    compare(ours, theirs, fields["vocab_size"])


@pytest.mark.parametrize("attention, message", [
    ("linear", "attention 2 x linear(feature_map=elu, chunk_size=64, eps=1e-06) has no transformers equivalent"),
    (["linear", "softmax"], "1 x linear(feature_map=elu, chunk_size=64, eps=1e-06), 1 x softmax(gate=none, "),
    (SlidingSpec(window=4, dilation=2), "2 x sliding(gate=none, qk_norm=False, window=4, dilation=2, sink_tokens=0, "),
    ([SlidingSpec(window=4), SlidingSpec(window=8)], "one undilated sliding window in every layer"),
    (layer_specs("sliding", 2, global_every=2), "one undilated sliding window in every layer"),
    ("efficient", "attention 2 x efficient(chunk_size=64) has no transformers equivalent"),
    ("additive", "attention 2 x additive(block=64) has no transformers equivalent"),
    ("lowrank", "attention 2 x lowrank(block=64, rank=8) has no transformers equivalent"),
    (SlidingSpec(window=4, sink_tokens=2), "window=4, dilation=1, sink_tokens=2, learned_sink=False, softcap=None) "),
    (SoftmaxSpec(learned_sink=True), "qk_norm=False, learned_sink=True, softcap=None) has no transformers equivalent"),
    (SlidingSpec(window=4, qk_norm=True), "qk_norm=True, window=4, dilation=1, sink_tokens=0, learned_sink=False, "),
    (SoftmaxSpec(gate="headwise"), "attn.gate=headwise cannot be exported to transformers: Qwen3-Next, the "
                                   "transformers architecture with gated attention, gates every channel"),
    (SoftmaxSpec(gate="elementwise"), "attn.gate=elementwise cannot be exported"),  # Qwen3-Next's also norms q, k
    ([GatedDeltaSpec(), GATED_SOFTMAX], "model.norm_eps=1e-05 with the DeltaNet's attn.norm_eps=[1e-06] cannot be "
                                        "exported to Qwen3-Next exactly: it L2-normalises q and k with 1e-06"),
    ([GatedDeltaSpec(), GatedDeltaSpec()], "a stack of Gated DeltaNet layers alone cannot be exported to Qwen3-Next"),

    ([GatedDeltaSpec(), "linear"], "the nearest class, Qwen3-Next (Qwen3NextForCausalLM) takes Gated DeltaNet "
                                   "layers beside softmax layers with qk_norm and gate=elementwise"),
    (["softmax", SoftmaxSpec(softcap=30.0)], "attn.softcap=30.0 cannot be exported to transformers: Gemma 2"),
    (LatentSpec(kv_rank=12, rope_dim=4), "attn=mla cannot be exported to transformers on its own"),
    (SparseLatentSpec(kv_rank=12, rope_dim=4), "attn=dsa cannot be exported to transformers: DeepSeek-V3.2"),
])
def test_kinds_without_an_equivalent_are_refused(attention, message, tokenizer, tmp_path):
    model = Transformer(ModelConfig(vocab_size=300, n_layer=2, d_model=32, n_head=4, d_ff=48, attention=attention))
    with pytest.raises(ConfigError, match=re.escape(message)):
        export_hf(model, tokenizer, tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("fields, message", [
    (dict(n_kv_head=2), r"^attn.n_kv_head=2 cannot be exported to Qwen3-Next: its DeltaNet gives every value head its "
                        r"own state"),
    (dict(attention=[GatedDeltaSpec(conv_size=3), GATED_SOFTMAX, GatedDeltaSpec()]),
     r"^Gated DeltaNet layers with conv_size \[3, 4\] cannot be exported to Qwen3-Next: its linear_conv_kernel_dim"),
])
def test_a_qwen3_next_stack_it_cannot_hold_is_refused(fields, message, tokenizer, tmp_path):
    fields = {"attention": [GatedDeltaSpec(), GATED_SOFTMAX], **fields}
    model = Transformer(ModelConfig(vocab_size=300, n_layer=len(fields["attention"]), d_model=32, n_head=4, d_ff=48,
                                    norm_eps=1e-6, **fields))
    with pytest.raises(ConfigError, match=message):
        export_hf(model, tokenizer, tmp_path)
    assert not any(tmp_path.iterdir())


KIMI = [KimiDeltaSpec(gate_bias=False), KIMI_MLA]


@pytest.mark.parametrize("attention, fields, message", [
    (KIMI, dict(n_kv_head=2), r"^attn.n_kv_head=2 cannot be exported to Kimi Linear: its KDA gives every head its own"),
    ([KimiDeltaSpec(), KIMI_MLA], {}, r"^attn.gate_bias=true cannot be exported to Kimi Linear: its KDA output gate"),
    ([KIMI[0], LatentSpec(kv_rank=12, rope_dim=2, latent_norm=True)], {},
     r"^attn.rope=true in an MLA layer cannot be exported to Kimi Linear: its MLA rotates nothing"),
    ([KIMI[0], LatentSpec(kv_rank=12, rope_dim=2, rope=False)], {},
     r"^attn.latent_norm=false in an MLA layer cannot .* RMS-normalises the latent \(kv_a_layernorm\)"),
    ([KIMI[0], LatentSpec(kv_rank=12, rope_dim=2, rope=False, latent_norm=True, q_rank=16)], {},
     r"^attn.q_rank=16 in an MLA layer cannot be exported to Kimi Linear: its MLA projects queries in full"),
    ([KIMI[0], KIMI_MLA, KIMI[0], LatentSpec(kv_rank=10, rope_dim=2, rope=False, latent_norm=True)], {},
     r"^MLA layers with \(kv_rank, rope_dim\) \[\(10, 2\), \(12, 2\)\] cannot be exported to Kimi Linear"),
    ([KimiDeltaSpec(gate_bias=False, conv_size=3), KIMI_MLA, KIMI[0]], {},
     r"^KDA layers with conv_size \[3, 4\] cannot be exported to Kimi Linear: its linear_conv_kernel_dim"),
    ([KimiDeltaSpec(gate_bias=False, conv_size=0), KIMI_MLA, KIMI[0]], {},
     r"^KDA layers with conv_size \[0, 4\] cannot be exported to Kimi Linear: .* \(conv_size 0 counts as 1\)"),
    ([KIMI[0], KIMI[0]], {}, r"^a stack of KDA layers alone cannot be exported to Kimi Linear"),
    (KIMI, dict(norm_eps=1e-5), r"^model.norm_eps=1e-05 with KDA's attn.norm_eps=\[1e-06\] cannot be exported to "
                                r"Kimi Linear exactly"),
])
def test_a_kimi_linear_stack_it_cannot_hold_is_refused(attention, fields, message, tokenizer, tmp_path):
    fields = {"norm_eps": 1e-6, **fields}
    model = Transformer(ModelConfig(vocab_size=300, n_layer=len(attention), d_model=32, n_head=4, d_ff=48,
                                    attention=attention, **fields))
    with pytest.raises(ConfigError, match=message):
        export_hf(model, tokenizer, tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_export_and_import_scripts_round_trip(tokenizer, tmp_path):
    from lm.formats.checkpoint import save_checkpoint

    model = native_model("gqa-untied")
    ckpt = save_checkpoint(tmp_path / "run" / "last.ckpt", model.state_dict(), model.config, tokenizer.to_str())
    run = lambda *args: subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=180)  # noqa: E731
    exported = run(str(ROOT / "scripts" / "export.py"), f"ckpt={ckpt}", "format=hf", f"out={tmp_path / 'hf'}")
    assert exported.returncode == 0, exported.stderr
    imported = run(str(ROOT / "scripts" / "import_hf.py"), f"src={tmp_path / 'hf'}", f"out={tmp_path / 'back'}")
    assert imported.returncode == 0, imported.stderr
    back, _ = load(tmp_path / "back" / "last.ckpt")
    idx = torch.randint(0, 317, (1, 12))
    with torch.no_grad():
        assert torch.equal(back(idx), model(idx))


def test_imported_model_trains_here(tmp_path, small_corpus, tokenizer):
    from conftest import train_small_run

    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True))
    theirs.save_pretrained(tmp_path / "hf")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(
        tmp_path / "hf")
    last = train_small_run(tmp_path, small_corpus, f"init_from={tmp_path / 'hf'}", "trainer.max_steps=2",
                           "trainer.val_every_n_steps=2")
    model, tok = load(last)
    assert (model.config.n_kv_head, model.config.vocab_size) == (2, 300)
    text = "def main():\n    return 0"
    assert tok.encode(text).ids == tokenizer.encode(text).ids  # the folder's tokenizer came along
