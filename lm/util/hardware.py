"""What the machine's matrix units do fast: the choices that depend on it (training precision, the
dtype of Muon's Newton-Schulz iteration, the int8 kernel) ask here."""

from __future__ import annotations

import functools
import os

import torch

# oneDNN's instruction-set limits (the values of ONEDNN_MAX_CPU_ISA, or DNNL_MAX_CPU_ISA, its older name:
# oneDNN's guide, "CPU Dispatcher Control"), partially ordered, that keep bf16 and int8 dot products
ONEDNN_BF16_LEVELS = frozenset({
    "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX",
    "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2",
})
ONEDNN_INT8_LEVELS = ONEDNN_BF16_LEVELS | {"AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE_VNNI"}
ONEDNN_LIMITS = ONEDNN_INT8_LEVELS | {"SSE41", "AVX", "AVX2", "AVX512_CORE", "AVX512_MIC", "AVX512_MIC_4OPS"}


def onednn_limit() -> str | None:
    """The instruction set the environment holds oneDNN to (ONEDNN_MAX_CPU_ISA before DNNL_MAX_CPU_ISA, as
    oneDNN reads them), upper-cased; None where it is not held. oneDNN ignores a value it does not know, and
    so does this (ALL and DEFAULT hold nothing)."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(name, "").strip().upper()
        if value:
            return value if value in ONEDNN_LIMITS else None
    return None


def onednn_allows(levels: frozenset[str]) -> bool:
    """Whether oneDNN may run the instructions that `levels` (the limits that keep them) name."""
    limit = onednn_limit()
    return limit is None or limit in levels


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX) and oneDNN, which runs
    PyTorch's bf16 matmuls on a CPU, may use them (onednn_allows): there a bf16 matmul runs ~3.5x fp32's
    rate (measured on an AMD EPYC with AVX512-BF16); on a CPU without them, ~100x slower (an AVX2 EPYC),
    and as slow where oneDNN is held below them: a 512 x 512 bf16 matmul on an AVX-512 Xeon with AMX took
    0.28 ms, and 160 ms with DNNL_MAX_CPU_ISA=AVX2 (fp32: 1.8 ms either way)."""
    return ((torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
            and onednn_allows(ONEDNN_BF16_LEVELS))


def cpu_multiplies_int8() -> bool:
    """Whether this CPU has int8 dot-product instructions (AVX512-VNNI or AMX), on which oneDNN's int8
    matmuls (torch._int_mm) run: with them int8 decoding ran 9.2x the fp32 step compiled (an AVX-512
    VNNI EPYC); without them oneDNN's int8 matmuls are slow (an AVX2 EPYC of family 25 model 1: 0.11x
    fp32 at 16 rows) or their sums not exact (int8_matmul_is_exact). oneDNN held below them
    (onednn_allows) is a CPU without them."""
    return ((torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported())
            and onednn_allows(ONEDNN_INT8_LEVELS))


def int8_matmul_pays() -> bool:
    """Whether torch._int_mm is the int8 matmul to take on this CPU: int8 dot-product instructions
    (cpu_multiplies_int8) and exact sums (int8_matmul_is_exact), the one without the other being slow or
    wrong."""
    return cpu_multiplies_int8() and int8_matmul_is_exact()


def cpu_features() -> str:
    """The CPU's instruction sets that choose kernels here, in a few words for the lines that say so:
    what ATen's kernels run (DEFAULT, AVX2, AVX512, ...; ATEN_CPU_CAPABILITY holds it back), the
    dot-product extensions present, and oneDNN's limit where one is set."""
    extensions = [name for name, present in (("AVX512-VNNI", torch.cpu._is_vnni_supported()),
                                             ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported()),
                                             ("AMX", torch.cpu._is_amx_tile_supported())) if present]
    held = f" (oneDNN held to {limit})" if (limit := onednn_limit()) else ""
    return " + ".join([torch.backends.cpu.get_cpu_capability(), *extensions]) + held


@functools.cache
def int8_matmul_is_exact() -> bool:
    """Whether torch._int_mm on this CPU returns the exact int32 sums it promises, tried once per
    process on full-range random int8 matrices. Without int8 dot-product instructions oneDNN's
    int8 GEMM adds pairs of byte products in int16 (vpmaddubsw), which saturates on full-range
    values (oneDNN's guide, "Nuances of int8 Computations"): with oneDNN held to AVX2 on an AVX-512 CPU
    (DNNL_MAX_CPU_ISA=AVX2) 83-100% of the sums came back wrong. On a CPU with AVX2 alone (an EPYC of
    family 25 model 1) they were exact, and slow (cpu_multiplies_int8): so both are asked."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (256, 32), dtype=torch.int8, generator=g)
    try:
        return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())
    except RuntimeError:  # a build without an int8 matmul for this CPU: as unusable as an inexact one
        return False


def multiplies_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls on `device` run at least as fast as fp32 ones: CUDA, or a CPU with bf16
    instructions."""
    return device.type == "cuda" or (device.type == "cpu" and cpu_multiplies_bf16())


def inductor_cache_per_capability() -> str | None:
    """Where ATEN_CPU_CAPABILITY holds PyTorch back (as docs/performance.md does to run AVX2's code on an
    AVX-512 CPU) and TORCHINDUCTOR_CACHE_DIR names no folder of the user's, a cache folder of inductor's for
    that capability alone; the folder, or None where nothing was changed. Called before anything compiles.
    (Importing torch._inductor.config sets the variable to torch's default folder, so that value counts as
    unset.)

    torch 2.13's on-disk cache of compiled graphs does not key its CPU code on the capability: a graph
    compiled held to AVX2 and then loaded by a process running AVX-512 aborted it (`malloc(): unaligned
    tcache chunk detected`, in transformers' compiled forward, every time; with separate folders both
    ran)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not capability:
        return None
    # only now: inductor's package imports dynamo, 1.3 s at the start of every script
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and chosen != default_cache_dir():
        return None
    folder = f"{default_cache_dir()}-{capability}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder
