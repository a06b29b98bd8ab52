"""`scripts/bench.py attention`: time and peak memory of each attention kind's op against the sequence
length N, a table, attention.csv and attention.png; then the ratios to full causal softmax and the
same kinds as whole layers (with their projections) at the longest N.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import math
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_models import attention_rows, bench_device, bench_dtype, describe_device, synchronize, timed
from benchmarks.train_bench import matmul_peak_flops
from lm.attention import AttentionSpec, LayerShape, LinearSpec, SoftmaxSpec

FULL_ATTENTION = "softmax-mha"  # the row the others are compared with


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


def bench_attention(args) -> dict:
    """On CUDA in bf16 (layers and inputs made there), on the CPU in fp32. Prints the tables and
    writes the CSV and the plot; returns them as plain data (--json)."""
    device = bench_device(args.device)
    with device, default_dtype(bench_dtype(device)):
        return attention_on(device, args)


def attention_cases(args) -> list[tuple[str, AttentionSpec, int, int, int]]:
    """(row name, spec, K/V heads, heads, N) of every measurement: each kind asked for at each length
    it declares it reaches, and the two single-head rows at the longest N only."""
    # The attention table's own choice of K/V heads is one per query head: each kind as MHA.
    cases = [(name, spec, ex.kv_heads(args.heads, args.heads), args.heads, ex.longest)
             for name, (spec, ex) in attention_rows().items() if name in args.kinds]
    if args.single_head:  # the footing of the published GPU figures: one head of size d_model
        cases += [("mha-1head", SoftmaxSpec(), 1, 1, None), ("linear-1head", LinearSpec(feature_map="elu"), 1, 1, None)]
    longest_n = max(args.lengths)
    return [(name, spec, n_kv_head, heads, n) for name, spec, n_kv_head, heads, longest in cases for n in args.lengths
            if not ((heads == 1 and n != longest_n) or (longest is not None and n > longest))]


def attention_on(device: torch.device, args) -> dict:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    cases = attention_cases(args)
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
    alternating = print_alternating_forward(cases, args) if args.rounds else {}
    whole_layer = print_whole_layer_times(args)
    label = f"{torch.cuda.get_device_name(device)} bf16" if device.type == "cuda" else "CPU fp32"
    png_path = plot_attention(rows, args.heads, out_dir / "attention.png", label)
    print(f"wrote {csv_path} and {png_path}")
    return {"device": describe_device(device), "precision": precision, "d_model": args.d_model,
            "measured_peak_flops": peak, "rows": rows, "whole_layer_forward_s": whole_layer,
            "alternating_forward_s": {f"{name}@{n}": t for (name, n), t in alternating.items()},
            "csv": str(csv_path), "png": str(png_path)}


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


def print_alternating_forward(cases: list, args) -> dict[tuple[str, int], float]:
    """Median forward seconds of each case's op over args.rounds rounds that take the kinds in turn
    at each length (after one round of warm-up): on a shared machine the kinds then see the same
    load, so their ratios hold where one absolute time does not. Prints them, and every kind's
    ratio to every faster one at that length when there are at most four kinds."""
    ops_at: dict[int, list] = {}
    for name, spec, n_kv_head, heads, n in cases:
        torch.manual_seed(0)
        module, _ = attention_layer(spec, n_kv_head, args.d_model, heads)
        ops_at.setdefault(n, []).append((name, *module.benchmark_op(n)))
    medians = {}
    for n, ops in ops_at.items():
        times: dict[str, list[float]] = {name: [] for name, _, _ in ops}
        for _ in range(args.rounds + 1):
            for name, op, inputs in ops:
                with torch.no_grad():
                    times[name].append(timed(lambda op=op, inputs=inputs: op(*inputs)))
        at_n = {name: statistics.median(t[1:]) for name, t in times.items()}
        medians.update({(name, n): t for name, t in at_n.items()})
        print(f"forward at N={n}, median of {args.rounds} alternating rounds: "
              + ", ".join(f"{name} {t:.4f} s" for name, t in at_n.items()))
        if len(at_n) <= 4:  # slower / faster
            slowest_first = sorted(at_n, key=at_n.get, reverse=True)
            print("  " + ", ".join(f"{a} / {b} {at_n[a] / at_n[b]:.2f}x"
                                   for a, b in itertools.combinations(slowest_first, 2)))
    return medians


def print_whole_layer_times(args) -> dict[str, float]:
    """The same kinds as whole layers at the longest N: the Q/K/V/O projections every kind
    shares are added to each, which narrows the ratios. Returns each one's forward seconds."""
    n = max(args.lengths)
    times = {}
    rows_of = attention_rows()
    for name in (FULL_ATTENTION, "sliding", "linear"):
        spec, _ = rows_of[name]
        module, shape = attention_layer(spec, args.heads, args.d_model, args.heads)
        times[name], _ = time_attention(module, shape, n, backward=False, repeats=args.repeats, whole_module=True)
    print(f"whole layer (with projections) forward at N={n}: " + ", ".join(
        f"{name} {t:.3f} s ({times[FULL_ATTENTION] / t:.1f}x)" for name, t in times.items()))
    return times


def plot_attention(rows: list[dict], heads: int, path: Path, label: str = "CPU fp32") -> Path:
    from lm.studies.plotting import pyplot, save_figure

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


