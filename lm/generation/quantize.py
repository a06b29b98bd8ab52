"""int8 matmuls for decoding.

Every nn.Linear of the model (Q/K/V, output, gate/up, down and the head) keeps its weight as
int8 with one float scale per output channel (symmetric, absmax / 127): the matmul reads a
quarter of the bytes, which is what bounds a batch-1 decoding step. The token embedding stays
float (it is a lookup, not a matmul), so a tied head gets an int8 copy of its own.

Four kernels; `auto` (the default: `kernel=`, `int8_kernel=` on the command line) chooses one by
what the device multiplies fast (choose_kernel) and says which, and the others name one:
- "dynamic": the activations are quantized too, each row (token) with its own
  absmax / 127 scale computed at run time, and `torch._int_mm` multiplies int8 by int8 into
  int32 (oneDNN's VNNI kernels on x86): 9.2x our fp32 step compiled on an AVX-512 VNNI EPYC
  (docs/performance.md); refused where torch._int_mm's sums are not exact (oneDNN held to AVX2 on
  an AVX-512 CPU saturates them), and 0.58x our fp32 eager step on a CPU with AVX2 alone, where they are;
- "native": the same arithmetic in lm's own C kernel (lm.generation.int8_native), whose int32 sums
  are exact on AVX2 without VNNI: the kernel that pays on such CPUs;
- "dequant": weights only; w_int8 -> float, one matmul, times the scales: plain PyTorch, any
  device, about fp32's speed on the CPU (the conversion costs what the smaller read saves);
- "int8pack": weights only, `torch.ops.aten._weight_int8pack_mm`, PyTorch's weight-only int8
  kernel (several times slower than fp32 on the CPU measured).

Accuracy: each weight is off by at most half its row's step (scale / 2), and with "dynamic" and "native" each
activation by half its row's step as well. At random initialisation the logits stay within 5% of
their own standard deviation for softmax (3.5-4% on seeds 0-2) and gated delta (4.5-4.9%), and within
15% for KDA (12-14%: its Q/K/V and output projections move them most) (tests/test_fast_paths.py); on a
trained model the greedy next token agrees with fp32's at the rate `scripts/bench.py int8` reports.

Shapes: M rows of input, K input features, N output features.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import nn

from lm.generation import int8_native
from lm.generation.decode import check_model
from lm.generation.int8_native import native_int8_linear
from lm.util import hardware
from lm.util.errors import GenerationError

log = logging.getLogger(__name__)

KERNELS = ("dynamic", "native", "dequant", "int8pack")
# Rows above which `native` gives way to torch._int_mm where that is exact. One decoding step's matmuls at
# the reference shape (benchmarks.kernel_bench's shapes, each timed alone, its weight hot in cache) on an
# AMD EPYC with AVX512-VNNI, one thread beside another job, against fp32: native 2.4x at 1 row, 3.3x at 2,
# 2.7x at 4, 1.7x at 8, 1.1x at 16; torch._int_mm 1.1x, 1.6x, 2.0x, 2.0x, 1.8x. Without exact sums from
# torch._int_mm, or without int8 dot-product instructions (AVX2 without VNNI), native serves every row count.
NATIVE_MAX_ROWS = 4
AUTO = "auto"
CHOICES = (AUTO, *KERNELS)


def choose_kernel(device: torch.device) -> tuple[str, str]:
    """(the kernel `auto` takes on `device`, one line saying which, why, and the CPU's features).
    Measured with `scripts/bench.py decode` at batch 1 (docs/performance.md): on a CPU with int8
    dot-product instructions, dynamic (9.2x our fp32 eager step compiled on an AVX512-VNNI EPYC of family
    26; on one of family 25, native ran 0.9x dynamic compiled); without them native, the one int8 kernel
    faster than fp32 there (2.6x compiled on an AVX2 EPYC of family 25 model 1, 5.5x held to AVX2); where native
    cannot be built, dynamic if torch._int_mm is exact, else int8pack, which decoded at 0.54-0.68x our fp32 step."""
    if device.type != "cpu":  # torch._int_mm on CUDA needs more than 16 rows, which a decoding step lacks
        return "dequant", (f"int8_kernel=auto: dequant (weights only), the kernel that runs a decoding step on "
                           f"{device.type}")
    features = f"this CPU: {hardware.cpu_features()}"
    if hardware.int8_matmul_pays():
        return "dynamic", (f"int8_kernel=auto: dynamic, torch._int_mm's int8 x int8 matmuls on the CPU's int8 "
                           f"dot-product instructions ({features})")
    if (why_not := int8_native.unavailable()) is None:
        return "native", (f"int8_kernel=auto: native, lm's C kernel of exact int8 x int8 sums, for a CPU without "
                          f"int8 dot-product instructions (AVX512-VNNI, AMX) or whose torch._int_mm is not exact "
                          f"({features})")
    if dynamic_refusal(device) is None:
        return "dynamic", f"int8_kernel=auto: dynamic, torch._int_mm's int8 x int8 matmuls ({why_not}; {features})"
    return "int8pack", (f"int8_kernel=auto: int8pack (weights only): {why_not}, and this CPU's int8 x int8 matmul "
                        f"does not return exact sums ({features}); int8pack decoded at 0.54-0.68x fp32 on such a "
                        f"CPU: quantize=null compile=true is the fastest here")


def dynamic_refusal(device: torch.device) -> str | None:
    """Why `dynamic` cannot run on `device` (one line), or None where it can: on a CPU whose
    torch._int_mm does not return exact sums (lm.util.hardware.int8_matmul_is_exact) its outputs
    would be wrong, not merely rounded."""
    if device.type == "cpu" and not hardware.int8_matmul_is_exact():
        return ("int8 kernel=dynamic: this CPU's int8 x int8 matmul (torch._int_mm) does not return exact sums "
                "(oneDNN saturates them without int8 dot-product instructions, AVX512-VNNI or AMX): choose "
                "int8_kernel=auto, dequant or int8pack")
    return None


def native_refusal(device: torch.device) -> str | None:
    """Why `native` cannot run on `device` (one line), or None where it can: it is a CPU kernel, built
    with the machine's C compiler."""
    if device.type != "cpu":
        return f"int8 kernel=native runs on the CPU; on {device.type} choose int8_kernel=auto or dequant"
    if (why_not := int8_native.unavailable()) is not None:
        return f"int8 kernel=native: {why_not}; choose int8_kernel=auto, dequant or int8pack"
    return None


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) float -> int8 (N, K) and scales (N,) with weight ~= int8 * scales[:, None].

    Each row's largest magnitude maps to 127; an all-zero row gets scale 1 (any scale is exact)."""
    absmax = weight.detach().abs().amax(dim=1).float()  # (N,)
    scales = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
    q = torch.round(weight.detach().float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


@torch.library.custom_op("lm::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ (weight (N, K) int8 as float)^T * scales (N,) -> (..., N).

    An opaque op to torch.compile: inductor would otherwise fuse the int8 -> float conversion
    into a generated matmul loop, which on the CPU runs 2x slower than converting and calling
    BLAS (measured at the reference shape). The scales apply per output column, so they can
    wait until after the matmul."""
    return F.linear(x, weight.to(x.dtype)) * scales


@int8_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def dynamic_int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (..., K) float, weight (N, K) int8, scales (N,) -> (..., N): x quantized per row, then an
    int8 x int8 -> int32 matmul, exact, rescaled by both scales."""
    flat = x.reshape(-1, x.shape[-1])  # (M, K)
    q, row_scales = quantize_per_channel(flat)  # each token a row: (M, K) int8, (M,)
    acc = torch._int_mm(q, weight.t())  # (M, N) int32
    out = acc.to(x.dtype) * row_scales.to(x.dtype)[:, None] * scales  # (M, N)
    return out.view(*x.shape[:-1], weight.shape[0])


class Int8Linear(nn.Module):
    """y = x W^T + b with W held as int8 (N, K) and per-output-channel float scales (N,); the bias
    (KDA's gate has one), where the Linear has it, stays float and is added after the matmul."""

    def __init__(self, linear: nn.Linear, kernel: str = "dynamic"):
        super().__init__()
        if kernel not in KERNELS:
            raise GenerationError(f"int8 kernel={kernel!r} must be one of {list(KERNELS)}")
        self.kernel = kernel
        # native hands float32 inputs of many rows to torch._int_mm where its sums are exact and the CPU
        # has int8 dot-product instructions: the same floats to the last bit (both round each row alike,
        # sum exactly and scale in float32), and oneDNN's blocked VNNI GEMM is the faster there
        # (NATIVE_MAX_ROWS). Exact alone is not enough: on an AVX2 EPYC without VNNI (family 25 model 1)
        # torch._int_mm is exact but took 117.7 ms for one step's matmuls at 16 rows against native's 6.4
        # (`bench.py kernels --rows 16`). A plain bool, which torch.compile reads as a constant.
        self.int_mm_pays = hardware.int8_matmul_pays()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scales = quantize_per_channel(linear.weight)
        self.register_buffer("weight", weight)  # (N, K) int8
        self.register_buffer("scales", scales.to(linear.weight.dtype))  # (N,)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())  # (N,) or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x)
        return out if self.bias is None else out + self.bias

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T by the layer's kernel."""
        if self.kernel == "int8pack":
            flat = x.reshape(-1, self.in_features)  # (M, K): the kernel takes 2-D inputs
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales)  # (M, N)
            return out.view(*x.shape[:-1], self.out_features)
        if self.kernel == "dynamic" or (self.kernel == "native" and self.int_mm_pays and x.dtype == torch.float32
                                        and x.numel() > NATIVE_MAX_ROWS * self.in_features):
            return dynamic_int8_linear(x, self.weight, self.scales)
        if self.kernel == "native":
            return native_int8_linear(x, self.weight, self.scales)
        return int8_linear(x, self.weight, self.scales)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int8, kernel={self.kernel}")


def resolve_kernel(kernel: str, device: torch.device) -> tuple[str, str | None]:
    """(the kernel `kernel` names on `device`, choose_kernel's line where it was `auto`, else None)."""
    if kernel not in CHOICES:
        raise GenerationError(f"int8 kernel={kernel!r} must be one of {list(CHOICES)}")
    if kernel == "dynamic" and (refusal := dynamic_refusal(device)) is not None:
        raise GenerationError(refusal)
    if kernel == "native" and (refusal := native_refusal(device)) is not None:
        raise GenerationError(refusal)
    return choose_kernel(device) if kernel == AUTO else (kernel, None)


def quantize_int8(model: nn.Module, kernel: str = AUTO) -> nn.Module:
    """A copy of `model` whose every nn.Linear is an Int8Linear; the original is left untouched.
    `auto` takes choose_kernel's choice for the model's device and logs its line.

    A model quantized already keeps its int8 weights (quantizing them again changes nothing) and
    takes the kernel asked for."""
    check_model(model)
    kernel, why = resolve_kernel(kernel, next(model.parameters()).device)
    if why is not None:
        log.info(why)
    quantized = copy.deepcopy(model)
    for parent in list(quantized.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child, kernel))
            elif isinstance(child, Int8Linear):
                child.kernel = kernel
    return quantized.eval()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and persistent buffer (a tied weight counts once)."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())
