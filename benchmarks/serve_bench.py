"""`scripts/bench.py serve`: the server under concurrent load, kind by kind.

Each kind's model has the reference shape (random weights: speed does not depend on them) and a
byte-level tokenizer of its vocabulary; it is written as a checkpoint and served by scripts/serve.py
in a process of its own, as a user runs it, with `max_batch` equal to the clients (up to `--slots`).
Clients in this process (asyncio, HTTP on the loopback) each send `--requests` streaming completions
one after another: a prompt of `--prompt-tokens` random token ids, `--new-tokens` greedy tokens.

Per kind and number of clients it reports generated tokens/s over all clients (the completion tokens
the responses count, over the wall-clock from the first request sent to the last answer read), time
to first token (request sent to the first text) and inter-token latency (a request's first to last
text over its tokens after the first), each as median and 95th percentile over the requests. The
clients share the machine with the server, as a load generator on one box does.

Beside them, where llama.cpp's own server is built (`make llama-server`, or `--llama-server PATH`):
`llama-server` on the same weights of one softmax kind exported to GGUF (F32 and Q8_0), with as many
parallel slots, the same threads, prompts and clients, and its greedy tokens compared with
`lm.generate`'s on the same prompts.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_models import REFERENCE, attention_rows
from benchmarks.servers import LlamaServerProcess, ServerProcess, find_llama_server, llama_server_version
from lm import ModelConfig, Transformer
from lm.attention import layer_specs
from lm.util.errors import ConfigError

HYBRID = "hybrid-gated_delta-softmax"  # gated delta with a softmax layer every third, as hybrids ship
LLAMA_TYPES = ("f32", "q8_0")  # the GGUF weight types llama-server serves: its rows "llama.cpp F32", "... Q8_0"
SERVE_KINDS = ["softmax-mha", "softmax-gqa", "sliding", "linear", "gated_delta", "mla", HYBRID]


def kind_model(name: str, max_seq_len: int) -> Transformer:
    """The reference shape with the kind's benchmark settings (a hybrid: two gated delta layers per softmax one)."""
    torch.manual_seed(0)
    n_layer = REFERENCE["n_layer"]
    if name == HYBRID:
        attention, n_kv_head = layer_specs(["gated_delta", "gated_delta", "softmax"] * (n_layer // 3), n_layer), 2
    else:
        rows = attention_rows()
        if name not in rows:
            raise ConfigError(f"--kinds holds {name!r}: not one of {sorted([*rows, HYBRID])}")
        spec, example = rows[name]
        attention, n_kv_head = spec, example.n_kv_head or REFERENCE["n_head"]
    shape = {**REFERENCE, "n_kv_head": n_kv_head, "max_seq_len": max_seq_len}
    return Transformer(ModelConfig(**shape, attention=attention)).eval()


def reference_tokenizer():
    """Byte-level BPE of the reference vocabulary, trained on a slice of the standard library."""
    import sysconfig

    from lm.data.tokenizer import train_tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))[:120]]
    return train_tokenizer(iter(texts), REFERENCE["vocab_size"])


