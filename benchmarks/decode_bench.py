"""`scripts/bench.py decode`: every way `lm` decodes, beside transformers and llama.cpp, in one run.

Batch 1, one prompt, the reference shape: transformers' eager `generate` and its static cache with
torch.compile; ours eager, compiled, and int8 with each kernel asked for (eager and compiled); and,
when llama-cpp-python is installed, llama.cpp running the same weights exported to GGUF (F32 and
Q8_0) with the same prompt, threads and new tokens. Then batches of ragged prompts (each row a
different length) beside transformers' batched `generate`, and every kind's decoding step at long
contexts (8k and 32k, batch 1 and 8), where the designs differ.

The contenders of a table run in alternating rounds and each keeps its median time, so background
load hits all of them alike: compare the ratios, not one absolute figure.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.bench_models import (
    GENERATE_KV_HEADS,
    REFERENCE,
    alternate,
    attention_rows,
    bench_device,
    bench_dtype,
    declared_cache_bytes,
    describe_device,
    hf_llama,
    reference_model,
    step_times,
)
from lm import ModelConfig, Transformer, generate
from lm.formats.weights import to_hf_state_dict
from lm.generation.quantize import quantize_int8, weight_bytes
from lm.util.errors import GenerationError


def hf_static_compiled(hf: torch.nn.Module) -> torch.nn.Module:
    """What a transformers user tries first for speed: a static KV cache and a compiled forward. On
    CUDA `generate` compiles the forward itself once the cache is static (its own CompileConfig,
    CUDA graphs included), so only the cache is set there; elsewhere the forward is compiled here."""
    hf = copy.deepcopy(hf)
    hf.generation_config.cache_implementation = "static"
    if next(hf.parameters()).device.type != "cuda":
        hf.forward = torch.compile(hf.forward, fullgraph=True)
    return hf


def as_hf_state(model: Transformer) -> dict:
    """Our weights under transformers' Llama names, so both contenders decode the same function."""
    return to_hf_state_dict(model.state_dict(), model.config)


