"""The GGUF export run by llama.cpp itself (llama-cpp-python): our tokenizer's ids, our greedy tokens.

llama-cpp-python compiles llama.cpp when it is installed (`pip install -e .[llama]`: about 6 minutes on a
2-core CPU), so it is not in `make install`; `make test-all` installs it and runs these tests."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import train_small_run

from lm import generate, load
from lm.formats.gguf import export_gguf

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e .[llama])")
pytestmark = pytest.mark.slow


def run_in_llama_cpp(path: Path, context: int):
    return llama_cpp.Llama(model_path=str(path), n_ctx=context, logits_all=True, verbose=False, seed=0,
                           n_threads=2)


@pytest.mark.parametrize("attn", ["mha", "gqa", "mqa"])
def test_llama_cpp_greedy_tokens_equal_ours(attn, tmp_path, small_corpus):
    # The default training config (train.yaml), shrunk: a checkpoint as `make train` writes them.
    ckpt = train_small_run(tmp_path, small_corpus, f"attn={attn}", "trainer.max_steps=20", "optim.warmup_steps=5")
    model, tokenizer = load(ckpt)
    path = export_gguf(model, tokenizer, tmp_path / "model.gguf", "f32")
    llm = run_in_llama_cpp(path, model.config.max_seq_len)

    text = "def main(argv):\n    return <|endoftext|>import os"
    prompt = tokenizer.encode(text).ids
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == prompt

    llm.eval(prompt)
    theirs = torch.from_numpy(np.asarray(llm.scores[: len(prompt)], dtype=np.float32))  # (T, V)
    with torch.no_grad():
        ours = model(torch.tensor([prompt]))[0]
    # llama.cpp keeps its KV cache in f16: measured 7e-5 (MHA) to 1e-3 (GQA) on logits of spread ~10
    assert (ours - theirs).abs().max().item() < 5e-3

    new = model.config.max_seq_len - len(prompt)
    llm.reset()
    their_tokens = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        their_tokens.append(token)
        if len(their_tokens) == new:
            break
    assert generate(model, [prompt], new)[0][len(prompt):] == their_tokens
