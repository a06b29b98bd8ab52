"""The C allocator's settings for training on a CPU."""

from __future__ import annotations

import ctypes
import functools
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for the next allocation instead of handing it back to
    the system. PyTorch allocates a CPU tensor with malloc, and glibc serves one of 32 MB or more
    (the logits of 16 x 256 tokens over 8192 ids, their float copy and gradients) from pages mapped
    afresh each time, which the kernel must zero and fault in on every training step: the default
    run (`scripts/train.py`, bf16-mixed on a 2-core AMD EPYC with AVX512-BF16) trained at 6,883
    tokens/s with 2 min 40 s of system time, and at 10,257 with 6 s once malloc kept its memory.
    The process keeps its peak footprint until it exits. True where applied (glibc); other C
    libraries are left as they are."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**30))
    except (OSError, AttributeError):
        return False
