"""What the benchmarks share: the reference shape and transformers' twin of it, each kind's
benchmark settings, the model a kind's row times, its declared cache, and the timers."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from lm import ModelConfig, Transformer
from lm.attention import AttentionSpec, Example, example_rows

# The reference shape named in the README and the issues.
REFERENCE = dict(vocab_size=8192, n_layer=6, d_model=384, n_head=6, n_kv_head=2, d_ff=1024,
                 max_seq_len=256, tie_embeddings=True)


def hf_llama(cfg: ModelConfig) -> torch.nn.Module:
    """transformers' LlamaForCausalLM of the same shape (the mapping lm's export uses), with SDPA."""
    from transformers import LlamaForCausalLM

    from lm.formats.hf import hf_config

    hf_cfg = hf_config(cfg)
    hf_cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(hf_cfg)


def attention_rows() -> dict[str, tuple[AttentionSpec, Example]]:
    """Every registered kind at the benchmark settings it declares (AttentionSpec.benchmarks)."""
    return example_rows("benchmarks")


GENERATE_KV_HEADS = 2  # the generate table's own choice of K/V heads at the reference shape (6 heads): GQA


def reference_model(spec: AttentionSpec, n_kv_head: int, max_seq_len: int) -> Transformer:
    torch.manual_seed(0)
    shape = {**REFERENCE, "n_kv_head": n_kv_head, "max_seq_len": max_seq_len}
    return Transformer(ModelConfig(**shape, attention=spec)).eval()


def timed(fn) -> float:
    """Seconds of fn(); on CUDA, of the work it queued too (the GPU runs behind the host)."""
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def bench_device(name: str) -> torch.device:
    """--device: `auto` is CUDA where torch sees it, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: torch sees no CUDA device here")
    return torch.device(name)


def bench_dtype(device: torch.device) -> torch.dtype:
    """What the benchmarks compute in: bf16 on CUDA (as bf16-mixed training and dtype=bf16 decoding
    run there), fp32 on the CPU (a CPU without bf16 instructions multiplies bf16 ~100x slower)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def add_device_argument(parser, on_cuda: str) -> None:
    """--device of a benchmark; `on_cuda` says what the benchmark does differently there."""
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help=f"auto: CUDA where torch sees it ({on_cuda}), else the CPU (fp32)")


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"


# Dense (no sparsity) bf16 tensor-core peaks from the vendors' data sheets, by a part of the name
# torch reports: what model FLOPs utilisation is measured against on a GPU.
DENSE_BF16_PEAK = {"H100 80GB HBM3": 989e12, "H100 SXM": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12,
                   "H200": 989e12, "A100": 312e12}


def dense_bf16_peak(device: torch.device) -> float | None:
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in DENSE_BF16_PEAK.items() if part in name), None)


def alternate(contenders: dict[str, Callable], rounds: int) -> tuple[dict, dict, dict]:
    """(what each contender returned, its first call's seconds, its median seconds): one call each
    first (it compiles, where there is anything to compile), then `rounds` rounds in turn, so the
    noise of a shared machine hits every contender alike."""
    returned, first = {}, {}
    for name, run in contenders.items():
        start = time.perf_counter()
        returned[name] = run()
        first[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, run in contenders.items():
            times[name].append(timed(run))
    return returned, first, {name: statistics.median(t) for name, t in times.items()}


def step_times(step, cache, batch: int, steps: int) -> list[float]:
    """Seconds of each of `steps` calls of a fixed-shape decoding step (`model.decode_step` or its
    compiled form) on one token per row, the cache advancing one slot after each."""
    token = torch.zeros(batch, 1, dtype=torch.long, device=cache.device)  # (B, 1)
    times = []
    with torch.no_grad():
        for _ in range(steps):
            pos = torch.tensor(cache.seen, device=cache.device)
            times.append(timed(lambda pos=pos: step(token, cache, pos)))
            cache.advance(1)
    return times


def declared_cache_bytes(model: Transformer, tokens: int, batch: int = 1) -> int:
    """What the model's caches hold after `tokens` positions, from what each layer declares
    (generation_state) in fp32; the shared cache test holds this equal to the built caches' nbytes."""
    return 4 * sum(block.attn.generation_state().numel(tokens, batch) for block in model.blocks)