def hf_twin(model: Transformer, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' Llama holding `model`'s weights in `dtype`, set for greedy batches: no end
    token, so every row decodes its n new tokens, and padding id 0."""
    hf = hf_llama(model.config).eval()
    hf.load_state_dict(as_hf_state(model), strict=False)  # rotary inv_freq buffers are not weights
    hf = hf.to(dtype)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


Run = Callable[[], list[list[int]]]  # one decoding run: every row's prompt and new tokens


def ours(model: Transformer, prompts: list[list[int]], n: int, compile: bool = False,
         compile_mode: str = "default") -> Run:
    return lambda: generate(model, prompts, n, compile=compile, compile_mode=compile_mode)


def autotuned(contenders: dict[str, Run], model: Transformer, prompts: list[list[int]], n: int) -> None:
    """`lm compiled max-autotune` on the CPU (--max-autotune): compile_mode=max-autotune (frozen weights,
    inductor's autotuned matmuls; lm.generation.compiled), for the float model only, as it refuses int8."""
    if next(model.parameters()).device.type == "cpu":
        contenders["lm compiled max-autotune"] = ours(model, prompts, n, compile=True, compile_mode="max-autotune")


def theirs(hf: torch.nn.Module, prompts: list[list[int]], n: int) -> Run:
    """transformers' greedy `generate` over the prompts, left-padded with an attention mask as its
    docs ask for batches; returns each row without its padding."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # (B, width)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # (B, width)

    def run() -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return [row[width - len(p):] for p, row in zip(prompts, out.tolist(), strict=True)]

    return run


def llama_cpp_runs(model: Transformer, prompt: list[int], n: int, folder: Path) -> dict[str, tuple[Run, float]]:
    """{'llama.cpp F32': (run, weight MB), 'llama.cpp Q8_0': ...} on `model`'s weights, or {} when
    llama-cpp-python is not installed. The GGUF files need a tokenizer; a small byte-level BPE
    stands in (the prompt is token ids, so its merges never matter) and the unused ids are padding."""
    try:
        import llama_cpp
    except ImportError:
        return {}
    from lm.data.tokenizer import train_tokenizer
    from lm.formats.gguf import export_gguf

    tokenizer = train_tokenizer(iter([Path(__file__).read_text()]), model.config.vocab_size)
    runs = {}
    for dtype, label in (("f32", "F32"), ("q8_0", "Q8_0")):
        path = export_gguf(model, tokenizer, folder / f"reference-{dtype}.gguf", dtype)
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + n, n_batch=len(prompt),
                              n_threads=torch.get_num_threads(), n_threads_batch=torch.get_num_threads(),
                              verbose=False, seed=0)

        def run(llm=llm) -> list[list[int]]:
            llm.reset()  # from an empty cache every time: no reuse of the previous run's prompt
            new = []
            for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
                new.append(token)
                if len(new) == n:
                    break
            return [prompt + new]

        runs[f"llama.cpp {label}"] = (run, path.stat().st_size / 2**20)
    return runs


def ragged_prompts(batch: int, length: int, vocab_size: int) -> list[list[int]]:
    """`batch` random prompts whose lengths spread evenly from length/2 to 3*length/2."""
    lengths = torch.linspace(length // 2, 3 * length // 2, batch).round().int().tolist()
    return [torch.randint(1, vocab_size, (n,)).tolist() for n in lengths]


def bench_decode(args) -> dict:
    """Prints the tables; returns them as plain data (--json)."""
    device = bench_device(args.device)
    with device:  # every model, cache and prompt tensor made where it decodes
        return decode_on(device, args)


def decode_on(device: torch.device, args) -> dict:
    """The tables on `device`: the CPU in fp32, CUDA in bf16 (as `generate.py dtype=bf16` runs)."""
    torch.manual_seed(0)
    n = args.new_tokens
    widest = 3 * args.prompt // 2 if args.batches else args.prompt  # the longest prompt of any table
    dtype = bench_dtype(device)
    cfg = ModelConfig(**{**REFERENCE, "max_seq_len": widest + n})
    model = Transformer(cfg).eval()
    hf = hf_twin(model, dtype)
    model = model.to(dtype)
    if device.type == "cuda" and args.int8_kernels:
        print("int8 rows: left out on CUDA (the int8 kernels are the CPU's)")
    int8 = {}
    for kernel in args.int8_kernels if device.type == "cpu" else []:
        try:
            int8[kernel] = quantize_int8(model, kernel)
        except GenerationError as e:  # dynamic where this CPU's int8 matmul is not exact
            print(f"lm int8 {kernel}: left out: {e}")
    prompt = [torch.randint(1, cfg.vocab_size, (args.prompt,)).tolist()]
    setting = f"{'bf16' if dtype == torch.bfloat16 else 'fp32'}, {describe_device(device)}"

    contenders = {"transformers eager": theirs(hf, prompt, n),
                  "transformers static+compile": theirs(hf_static_compiled(hf), prompt, n),
                  "lm eager": ours(model, prompt, n), "lm compiled": ours(model, prompt, n, compile=True)}
    weights_mb = dict.fromkeys(contenders, weight_bytes(model) / 2**20)
    for kernel, quantized in int8.items():
        for suffix, compile in (("", False), (" compiled", True)):
            contenders[f"lm int8 {kernel}{suffix}"] = ours(quantized, prompt, n, compile=compile)
            weights_mb[f"lm int8 {kernel}{suffix}"] = weight_bytes(quantized) / 2**20
    if args.max_autotune:
        autotuned(contenders, model, prompt, n)
        if "lm compiled max-autotune" in contenders:
            weights_mb["lm compiled max-autotune"] = weights_mb["lm compiled"]
    with tempfile.TemporaryDirectory() as folder:
        llama_cpp = llama_cpp_runs(model, prompt[0], n, Path(folder)) if device.type == "cpu" else {}
        for name, (run, mb) in llama_cpp.items():
            contenders[name], weights_mb[name] = run, mb
        tokens, first, seconds = alternate(contenders, args.rounds)
    print(f"greedy decoding, batch 1, {args.prompt}-token prompt, {n} new tokens, {setting}; "
          f"reference shape (vocab 8192, 6 layers, d_model 384, 6 heads / 2 KV heads, SwiGLU 1024); "
          f"median of {args.rounds} alternating rounds")
    print(f"{'':40}{'tokens/s':>10}{'vs transformers':>17}{'vs lm eager':>13}{'first call s':>14}{'weight MB':>11}"
          f"{'same tokens':>13}")
    rows = [{"name": name, "tokens_per_s": n / s, "vs_transformers": seconds["transformers eager"] / s,
             "vs_lm_eager": seconds["lm eager"] / s, "first_call_s": first[name], "weight_mb": weights_mb[name],
             "same_tokens": tokens[name] == tokens["lm eager"]} for name, s in seconds.items()]
    for row in rows:
        print(f"{row['name']:40}{row['tokens_per_s']:10.1f}{row['vs_transformers']:16.2f}x"
              f"{row['vs_lm_eager']:12.2f}x{row['first_call_s']:14.1f}{row['weight_mb']:11.1f}"
              f"{str(row['same_tokens']):>13}")
    if device.type == "cuda":
        print("llama.cpp rows: left out on CUDA (llama-cpp-python's CPU build)")
    elif not llama_cpp:
        print("llama.cpp rows: llama-cpp-python is not installed (pip install -e '.[llama]')")
    elif tokens["llama.cpp F32"] != tokens["lm eager"]:
        print("llama.cpp F32's greedy tokens differ from ours (its KV cache is f16: a near-tie can flip)")
    batched = [bench_batched(model, hf, int8, batch, args) for batch in args.batches]
    long_context = bench_long_context(args) if args.contexts else None
    return {"device": describe_device(device), "precision": "bf16" if dtype == torch.bfloat16 else "fp32",
            "prompt": args.prompt, "new_tokens": n, "rows": rows, "batched": batched, "long_context": long_context}


def bench_batched(model: Transformer, hf: torch.nn.Module, int8: dict, batch: int, args) -> dict:
    """Tokens/s of every row together, prompts of different lengths in one batch."""
    n = args.new_tokens
    prompts = ragged_prompts(batch, args.prompt, model.config.vocab_size)
    contenders = {"transformers eager": theirs(hf, prompts, n),
                  "transformers static+compile": theirs(hf_static_compiled(hf), prompts, n),
                  "lm eager": ours(model, prompts, n), "lm compiled": ours(model, prompts, n, compile=True)}
    for kernel, quantized in int8.items():
        contenders[f"lm int8 {kernel} compiled"] = ours(quantized, prompts, n, compile=True)
    if args.max_autotune:
        autotuned(contenders, model, prompts, n)
    tokens, first, seconds = alternate(contenders, args.batch_rounds)
    lengths = sorted(map(len, prompts))
    print(f"\nbatch {batch}, prompts of {lengths[0]} to {lengths[-1]} tokens, {n} new tokens each; "
          f"median of {args.batch_rounds} alternating rounds")
    print(f"{'':40}{'tokens/s':>10}{'vs transformers':>17}{'first call s':>14}{'rows equal':>12}")
    # a count, not one yes or no: in bf16 one near-tie rounded the other way changes a whole row
    # (on an H100 the rows that differed first differed where lm eager's top two logits were 2^-7
    # and 2^-6 apart; in float32 every row was equal: `gpu/diagnose.py ragged`, docs/gpu.md)
    rows_equal = {name: sum(a == b for a, b in zip(decoded, tokens["lm eager"], strict=True))
                  for name, decoded in tokens.items()}
    rows = [{"name": name, "tokens_per_s": batch * n / s, "vs_transformers": seconds["transformers eager"] / s,
             "first_call_s": first[name], "rows_equal": rows_equal[name],
             "same_tokens": rows_equal[name] == batch}
            for name, s in seconds.items()]
    for row in rows:
        shown = f"{row['rows_equal']} of {batch}"
        print(f"{row['name']:40}{row['tokens_per_s']:10.1f}{row['vs_transformers']:16.2f}x"
              f"{row['first_call_s']:14.1f}{shown:>12}")
    return {"batch": batch, "prompt_lengths": lengths, "rows": rows}


# ---------------------------------------------------------------------------- long contexts

LONG_CONTEXT_KINDS = ["softmax-mha", "softmax-gqa", "softmax-mqa", "mla", "dsa", "lowrank", "linear", "efficient",
                      "gated_delta", "sliding"]


def step_rate(model: Transformer, context: int, batch: int, compile: bool, steps: int) -> float:
    """Tokens/s (every row's) of the fixed-shape decoding step generation uses, with `context` slots
    already in each row's cache. The cache is advanced to `context` without a prefill: the step reads
    every slot it would after a real prompt (the same shapes and masks) and its time does not depend
    on what the slots hold, so the minutes a 32k prefill takes per row are not spent."""
    from lm.generation.compiled import compiled_functions
    from lm.model.generation_cache import GenerationCache

    device = next(model.parameters()).device
    cache = GenerationCache(model, pad=torch.zeros(batch, dtype=torch.long, device=device), max_len=context + steps + 2)
    cache.advance(context)
    step = compiled_functions(model)[1] if compile else model.decode_step  # as generation compiles it
    times = step_times(step, cache, batch, steps + 2)[2:]  # the first two untimed: compilation, first touches
    return batch / statistics.median(times)


def bench_long_context(args) -> dict:
    """Every kind's decoding tokens/s at long contexts and batches, against MHA's."""
    cells = [(context, batch) for context in args.contexts for batch in args.context_batches]
    labels = "".join(f"{f'{context_label(c)} x {b}':>11}" for c, b in cells)
    print(f"\ndecoding at long contexts: reference shape, {'compiled' if args.compile_long else 'eager'} fixed-shape "
          f"step, the cache advanced to the context without a prefill; median of {args.context_steps} steps")
    cache_label = f"cache MB @{context_label(max(args.contexts))}"
    if torch.get_default_device().type == "cuda":  # the declared sizes count 4 bytes a number
        print("cache MB: as fp32 holds it; the bf16 K/V caches hold half, the recurrent states stay fp32")
    print(f"{'tokens/s (context x batch)':28}{'kv heads':>9}{labels}{cache_label:>16}")
    rows_of, rates, rows = attention_rows(), {}, []
    for name in args.context_kinds:
        # Each kind's step is a new model's graph; torch's recompile limit would count them all, and a
        # fullgraph step stops at it instead of running eagerly.
        torch._dynamo.reset()
        spec, example = rows_of[name]
        n_kv_head = example.kv_heads(REFERENCE["n_head"], GENERATE_KV_HEADS)
        model = reference_model(spec, n_kv_head, max_seq_len=max(args.contexts) + args.context_steps + 2)
        model = model.to(bench_dtype(next(model.parameters()).device))
        rates[name] = [step_rate(model, c, b, args.compile_long, args.context_steps) for c, b in cells]
        cache_mb = declared_cache_bytes(model, max(args.contexts)) / 2**20
        rows.append({"kind": name, "n_kv_head": n_kv_head, "tokens_per_s": rates[name], "cache_mb": cache_mb})
        print(f"{name:28}{n_kv_head:9}{''.join(f'{r:11.1f}' for r in rates[name])}{cache_mb:16.1f}", flush=True)
    if "softmax-mha" in rates:
        print(f"\n{'x MHA (context x batch)':37}{labels}")
        for row in rows:
            row["vs_mha"] = [r / m for r, m in zip(row["tokens_per_s"], rates["softmax-mha"], strict=True)]
            print(f"{row['kind']:37}{''.join(f'{r:10.2f}x' for r in row['vs_mha'])}")
    return {"cells": [{"context": c, "batch": b} for c, b in cells], "compiled": args.compile_long,
            "cache_mb_at": max(args.contexts), "rows": rows}


def context_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
