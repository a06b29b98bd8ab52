"""`scripts/bench.py kernels`: one decoding matmul through every int8/int4 kernel there is to choose from.

The reference shape's matmuls at decoding's row counts (1 token, or a batch of them), each through
fp32 BLAS, `lm`'s three int8 kernels (lm.generation.quantize), PyTorch's int4 CPU kernel and, when
torchao is installed, its int8 configurations, eager and compiled; the kernels run in alternating
rounds, medians kept. Each call reads the same weight, hot in the CPU's cache: this measures a
kernel's arithmetic and per-call overhead (which kernels are slow at decoding's shapes), not the
memory traffic that bounds a decoding step, where fp32's weights stream from memory and int8's
quarter of them may stay in cache: `bench.py decode` measures that, and chose `int8_kernel`'s default.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch

from benchmarks.bench_models import REFERENCE, alternate
from lm.generation.int8_native import unavailable
from lm.generation.quantize import KERNELS, Int8Linear
from lm.util.hardware import int8_matmul_is_exact

# (in, out) of the reference shape's matmuls: fused Q/K/V (2 K/V heads), attention out, gate and up, down, head
SHAPES = [(384, 384 + 2 * 128), (384, 384), (384, 2 * 1024), (1024, 384), (384, REFERENCE["vocab_size"])]
PER_STEP = [6, 6, 6, 6, 1]  # how often each runs in one decoding step of the 6-layer model
INT4_GROUP = 32


def int4_kernel(linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """PyTorch's CPU weight-only int4 matmul (`_weight_int4pack_mm_for_cpu`): asymmetric 4-bit
    weights in groups of 32 along the input, a scale and a zero point per group."""
    w = linear.weight.detach()
    n, k = w.shape
    groups = w.reshape(n, k // INT4_GROUP, INT4_GROUP)  # (N, K/32, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)  # (N, K/32, 1) each
    scale = ((high - low) / 15).clamp(min=1e-6)
    q = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # the kernel's zero is the value of code 8: low + 8 * scale; (K/32, N, 2) scales and zeros
    scales_zeros = torch.cat([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scales_zeros)


def torchao_kernels(linear: torch.nn.Linear) -> dict[str, Callable]:
    """torchao's int8 configurations of this Linear, eager and compiled, or {} without torchao."""
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    except ImportError:
        return {}
    # torchao's tensor subclasses warn, once each, that torch's compile cache cannot hash them
    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching")
    kernels = {}
    for name, config in (("torchao int8 dynamic", Int8DynamicActivationInt8WeightConfig()),
                         ("torchao int8 weight-only", Int8WeightOnlyConfig())):
        module = copy.deepcopy(linear)
        quantize_(module, config)
        kernels[name] = module
        kernels[name + " compiled"] = torch.compile(module)
    return kernels


def bench_kernels(args) -> dict:
    """Prints the table; returns it as plain data (--json)."""
    torch.manual_seed(0)
    print(f"one matmul of the reference shape, {args.rows} row(s) of input, {torch.get_num_threads()} threads; "
          f"microseconds, median of {args.rounds} alternating rounds of {args.repeats} calls; the weight hot in "
          "cache (bench.py decode has the weights stream as decoding does)")
    table = {}
    native_builds = (why_not := unavailable()) is None
    if not native_builds:
        print(f"lm int8 native: left out: {why_not}")
    for k, n in SHAPES:
        torch._dynamo.reset()  # each shape's compiled kernels start afresh, far from the recompile limit
        linear = torch.nn.Linear(k, n, bias=False)
        x = torch.randn(args.rows, k)
        kernels = {"fp32": linear, **{f"lm int8 {name}": Int8Linear(linear, name) for name in KERNELS
                                      if name != "native" or native_builds}}
        for name in ("dynamic", "native"):
            if f"lm int8 {name}" in kernels:
                kernels[f"lm int8 {name} compiled"] = torch.compile(kernels[f"lm int8 {name}"])
        kernels["aten int4 (group 32)"] = int4_kernel(linear)
        kernels.update(torchao_kernels(linear))
        calls = {name: lambda fn=fn, x=x: [fn(x) for _ in range(args.repeats)] for name, fn in kernels.items()}
        with torch.no_grad():
            _, _, seconds = alternate(calls, args.rounds)
        table[f"{k}x{n}"] = {name: s / args.repeats * 1e6 for name, s in seconds.items()}
    names = list(next(iter(table.values())))
    print(f"{'kernel':34}" + "".join(f"{shape:>11}" for shape in table) + f"{'per step':>11}{'vs fp32':>10}")
    step = {name: sum(n * row[name] for n, row in zip(PER_STEP, table.values(), strict=True)) for name in names}
    rows = [{"kernel": name, "us": {shape: row[name] for shape, row in table.items()}, "per_step_us": step[name],
             "vs_fp32": step["fp32"] / step[name]} for name in names]
    for row in rows:
        print(f"{row['kernel']:34}" + "".join(f"{us:11.1f}" for us in row["us"].values())
              + f"{row['per_step_us']:11.0f}{row['vs_fp32']:9.2f}x")
    print("per step: the matmuls of one decoding step of the 6-layer model (each layer's four, then the head)")
    if not int8_matmul_is_exact():
        print("lm int8 dynamic: timed only; its sums are not exact on this CPU, where generate and serve refuse it")
    return {"threads": torch.get_num_threads(), "rows_of_input": args.rows, "shapes": list(table),
            "per_step_calls": dict(zip(table, PER_STEP, strict=True)), "rows": rows}

