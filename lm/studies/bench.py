"""Benchmarks, measured side by side in one process and reported as ratios.

    python scripts/bench.py train       # training tokens/s vs transformers' LlamaForCausalLM, and MFU
    python scripts/bench.py attention   # time and peak memory of each attention kind vs sequence length
    python scripts/bench.py generate    # decode tokens/s, per-token latency and cache bytes per kind vs transformers
    python scripts/bench.py decode      # eager, compiled, int8 and llama.cpp decoding vs transformers, batch 1 and
                                        # ragged batches (lm.studies.decode_bench)
    python scripts/bench.py kernels     # one decoding matmul through every int8/int4 kernel (lm.studies.kernel_bench)
    python scripts/bench.py int8 --ckpt ...  # int8 against fp32 on a trained model

The machine may be shared and noisy, so the contenders run in alternating rounds and each
reports its median step time; compare the ratio, not a single absolute figure.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import dataclasses
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lm import ModelConfig, Transformer
from lm.attention import AttentionSpec, LayerShape, LinearSpec, SoftmaxSpec, spec_from_dict
from lm.studies.bench_models import (
    GENERATE_KV_HEADS,
    REFERENCE,
    add_device_argument,
    attention_rows,
    bench_device,
    bench_dtype,
    declared_cache_bytes,
    dense_bf16_peak,
    describe_device,
    hf_llama,
    reference_model,
    step_times,
    synchronize,
    timed,
)
from lm.util.errors import ConfigError

MODEL_CONFIGS = Path(__file__).resolve().parents[2] / "conf" / "model"


def matmul_peak_flops(device: torch.device, repeats: int = 10) -> float:
    """Best observed FLOP/s of one square matmul in the device's benchmark dtype: the ceiling the
    CPU's MFU is measured against (a GPU's is its data sheet's dense bf16 peak; this is printed
    beside it). 2048 on the CPU, 4096 on CUDA, where a smaller product cannot fill the GPU."""
    size = 4096 if device.type == "cuda" else 2048
    a, b = (torch.randn(size, size, device=device, dtype=bench_dtype(device)) for _ in range(2))
    a @ b
    return 2 * size**3 / min(timed(lambda: a @ b) for _ in range(repeats))


def train_step_fn(model: torch.nn.Module, logits_of, autocast: torch.dtype | None = None):
    """One training step: forward (under bf16 autocast when `autocast` says, as `bf16-mixed`
    trains), loss in float32, backward, fused AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(batch: torch.Tensor) -> None:
        with torch.autocast(batch.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            logits = logits_of(model, batch[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def variant_spec(variant: str) -> SoftmaxSpec:
    """'gate=elementwise,qk_norm=true' -> the reference's softmax spec with those options, each value
    read by Hydra's override parser, as `attn.<option>=<value>` would be on a training command."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    items = variant.split(",")
    if any("=" not in item or item.startswith("=") for item in items):
        raise ConfigError(f"--variants entry {variant!r} must be option=value[,option=value...]")
    try:
        overrides = OverridesParser.create().parse_overrides(items)
    except HydraException as e:
        raise ConfigError(f"--variants entry {variant!r}: {str(e).strip().splitlines()[0]}") from None
    return spec_from_dict({"kind": "softmax", **{o.key_or_group: o.value() for o in overrides}})


def checked_variant(variant: str) -> str:
    """argparse's type for --variants: refused at parsing, before any model is built."""
    try:
        variant_spec(variant)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return variant


def bench_shape(args) -> ModelConfig:
    """--model: the reference shape, or one of conf/model/ (MHA, as `attn=mha` trains it);
    --vocab and --seq change its vocabulary and sequence length."""
    if args.model == "reference":
        shape = dict(REFERENCE)
    else:
        from omegaconf import OmegaConf

        model = OmegaConf.load(MODEL_CONFIGS / f"{args.model}.yaml")
        shape = {key: model[key] for key in ("n_layer", "d_model", "n_head", "d_ff", "max_seq_len", "tie_embeddings")}
        shape.update(vocab_size=REFERENCE["vocab_size"], n_kv_head=model.n_head)  # the built-in corpus's vocabulary
    if args.vocab:
        shape["vocab_size"] = args.vocab
    if args.seq:
        shape["max_seq_len"] = args.seq
    return ModelConfig(**shape)


def bench_train(args) -> None:
    device = bench_device(args.device)
    autocast = bench_dtype(device) if device.type == "cuda" else None  # bf16-mixed on a GPU, fp32 on the CPU
    torch.manual_seed(0)
    cfg = bench_shape(args)
    with device:  # every model's weights built where it trains
        ours = Transformer(cfg)
        peers = {"transformers": (hf_llama(cfg), lambda m, x: m(input_ids=x).logits)}
        litgpt = litgpt_model(cfg)
        if litgpt is not None:
            peers["litgpt"] = (litgpt, lambda m, x: m(x))
        models = {"lm": ours, **{name: model for name, (model, _) in peers.items()}}
        contenders = {"lm": train_step_fn(ours, lambda m, x: m(x), autocast)}
        for name, (model, logits_of) in peers.items():
            contenders[name] = train_step_fn(model, logits_of, autocast)
        if args.compile:  # a second copy of our model, compiled as `compile=true` training compiles it
            twin = Transformer(cfg)
            twin.load_state_dict(ours.state_dict())
            compiled = torch.compile(twin)
            models["lm compiled"] = twin
            contenders["lm compiled"] = train_step_fn(twin, lambda m, x: compiled(x), autocast)
            if args.compile_peers:  # the peers compiled alike, each a copy of its eager model
                for name, (model, logits_of) in peers.items():
                    copy_ = copy.deepcopy(model)
                    compiled_peer = torch.compile(copy_)
                    models[f"{name} compiled"] = copy_
                    contenders[f"{name} compiled"] = train_step_fn(
                        copy_, lambda m, x, f=compiled_peer, of=logits_of: of(f, x), autocast)
        for variant in args.variants:  # the same shape with attention options: gate, qk_norm, softcap ...
            models[variant] = Transformer(dataclasses.replace(cfg, attention=variant_spec(variant)))
            contenders[variant] = train_step_fn(models[variant], lambda m, x: m(x), autocast)
        batch = torch.randint(0, cfg.vocab_size, (args.batch, cfg.max_seq_len + 1))
    first_step = {}
    for name, step in contenders.items():
        first_step[name] = timed(lambda step=step: step(batch))  # compiles, for the compiled contender
        for _ in range(args.warmup):
            step(batch)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.steps):  # alternate, so background load hits both alike
        for name, step in contenders.items():
            times[name].append(timed(lambda step=step: step(batch)))

    measured_peak = matmul_peak_flops(device)
    spec_peak = dense_bf16_peak(device) if device.type == "cuda" else None
    peak = spec_peak or measured_peak
    tokens = args.batch * cfg.max_seq_len
    # Each of our models counts its own FLOPs (a variant's gate adds some); a peer is the same shape as ours.
    counted = {name: models[name] if isinstance(models[name], Transformer) else ours for name in contenders}
    flops_per_step = {name: model.flops_per_token(cfg.max_seq_len) * tokens for name, model in counted.items()}
    precision = "bf16-mixed" if autocast else "fp32"
    print(f"training step, {precision}, {describe_device(device)}: {ours.num_params() / 1e6:.1f}M parameters, "
          f"vocab {cfg.vocab_size}, {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads / "
          f"{cfg.n_kv_head} KV, SwiGLU {cfg.d_ff}, seq {cfg.max_seq_len}, batch {args.batch}, "
          f"{'tied' if cfg.tie_embeddings else 'untied'} embeddings; {args.steps} steps each")
    if spec_peak:
        print(f"MFU against the data sheet's dense bf16 peak {spec_peak / 1e12:.0f} TFLOP/s "
              f"(measured bf16 matmul peak {measured_peak / 1e12:.0f} TFLOP/s)")
    else:
        print(f"measured {'bf16' if autocast else 'fp32'} matmul peak: {measured_peak / 1e9:.0f} GFLOP/s")
    if "litgpt" not in peers:
        print("litgpt row: left out (pip install litgpt to time it)")
    width = max(14, *(len(name) + 2 for name in contenders))
    print(f"{'':{width}}{'median step s':>14}{'tokens/s':>10}{'MFU':>7}{'first step s':>14}")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in medians.items():
        print(f"{name:{width}}{seconds:14.3f}{tokens / seconds:10.0f}{flops_per_step[name] / seconds / peak:7.1%}"
              f"{first_step[name]:14.1f}")
    for name, suffix in (("lm", ""), ("lm compiled", " compiled")):  # each against its like: eager, compiled
        for peer in (f"{p}{suffix}" if f"{p}{suffix}" in medians else p for p in peers):
            if name in medians:
                print(f"{name} / {peer} tokens/s: {medians[peer] / medians[name]:.2f}x")
    for variant in args.variants:
        print(f"{variant} / lm tokens/s: {medians['lm'] / medians[variant]:.2f}x")


def litgpt_model(cfg: ModelConfig) -> torch.nn.Module | None:
    """litgpt's GPT of the same shape (Llama's layout: RMSNorm, SwiGLU, RoPE on every dimension,
    no biases), or None where litgpt is not installed."""
    try:
        from litgpt.config import Config
        from litgpt.model import GPT
    except ImportError as e:
        if e.name != "litgpt":  # installed, but something it imports is missing: say what
            print(f"litgpt row: importing litgpt failed: {e}")
        return None
    config = Config(name="lm-shape", block_size=cfg.max_seq_len, vocab_size=cfg.vocab_size,
                    padded_vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.d_model,
                    n_query_groups=cfg.n_kv_head, head_size=cfg.head_dim, rotary_percentage=1.0,
                    parallel_residual=False, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                    intermediate_size=cfg.d_ff)
    return GPT(config)


# ---------------------------------------------------------------------------- attention

FULL_ATTENTION, GQA = "softmax-mha", "softmax-gqa"  # the rows the others are compared with


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def exact_resident_memory() -> None:
    """Make resident memory track live tensors: glibc otherwise keeps freed blocks below its
    (growing) mmap threshold resident and serves later allocations from them unseen."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: blocks >= 64 KiB are mapped and unmapped
    libc.malloc_trim(0)


def peak_memory_of(fn) -> tuple[float, int]:
    """(seconds, peak bytes above what was held before the call) of fn().

    On CUDA, the caching allocator's own peak. The CPU has no allocator statistics like CUDA's, so
    there the peak is the process' high-water resident size, which Linux resets on writing 5 to
    /proc/self/clear_refs."""
    import ctypes

    if torch.cuda.is_initialized():
        synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        seconds = timed(fn)
        return seconds, torch.cuda.max_memory_allocated() - before
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _proc_status_bytes("VmRSS")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, _proc_status_bytes("VmHWM") - before


def attention_layer(spec: AttentionSpec, n_kv_head: int | None, d_model: int, n_head: int):
    """The spec's layer alone, built from its sizes: no model around it."""
    shape = LayerShape(d_model, n_head, n_kv_head or n_head, d_model // n_head)
    layer = spec.build(shape)
    layer.reset_own_parameters()  # what the Transformer does after building it: e.g. gated delta's decay
    return layer, shape


def time_attention(module, shape: LayerShape, seq_len: int, backward: bool, repeats: int,
                   whole_module: bool = False) -> tuple[float, int]:
    """Best time and peak memory of one forward (or forward + backward) of the kind's attention
    op on the inputs it names (`module.benchmark_op`: for most, `attend` on q (1, nh, N, hs) and
    k, v (1, nkv, N, hs)); with
    `whole_module`, of the layer with its projections (and RoPE) on x (1, N, C)."""
    from lm.attention.rope import RotaryEmbedding

    if whole_module:
        cos, sin = RotaryEmbedding(shape.head_dim, 10000.0)(torch.arange(seq_len))
        inputs = [torch.randn(1, seq_len, shape.d_model, requires_grad=backward)]
        op = lambda x: module(x, cos, sin)  # noqa: E731
    else:
        op, inputs = module.benchmark_op(seq_len, requires_grad=backward)

    def run() -> None:
        if backward:
            op(*inputs).sum().backward()
        else:
            with torch.no_grad():
                op(*inputs)

    run()  # warm-up
    results = [peak_memory_of(run) for _ in range(repeats)]
    return min(r[0] for r in results), max(r[1] for r in results)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Layers built and inputs drawn in `dtype` inside the block."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def bench_attention(args) -> None:
    """On CUDA in bf16 (layers and inputs made there), on the CPU in fp32."""
    device = bench_device(args.device)
    with device, default_dtype(bench_dtype(device)):
        attention_on(device, args)


def attention_on(device: torch.device, args) -> None:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    rows_of = attention_rows()
    # The attention table's own choice of K/V heads is one per query head: each kind as MHA.
    cases = [(name, spec, ex.kv_heads(args.heads, args.heads), args.heads, ex.longest)
             for name, (spec, ex) in rows_of.items() if name in args.kinds]
    if args.single_head:  # the footing of the published GPU figures: one head of size d_model
        cases += [("mha-1head", SoftmaxSpec(), 1, 1, None), ("linear-1head", LinearSpec(feature_map="elu"), 1, 1, None)]
    longest_n = max(args.lengths)
    cases = [(name, spec, n_kv_head, heads, n) for name, spec, n_kv_head, heads, longest in cases for n in args.lengths
             if not ((heads == 1 and n != longest_n) or (longest is not None and n > longest))]
    precision = "bf16" if torch.get_default_dtype() == torch.bfloat16 else "fp32"
    peak = matmul_peak_flops(device)
    print(f"attention op (q, k, v -> out; projections excluded), {precision}, {describe_device(device)}, "
          f"batch 1, d_model {args.d_model}; measured {precision} matmul peak {peak / 1e9:.0f} GFLOP/s")
    # Times first, with the allocator as every program has it; then the memory peaks, with the
    # allocator made to map and unmap every block (exact_resident_memory), which costs page faults.
    print(f"{'kind':24}{'N':>7}{'fwd s':>9}{'fwd+bwd s':>11}{'fwd GFLOP/s':>13}{'of peak':>9}")
    for name, spec, n_kv_head, heads, n in cases:
        torch.manual_seed(0)
        module, shape = attention_layer(spec, n_kv_head, args.d_model, heads)
        fwd_s = time_attention(module, shape, n, backward=False, repeats=args.repeats)[0]
        bwd_s = time_attention(module, shape, n, backward=True, repeats=args.repeats)[0]
        gflops = spec.flops(n, heads, shape.n_kv_head, shape.head_dim) / fwd_s / 1e9
        rows.append({"kind": name, "n_head": heads, "n_kv_head": shape.n_kv_head, "seq_len": n, "forward_s": fwd_s,
                     "forward_backward_s": bwd_s, "forward_gflops": gflops, "forward_of_peak": gflops * 1e9 / peak})
        print(f"{name:24}{n:7}{fwd_s:9.4f}{bwd_s:11.4f}{gflops:13.1f}{gflops * 1e9 / peak:9.1%}", flush=True)
    if device.type == "cpu":
        exact_resident_memory()
    what = "peak CUDA memory allocated" if device.type == "cuda" else "peak resident memory"
    print(f"{'kind':24}{'N':>7}{'fwd MB':>9}{'fwd+bwd MB':>12}   ({what} above the inputs)")
    for row, (name, spec, n_kv_head, heads, n) in zip(rows, cases, strict=True):
        torch.manual_seed(0)
        module, shape = attention_layer(spec, n_kv_head, args.d_model, heads)
        row["forward_peak_mb"] = time_attention(module, shape, n, backward=False, repeats=1)[1] / 2**20
        row["forward_backward_peak_mb"] = time_attention(module, shape, n, backward=True, repeats=1)[1] / 2**20
        print(f"{name:24}{n:7}{row['forward_peak_mb']:9.1f}{row['forward_backward_peak_mb']:12.1f}", flush=True)
    csv_path = out_dir / "attention.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print_attention_ratios(rows, max(args.lengths))
    print_whole_layer_times(args)
    label = f"{torch.cuda.get_device_name(device)} bf16" if device.type == "cuda" else "CPU fp32"
    png_path = plot_attention(rows, args.heads, out_dir / "attention.png", label)
    print(f"wrote {csv_path} and {png_path}")


def _ratio(a: float, b: float) -> str:
    """a / b as '1.23x'; 'n/a' when b rounds to nothing (tiny sizes fit in memory already resident)."""
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def print_attention_ratios(rows: list[dict], n_max: int) -> None:
    at = {(r["kind"], r["seq_len"]): r for r in rows}
    full = at.get((FULL_ATTENTION, n_max))
    if full is None:
        return
    print(f"at N={n_max}, against full causal softmax (mha, SDPA):")
    for name in sorted({kind for kind, _ in at} - {FULL_ATTENTION, "mha-1head", "linear-1head"}):
        r = at.get((name, n_max))
        if r is None:
            continue
        print(f"  {name:16} forward {full['forward_s'] / r['forward_s']:5.1f}x faster, "
              f"forward+backward {full['forward_backward_s'] / r['forward_backward_s']:5.1f}x faster, "
              f"peak memory forward {_ratio(r['forward_peak_mb'], full['forward_peak_mb'])}, "
              f"forward+backward {_ratio(r['forward_backward_peak_mb'], full['forward_backward_peak_mb'])} of mha's")
        lengths = sorted(n for (kind, n) in at if kind == name and n >= n_max // 4)
        if len(lengths) >= 2 and lengths[0] < lengths[-1]:
            doublings = math.log2(lengths[-1] / lengths[0])
            growth = (at[(name, lengths[-1])]["forward_s"] / at[(name, lengths[0])]["forward_s"]) ** (1 / doublings)
            print(f"  {name:16} forward time grows {growth:.2f}x per doubling of N from {lengths[0]} to {lengths[-1]}")
    single = at.get(("mha-1head", n_max)), at.get(("linear-1head", n_max))
    if all(single):
        print(f"  one head of size d_model: softmax {single[0]['forward_s']:.3f} s vs linear "
              f"{single[1]['forward_s']:.3f} s forward ({single[0]['forward_s'] / single[1]['forward_s']:.1f}x)")


def print_whole_layer_times(args) -> None:
    """The same kinds as whole layers at the longest N: the Q/K/V/O projections every kind
    shares are added to each, which narrows the ratios."""
    n = max(args.lengths)
    times = {}
    rows_of = attention_rows()
    for name in (FULL_ATTENTION, "sliding", "linear"):
        spec, _ = rows_of[name]
        module, shape = attention_layer(spec, args.heads, args.d_model, args.heads)
        times[name], _ = time_attention(module, shape, n, backward=False, repeats=args.repeats, whole_module=True)
    print(f"whole layer (with projections) forward at N={n}: " + ", ".join(
        f"{name} {t:.3f} s ({times[FULL_ATTENTION] / t:.1f}x)" for name, t in times.items()))


def plot_attention(rows: list[dict], heads: int, path: Path, label: str = "CPU fp32") -> Path:
    from lm.studies.report import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, key, title in ((axes[0], "forward_s", "forward"), (axes[1], "forward_backward_s", "forward + backward")):
        for name in dict.fromkeys(r["kind"] for r in rows):
            points = sorted((r["seq_len"], r[key]) for r in rows if r["kind"] == name)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("seconds")
        ax.set_title(f"{title} ({label}, {heads} heads)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    save_figure(fig, Path(path))
    return path


# ---------------------------------------------------------------------------- generate

def decode_seconds(run_generate, repeats: int) -> float:
    run_generate()  # warm-up
    return min(timed(run_generate) for _ in range(repeats))


def step_latency(model: Transformer, position: int, steps: int = 16) -> float:
    """Median seconds of one decoding step once `position` tokens are in the cache."""
    from lm.attention.cache import GenerationCache

    cache = GenerationCache(model, pad=torch.zeros(1, dtype=torch.long, device=next(model.parameters()).device),
                            max_len=position + steps + 1)
    prompt = torch.randint(0, model.config.vocab_size, (1, position))
    with torch.no_grad():
        for start in range(0, position, 1024):
            model(prompt[:, start:start + 1024], cache=cache)
    return statistics.median(step_times(model.decode_step, cache, 1, steps))  # the fixed-shape step of generation


def bench_generate(args) -> None:
    from lm.generation.decode import stream

    prompt = torch.randint(0, REFERENCE["vocab_size"], (1, args.prompt))
    max_len = max(args.new_tokens) + args.prompt + 1
    long_position = args.positions[-1]
    print(f"greedy decoding, batch 1, {args.prompt}-token prompt, fp32, {torch.get_num_threads()} threads; "
          f"reference shape (vocab 8192, 6 layers, d_model 384, 6 heads, SwiGLU 1024)")
    header = "".join(f"{f'tok/s @{n}':>12}" for n in args.new_tokens)
    header += "".join(f"{f'ms @pos {p}':>13}" for p in args.positions)
    header += f"{'latency ratio':>15}{'cache bytes/token':>19}{'cache @' + str(max_len - 1):>14}"
    print(f"{'kind':24}{'kv heads':>9}{header}")
    rates: dict[str, dict[int, float]] = {}
    rows_of = attention_rows()
    for name in args.kinds:
        spec, example = rows_of[name]
        n_kv_head = example.kv_heads(REFERENCE["n_head"], GENERATE_KV_HEADS)
        model = reference_model(spec, n_kv_head, max_seq_len=max(max_len, long_position + 32))
        rates[name] = {}
        for n in args.new_tokens:
            seconds = decode_seconds(lambda m=model, n=n: list(stream(m, prompt, n)), args.repeats)
            rates[name][n] = n / seconds
        latency = [step_latency(model, p) for p in args.positions]
        tokens = args.prompt + max(args.new_tokens)
        total = declared_cache_bytes(model, tokens)
        per_token = total / tokens
        cells = "".join(f"{rates[name][n]:12.1f}" for n in args.new_tokens)
        cells += "".join(f"{t * 1e3:13.2f}" for t in latency)
        print(f"{name:24}{n_kv_head:9}{cells}{latency[-1] / latency[0]:15.2f}{per_token:19,.0f}{total:14,}", flush=True)
    if args.compare:
        hf = hf_llama(ModelConfig(**{**REFERENCE, "max_seq_len": max_len})).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0

        def hf_generate(n: int) -> None:
            with torch.no_grad():
                hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True)

        hf_rates = {n: n / decode_seconds(lambda n=n: hf_generate(n), args.repeats) for n in args.new_tokens}
        cells = "".join(f"{hf_rates[n]:12.1f}" for n in args.new_tokens)
        print(f"{'transformers':24}{2:9}{cells}   (LlamaForCausalLM.generate, gqa shape, SDPA, cache on)")
        for n in args.new_tokens:
            if GQA in rates:
                print(f"lm gqa / transformers decode tokens/s at {n} new tokens: {rates[GQA][n] / hf_rates[n]:.2f}x")


# ---------------------------------------------------------------------------- int8 accuracy


def bench_int8(args) -> None:
    """A trained checkpoint against its int8 copy on the built-in corpus's validation split."""
    import torch.nn.functional as F
    from omegaconf import OmegaConf

    from lm import load
    from lm.data.corpora import build_corpus
    from lm.generation.quantize import quantize_int8, weight_bytes
    from lm.studies.evaluate import split_documents, token_stream

    model, tokenizer = load(args.ckpt)
    int8 = quantize_int8(model, args.int8_kernel)
    data_cfg = OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "data" / "pystdlib.yaml")
    ids, _, _, _ = token_stream(split_documents(build_corpus(data_cfg), "val", float(data_cfg.val_fraction)),
                                tokenizer)
    T = model.config.max_seq_len
    windows = ids[: (min(len(ids), args.tokens) - 1) // T * T + 1]
    inputs = windows[:-1].view(-1, T)  # (windows, T)
    targets = windows[1:].view(-1, T)
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
    print(f"{args.ckpt}: {total:,} validation tokens of the built-in corpus, int8 kernel {args.int8_kernel}")
    print(f"next-token argmax agreement int8 vs fp32: {agree / total:.2%}")
    print(f"largest logit difference {worst:.4f} (logits' standard deviation {spread:.3f})")
    print(f"loss fp32 {nll['fp32'] / total:.4f}, int8 {nll['int8'] / total:.4f}")
    print(f"weights: fp32 {weight_bytes(model):,} bytes, int8 {weight_bytes(int8):,} bytes "
          f"(the embedding stays float: {model.embed.weight.numel() * 4:,} bytes)")


def build_parser() -> argparse.ArgumentParser:
    """The command line of scripts/bench.py: one subcommand per benchmark."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    train = sub.add_parser("train", help="training tokens/s and MFU against transformers' Llama")
    train.add_argument("--steps", type=int, default=10, help="measured steps per contender")
    train.add_argument("--warmup", type=int, default=2, help="unmeasured steps per contender first")
    train.add_argument("--batch", type=int, default=8)
    shapes = ["reference", *sorted(p.stem for p in MODEL_CONFIGS.glob("*.yaml"))]
    train.add_argument("--model", default="reference", choices=shapes,
                       help="the reference shape (GQA, 6 layers, d_model 384) or a conf/model shape as MHA")
    train.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the corpus's, 8192)")
    train.add_argument("--seq", type=int, default=None, help="sequence length (default: the shape's max_seq_len)")
    add_device_argument(train, "bf16-mixed there")
    train.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled contender")
    train.add_argument("--compile-peers", action="store_true",
                       help="compiled copies of transformers' and litgpt's models too")
    train.add_argument("--variants", nargs="+", type=checked_variant, default=[], metavar="OPTIONS",
                       help="more contenders: the same model with softmax options, e.g. gate=elementwise,qk_norm=true")
    train.set_defaults(run=bench_train)
    attention = sub.add_parser("attention", help="time and peak memory of each attention kind against N")
    attention.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    attention.add_argument("--d-model", type=int, default=512)
    attention.add_argument("--heads", type=int, default=8)
    attention.add_argument("--repeats", type=int, default=2, help="measured runs per case; the best is kept")
    attention.add_argument("--no-single-head", dest="single_head", action="store_false",
                           help="skip the one-head comparison at the longest N")
    attention.add_argument("--out", default="bench", help="folder for attention.csv and attention.png")
    add_device_argument(attention, "bf16 there")
    attention.add_argument("--kinds", nargs="+", choices=list(attention_rows()), default=list(attention_rows()),
                           help="rows to time (default: every registered kind's benchmark settings)")
    attention.set_defaults(run=bench_attention)
    gen = sub.add_parser("generate", help="decode tokens/s, per-token latency and cache bytes of each kind")
    gen.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    gen.add_argument("--new-tokens", type=int, nargs="+", default=[128, 1024])
    gen.add_argument("--positions", type=int, nargs=2, default=[64, 4096], help="where per-token latency is taken")
    gen.add_argument("--repeats", type=int, default=2)
    gen.add_argument("--no-compare", dest="compare", action="store_false", help="skip transformers' generate")
    gen.add_argument("--kinds", nargs="+", choices=list(attention_rows()), default=list(attention_rows()),
                     help="rows to time (default: every registered kind's benchmark settings)")
    gen.set_defaults(run=bench_generate)
    from lm.generation.quantize import KERNELS
    from lm.studies.decode_bench import LONG_CONTEXT_KINDS, bench_decode

    dec = sub.add_parser("decode", help="eager, compiled, int8 and llama.cpp decoding beside transformers")
    dec.add_argument("--prompt", type=int, default=32, help="prompt tokens (batches: from half to 1.5x this)")
    dec.add_argument("--new-tokens", type=int, default=128)
    dec.add_argument("--rounds", type=int, default=5, help="alternating measured rounds; the median is kept")
    dec.add_argument("--int8-kernels", nargs="*", choices=KERNELS, default=["dynamic", "dequant"],
                     help="int8 rows, eager and compiled, one pair per kernel")
    dec.add_argument("--batches", type=int, nargs="*", default=[16, 64], help="batch sizes of ragged prompts")
    dec.add_argument("--batch-rounds", type=int, default=3, help="alternating rounds of each batched table")
    dec.add_argument("--contexts", type=int, nargs="*", default=[8192, 32768],
                     help="long-context table: decoding at these cache fill levels (none: no table)")
    dec.add_argument("--context-batches", type=int, nargs="+", default=[1, 8])
    dec.add_argument("--context-kinds", nargs="+", choices=list(attention_rows()), default=LONG_CONTEXT_KINDS)
    dec.add_argument("--context-steps", type=int, default=16, help="timed steps per cell (the median is kept)")
    add_device_argument(dec, "bf16 there, no int8 or llama.cpp rows")
    dec.add_argument("--eager-long", dest="compile_long", action="store_false",
                     help="the long-context table with the eager step (default: compiled, as compile=true decodes)")
    dec.set_defaults(run=bench_decode)
    from lm.studies.kernel_bench import bench_kernels

    kernels = sub.add_parser("kernels", help="one decoding matmul through every int8/int4 kernel to choose from")
    kernels.add_argument("--rows", type=int, default=1, help="rows of input (tokens decoded at once)")
    kernels.add_argument("--rounds", type=int, default=5)
    kernels.add_argument("--repeats", type=int, default=20, help="calls per timing")
    kernels.set_defaults(run=bench_kernels)
    q8 = sub.add_parser("int8", help="a trained checkpoint against its int8 copy on the built-in corpus")
    q8.add_argument("--ckpt", required=True, help="a training checkpoint or export folder")
    q8.add_argument("--tokens", type=int, default=50_000, help="validation tokens scored")
    q8.add_argument("--int8-kernel", choices=KERNELS, default="dynamic")
    q8.set_defaults(run=bench_int8)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)