async def one_request(client, url: str, prompt: list[int], new_tokens: int) -> dict:
    """One streamed completion: when it was sent, when each piece of text came, its tokens."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # usage on a final chunk, from either server
    sent, arrivals, tokens = time.perf_counter(), [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise ConfigError(f"the server answered {reply.status_code}: {(await reply.aread()).decode()[:200]}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"sent": sent, "arrivals": arrivals, "tokens": tokens}


async def drive(url: str, clients: int, requests: int, prompt_tokens: int, new_tokens: int, vocab: int,
                seed: int = 0) -> dict:
    """`clients` concurrent clients, each sending `requests` completions in turn, every prompt its own."""
    import httpx

    rng = random.Random(f"{seed}-{clients}")
    # A connection per request: llama-server may close one after a streamed answer, and a request sent
    # on it then fails; loopback connections cost a fraction of a millisecond, and both servers pay it.
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:

        async def one_client() -> list[dict]:
            out = []
            for _ in range(requests):
                prompt = [rng.randrange(1, vocab) for _ in range(prompt_tokens)]
                out.append(await one_request(client, url, prompt, new_tokens))
            return out

        started = time.perf_counter()
        done = await asyncio.gather(*(one_client() for _ in range(clients)))
        wall = time.perf_counter() - started
    runs = [r for per_client in done for r in per_client]
    first = [r["arrivals"][0] - r["sent"] for r in runs if r["arrivals"]]
    inter = [(r["arrivals"][-1] - r["arrivals"][0]) / (r["tokens"] - 1) for r in runs
             if len(r["arrivals"]) > 1 and r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in runs)
    return {"clients": clients, "requests": len(runs), "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "ttft_p50": percentile(first, 50), "ttft_p95": percentile(first, 95),
            "itl_p50": percentile(inter, 50), "itl_p95": percentile(inter, 95)}


def percentile(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def bench_serve(args) -> dict:
    """Prints a table per kind (and per llama.cpp weight type); returns every cell unrounded (--json)."""
    from lm.formats.checkpoint import save_checkpoint

    max_seq_len = args.prompt_tokens + args.new_tokens
    models = {name: kind_model(name, max_seq_len) for name in args.kinds}  # every name checked before any run
    missing = [name for name in args.int8 if name not in args.kinds]
    if missing:
        raise ConfigError(f"--int8 holds {missing}: not among --kinds {args.kinds} (--int8 alone: no int8 rows)")
    if args.llama_kind is not None and args.llama_kind not in args.kinds:
        raise ConfigError(f"--llama-kind {args.llama_kind}: not one of --kinds {args.kinds}")
    llama = find_llama_server(args.llama_server)
    llama_kind = args.llama_kind
    if llama is not None:  # llama.cpp runs the llama architecture: softmax attention only, said before serving
        from lm.formats.gguf import check_exportable

        if llama_kind is not None:
            check_exportable(models[llama_kind])
        else:  # the first it runs of the int8 kinds (so Q8_0 meets lm's int8 on the same weights), else of --kinds
            llama_kind = next((name for name in [*args.int8, *args.kinds] if exportable(models[name])), None)
    tokenizer = reference_tokenizer()
    print(f"serving the reference shape ({REFERENCE['n_layer']} layers, d_model {REFERENCE['d_model']}); "
          f"prompts of {args.prompt_tokens} tokens, {args.new_tokens} new tokens each, {args.requests} request(s) "
          f"per client; max_batch = clients up to {args.slots}; server threads: torch's default "
          f"({torch.get_num_threads()} here); lm's decoding step {'compiled' if args.compile else 'eager'}")
    if llama is None:
        print("llama.cpp rows: no llama-server here (`make llama-server` builds llama.cpp's own server)")
    elif llama_kind is None:
        print("llama.cpp rows: no kind of --kinds is one llama.cpp runs (softmax MHA, GQA or MQA)")
    else:
        print(f"llama.cpp rows: {llama} serving {llama_kind}'s weights")
    results, greedy = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        servers = {}  # label -> (slots -> a started server with .url and .close())
        ours = [(name, []) for name in args.kinds] + [(f"{name} int8", ["quantize=int8"]) for name in args.int8]
        for label, settings in ours:
            name = label.removesuffix(" int8")
            ckpt = Path(folder) / name / "bench.ckpt"
            if not ckpt.exists():
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                save_checkpoint(ckpt, models[name].state_dict(), models[name].config, tokenizer.to_str())
            settings = ["model_name=bench", *settings, f"max_new_tokens={args.new_tokens}",
                        f"max_prompt_tokens={args.prompt_tokens}", f"compile={str(args.compile).lower()}"]
            servers[label] = lambda slots, c=ckpt, s=settings: ServerProcess(c, slots, s)
        if llama is not None and llama_kind is not None:
            from lm.formats.gguf import export_gguf

            for dtype in LLAMA_TYPES:
                gguf = export_gguf(models[llama_kind], tokenizer, Path(folder) / f"bench-{dtype}.gguf", dtype)
                servers[f"llama.cpp {dtype.upper()}"] = lambda slots, g=gguf: LlamaServerProcess(
                    llama, g, slots, max_seq_len + 16, torch.get_num_threads())  # room: it marks a full slot truncated
            greedy = greedy_agreement(llama, models[llama_kind], tokenizer, Path(folder), args)
        for label, start in servers.items():
            rows = []
            for slots in sorted({min(c, args.slots) for c in args.clients}):
                server = start(slots)
                try:
                    # One request first, not counted: what happens once per server (compiling, the first
                    # allocations) is not a cost of serving, for either server.
                    asyncio.run(drive(server.url, 1, 1, args.prompt_tokens, 2, REFERENCE["vocab_size"], seed=1))
                    for clients in [c for c in args.clients if min(c, args.slots) == slots]:
                        row = asyncio.run(drive(server.url, clients, args.requests, args.prompt_tokens,
                                                args.new_tokens, REFERENCE["vocab_size"]))
                        rows.append({**row, "slots": slots})
                finally:
                    server.close()
            results[label] = sorted(rows, key=lambda r: r["clients"])
            print_table(label, results[label])
    if greedy:
        print(f"\nllama.cpp's greedy tokens against lm.generate's ({llama_kind}'s weights with the block matrices "
              f"x3, so the blocks choose the tokens; llama-server with its K/V cache in f32):")
        for label, agreement in greedy.items():
            print(f"  {label}: {agreement['equal']}/{agreement['prompts']} prompts equal over {args.new_tokens} "
                  f"tokens; {agreement['tokens_equal']:.1%} of tokens before a first difference; "
                  f"{min(agreement['distinct_tokens'])} or more distinct tokens in each continuation")
            if agreement["margins_at_difference"]:
                print(f"    where they part, our logits of the two tokens differ by "
                      f"{max(agreement['margins_at_difference']):.3f} standard deviations of our logits at most")
    if args.out:
        plot(results, Path(args.out))
    version = llama_server_version(llama) if llama and llama_kind else None
    return {"kinds": results, "llama_server": version, "llama_kind": llama_kind, "greedy": greedy}


def exportable(model: Transformer) -> bool:
    from lm.formats.gguf import check_exportable

    try:
        check_exportable(model)
    except ConfigError:
        return False
    return True


def greedy_agreement(binary: Path, model: Transformer, tokenizer, folder: Path, args, prompts: int = 4) -> dict:
    """{"llama.cpp F32": ..., "llama.cpp Q8_0": ...}: llama-server's greedy tokens against lm.generate's
    on the same weights, for a few random prompts of the benchmark's length. The weights are `model`'s
    with every block matrix scaled by 3: at their initial scale the tied embedding decides each token
    and a random model only repeats its prompt's last one, which both would do whatever their blocks
    computed. llama-server's K/V cache is f32 here (f16 by default), so a difference is the weights'
    type or the arithmetic, not the cache."""
    import copy

    from lm.formats.gguf import export_gguf
    from lm.generation import generate

    scaled = copy.deepcopy(model)
    with torch.no_grad():
        for name, parameter in scaled.named_parameters():
            if name.startswith("blocks.") and parameter.ndim == 2:
                parameter.mul_(3)
    rng = random.Random(0)
    asked = [[rng.randrange(1, REFERENCE["vocab_size"]) for _ in range(args.prompt_tokens)] for _ in range(prompts)]
    ours = [row[len(p):] for p, row in zip(asked, generate(scaled, asked, args.new_tokens), strict=True)]
    agreements = {}
    for dtype in LLAMA_TYPES:
        gguf = export_gguf(scaled, tokenizer, folder / f"greedy-{dtype}.gguf", dtype)
        server = LlamaServerProcess(binary, gguf, 1, args.prompt_tokens + args.new_tokens + 16,
                                    torch.get_num_threads(), cache_type="f32")
        try:
            theirs = [server.greedy(p, args.new_tokens) for p in asked]
        finally:
            server.close()
        agreements[f"llama.cpp {dtype.upper()}"] = agreement(scaled, asked, ours, theirs)
    return agreements


def agreement(model: Transformer, prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far two greedy continuations of each prompt run together, and where they part, how far
    apart `model`'s logits put the two tokens over the spread of its logits there: a near-tie (a small
    fraction) flips with any change of summation order; a real error does not."""
    before = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
              for x, y in zip(ours, theirs, strict=True)]
    margins = []
    for p, x, y, i in zip(prompts, ours, theirs, before, strict=True):
        if i < min(len(x), len(y)):
            with torch.no_grad():
                logits = model(torch.tensor([p + x[:i]]))[0, -1]  # (V,) at the first token they differ on
            margins.append(float((logits[x[i]] - logits[y[i]]) / logits.std()))
    return {"prompts": len(prompts), "equal": sum(x == y for x, y in zip(ours, theirs, strict=True)),
            "tokens_equal": sum(before) / sum(map(len, ours)), "first_difference": before,
            "margins_at_difference": margins, "distinct_tokens": [len(set(x)) for x in ours]}


