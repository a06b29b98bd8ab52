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
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from lm import ModelConfig, Transformer
from lm.attention import layer_specs
from lm.studies.bench_models import REFERENCE, attention_rows
from lm.util.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
HYBRID = "hybrid-gated_delta-softmax"  # gated delta with a softmax layer every third, as hybrids ship
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


class ServerProcess:
    """scripts/serve.py in a process of its own on a free port; `url` once it listens."""

    def __init__(self, ckpt: Path, slots: int, settings: list[str]):
        command = [sys.executable, str(ROOT / "scripts" / "serve.py"), f"ckpt={ckpt}", "port=0",
                   f"max_batch={slots}", "max_queue=1024", "drain_s=0", *settings]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        banner = self.process.stderr.readline()
        if " at http://" not in banner:
            self.process.kill()
            raise ConfigError(f"the server did not start: {banner.strip() or self.process.stderr.read().strip()}")
        self.url = banner.split(" at ", 1)[1].split()[0].removesuffix("/v1")
        # What it writes later is read as it comes, so a full pipe never stops the server.
        threading.Thread(target=self.process.stderr.read, daemon=True).start()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def one_request(client, url: str, prompt: list[int], new_tokens: int) -> dict:
    """One streamed completion: when it was sent, when each piece of text came, its tokens."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True}
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


async def drive(url: str, clients: int, requests: int, prompt_tokens: int, new_tokens: int, vocab: int) -> dict:
    """`clients` concurrent clients, each sending `requests` completions in turn."""
    import httpx

    rng = random.Random(clients)
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
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
    """Prints a table per kind; returns every cell unrounded (--json)."""
    from lm.formats.checkpoint import save_checkpoint

    max_seq_len = args.prompt_tokens + args.new_tokens
    models = {name: kind_model(name, max_seq_len) for name in args.kinds}  # every name checked before any run
    tokenizer = reference_tokenizer()
    contenders = [(name, []) for name in args.kinds] + [(f"{name} int8", ["quantize=int8"]) for name in args.int8]
    print(f"serving the reference shape ({REFERENCE['n_layer']} layers, d_model {REFERENCE['d_model']}); "
          f"prompts of {args.prompt_tokens} tokens, {args.new_tokens} new tokens each, {args.requests} request(s) "
          f"per client; max_batch = clients up to {args.slots}; server threads: torch's default "
          f"({os.cpu_count()} CPUs here)")
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for label, settings in contenders:
            name = label.removesuffix(" int8")
            ckpt = Path(folder) / name / "bench.ckpt"
            if not ckpt.exists():
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                save_checkpoint(ckpt, models[name].state_dict(), models[name].config, tokenizer.to_str())
            rows = []
            for slots in sorted({min(c, args.slots) for c in args.clients}):
                server = ServerProcess(ckpt, slots, ["model_name=bench", *settings,
                                                     f"max_new_tokens={args.new_tokens}",
                                                     f"max_prompt_tokens={args.prompt_tokens}"])
                try:
                    for clients in [c for c in args.clients if min(c, args.slots) == slots]:
                        row = asyncio.run(drive(server.url, clients, args.requests, args.prompt_tokens,
                                                args.new_tokens, REFERENCE["vocab_size"]))
                        rows.append({**row, "slots": slots})
                finally:
                    server.close()
            results[label] = sorted(rows, key=lambda r: r["clients"])
            print_table(label, results[label])
    if args.out:
        plot(results, Path(args.out))
    return {"kinds": results}


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
