"""`scripts/bench.py generate`: each kind's decoding tokens/s, per-token latency at two cache fill
levels and declared cache bytes at the reference shape, beside transformers' `generate` (eager).
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.bench_models import (
    GENERATE_KV_HEADS,
    REFERENCE,
    attention_rows,
    declared_cache_bytes,
    hf_llama,
    reference_model,
    step_times,
    timed,
)
from lm import ModelConfig, Transformer

GQA = "softmax-gqa"  # the row set beside transformers' Llama of the same (GQA) shape


def decode_seconds(run_generate, repeats: int) -> float:
    run_generate()  # warm-up
    return min(timed(run_generate) for _ in range(repeats))


def step_latency(model: Transformer, position: int, steps: int = 16) -> float:
    """Median seconds of one decoding step once `position` tokens are in the cache."""
    from lm.model.generation_cache import GenerationCache

    cache = GenerationCache(model, pad=torch.zeros(1, dtype=torch.long, device=next(model.parameters()).device),
                            max_len=position + steps + 1)
    prompt = torch.randint(0, model.config.vocab_size, (1, position))
    with torch.no_grad():
        for start in range(0, position, 1024):
            model(prompt[:, start:start + 1024], cache=cache)
    return statistics.median(step_times(model.decode_step, cache, 1, steps))  # the fixed-shape step of generation


def kind_row(name: str, prompt: torch.Tensor, args) -> dict:
    """One kind's figures: tokens/s of whole `stream` runs, step latency at each position, and the
    cache it declares once the prompt and the most new tokens are in."""
    from lm.generation.decode import stream

    spec, example = attention_rows()[name]
    n_kv_head = example.kv_heads(REFERENCE["n_head"], GENERATE_KV_HEADS)
    max_len = max(args.new_tokens) + args.prompt + 1
    model = reference_model(spec, n_kv_head, max_seq_len=max(max_len, args.positions[-1] + 32))
    rates = {n: n / decode_seconds(lambda n=n: list(stream(model, prompt, n)), args.repeats) for n in args.new_tokens}
    latency = [step_latency(model, p) for p in args.positions]
    tokens = args.prompt + max(args.new_tokens)
    total = declared_cache_bytes(model, tokens)
    return {"kind": name, "n_kv_head": n_kv_head, "tokens_per_s": {str(n): r for n, r in rates.items()},
            "step_s": {str(p): t for p, t in zip(args.positions, latency, strict=True)},
            "latency_ratio": latency[-1] / latency[0], "cache_bytes_per_token": total / tokens,
            "cache_tokens": tokens, "cache_bytes": total}


def transformers_rates(prompt: torch.Tensor, args) -> dict[str, float]:
    """tokens/s of transformers' LlamaForCausalLM.generate (GQA shape, SDPA, its cache on) at each
    --new-tokens."""
    hf = hf_llama(ModelConfig(**{**REFERENCE, "max_seq_len": max(args.new_tokens) + args.prompt + 1})).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    def hf_generate(n: int) -> None:
        with torch.no_grad():
            hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True)

    return {str(n): n / decode_seconds(lambda n=n: hf_generate(n), args.repeats) for n in args.new_tokens}


def bench_generate(args) -> dict:
    """Prints the table; returns it as plain data (--json)."""
    prompt = torch.randint(0, REFERENCE["vocab_size"], (1, args.prompt))
    threads = torch.get_num_threads()
    print(f"greedy decoding, batch 1, {args.prompt}-token prompt, fp32, {threads} threads; "
          f"reference shape (vocab 8192, 6 layers, d_model 384, 6 heads, SwiGLU 1024)")
    header = "".join(f"{f'tok/s @{n}':>12}" for n in args.new_tokens)
    header += "".join(f"{f'ms @pos {p}':>13}" for p in args.positions)
    header += f"{'latency ratio':>15}{'cache bytes/token':>19}{'cache @' + str(args.prompt + max(args.new_tokens)):>14}"
    print(f"{'kind':24}{'kv heads':>9}{header}")
    rows = []
    for name in args.kinds:
        row = kind_row(name, prompt, args)
        rows.append(row)
        cells = "".join(f"{row['tokens_per_s'][str(n)]:12.1f}" for n in args.new_tokens)
        cells += "".join(f"{row['step_s'][str(p)] * 1e3:13.2f}" for p in args.positions)
        print(f"{name:24}{row['n_kv_head']:9}{cells}{row['latency_ratio']:15.2f}{row['cache_bytes_per_token']:19,.0f}"
              f"{row['cache_bytes']:14,}", flush=True)
    results = {"threads": threads, "prompt": args.prompt, "rows": rows, "transformers": None}
    if args.compare:
        hf_rates = results["transformers"] = transformers_rates(prompt, args)
        cells = "".join(f"{hf_rates[str(n)]:12.1f}" for n in args.new_tokens)
        print(f"{'transformers':24}{2:9}{cells}   (LlamaForCausalLM.generate, gqa shape, SDPA, cache on)")
        gqa = next((row for row in rows if row["kind"] == GQA), None)
        for n in args.new_tokens:
            if gqa is not None:
                print(f"lm gqa / transformers decode tokens/s at {n} new tokens: "
                      f"{gqa['tokens_per_s'][str(n)] / hf_rates[str(n)]:.2f}x")
    return results
