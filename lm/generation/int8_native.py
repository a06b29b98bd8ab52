"""`int8_kernel=native`: the `dynamic` kernel's arithmetic (activations rounded per row to int8, int8 x
int8 sums exact in int32) in lm's own C kernel, int8_matmul.c, for CPUs without int8 dot-product
instructions. There oneDNN's int8 GEMM behind torch._int_mm saturates its sums and PyTorch's weight-only
kernels run slower than fp32 (docs/performance.md); this one reads a quarter of fp32's bytes and
multiplies 32 byte pairs per AVX2 instruction without saturating.

Built on first use with the machine's C compiler (lm.util.native), with AVX2 where PyTorch dispatches to
AVX2 or AVX-512 on this CPU, else as plain C."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from lm.util.native import NativeBuildError, build_library

SOURCE = Path(__file__).with_name("int8_matmul.c")


def isa_flags() -> tuple[str, ...]:
    """AVX2 where PyTorch's own kernels run AVX2 or AVX-512 here (ATEN_CPU_CAPABILITY holds both back)."""
    return ("-mavx2",) if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else ()


def build(flags: tuple[str, ...]) -> ctypes.CDLL:
    """The kernel built with these compiler flags, its function's C signature declared."""
    lib = build_library(SOURCE, flags)
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.lm_int8_linear.argtypes = [pointer, pointer, pointer, pointer, size, size, size, ctypes.c_int]
    lib.lm_int8_linear.restype = ctypes.c_int
    return lib


@functools.cache
def library() -> ctypes.CDLL:
    """The built kernel (built once per process at most); NativeBuildError where it cannot be built."""
    return build(isa_flags())


def unavailable() -> str | None:
    """Why the native kernel cannot run here (one line), or None where it can."""
    try:
        library()
    except NativeBuildError as error:
        return f"lm's native int8 kernel cannot be built here: {error}"
    return None


# 127 * 127 * K must fit the kernel's int32 sums.
MAX_FEATURES = (2**31 - 1) // (127 * 127)


def check_operands(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> None:
    """What the kernel reads through raw pointers, checked first: a wrong shape or dtype is one line,
    never a read past a buffer."""
    K, N = x.shape[-1], weight.shape[0]
    if (weight.dtype == torch.int8 and weight.dim() == 2 and weight.shape[1] == K and scales.shape == (N,)
            and x.is_cpu and weight.is_cpu and scales.is_cpu and K <= MAX_FEATURES):
        return  # the common case in one test: this runs once per matmul of every decoding step
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"native int8 linear: weight must be int8 of shape (N, {K}), got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if scales.shape != (N,):
        raise ValueError(f"native int8 linear: scales must have shape ({N},), got {tuple(scales.shape)}")
    if not (x.is_cpu and weight.is_cpu and scales.is_cpu):
        raise ValueError("native int8 linear: runs on the CPU; its tensors are on "
                         f"{sorted({x.device.type, weight.device.type, scales.device.type})}")
    if K > MAX_FEATURES:
        raise ValueError(f"native int8 linear: {K} input features, more than the {MAX_FEATURES} whose int32 sums "
                         f"stay exact")


def run_kernel(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (..., K) float, weight (N, K) int8, scales (N,) -> (..., N) in x's dtype, through `lib`'s kernel."""
    check_operands(x, weight, scales)
    dtype = x.dtype
    # A decoding step calls this once per matmul, so each tensor is converted only where it must be: the
    # quantized layers hold a contiguous int8 weight and float32 scales, and decode float32 rows.
    if dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()  # (..., K) float32: what the kernel reads
    if not weight.is_contiguous():
        weight = weight.contiguous()
    if scales.dtype != torch.float32 or not scales.is_contiguous():
        scales = scales.to(torch.float32).contiguous()
    K, N = x.shape[-1], weight.shape[0]
    M = x.numel() // K if K else 0
    out = torch.empty(*x.shape[:-1], N, dtype=torch.float32, device="cpu")  # (..., N), whatever the defaults
    if K == 0:
        out.zero_()  # a sum over no features (the kernel would be asked for no scratch at all)
    elif M and lib.lm_int8_linear(x.data_ptr(), weight.data_ptr(), scales.data_ptr(), out.data_ptr(),
                                M, N, K, torch.get_num_threads()) != 0:
        raise MemoryError(f"lm's native int8 kernel could not allocate {M * K} bytes of scratch")
    return out if dtype == torch.float32 else out.to(dtype)


def _native_int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return run_kernel(library(), x, weight, scales)


# An operator of PyTorch's own (opaque to torch.compile, which calls it as it is) defined with
# torch.library.Library rather than torch.library.custom_op: a call cost 13 us instead of 26 us (timed
# over 5,000 calls at d_model 384, one thread), and a decoding step makes one per matmul.
_OPS = torch.library.Library("lm", "FRAGMENT")
_OPS.define("native_int8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor")
_OPS.impl("native_int8_linear", _native_int8_linear, "CPU")


@torch.library.register_fake("lm::native_int8_linear")
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def native_int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (..., K) float, weight (N, K) int8, scales (N,) -> (..., N), as dynamic_int8_linear computes it
    in float32, on the CPU. For inference: it has no gradient (no autograd formula is registered)."""
    return torch.ops.lm.native_int8_linear(x, weight, scales)
