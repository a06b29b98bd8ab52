"""`scripts/bench.py int8 --ckpt ...`: a trained model against its int8 copy on the built-in corpus's
validation split: how often their next-token choices agree, their logits' largest difference, both
losses and both weights' bytes. An accuracy measure; `bench.py decode` and `kernels` time int8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def validation_windows(tokenizer, tokens: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (windows, seq_len): at most `tokens` of the built-in corpus's
    validation split, cut into whole windows."""
    from lm.config.compose import compose_train
    from lm.data.corpora import build_corpus
    from lm.evaluation.perplexity import split_documents, token_stream

    data_cfg = compose_train(["data=pystdlib"]).data
    ids, _, _, _ = token_stream(split_documents(build_corpus(data_cfg), "val", float(data_cfg.val_fraction)),
                                tokenizer)
    windows = ids[: (min(len(ids), tokens) - 1) // seq_len * seq_len + 1]
    return windows[:-1].view(-1, seq_len), windows[1:].view(-1, seq_len)  # (windows, T) each


def bench_int8(args) -> dict:
    """Prints the comparison; returns it as plain data (--json)."""
    from lm import load
    from lm.generation.quantize import Int8Linear, quantize_int8, weight_bytes

    model, tokenizer = load(args.ckpt)
    int8 = quantize_int8(model, args.int8_kernel)
    kernel = next(m.kernel for m in int8.modules() if isinstance(m, Int8Linear))  # what `auto` chose
    inputs, targets = validation_windows(tokenizer, args.tokens, model.config.max_seq_len)
    agree = total = 0
    worst = spread = 0.0
    nll = {"fp32": 0.0, "int8": 0.0}
    with torch.no_grad():
        for x, y in zip(inputs.split(8), targets.split(8), strict=True):
            full, approx = model(x), int8(x)  # (b, T, V)
            agree += int((full.argmax(-1) == approx.argmax(-1)).sum())
            total += y.numel()
            worst = max(worst, float((approx - full).abs().max()))
            spread = max(spread, float(full.std()))
            nll["fp32"] += float(F.cross_entropy(full.flatten(0, 1), y.flatten(), reduction="sum"))
            nll["int8"] += float(F.cross_entropy(approx.flatten(0, 1), y.flatten(), reduction="sum"))
    results = {"ckpt": str(args.ckpt), "int8_kernel": kernel, "tokens": total, "agreement": agree / total,
               "max_logit_difference": worst, "logit_std": spread, "loss_fp32": nll["fp32"] / total,
               "loss_int8": nll["int8"] / total, "weight_bytes_fp32": weight_bytes(model),
               "weight_bytes_int8": weight_bytes(int8), "embedding_bytes": model.embed.weight.numel() * 4}
    print(f"{args.ckpt}: {total:,} validation tokens of the built-in corpus, int8 kernel {kernel}")
    print(f"next-token argmax agreement int8 vs fp32: {results['agreement']:.2%}")
    print(f"largest logit difference {worst:.4f} (logits' standard deviation {spread:.3f})")
    print(f"loss fp32 {results['loss_fp32']:.4f}, int8 {results['loss_int8']:.4f}")
    print(f"weights: fp32 {results['weight_bytes_fp32']:,} bytes, int8 {results['weight_bytes_int8']:,} bytes "
          f"(the embedding stays float: {results['embedding_bytes']:,} bytes)")
    return results