def print_table(label: str, rows: list[dict]) -> None:
    one = next((r["tokens_per_s"] for r in rows if r["clients"] == 1), None)
    print(f"\n{label}")
    print(f"{'clients':>7} {'slots':>5} {'tokens/s':>9} {'x 1 client':>10} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'ITL p50':>8} {'ITL p95':>8}")
    for r in rows:
        ratio = f"{r['tokens_per_s'] / one:.1f}x" if one else "-"
        print(f"{r['clients']:>7} {r['slots']:>5} {r['tokens_per_s']:>9.1f} {ratio:>10} "
              f"{r['ttft_p50'] * 1e3:>7.0f}ms {r['ttft_p95'] * 1e3:>7.0f}ms "
              f"{r['itl_p50'] * 1e3:>6.1f}ms {r['itl_p95'] * 1e3:>6.1f}ms")


def plot(results: dict, folder: Path) -> None:
    """serve.png: tokens/s and inter-token latency against clients, a line per kind."""
    from lm.studies.plotting import line_style, pyplot, save_figure
    from lm.util.files import make_folder

    make_folder(folder)
    plt = pyplot()
    figure, (rate, latency) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (label, rows) in enumerate(results.items()):
        clients = [r["clients"] for r in rows]
        rate.plot(clients, [r["tokens_per_s"] for r in rows], label=label, **line_style(i))
        latency.plot(clients, [r["itl_p50"] * 1e3 for r in rows], label=label, **line_style(i))
    for axis, title in ((rate, "generated tokens/s, all clients"), (latency, "inter-token latency p50 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent clients")
        axis.set_title(title)
    rate.legend()
    save_figure(figure, folder / "serve.png")
    print(f"\nwrote {folder / 'serve.png'}")


__all__ = ["SERVE_KINDS", "bench_serve"]
